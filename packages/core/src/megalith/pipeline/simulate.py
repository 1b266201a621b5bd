"""Pure-Python simulator: checks a `Schedule` and measures its bubble.

Every rank executes its list in order. Compute costs (default, per *stage*, v chunks per rank so
a chunk is 1/v of a rank's model): F = 1/v, unsplit B = 2/v, split B (input gradient) = 1/v,
W = 1/v; communication is free. A compute starts when its rank is free — its inputs arrived
through the RECV before it, which waits for the matching SEND.

Point-to-point models (`p2p`):
    "buffered"  (default) a send completes at once; a receive blocks until its send was posted.
    "batched"   each maximal run of adjacent SEND/RECV actions of a rank is one batch
                (``batch_isend_irecv``); a batch completes only when the partner of every action
                in it has been posted (rendezvous), so a send does not finish before its receive.
The generated schedules pass both. Deadlock = no rank can progress; the error names every
blocked rank, the action it is stuck on and the partner it waits for.

    busy_r       = Σ compute costs on rank r (equal on every rank for these schedules)
    bubble_ratio = (makespan − busy) / busy,  busy = max_r busy_r
which gives (p−1)/m for GPipe and 1F1B and (p−1)/(v·m) for interleaved 1F1B.

Peak in-flight activations: per rank, the most (stage, microbatch) activations alive at once —
alive from F until the B (unsplit) or W (split) that frees them, counted in list order. With
v chunks each counts 1/v of a microbatch through the whole rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from megalith.common.errors import ConfigError
from megalith.pipeline.schedule import COMPUTE_OPS, Action, Op, Schedule
from megalith.pipeline.validate import ScheduleError, Slot, validate

logger = logging.getLogger(__name__)

P2PModel = Literal["buffered", "batched"]
CostModel = Callable[[Action, bool], float]  # (compute action, B is split) -> duration


@dataclass(frozen=True)
class OpCost:
    """Durations of F, unsplit B, split B (input gradient only) and W, per stage."""

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    weight: float = 1.0

    @classmethod
    def for_chunks(cls, v: int) -> OpCost:
        return cls(1.0 / v, 2.0 / v, 1.0 / v, 1.0 / v)

    def __call__(self, action: Action, split: bool) -> float:
        if action.op is Op.F:
            return self.forward
        if action.op is Op.W:
            return self.weight
        return self.backward_input if split else self.backward


@dataclass(frozen=True)
class SimulationResult:
    """`busy[r]` compute time of rank r, `finish[r]` when rank r ends, `peak_activations[r]` the most
    (stage, microbatch) activations alive on rank r at once."""

    makespan: float
    busy: tuple[float, ...]
    finish: tuple[float, ...]
    bubble_ratio: float
    peak_activations: tuple[int, ...]


def _split_keys(schedule: Schedule) -> set[tuple[int, int]]:
    return {(a.stage, a.microbatch) for acts in schedule.actions for a in acts if a.op is Op.W}


def _peak(actions: tuple[Action, ...], split: set[tuple[int, int]]) -> int:
    alive = peak = 0
    for a in actions:
        if a.op is Op.F:
            alive += 1
            peak = max(peak, alive)
        elif a.op is (Op.W if (a.stage, a.microbatch) in split else Op.B):
            alive -= 1
    return peak


class _Run:
    """Event loop over the ranks' lists; `posted[slot]` is when a send/recv was posted."""

    def __init__(self, schedule: Schedule, pairs: dict[Slot, Slot], cost: CostModel, p2p: P2PModel) -> None:
        self.s, self.pairs, self.cost, self.p2p = schedule, pairs, cost, p2p
        self.split = _split_keys(schedule)
        n = schedule.num_ranks
        self.pos, self.clock, self.busy = [0] * n, [0.0] * n, [0.0] * n
        self.posted: dict[Slot, float] = {}

    def _batch_end(self, rank: int, start: int) -> int:
        acts = self.s.actions[rank]
        if self.p2p == "buffered":
            return start + 1
        end = start
        while end < len(acts) and acts[end].op not in COMPUTE_OPS:
            end += 1
        return end

    def _blockers(self, rank: int, start: int, end: int) -> list[Slot]:
        acts = self.s.actions[rank]
        slots = [
            i for i in range(start, end) if self.p2p == "batched" or acts[i].op in (Op.RECV_F, Op.RECV_B)
        ]
        return [self.pairs[(rank, i)] for i in slots]

    def step(self, rank: int) -> bool:
        """Advance `rank` by one action or batch; False when it is done or blocked."""
        i, acts = self.pos[rank], self.s.actions[rank]
        if i >= len(acts):
            return False
        a = acts[i]
        if a.op in COMPUTE_OPS:
            dt = self.cost(a, (a.stage, a.microbatch) in self.split)
            self.clock[rank] += dt
            self.busy[rank] += dt
            self.pos[rank] = i + 1
            return True
        end = self._batch_end(rank, i)
        for j in range(i, end):
            self.posted.setdefault((rank, j), self.clock[rank])
        waits = self._blockers(rank, i, end)
        if any(w not in self.posted for w in waits):
            return False
        self.clock[rank] = max([self.clock[rank]] + [self.posted[w] for w in waits])
        self.pos[rank] = end
        return True

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for rank in range(self.s.num_ranks):
                while self.step(rank):
                    progress = True
        blocked = [r for r in range(self.s.num_ranks) if self.pos[r] < len(self.s.actions[r])]
        if blocked:
            raise self._deadlock(blocked)

    def _deadlock(self, blocked: list[int]) -> ScheduleError:
        lines = []
        for r in blocked:
            i = self.pos[r]
            waits = [w for w in self._blockers(r, i, self._batch_end(r, i)) if w not in self.posted]
            partner = ", ".join(f"{self.s.actions[q][j]} (rank {q}, index {j})" for q, j in waits)
            lines.append(f"rank {r} at index {i} {self.s.actions[r][i]} waits for {partner}")
        first = blocked[0]
        return ScheduleError(
            f"deadlock ({self.p2p} p2p): " + "; ".join(lines),
            first,
            self.pos[first],
            self.s.actions[first][self.pos[first]],
        )


def simulate(
    schedule: Schedule, cost: CostModel | None = None, p2p: P2PModel = "buffered"
) -> SimulationResult:
    """Check `schedule` (raises `ScheduleError` at the first bad action) and time it.

    `cost(action, split)` gives a compute's duration; default `OpCost.for_chunks(num_chunks)`.
    """
    if p2p not in ("buffered", "batched"):
        raise ConfigError(f"p2p model must be 'buffered' or 'batched', got {p2p!r}")
    pairs = validate(schedule)
    run = _Run(schedule, pairs, cost or OpCost.for_chunks(schedule.num_chunks), p2p)
    run.run()
    makespan = max(run.clock)
    busy = max(run.busy)
    split = run.split
    result = SimulationResult(
        makespan=makespan,
        busy=tuple(run.busy),
        finish=tuple(run.clock),
        bubble_ratio=(makespan - busy) / busy if busy > 0 else 0.0,
        peak_activations=tuple(_peak(acts, split) for acts in schedule.actions),
    )
    logger.debug("simulated %s: %s", schedule.name, result)
    return result


__all__ = ["CostModel", "OpCost", "P2PModel", "ScheduleError", "SimulationResult", "simulate"]
