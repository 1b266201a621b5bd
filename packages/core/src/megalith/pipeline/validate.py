"""Static checks of a `Schedule`: every action is well formed, in a valid order on its rank, every
stage's F and B of every microbatch present exactly once, and sends/receives paired.

Send/receive matching: the k-th send from rank a to rank b pairs with the k-th receive on rank b
from rank a (per ordered pair of ranks, in list order), and the pair must carry the same tensor:
SEND_F(s, i) ↔ RECV_F(s+1, i) (an activation) and SEND_B(s, i) ↔ RECV_B(s−1, i) (a gradient).

Checks run in this order and the first failure raises `ScheduleError` naming the rank, the index
in that rank's list and the action: per-action checks rank by rank in list order, then missing
computations, then pairing. The simulator adds the dynamic check (deadlock).
"""

from __future__ import annotations

from megalith.common.errors import ConfigError
from megalith.pipeline.schedule import COMPUTE_OPS, Action, Op, Schedule

Key = tuple[Op, int, int]
Slot = tuple[int, int]  # (rank, index in that rank's list)

# (other stage's offset, op the matching action has) for each transfer op
_TRANSFER = {
    Op.SEND_F: (1, Op.RECV_F),
    Op.RECV_F: (-1, Op.SEND_F),
    Op.SEND_B: (-1, Op.RECV_B),
    Op.RECV_B: (1, Op.SEND_B),
}


class ScheduleError(ConfigError):
    """A pipeline schedule is invalid; `rank`, `index` and `action` locate the first bad action."""

    def __init__(
        self, message: str, rank: int | None = None, index: int | None = None, action: Action | None = None
    ) -> None:
        where = "" if rank is None else f"rank {rank}" + ("" if index is None else f", index {index}")
        what = "" if action is None else f" {action}"
        super().__init__(f"{where}{what}: {message}" if where or what else message)
        self.rank, self.index, self.action = rank, index, action


def _fail(message: str, rank: int, index: int | None, action: Action) -> ScheduleError:
    return ScheduleError(message, rank, index, action)


def _shape_error(schedule: Schedule, rank: int, a: Action) -> str | None:
    """Why `a` cannot appear on `rank` at all (range, ownership, peer), or None."""
    last = schedule.num_stages - 1
    if not 0 <= a.stage <= last:
        return f"stage {a.stage} out of range 0..{last}"
    if not 0 <= a.microbatch < schedule.num_microbatches:
        return f"microbatch {a.microbatch} out of range 0..{schedule.num_microbatches - 1}"
    owner = schedule.stage_rank(a.stage)
    if owner != rank:
        return f"rank {rank} does not hold stage {a.stage} (rank {owner} does)"
    if a.op in COMPUTE_OPS:
        return None if a.peer is None else f"a computation has no peer (got peer={a.peer})"
    offset, _ = _TRANSFER[a.op]
    other = a.stage + offset
    if not 0 <= other <= last:
        return f"stage {a.stage} has no stage {other} to exchange with"
    expected = schedule.stage_rank(other)
    if expected == rank:
        return f"stages {a.stage} and {other} are both on rank {rank}; nothing is sent"
    if a.peer != expected:
        return f"peer must be rank {expected} (holder of stage {other}), got {a.peer}"
    return None


def _prerequisite(schedule: Schedule, rank: int, a: Action) -> tuple[Key, str] | None:
    """What must already have happened on `rank` before `a`, and why."""
    s, mb = a.stage, a.microbatch
    if a.op is Op.F and s > 0:
        local = schedule.stage_rank(s - 1) == rank
        need = (Op.F, s - 1, mb) if local else (Op.RECV_F, s, mb)
        return need, "forward of a stage > 0 before its activation was received"
    if a.op is Op.B:
        return (Op.F, s, mb), "backward before its forward"
    if a.op is Op.W:
        return (Op.B, s, mb), "weight gradient before its backward"
    if a.op is Op.SEND_F:
        return (Op.F, s, mb), "sends an activation before the forward that makes it"
    if a.op is Op.SEND_B:
        return (Op.B, s, mb), "sends a gradient before the backward that makes it"
    return None


