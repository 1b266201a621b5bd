"""Loss aggregation modes by hand, including the global token-mean over a 2-rank gloo group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalith.common.errors import ConfigError
from megalith_chat.algorithms import aggregate_loss

LOSSES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the empty third row never counts


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
        ("seq-mean-token-sum-norm", ((1 + 2) / 3 + 4 / 3) / 2),  # C = padded length 3
    ],
)
def test_modes_by_hand(mode: str, expected: float) -> None:
    assert float(aggregate_loss(LOSSES, MASK, mode)) == pytest.approx(expected)  # type: ignore[arg-type]


def test_dr_grpo_constant_normaliser() -> None:
    got = aggregate_loss(LOSSES, MASK, "seq-mean-token-sum-norm", norm_constant=10.0)
    assert float(got) == pytest.approx((3 / 10 + 4 / 10) / 2)


def test_token_mean_gradient_weights_every_token_equally() -> None:
    losses = LOSSES.clone().requires_grad_()
    aggregate_loss(losses, MASK, "token-mean").backward()
    assert losses.grad is not None
    expected = [1 / 3, 1 / 3, 0.0, 1 / 3, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert losses.grad.flatten().tolist() == pytest.approx(expected)


def test_bad_mode_and_stray_constant_rejected() -> None:
    with pytest.raises(ConfigError, match="'token-max'"):
        aggregate_loss(LOSSES, MASK, "token-max")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="norm_constant=5"):
        aggregate_loss(LOSSES, MASK, "token-mean", norm_constant=5)
    with pytest.raises(ConfigError, match="> 0"):
        aggregate_loss(LOSSES, MASK, "seq-mean-token-sum-norm", norm_constant=0.0)


WORKER = """
import json, sys, torch, torch.distributed as dist
from megalith_chat.algorithms import aggregate_loss
rank, init = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=60))
if rank == 0:
    losses, mask = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1, 1], [1, 0]])
else:
    losses, mask = torch.tensor([[10.0, 20.0]]), torch.tensor([[1, 0]])
out = {m: float(aggregate_loss(losses, mask, m, dp_group=dist.group.WORLD))
       for m in ("token-mean", "seq-mean-token-mean")}
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_global_token_mean_over_two_gloo_ranks(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(r), init], stdout=subprocess.PIPE, text=True, env=env
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    # rank0 holds tokens {1, 2, 3}, rank1 holds {10}: global token mean = 16 / 4 = 4.
    # Each rank returns local_sum / 4 * world(2): 3 and 5, whose average (what DDP does to grads) is 4.
    assert [o["token-mean"] for o in outs] == pytest.approx([6 / 4 * 2, 10 / 4 * 2])
    # sequences: rank0 means (1.5, 3), rank1 (10): global mean = 14.5 / 3; rank-local = sum / 3 * 2
    assert [o["seq-mean-token-mean"] for o in outs] == pytest.approx([4.5 / 3 * 2, 10 / 3 * 2])
    assert sum(o["token-mean"] for o in outs) / 2 == pytest.approx(16 / 4)
