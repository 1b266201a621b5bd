"""`Booster(compile=True, cuda_graphs=True)`: the compiled forward and backward replayed as CUDA
graphs train exactly like the compiled model without graphs (fp32, a GPU; with and without
gradient accumulation), and the option is refused where it cannot apply."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megalith.booster import Booster
from megalith.booster import booster as booster_module
from megalith.booster.plugins import ZeroPlugin
from megalith.common.errors import ConfigError

SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa",
)  # fmt: skip


def _train(cuda_graphs: bool, accum: int, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of every micro-step and the final parameters of ZeRO-2 (one process) + AdamW."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).cuda()
    booster = Booster(plugin=ZeroPlugin(stage=2), precision="fp32", compile=True, cuda_graphs=cuda_graphs)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        for micro in range(accum):
            ids = torch.randint(0, 64, (2, 16), generator=g).cuda()
            with booster.no_sync(model, opt) if micro < accum - 1 else nullcontext():
                loss = model(input_ids=ids, labels=ids).loss / accum
                booster.backward(loss, opt)
            losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("accum", [1, 2])
def test_cuda_graphs_train_like_the_compiled_model(accum: int) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    plain_losses, plain = _train(cuda_graphs=False, accum=accum)
    counters.clear()
    graph_losses, graphed = _train(cuda_graphs=True, accum=accum)
    assert counters["inductor"]["cudagraph_skips"] == 0  # the graphs ran
    assert graph_losses == pytest.approx(plain_losses, abs=1e-5)
    for name, p in plain.items():
        assert torch.allclose(graphed[name], p, atol=1e-5), name


def test_cuda_graphs_need_compile_and_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="cuda_graphs=True needs compile=True"):
        Booster(cuda_graphs=True)
    monkeypatch.setattr(booster_module, "_world", lambda: 4)
    with pytest.raises(ConfigError, match="implemented for one process, got a world of 4 ranks"):
        Booster(compile=True, cuda_graphs=True)
