"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V as plain `Schedule` data.

Every generator first decides each rank's *compute* order (F / B / W of a stage and microbatch)
and then `with_p2p` inserts the point-to-point actions around it: a RECV right before the compute
that needs it, a SEND right after the compute that produces it, with `peer` set. A send after one
compute and the recv before the next compute are therefore adjacent in the list, which lets an
executor batch them (Megatron's ``send_forward_recv_backward``). Stages on the same rank (the tip
of ZB-V's "V") exchange nothing.

Bubbles with F = 1, B = 2 (or split B = W = 1) per whole microbatch and free communication, p
ranks, m microbatches, v chunks per rank (see `megalith.pipeline.simulate`):

    gpipe, 1f1b      (p − 1) / m                     (makespan 3(m + p − 1))
    interleaved      (p − 1) / (v·m)                 (Narayanan et al. 2021, Megatron's order)
    zb-h1            (p − 1) / (3m)                  ((p − 1)(T_F + T_B − T_W) of Qi et al. 2023)
    zb-v             about half of zb-h1             (greedy order on the V placement; simulated)

GPipe holds all m microbatches' activations; 1F1B, ZB-H1 and ZB-V at most p on any rank.
The schedules assume non-blocking sends (see `simulate`'s "buffered" model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megalith.common.errors import ConfigError
from megalith.pipeline.schedule import Action, Op, Schedule

Compute = tuple[Op, int, int]  # (F | B | W, stage, microbatch)


def _check_sizes(name: str, p: int, m: int, v: int = 1) -> None:
    if p < 1:
        raise ConfigError(f"{name}: pipeline ranks p must be >= 1, got p={p}")
    if v < 1:
        raise ConfigError(f"{name}: model chunks per rank v must be >= 1, got v={v}")
    if m < p:
        raise ConfigError(f"{name}: microbatches < stages: m={m} microbatches for p={p} pipeline ranks")


def with_p2p(
    name: str, num_microbatches: int, stage_ranks: Sequence[int], orders: Sequence[Sequence[Compute]]
) -> Schedule:
    """Build a `Schedule` from per-rank compute orders by inserting SEND/RECV actions.

    Activation of stage s goes to stage s+1 (SEND_F(s) → RECV_F(s+1)), gradient of stage s goes
    to stage s−1 (SEND_B(s) → RECV_B(s−1)); nothing is sent between stages on the same rank.
    """
    last = len(stage_ranks) - 1
    actions: list[list[Action]] = []
    for rank, order in enumerate(orders):
        acts: list[Action] = []
        for op, s, mb in order:
            if op is Op.F and s > 0 and stage_ranks[s - 1] != rank:
                acts.append(Action(Op.RECV_F, s, mb, stage_ranks[s - 1]))
            if op is Op.B and s < last and stage_ranks[s + 1] != rank:
                acts.append(Action(Op.RECV_B, s, mb, stage_ranks[s + 1]))
            acts.append(Action(op, s, mb))
            if op is Op.F and s < last and stage_ranks[s + 1] != rank:
                acts.append(Action(Op.SEND_F, s, mb, stage_ranks[s + 1]))
            if op is Op.B and s > 0 and stage_ranks[s - 1] != rank:
                acts.append(Action(Op.SEND_B, s, mb, stage_ranks[s - 1]))
        actions.append(acts)
    actions = [_recv_in_send_order(rank, actions) for rank in range(len(actions))]
    chunks = len(stage_ranks) // max(len(orders), 1)
    return Schedule(
        name, len(orders), num_microbatches, chunks, tuple(stage_ranks), tuple(map(tuple, actions))
    )


def _matching_recv(send: Action, sender: int) -> Action:
    if send.op is Op.SEND_F:
        return Action(Op.RECV_F, send.stage + 1, send.microbatch, sender)
    return Action(Op.RECV_B, send.stage - 1, send.microbatch, sender)


def _recv_in_send_order(rank: int, actions: list[list[Action]]) -> list[Action]:
    """Receive from each peer in the order that peer sends (one FIFO per pair of ranks): where a
    RECV would overtake an earlier send of the same peer (activations and gradients on one pair,
    as in ZB-V), the earlier one is received first, at the same place. That adds no wait: the
    earlier send was posted before the one being waited for."""
    queues = {
        peer: [_matching_recv(a, peer) for a in acts if a.op in (Op.SEND_F, Op.SEND_B) and a.peer == rank]
        for peer, acts in enumerate(actions)
    }
    done: set[Action] = set()
    out: list[Action] = []
    for a in actions[rank]:
        if a.op not in (Op.RECV_F, Op.RECV_B):
            out.append(a)
            continue
        if a in done:
            continue
        queue = queues[a.peer if a.peer is not None else rank]
        upto = queue.index(a) + 1 if a in queue else 0
        for earlier in queue[:upto]:
            if earlier not in done:
                out.append(earlier)
                done.add(earlier)
        if a not in done:
            out.append(a)
            done.add(a)
    return out


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards, on every rank."""
    _check_sizes("gpipe", p, m)
    orders = [[(Op.F, r, i) for i in range(m)] + [(Op.B, r, i) for i in range(m)] for r in range(p)]
    return with_p2p("gpipe", m, list(range(p)), orders)


def _one_f_one_b_order(r: int, p: int, m: int) -> list[Compute]:
    warmup = min(p - 1 - r, m)
    order: list[Compute] = [(Op.F, r, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(Op.F, r, warmup + i), (Op.B, r, i)]
    order += [(Op.B, r, i) for i in range(m - warmup, m)]
    return order


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2019): rank r runs p−1−r warm-up forwards, then
    alternates one forward and one backward, then drains the backwards; at most p − r microbatches'
    activations live on rank r."""
    _check_sizes("1f1b", p, m)
    return with_p2p("1f1b", m, list(range(p)), [_one_f_one_b_order(r, p, m) for r in range(p)])


def _interleaved_order(r: int, p: int, m: int, v: int) -> list[Compute]:
    if v == 1:
        return _one_f_one_b_order(r, p, m)
    total = m * v

    def unit(k: int, forward: bool) -> Compute:
        chunk = (k % (p * v)) // p
        chunk = chunk if forward else v - 1 - chunk
        mb = (k // (p * v)) * p + k % p
        return (Op.F if forward else Op.B, chunk * p + r, mb)

    warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
    order = [unit(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        order += [unit(warmup + i, True), unit(i, False)]
    order += [unit(k, False) for k in range(total - warmup, total)]
    return order


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's order) with v model chunks per rank.

    Stage s = c·p + r (chunk c of rank r), so stages go round-robin over ranks. Microbatches go
    through the chunks in groups of p: the k-th forward of a rank is chunk (k mod p·v) // p of
    microbatch (k // p·v)·p + k mod p. Warm-up is 2(p−1−r) + (v−1)·p forwards (all of them when
    m = p). Requires m % p == 0, as Megatron does.
    """
    _check_sizes("interleaved", p, m, v)
    if m % p:
        raise ConfigError(f"interleaved: microbatches m={m} must be a multiple of pipeline ranks p={p}")
    stage_ranks = [s % p for s in range(p * v)]
    orders = [_interleaved_order(r, p, m, v) for r in range(p)]
    return with_p2p("interleaved", m, stage_ranks, orders)


def _zb_h1_order(r: int, p: int, m: int) -> list[Compute]:
    """1F1B's F/B order with each B split into B and W; rank r keeps r W's deferred (a FIFO), which
    raises its live activations to p — rank 0's 1F1B peak — and lets the W's fill the cool-down."""
    warmup = min(p - 1 - r, m)
    order: list[Compute] = [(Op.F, r, i) for i in range(warmup)]
    deferred: list[int] = []

    def backward(i: int) -> None:
        order.append((Op.B, r, i))
        deferred.append(i)
        if len(deferred) > r:
            order.append((Op.W, r, deferred.pop(0)))

    for i in range(m - warmup):
        order.append((Op.F, r, warmup + i))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    order += [(Op.W, r, i) for i in deferred]
    return order


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): B is split into B (input
    gradient, on the critical path) and W (weight gradient, deferrable). Same peak activation
    memory as 1F1B (p microbatches); bubble (p−1)(T_F + T_B − T_W), i.e. (p−1)/(3m) at unit costs."""
    _check_sizes("zb-h1", p, m)
    return with_p2p("zb-h1", m, list(range(p)), [_zb_h1_order(r, p, m) for r in range(p)])


class _GreedyV:
    """Unit-time list scheduling of ZB-V's 2p stages on p ranks (stage s on rank s for s < p, on
    rank 2p−1−s after): a free rank runs, in priority, a ready B (later stage first), a ready F
    (later stage first) while fewer than 2p chunk activations — p microbatches, 1F1B's peak — are
    alive, else its oldest deferred W."""

    def __init__(self, p: int, m: int) -> None:
        self.p, self.m, self.last = p, m, 2 * p - 1
        self.done: dict[Compute, int] = {}
        self.next = {(op, s): 0 for op in (Op.F, Op.B) for s in range(2 * p)}
        self.alive, self.deferred = [0] * p, [list[Compute]() for _ in range(p)]
        self.orders: list[list[Compute]] = [[] for _ in range(p)]

    def _ready(self, key: Compute, t: int) -> bool:
        return self.done.get(key, t + 1) <= t

    def _pick(self, r: int, t: int) -> Compute | None:
        stages = (2 * self.p - 1 - r, r)
        for s in stages:
            i = self.next[(Op.B, s)]
            if i < self.m and self._ready((Op.F, s, i), t):
                if s == self.last or self._ready((Op.B, s + 1, i), t):
                    return (Op.B, s, i)
        for s in stages if self.alive[r] < 2 * self.p else ():
            i = self.next[(Op.F, s)]
            if i < self.m and (s == 0 or self._ready((Op.F, s - 1, i), t)):
                return (Op.F, s, i)
        return self.deferred[r].pop(0) if self.deferred[r] else None

    def _run(self, r: int, unit: Compute, t: int) -> None:
        op, s, i = unit
        if op is Op.W:
            self.alive[r] -= 1
        else:
            self.next[(op, s)] += 1
            self.alive[r] += op is Op.F
        if op is Op.B:
            self.deferred[r].append((Op.W, s, i))
        self.done[unit] = t + 1
        self.orders[r].append(unit)

    def orders_of_all(self) -> list[list[Compute]]:
        total, t = 3 * 2 * self.p * self.m, 0
        while len(self.done) < total:
            if t > 2 * total:
                raise ConfigError(f"zb-v: no schedule found for p={self.p}, m={self.m}")
            for r in range(self.p):
                if not self.orders[r] or self.done[self.orders[r][-1]] <= t:
                    unit = self._pick(r, t)
                    if unit is not None:
                        self._run(r, unit, t)
            t += 1
        return self.orders


def zero_bubble_v(p: int, m: int) -> Schedule:
    """ZB-V placement (Qi et al. 2023): 2 chunks per rank in a "V" — stage s on rank s for s < p
    and on rank 2p−1−s otherwise, so rank 0 holds the first and the last stage — with split B/W.

    The order comes from the greedy list scheduler `_GreedyV` at unit costs with the same peak
    activation memory as 1F1B (p microbatches), not from the paper's hand-crafted figure; its
    bubble is about half of ZB-H1's (the simulator reports it).
    """
    _check_sizes("zb-v", p, m)
    stage_ranks = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return with_p2p("zb-v", m, stage_ranks, _GreedyV(p, m).orders_of_all())


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered schedule: its generator and its number of chunks per rank (None: takes v)."""

    build: Callable[[int, int, int], Schedule]
    chunks: int | None
    summary: str


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(lambda p, m, v: gpipe(p, m), 1, "all forwards, then all backwards"),
    "1f1b": ScheduleSpec(lambda p, m, v: one_f_one_b(p, m), 1, "one forward, one backward"),
    "interleaved": ScheduleSpec(interleaved_1f1b, None, "1F1B over v virtual stages per rank"),
    "zb-h1": ScheduleSpec(lambda p, m, v: zero_bubble_h1(p, m), 1, "1F1B with B/W split, W deferred"),
    "zb-v": ScheduleSpec(lambda p, m, v: zero_bubble_v(p, m), 2, "V-shaped 2 chunks per rank, B/W split"),
}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `name` for p pipeline ranks and m microbatches (v chunks per rank where the
    schedule takes it; a fixed-chunk schedule accepts v = 1 or its own chunk count)."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ConfigError(f"unknown pipeline schedule {name!r}; valid: {', '.join(sorted(SCHEDULES))}")
    if spec.chunks is not None and v not in (1, spec.chunks):
        raise ConfigError(f"schedule {name!r} uses {spec.chunks} chunk(s) per rank, got v={v}")
    _check_sizes(name, p, m, v)
    return spec.build(p, m, v if spec.chunks is None else spec.chunks)
