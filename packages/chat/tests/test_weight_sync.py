"""Bucketed weight sync over a separate loopback group: exact copy, checksums, corruption detected."""

from __future__ import annotations

import pytest
import torch

from megalith.common.errors import ConfigError, DistributedError
from megalith.testing import run_distributed
from megalith.testing.models import tiny_llama
from megalith.testing.spawn import free_port
from megalith_chat.rollout import weight_sync
from megalith_chat.rollout.weight_sync import SyncGroupSpec, WeightSyncGroup, receive_weights, send_weights


def _sync(rank: int, world: int, port: int, corrupt: bool) -> dict:
    # The default (gloo) group of these ranks is NOT used: the sync group is a second, separate one.
    spec = SyncGroupSpec(port=port, world_size=2, bucket_mb=0.004, timeout_s=30)
    group = WeightSyncGroup(spec, rank)
    model = tiny_llama(seed=rank)  # different initial weights on each side
    if rank == 0:
        stats = send_weights(group, model, version=3, trainable_only=False)
    else:
        if corrupt:
            real = weight_sync.checksum
            weight_sync.checksum = lambda flat: real(flat) + 1  # type: ignore[assignment]
        staged = receive_weights(group, model, version=3, trainable_only=False)
        staged.apply_to(model)
        stats = staged.stats
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "checksums": stats.checksums,
        "buckets": stats.num_buckets,
    }


def test_receiver_equals_sender_after_sync() -> None:
    sender, receiver = run_distributed(_sync, 2, free_port(), False, timeout_s=60)
    assert sender["buckets"] > 3  # a 4 KB bucket bound splits the tiny model into several buckets
    assert sender["checksums"] == receiver["checksums"]
    before = {n: p.detach() for n, p in tiny_llama(seed=1).named_parameters()}
    for name, p in sender["params"].items():
        torch.testing.assert_close(receiver["params"][name], p, atol=0, rtol=0)
        assert not torch.equal(before[name], p) or "norm" in name  # it really changed


def test_corrupted_bucket_is_reported() -> None:
    with pytest.raises(DistributedError, match="bucket 1 .*failed verification"):
        run_distributed(_sync, 2, free_port(), True, timeout_s=60)


def test_checksum_detects_changes_and_permutations() -> None:
    t = torch.arange(12, dtype=torch.float32)
    # by hand: int32 words of 0.0 and 1.0 are 0 and 0x3F800000; weights are position + 1
    assert weight_sync.checksum(torch.tensor([0.0, 1.0])) == 0x3F800000 * 2
    assert weight_sync.checksum(t) != weight_sync.checksum(t.flip(0))
    u = t.clone()
    u[5] += 1e-6
    assert weight_sync.checksum(t) != weight_sync.checksum(u)


def test_bad_specs() -> None:
    with pytest.raises(ConfigError, match="got 1"):
        SyncGroupSpec(port=1, world_size=1)
    with pytest.raises(ConfigError, match="'mpi'"):
        SyncGroupSpec(port=1, world_size=2, backend="mpi")
