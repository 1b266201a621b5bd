"""Dropout RNG under tensor / sequence parallelism, per-parameter memory plans, and sharded
`save_state` → `export_hf` with full shapes, all in one 2-rank (tp=2) run.

Dropout: the mask on the replicated hidden states (sp none) must be identical on both tp ranks,
masks on this rank's heads (attention) or on sequence shards (split_gather, all_to_all) must differ.
The ranks are seeded differently on purpose (`seed + rank`, as training scripts do): without the
boost-time sync the replicated masks would differ; without the rank stream the head masks of a
shared stream would be equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from megalith.booster import Booster, plan
from megalith.booster.plugins import HybridPlugin
from megalith.checkpoint import export_hf
from megalith.common.errors import ConfigError
from megalith.tensor_parallel import TensorParallelRNG, full_state_dict
from megalith.testing import run_distributed, state_of
from megalith.testing.models import tiny_llama

VOCAB, SEQ = 131, 8


def dropout_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_dropout=0.5,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).train()


def _record_dropout(masks: dict[str, list[torch.Tensor]]):
    """Wrap F.dropout: 4-D inputs are attention probabilities, 3-D ones hidden states."""
    original = F.dropout

    def recording(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
        out = original(x, p, training, inplace)
        if training and p > 0:
            key = "attention" if x.dim() == 4 else "hidden"
            masks[key].append((out == 0).detach().clone())
        return out

    return original, recording


def dropout_run(rank: int, mode: str) -> dict[str, object]:
    """Two training steps at tp=2 with attention dropout plus a dropout on the final norm's input."""
    masks: dict[str, list[torch.Tensor]] = {"attention": [], "hidden": []}
    original, recording = _record_dropout(masks)
    torch.manual_seed(100 + rank)  # different default streams on purpose
    plugin = HybridPlugin(tp_size=2, sp_mode=mode)
    model = dropout_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, opt)

    def hidden_dropout(module: torch.nn.Module, args: tuple) -> tuple:
        return (F.dropout(args[0], 0.5, module.training), *args[1:])

    model.model.norm.register_forward_pre_hook(hidden_dropout)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    F.dropout = recording  # eager attention calls nn.functional.dropout at call time
    try:
        losses = []
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    finally:
        F.dropout = original
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}
    return {
        "attention": masks["attention"],
        "hidden": masks["hidden"],
        "losses": losses,
        "norms": norms,
        "after": torch.rand(4),  # the default stream after the forks
    }


def memory_run(mode: str) -> dict[str, int]:
    plugin = HybridPlugin(tp_size=2, sp_mode=mode, zero_stage=2)
    model = tiny_llama()
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    opt.step()
    measured = opt.memory_bytes()
    unique = {id(p): p for p in model.parameters()}.values()
    measured["params"] = sum(p.numel() * p.element_size() for p in unique)
    return measured


def export_run(root: str) -> dict[str, torch.Tensor]:
    plugin = HybridPlugin(tp_size=2, sp_mode="split_gather", zero_stage=1)
    model = tiny_llama()
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    opt.step()
    booster.save_state(Path(root) / "state", model, opt, step=1)
    return {k: v.clone() for k, v in full_state_dict(model, plugin.tp_group).items()}


def worker(rank: int, world: int, root: str) -> dict[str, object]:
    out: dict[str, object] = {
        mode: dropout_run(rank, mode) for mode in ("none", "split_gather", "all_to_all")
    }
    out["memory"] = {mode: memory_run(mode) for mode in ("none", "all_to_all")}
    out["export"] = export_run(root)
    return out


def _differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(x.shape == y.shape and not torch.equal(x, y) for x, y in zip(a, b))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))


