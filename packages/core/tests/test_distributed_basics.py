"""ParallelDims validation, the sampler, and failure propagation of the test launcher (§6)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from megalith.common.errors import ConfigError
from megalith.distributed import ParallelDims, StatefulDistributedSampler, build_mesh, launch
from megalith.testing import run_distributed


def test_parallel_dims_infers_dp_and_validates():
    assert ParallelDims(world_size=8, tp=2).dp == 4
    assert ParallelDims(world_size=8, dp=2, tp=2, pp=2).shape == (2, 2, 1, 2)
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp\*sp = 3\*2\*1\*1 = 6 does not equal world_size=8"):
        ParallelDims(world_size=8, dp=3, tp=2)
    with pytest.raises(ConfigError, match=r"world_size=6 is not divisible by tp\*pp\*sp=4"):
        ParallelDims(world_size=6, tp=4)
    with pytest.raises(ConfigError, match="tp must be >= 1, got 0"):
        ParallelDims(world_size=2, tp=0)


def test_launch_without_environment_is_single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    info = launch(device="cpu")
    assert (info.rank, info.world_size, info.device.backend) == (0, 1, "gloo")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not an integer"):
        launch(device="cpu")


def test_sampler_shards_disjointly_and_resumes():
    data = list(range(10))
    shards = [list(StatefulDistributedSampler(data, 2, r, shuffle=True, seed=1)) for r in range(2)]
    assert sorted(shards[0] + shards[1]) == data and not set(shards[0]) & set(shards[1])
    s = StatefulDistributedSampler(data, 2, 0, seed=1)
    s.advance(3)
    resumed = StatefulDistributedSampler(data, 2, 0, seed=1)
    resumed.load_state_dict(s.state_dict())
    assert list(resumed) == shards[0][3:]
    with pytest.raises(ConfigError, match="dataset is empty"):
        StatefulDistributedSampler([], 2, 0)


def mesh_worker(rank, world):
    mesh = build_mesh(ParallelDims(world_size=world, tp=2), "cpu")
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh["dp"].get_group())
    return mesh["tp"].get_local_rank(), t.item()


def test_mesh_axes_group_the_right_ranks():
    # tp is innermost: ranks (0,1) and (2,3) share tp groups; dp groups are (0,2) and (1,3).
    assert run_distributed(mesh_worker, 4) == [(0, 2.0), (1, 4.0), (0, 2.0), (1, 4.0)]


def one_rank_raises(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    t = torch.zeros(1)
    dist.all_reduce(t)  # rank 0 waits here for a peer that never comes
    return t.item()


def test_one_rank_raising_fails_fast_with_its_exception():
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on purpose") as info:
        run_distributed(one_rank_raises, 2, timeout_s=10)
    assert time.monotonic() - start < 30
    assert any("raised on rank 1" in note for note in info.value.__notes__)


RANK_SCRIPT = """
import os, sys
from megalith.distributed import relaunch, under_launcher
if not under_launcher():
    sys.exit(relaunch(2, sys.argv[1:]))
rank = int(os.environ["RANK"])
print(f"rank {rank} ran", flush=True)
if rank == 1:
    print("error: rank 1 refuses", file=sys.stderr, flush=True)
    sys.exit(3)
"""


def test_relaunch_reports_a_failed_rank_in_one_line(tmp_path):
    """`relaunch` runs both ranks; when one exits 3, the launcher returns 3 and says which rank
    failed, without the elastic agent's traceback and log lines."""
    import os
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOGLEVEL")}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert "rank 0 ran" in done.stdout and "rank 1 ran" in done.stdout
    assert "error: rank 1 refuses" in done.stderr
    # rank 1 failed first; rank 0 either finished or was stopped by the agent because of it
    assert "error: rank 1 exited with code 3" in done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr


def test_failed_ranks_are_described_by_exit_code_or_signal():
    from types import SimpleNamespace

    from megalith.distributed.torchrun import describe

    failures = {
        1: SimpleNamespace(exitcode=2, timestamp=20),
        0: SimpleNamespace(exitcode=-9, timestamp=10),
        2: SimpleNamespace(exitcode=-999, timestamp=30),
    }
    line, code = describe(failures)
    assert code == 128 + 9  # the first failure (by time) was rank 0, killed by SIGKILL
    assert line == (
        "error: rank 0 was killed by SIGKILL, the first of 3 failed ranks (rank 1 exited with code 2; "
        "rank 2 was killed by signal 999); each rank's own output is above"
    )
    line, code = describe({4: SimpleNamespace(exitcode=1, timestamp=0)})
    assert (line, code) == ("error: rank 4 exited with code 1; its own output is above", 1)
