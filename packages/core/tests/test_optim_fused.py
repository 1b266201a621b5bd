"""`prefer_fused`: torch Adam/AdamW switched to the fused kernel only when left at its defaults."""

import pytest
import torch

from megalith.optim import prefer_fused


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (7, 300, 1025)]


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_update_matches_default(cls: type) -> None:
    ref, fused = _params(0), _params(0)
    opt_ref = cls(ref, lr=1e-2, weight_decay=0.1)
    opt_fused = cls(fused, lr=1e-2, weight_decay=0.1)
    assert prefer_fused(opt_fused)
    assert all(g["fused"] for g in opt_fused.param_groups)
    _run(opt_ref, ref)
    _run(opt_fused, fused)
    for a, b in zip(ref, fused, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert opt_fused.state[fused[0]]["step"].device == fused[0].device


def test_explicit_choices_and_other_optimizers_are_left_alone() -> None:
    assert not prefer_fused(torch.optim.AdamW(_params(0), foreach=False))
    assert not prefer_fused(torch.optim.SGD(_params(0), lr=0.1))
    started = torch.optim.AdamW(ps := _params(0))
    _run(started, ps)
    assert not prefer_fused(started)  # state exists: its step counters belong to the default path
    assert started.param_groups[0]["fused"] is None