def test_tp2_dropout_streams_memory_plan_and_export(tmp_path: Path) -> None:
    r0, r1 = run_distributed(worker, 2, str(tmp_path), timeout_s=240)
    # sp none: replicated hidden states get one mask; the heads of each rank their own.
    assert _same(r0["none"]["hidden"], r1["none"]["hidden"])
    assert _differ(r0["none"]["attention"], r1["none"]["attention"])
    # the replicas stayed equal: replicated norm weights trained identically on both ranks
    for name, value in r0["none"]["norms"].items():
        assert torch.equal(value, r1["none"]["norms"][name]), name
    assert torch.equal(r0["none"]["after"], r1["none"]["after"])  # forks left the shared stream alone
    # sequence parallelism: hidden states are sequence shards, so their masks differ as well
    for mode in ("split_gather", "all_to_all"):
        assert _differ(r0[mode]["hidden"], r1[mode]["hidden"]), mode
        assert _differ(r0[mode]["attention"], r1[mode]["attention"]), mode
        assert all(torch.isfinite(torch.tensor(r[mode]["losses"])).all() for r in (r0, r1))
    # dropout 0.5 drops about half of the (dense) hidden states: a mask that dropped nothing or
    # everything would pass the comparisons above
    frac = torch.cat([m.float().reshape(-1) for m in r0["none"]["hidden"]]).mean()
    assert 0.35 < float(frac) < 0.65

    # memory: plan() counts each parameter as a tp rank holds it (measured after one step)
    for mode in ("none", "all_to_all"):
        p = plan(tiny_llama(), HybridPlugin(tp_size=2, sp_mode=mode, zero_stage=2), world_size=2)
        measured = r0["memory"][mode]
        assert p.params == measured["params"], mode  # exact: blocks, padded vocab rows, full norms
        assert measured["grads"] == pytest.approx(p.grads, rel=0.05), mode
        assert measured["optimizer_states"] == pytest.approx(p.optimizer_states, rel=0.05), mode
    n = sum(t.numel() for t in tiny_llama().parameters())
    ulysses = plan(tiny_llama(), HybridPlugin(tp_size=2, sp_mode="all_to_all"), world_size=2)
    assert ulysses.params == 4 * n  # weights replicated over the tp group under Ulysses

    # sharded save_state → export_hf: full shapes in meta.json, from_pretrained loads it
    meta = json.loads((tmp_path / "state" / "model_sharded" / "meta.json").read_text())
    full = state_of(tiny_llama())
    assert meta["shapes"]["model.embed_tokens.weight"] == [VOCAB, 32]
    assert meta["shapes"]["model.layers.0.self_attn.o_proj.weight"] == list(
        full["model.layers.0.self_attn.o_proj.weight"].shape
    )
    exported = LlamaForCausalLM.from_pretrained(
        export_hf(tmp_path / "state" / "model_sharded", tmp_path / "hf")
    )
    for name, value in state_of(exported).items():
        assert value.shape == full[name].shape, name
        assert float((value - r0["export"][name]).abs().max()) < 1e-6, name


def test_rank_stream_fork_restores_the_default_stream() -> None:
    torch.manual_seed(1)
    expected_default = torch.Generator().manual_seed(1)
    rng = TensorParallelRNG(seed=7)
    with rng.fork():
        first = torch.rand(3)
        with rng.fork():  # nested: still the rank stream
            second = torch.rand(3)
    after = torch.rand(3)
    reference = torch.Generator().manual_seed(7)
    assert torch.equal(first, torch.rand(3, generator=reference))
    assert torch.equal(second, torch.rand(3, generator=reference))
    assert torch.equal(after, torch.rand(3, generator=expected_default))  # untouched by the forks
    with rng.fork():
        assert torch.equal(torch.rand(3), torch.rand(3, generator=reference))  # continues the stream


def test_plan_rejects_kv_heads_below_tp_before_counting() -> None:
    with pytest.raises(ConfigError, match=r"key/value heads = 2 .* tp = 4 .*not replicated"):
        plan(tiny_llama(), HybridPlugin(tp_size=4), world_size=4)


def _recompute_with_dropout(rank: int, world: int) -> list[str]:
    """Gradient checkpointing with attention dropout at tp=2: enabled before boost (refused by the
    plugin), after it (refused when the backward recomputes), then without dropout (trains)."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    errors = []
    model = dropout_llama()
    model.gradient_checkpointing_enable()
    try:
        Booster(HybridPlugin(tp_size=world)).boost(model)
    except ConfigError as exc:
        errors.append(str(exc))
    model, *_ = Booster(HybridPlugin(tp_size=world)).boost(dropout_llama())
    model.gradient_checkpointing_enable()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except ConfigError as exc:
        errors.append(str(exc))
    plain = dropout_llama()
    plain.config.attention_dropout = 0.0
    for layer in plain.model.layers:
        layer.self_attn.attention_dropout = 0.0
    plain.gradient_checkpointing_enable()
    plain, *_ = Booster(HybridPlugin(tp_size=world)).boost(plain)
    plain(input_ids=ids, labels=ids).loss.backward()
    errors.append(str(all(p.grad is not None for p in plain.parameters())))
    return errors


def test_dropout_with_recomputation_is_refused_under_tp() -> None:
    """A recomputed module would draw a different dropout mask on its rank stream than its forward:
    refused with a ConfigError at boost or at the recomputation, never silently wrong gradients."""
    for at_boost, at_backward, trained in run_distributed(_recompute_with_dropout, 2, timeout_s=120):
        assert "dropout 0.5 with activation recomputation under tp_size=2" in at_boost
        assert "self_attn" in at_backward and "recomputed (gradient checkpointing)" in at_backward
        assert trained == "True"
