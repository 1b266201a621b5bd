"""Pipeline schedules as data and the simulator (pure Python, no process group).

Expected bubbles are the closed forms with F = 1, B = 2 (split B = W = 1) per microbatch:
GPipe / 1F1B (p−1)/m, interleaved (p−1)/(v·m), ZB-H1 (p−1)(T_F+T_B−T_W)/(m(T_F+T_B+T_W)) = (p−1)/(3m).
"""

from __future__ import annotations

import dataclasses

import pytest

from megalith.common.errors import ConfigError
from megalith.pipeline import (
    SCHEDULES,
    Action,
    Op,
    OpCost,
    Schedule,
    ScheduleError,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    simulate,
    zero_bubble_h1,
    zero_bubble_v,
)

F, B, W = Op.F, Op.B, Op.W
SF, RF, SB, RB = Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B


def _grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for name, v in [
        ("gpipe", 1),
        ("1f1b", 1),
        ("zb-h1", 1),
        ("interleaved", 1),
        ("interleaved", 2),
        ("zb-v", 2),
    ]:
        for p in (2, 4):
            for m in (p, 2 * p, 4 * p):
                cases.append((name, p, m, v))
    return cases


def _expected_bubble(name: str, p: int, m: int, v: int) -> float:
    if name == "zb-h1":
        return (p - 1) / (3 * m)
    return (p - 1) / (v * m)


@pytest.mark.parametrize(("name", "p", "m", "v"), _grid())
def test_acceptance_grid_bubble_ratio(name: str, p: int, m: int, v: int) -> None:
    schedule = make_schedule(name, p, m, v)
    result = simulate(schedule)
    if name == "zb-v":  # no closed form for the greedy order: below ZB-H1 at 1F1B's peak memory
        assert 0 < result.bubble_ratio < (p - 1) / (3 * m)
        assert max(result.peak_activations) == 2 * p  # chunk activations, half a microbatch each
    else:
        assert result.bubble_ratio == pytest.approx(_expected_bubble(name, p, m, v), abs=1e-12)
    # every rank does m·v F's and B's of cost 1/v and 2/v: busy = 3m
    assert result.busy == pytest.approx((3.0 * m,) * p)
    assert schedule.num_stages == p * v
    # every stage's F and B of every microbatch exactly once, on the rank holding the stage
    for s in range(p * v):
        acts = schedule.actions[schedule.stage_rank(s)]
        for op in (F, B):
            assert sorted(a.microbatch for a in acts if a.op is op and a.stage == s) == list(range(m))


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16)])
def test_zero_bubble_h1_beats_1f1b_with_the_same_peak_memory(p: int, m: int) -> None:
    zb, base = simulate(zero_bubble_h1(p, m)), simulate(one_f_one_b(p, m))
    assert zb.bubble_ratio < base.bubble_ratio
    assert zb.makespan == pytest.approx(3 * m + p - 1)  # 3m + (p−1)(T_F+T_B−T_W)
    assert max(zb.peak_activations) == max(base.peak_activations) == p
    assert base.peak_activations == tuple(p - r for r in range(p))
    assert simulate(gpipe(p, m)).peak_activations == (m,) * p


def test_one_f_one_b_two_ranks_matches_hand_written_schedule() -> None:
    r0 = (
        Action(F, 0, 0),
        Action(SF, 0, 0, 1),
        Action(F, 0, 1),
        Action(SF, 0, 1, 1),
        Action(RB, 0, 0, 1),
        Action(B, 0, 0),
        Action(RB, 0, 1, 1),
        Action(B, 0, 1),
    )
    r1 = (
        Action(RF, 1, 0, 0),
        Action(F, 1, 0),
        Action(B, 1, 0),
        Action(SB, 1, 0, 0),
        Action(RF, 1, 1, 0),
        Action(F, 1, 1),
        Action(B, 1, 1),
        Action(SB, 1, 1, 0),
    )
    schedule = one_f_one_b(2, 2)
    assert schedule.actions == (r0, r1)
    assert schedule.stage_ranks == (0, 1)
    result = simulate(schedule)
    # r0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9];  r1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]
    assert result.finish == (9.0, 7.0)
    assert result.makespan == 9.0 and result.bubble_ratio == pytest.approx(0.5)


