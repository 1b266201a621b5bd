"""Pipeline schedules as plain data.

A schedule says, for every pipeline rank, the ordered list of actions that rank performs in one
training step. Nothing here runs a model: the simulator (`simulate`) checks a schedule and the
executor runs any schedule the simulator accepts.

Stages are *virtual*: with `num_chunks` v model chunks per rank there are p·v stages, numbered in
model order 0 … p·v−1; `stage_rank` maps a stage to the rank that holds it (round-robin for
interleaved 1F1B, a "V" for ZB-V). Microbatches are numbered 0 … m−1.

Ops:
    F       forward of `microbatch` through `stage`
    B       backward of `microbatch` through `stage`; when the schedule also has a W for the same
            (stage, microbatch), B computes only the input gradient and W the weight gradient
            (zero-bubble split); otherwise B computes both
    W       weight-gradient part of a split backward
    SEND_F / RECV_F   activation of `microbatch` leaving `stage` / arriving at `stage`
    SEND_B / RECV_B   gradient of `microbatch` leaving `stage` (towards stage−1) / arriving at `stage`
                      (from stage+1)
`peer` on send/recv actions is the other rank; sends and receives between the same pair of ranks
must be posted in the same relative order on both sides (the simulator checks that no rank waits
forever).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Op(str, Enum):  # noqa: UP042 (str mix-in kept: the values are the wire names)
    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.W})


@dataclass(frozen=True)
class Action:
    op: Op
    stage: int
    microbatch: int
    peer: int | None = None

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"->r{self.peer}"
        return f"{self.op.value}(s{self.stage},m{self.microbatch}){peer}"


@dataclass(frozen=True)
class Schedule:
    """`actions[r]` is rank r's ordered list. `stage_ranks[s]` is the rank holding stage s."""

    name: str
    num_ranks: int
    num_microbatches: int
    num_chunks: int
    stage_ranks: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def stage_rank(self, stage: int) -> int:
        return self.stage_ranks[stage]

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank `rank` holds, in model order."""
        return [s for s, r in enumerate(self.stage_ranks) if r == rank]