def _grad_prerequisite(schedule: Schedule, rank: int, a: Action) -> Key | None:
    if a.op is not Op.B or a.stage == schedule.num_stages - 1:
        return None
    local = schedule.stage_rank(a.stage + 1) == rank
    return (Op.B, a.stage + 1, a.microbatch) if local else (Op.RECV_B, a.stage, a.microbatch)


def _name(key: Key) -> str:
    return str(Action(key[0], key[1], key[2]))


def _check_rank(schedule: Schedule, rank: int) -> set[Key]:
    seen: set[Key] = set()
    acts = schedule.actions[rank]
    for i, a in enumerate(acts):
        problem = _shape_error(schedule, rank, a)
        if problem:
            raise _fail(problem, rank, i, a)
        key = (a.op, a.stage, a.microbatch)
        if key in seen:
            raise _fail("duplicated", rank, i, a)
        needs: list[tuple[Key, str]] = []
        pre = _prerequisite(schedule, rank, a)
        if pre:
            needs.append(pre)
        grad = _grad_prerequisite(schedule, rank, a)
        if grad:
            needs.append((grad, "backward of a non-last stage before the gradient was received"))
        for need, why in needs:
            if need not in seen:
                later = any((b.op, b.stage, b.microbatch) == need for b in acts[i + 1 :])
                where = "it comes later" if later else f"rank {rank} never runs it"
                raise _fail(f"{why}: needs {_name(need)} first ({where})", rank, i, a)
        seen.add(key)
    return seen


def _check_complete(schedule: Schedule, seen: list[set[Key]]) -> None:
    for s in range(schedule.num_stages):
        rank = schedule.stage_rank(s)
        for mb in range(schedule.num_microbatches):
            for op in (Op.F, Op.B):
                if (op, s, mb) not in seen[rank]:
                    raise _fail("missing (never scheduled)", rank, None, Action(op, s, mb))


def match_p2p(schedule: Schedule) -> dict[Slot, Slot]:
    """Pair every send with its receive (both directions in the result); raises on a mismatch."""
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.op in (Op.SEND_F, Op.SEND_B):
                sends.setdefault((rank, a.peer or 0), []).append(i)
            elif a.op in (Op.RECV_F, Op.RECV_B):
                recvs.setdefault((a.peer or 0, rank), []).append(i)
    pairs: dict[Slot, Slot] = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        out, inn = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k in range(max(len(out), len(inn))):
            if k >= len(inn):
                raise _fail(f"no matching receive on rank {dst}", src, out[k], schedule.actions[src][out[k]])
            recv = schedule.actions[dst][inn[k]]
            if k >= len(out):
                raise _fail(f"no matching send from rank {src}", dst, inn[k], recv)
            send = schedule.actions[src][out[k]]
            offset, op = _TRANSFER[send.op]
            if (op, send.stage + offset, send.microbatch) != (recv.op, recv.stage, recv.microbatch):
                raise _fail(
                    f"send/recv mismatch: receive #{k} from rank {src} pairs with {send} "
                    f"(rank {src}, index {out[k]})",
                    dst,
                    inn[k],
                    recv,
                )
            pairs[(src, out[k])] = (dst, inn[k])
            pairs[(dst, inn[k])] = (src, out[k])
    return pairs


def validate(schedule: Schedule) -> dict[Slot, Slot]:
    """Run the static checks; return the send/receive pairing for the simulator."""
    if len(schedule.actions) != schedule.num_ranks:
        raise ScheduleError(f"{len(schedule.actions)} action lists for num_ranks={schedule.num_ranks}")
    seen = [_check_rank(schedule, r) for r in range(schedule.num_ranks)]
    _check_complete(schedule, seen)
    return match_p2p(schedule)
