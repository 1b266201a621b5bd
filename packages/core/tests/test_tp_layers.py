"""Tensor-parallel layers on 2 and 4 gloo ranks equal their single-process torch counterparts
(forward and every gradient): column→row pair, sequence-parallel pair, fused projection,
vocabulary-parallel embedding / LM head / cross-entropy (with ignore_index and vocabulary padding)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megalith.common.errors import ConfigError
from megalith.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    shard_spec,
    vocab_parallel_cross_entropy,
)
from megalith.testing import run_distributed

H, B, S = 8, 2, 4


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def _pair(rank: int, world: int, sequence_parallel: bool) -> dict[str, float]:
    torch.manual_seed(0)
    a, b = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
    x = torch.randn(B, S, H, requires_grad=True)
    w = torch.randn(B, S, H)
    (b(F.gelu(a(x))) * w).sum().backward()
    ref_out = b(F.gelu(a(x))).detach()
    col = ColumnParallelLinear(
        copy.deepcopy(a), None, input_op="gather_sequence" if sequence_parallel else "copy"
    )
    row = RowParallelLinear(copy.deepcopy(b), None, sequence_parallel=sequence_parallel)
    shard = slice(rank * S // world, (rank + 1) * S // world) if sequence_parallel else slice(None)
    x2 = x.detach()[:, shard].clone().requires_grad_(True)
    out = row(F.gelu(col(x2)))
    (out * w[:, shard]).sum().backward()
    col_spec, row_spec = shard_spec(col.weight), shard_spec(row.weight)
    assert col_spec is not None and row_spec is not None and col.bias is not None
    bias_spec = shard_spec(col.bias)
    assert bias_spec is not None
    return {
        "out": _diff(out, ref_out[:, shard]),
        "x.grad": _diff(x2.grad, x.grad[:, shard]),
        "col.weight.grad": _diff(col.weight.grad, col_spec.shard(a.weight.grad)),
        "col.bias.grad": _diff(col.bias.grad, bias_spec.shard(a.bias.grad)),
        "row.weight.grad": _diff(row.weight.grad, row_spec.shard(b.weight.grad)),
        "row.bias.grad": _diff(row.bias.grad, b.bias.grad),
        "col.weight": _diff(col.weight, a.weight.chunk(world, 0)[rank]),
        "row.weight": _diff(row.weight, b.weight.chunk(world, 1)[rank]),
    }


def _fused(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(1)
    parts = (4 * world, 2 * world, 2 * world)  # q, k, v widths
    fused = nn.Linear(H, sum(parts))
    x = torch.randn(B, S, H, requires_grad=True)
    out = fused(x)
    weights = [torch.randn(B, S, n) for n in parts]
    sum((o * wt).sum() for o, wt in zip(out.split(parts, -1), weights, strict=True)).backward()
    col = ColumnParallelLinear(copy.deepcopy(fused), None, parts=parts)
    x2 = x.detach().clone().requires_grad_(True)
    local = col(x2)
    local_parts = local.split([n // world for n in parts], -1)
    mine = [wt.chunk(world, -1)[rank] for wt in weights]
    sum((o * wt).sum() for o, wt in zip(local_parts, mine, strict=True)).backward()
    ref_parts = [o.chunk(world, -1)[rank] for o in out.split(parts, -1)]
    spec = shard_spec(col.weight)
    assert spec is not None
    return {
        "fused.out": max(_diff(a, b) for a, b in zip(local_parts, ref_parts, strict=True)),
        "fused.x.grad": _diff(x2.grad, x.grad),
        "fused.weight.grad": _diff(col.weight.grad, spec.shard(fused.weight.grad)),
        "fused.weight.q": _diff(col.weight[: parts[0] // world], fused.weight[: parts[0]].chunk(world)[rank]),
    }


def _vocab(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(2)
    vocab = 11  # not a multiple of 2 or 4: the last block is padded
    emb = nn.Embedding(vocab, H, padding_idx=3)
    ids = torch.tensor([[0, 3, 5, 10], [9, 1, 3, 7]])
    wt = torch.randn(B, 4, H)
    (emb(ids) * wt).sum().backward()
    pemb = VocabParallelEmbedding(copy.deepcopy(emb), None)
    out = pemb(ids)
    (out * wt).sum().backward()
    spec = shard_spec(pemb.weight)
    assert spec is not None
    diffs = {
        "emb.out": _diff(out, emb(ids)),
        "emb.grad": _diff(pemb.weight.grad, spec.shard(emb.weight.grad)),
    }
    # LM head (tied to the embedding) with gathered logits, and the cross-entropy on local logits.
    head = nn.Linear(H, vocab, bias=False)
    head.weight = emb.weight
    hidden = torch.randn(6, H)
    phead = VocabParallelLMHead(head, None, weight=pemb.weight, gather_output=True)
    diffs["head.gather"] = _diff(phead(hidden), hidden @ emb.weight.t())
    logits = torch.randn(6, vocab, requires_grad=True)
    target = torch.tensor([0, 10, -100, 4, 7, -100])
    ref = F.cross_entropy(logits, target, ignore_index=-100)
    ref.backward()
    lo, n = phead.vocab_start, phead.num_local
    local = logits.detach()[:, lo : lo + n].clone().requires_grad_(True)
    per_token = vocab_parallel_cross_entropy(local, target, None, lo)
    loss = per_token.sum() / (target != -100).sum()
    loss.backward()
    diffs["ce.loss"] = abs(float(loss - ref))
    diffs["ce.grad"] = _diff(local.grad, logits.grad[:, lo : lo + n])
    return diffs


def _indivisible_message() -> str:
    try:
        ColumnParallelLinear(nn.Linear(4, 10), None)
    except ConfigError as exc:
        return str(exc)
    return ""


def layers_worker(rank: int, world: int) -> dict[str, float]:
    message = _indivisible_message()
    assert "output features = 10 is not divisible by the tensor-parallel size 4" in message or world != 4, (
        message
    )
    return {
        **_pair(rank, world, sequence_parallel=False),
        **{f"sp.{k}": v for k, v in _pair(rank, world, sequence_parallel=True).items()},
        **_fused(rank, world),
        **_vocab(rank, world),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layers_match_torch(world: int) -> None:
    results = run_distributed(layers_worker, world, timeout_s=120)
    for rank, diffs in enumerate(results):
        bad = {k: v for k, v in diffs.items() if not v < 1e-5}
        assert not bad, f"rank {rank} of {world}: {bad}"
    assert "sp.row.bias.grad" in results[0] and "ce.grad" in results[0]


def test_shard_spec_roundtrip_with_padding_and_parts() -> None:
    """Hand-checked layout: vocabulary 5 over 2 ranks pads to 6, rank 1 holds rows 3, 4 and a zero row."""
    full = torch.arange(10.0).view(5, 2)
    specs = [ShardSpec((5, 2), 0, (5,), 2, r) for r in range(2)]
    assert torch.equal(specs[1].shard(full), torch.tensor([[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]))
    assert torch.equal(specs[0].unshard([s.shard(full) for s in specs]), full)
    fused = torch.arange(6.0).view(6, 1)  # parts (4, 2): rank 1 holds rows 2, 3 of part 0 and row 5
    spec = ShardSpec((6, 1), 0, (4, 2), 2, 1)
    assert spec.shard(fused).view(-1).tolist() == [2.0, 3.0, 5.0]
    with pytest.raises(ConfigError, match=r"\(5, 2\)"):
        specs[0].shard(torch.zeros(4, 2))