def test_zero_bubble_h1_two_ranks_by_hand() -> None:
    compute = [
        [(a.op, a.microbatch) for a in acts if a.op in (F, B, W)] for acts in zero_bubble_h1(2, 2).actions
    ]
    assert compute[0] == [(F, 0), (F, 1), (B, 0), (W, 0), (B, 1), (W, 1)]
    assert compute[1] == [(F, 0), (B, 0), (F, 1), (B, 1), (W, 0), (W, 1)]
    # r1: F0 [1,2] B0 [2,3] F1 [3,4] B1 [4,5] W0 [5,6] W1 [6,7]; r0 ends with W1 [6,7]
    assert simulate(zero_bubble_h1(2, 2)).makespan == 7.0


def test_interleaved_stages_round_robin_and_cost_override() -> None:
    schedule = interleaved_1f1b(2, 4, 2)
    assert schedule.stage_ranks == (0, 1, 0, 1)
    assert schedule.stages_of(1) == [1, 3]
    # with F = B = 1 per stage, GPipe on 2 ranks with 2 microbatches: 2·(m + p − 1) = 6
    assert simulate(gpipe(2, 2), cost=OpCost(forward=1, backward=1)).makespan == 6.0


def _replace(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    lists = list(schedule.actions)
    lists[rank] = tuple(actions)
    return dataclasses.replace(schedule, actions=tuple(lists))


def test_missing_backward_is_named() -> None:
    s = one_f_one_b(2, 2)
    broken = _replace(s, 1, [a for a in s.actions[1] if (a.op, a.microbatch) not in ((B, 1), (SB, 1))])
    with pytest.raises(ScheduleError, match=r"rank 1 B\(s1,m1\): missing") as info:
        simulate(broken)
    assert info.value.rank == 1 and info.value.action == Action(B, 1, 1)


def test_deadlocking_order_names_blocked_ranks() -> None:
    # rank 0 waits for the gradient before it sends the activation rank 1 waits for
    r0 = (Action(RB, 0, 0, 1), Action(F, 0, 0), Action(SF, 0, 0, 1), Action(B, 0, 0))
    r1 = (Action(RF, 1, 0, 0), Action(F, 1, 0), Action(B, 1, 0), Action(SB, 1, 0, 0))
    with pytest.raises(ScheduleError, match="deadlock") as info:
        simulate(Schedule("hand", 2, 1, 1, (0, 1), (r0, r1)))
    msg = str(info.value)
    assert "rank 0 at index 0 RECV_B(s0,m0)" in msg
    assert "rank 1 at index 0 RECV_F(s1,m0)" in msg
    assert (info.value.rank, info.value.index) == (0, 0)


@pytest.mark.parametrize(
    ("rank", "edit", "pattern"),
    [
        (0, lambda a: [a[0], a[1], a[4], a[5], a[2], a[3], a[6], a[7]], None),  # valid reorder
        (1, lambda a: [a[0], a[2], a[1], *a[3:]], r"index 1 B\(s1,m0\): backward before its forward"),
        (1, lambda a: [a[1], a[0], *a[2:]], r"index 0 F\(s1,m0\): forward of a stage > 0 before its activ"),
        (0, lambda a: [*a[:4], a[5], a[4], *a[6:]], r"index 4 B\(s0,m0\): backward of a non-last stage"),
        (1, lambda a: [*a[:5], a[5], a[5], *a[6:]], r"index 6 F\(s1,m1\): duplicated"),
        (1, lambda a: [*a, Action(F, 0, 0)], r"rank 1 does not hold stage 0 \(rank 0 does\)"),
        (0, lambda a: [*a[:1], Action(SF, 0, 0, 0), *a[2:]], "peer must be rank 1"),
        (1, lambda a: [*a[4:7], a[0], a[1], a[2], a[7], a[3]], r"send/recv mismatch"),
        (1, lambda a: [*a[:3], a[4], a[3], *a[5:]], None),  # the recv may come before the send
        (0, lambda a: [*a[:2], a[3], a[2], *a[4:]], r"SEND_F\(s0,m1\)->r1: sends an activation before"),
    ],
)
def test_broken_schedules_name_the_first_bad_action(rank: int, edit, pattern: str | None) -> None:  # type: ignore[no-untyped-def]
    s = one_f_one_b(2, 2)
    broken = _replace(s, rank, edit(list(s.actions[rank])))
    if pattern is None:
        assert simulate(broken).makespan >= 9.0
        return
    with pytest.raises(ScheduleError, match=pattern):
        simulate(broken)


def test_weight_before_backward_and_missing_microbatch() -> None:
    s = zero_bubble_h1(2, 2)
    r0 = list(s.actions[0])
    w0 = r0.index(Action(W, 0, 0))
    r0.insert(0, r0.pop(w0))
    with pytest.raises(
        ScheduleError, match=r"rank 0, index 0 W\(s0,m0\): weight gradient before its backward"
    ):
        simulate(_replace(s, 0, r0))
    g = gpipe(2, 2)
    with pytest.raises(ScheduleError, match=r"rank 1 F\(s1,m1\): missing"):
        simulate(_replace(g, 1, [a for a in g.actions[1] if a.microbatch != 1]))


def test_batched_rendezvous_model() -> None:
    for name in ("gpipe", "1f1b"):
        assert simulate(make_schedule(name, 4, 8), p2p="batched").bubble_ratio == pytest.approx(3 / 8)
    # interleaved relies on non-blocking sends: buffered accepts it, rendezvous of adjacent batches deadlocks
    s = interleaved_1f1b(2, 4, 2)
    assert simulate(s).bubble_ratio == pytest.approx(1 / 8)
    with pytest.raises(ScheduleError, match=r"deadlock \(batched p2p\)"):
        simulate(s, p2p="batched")


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda: make_schedule("pipedream", 2, 4),
            r"unknown pipeline schedule 'pipedream'; valid: 1f1b, gpipe",
        ),
        (lambda: make_schedule("1f1b", 4, 3), r"microbatches < stages: m=3 microbatches for p=4"),
        (lambda: make_schedule("gpipe", 0, 4), r"p must be >= 1, got p=0"),
        (lambda: make_schedule("interleaved", 2, 4, 0), r"v must be >= 1, got v=0"),
        (lambda: make_schedule("interleaved", 4, 6, 2), r"m=6 must be a multiple of pipeline ranks p=4"),
        (lambda: make_schedule("gpipe", 2, 4, 2), r"'gpipe' uses 1 chunk\(s\) per rank, got v=2"),
        (lambda: simulate(gpipe(2, 2), p2p="nccl"), r"got 'nccl'"),  # type: ignore[arg-type]
    ],
)
def test_bad_input_raises_config_error(call, pattern: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=pattern):
        call()


def test_zero_bubble_v_placement() -> None:
    s = zero_bubble_v(4, 8)
    assert s.stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    assert s.stages_of(0) == [0, 7] and s.num_chunks == 2
    # the tip of the V (stages 3 and 4 on rank 3) exchanges nothing
    assert not [a for a in s.actions[3] if a.op in (SF, RF) and a.stage in (3, 4) and a.peer == 3]
    assert make_schedule("zb-v", 2, 4).num_chunks == 2


def test_registry_names() -> None:
    assert {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"} <= set(SCHEDULES)
    assert issubclass(ScheduleError, ConfigError)
