"""Tiny Llama, Qwen2 (tied embeddings, q/k/v biases) and Mistral (sliding window, SDPA), all with
GQA and a vocabulary of 131 (padded at tp=2 and 4), trained 3 steps with prompt-masked labels and
global-norm clipping at tp=2 and tp=4, with no / split_gather / all_to_all sequence parallelism,
equal the single-process run within 1e-5 (acceptance 2). Bad input fails before weights move; a
user plan (fused projection) and generation with gathered logits work on 2 ranks."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
import torch
import transformers.models.mistral.modeling_mistral
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from megalith.booster import Booster
from megalith.booster.plugins import HybridPlugin
from megalith.common.errors import ConfigError
from megalith.policies import policy_for
from megalith.tensor_parallel import TensorParallelPlan, full_state_dict, validate_plan
from megalith.testing import run_distributed, state_of

STEPS, BATCH, SEQ, LR, VOCAB = 3, 4, 12, 1e-3, 131
MODES = ("none", "split_gather", "all_to_all")
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,  # GQA: 2 query heads per KV head
    "max_position_embeddings": 64,
    "attn_implementation": "eager",
}


def build(family: str, seed: int = 0, **overrides: object) -> nn.Module:
    torch.manual_seed(seed)
    kw = {**COMMON, **overrides}
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw))
    if family == "qwen2":  # tied embeddings, q/k/v biases
        return Qwen2ForCausalLM(Qwen2Config(**{"tie_word_embeddings": True, **kw}))
    # window < SEQ; SDPA attention (Llama and Qwen2 use the eager path)
    return MistralForCausalLM(MistralConfig(**{"sliding_window": 8, **kw, "attn_implementation": "sdpa"}))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def labels_of(ids: torch.Tensor) -> torch.Tensor:
    """Prompt-masked labels: the first 5 tokens are ignored, so sequence shards hold unequal counts."""
    labels = ids.clone()
    labels[:, :5] = -100
    return labels


@cache
def reference(family: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain torch in one process: the parameters after 3 steps and the gradient norm of each step."""
    model = build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    norms = []
    for ids in batches():
        model(input_ids=ids, labels=labels_of(ids)).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    return state_of(model), norms


def train_tp(family: str, mode: str, tp: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    plugin = HybridPlugin(tp_size=tp, sp_mode=mode)
    booster = Booster(plugin)
    model, opt, *_ = booster.boost(model, opt)
    norms = []
    for ids in batches():
        booster.backward(model(input_ids=ids, labels=labels_of(ids)).loss, opt)
        norms.append(opt.clip_grad_by_norm(0.5))
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in full_state_dict(model, plugin.tp_group).items()}, norms


def models_worker(rank: int, world: int) -> dict[str, tuple[dict[str, torch.Tensor], list[float]]]:
    return {f"{f}/{m}": train_tp(f, m, world) for f in ("llama", "qwen2", "mistral") for m in MODES}


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_models_match_single_process(tp: int) -> None:
    results = run_distributed(models_worker, tp, timeout_s=240)
    for key in results[0]:
        family = key.split("/")[0]
        ref, ref_norms = reference(family)
        assert ref_norms[0] > 0.5, "clipping must be active for the comparison to test it"
        for rank, res in enumerate(results):
            state, norms = res[key]
            for name, value in ref.items():
                diff = float((state[name] - value).abs().max())
                assert diff < 1e-5, f"{key} tp={tp} rank={rank} {name}: max |diff| {diff:.2e}"
            assert norms == pytest.approx(ref_norms, rel=1e-5), (
                f"{key} tp={tp}: grad norms {norms} != {ref_norms}"
            )
    assert not torch.equal(reference("llama")[0]["lm_head.weight"], build("llama").lm_head.weight)


def test_unsupported_model_names_supported_classes() -> None:
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Policy"):
        policy_for(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 36},
            4,
            "attention heads = 6 .* tp = 4",
        ),
        ({"num_attention_heads": 8, "num_key_value_heads": 2}, 4, "key/value heads = 2 .* tp = 4"),
    ],
)
def test_indivisible_heads_fail_before_weights_move(overrides: dict, tp: int, message: str) -> None:
    model = build("llama", **overrides)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = policy_for(model).plan_for(model)
    with pytest.raises(ConfigError, match=message):
        validate_plan(model, plan, tp, "none")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)


def _bad_heads(rank: int, world: int) -> list[bool]:
    """The model's own policy, then its bare plan (no head counts: read from the model's config)."""
    refused = []
    for bare in (False, True):
        model = build("llama", num_attention_heads=8, num_key_value_heads=2)
        policy = policy_for(model).plan if bare else None
        q_before = model.model.layers[0].self_attn.q_proj
        try:
            Booster(HybridPlugin(tp_size=4, policy=policy)).boost(
                model, torch.optim.SGD(model.parameters(), lr=0.1)
            )
        except ConfigError as exc:
            assert "key/value heads = 2" in str(exc) and "tp = 4" in str(exc), str(exc)
            refused.append(model.model.layers[0].self_attn.q_proj is q_before)
        else:
            refused.append(False)
    return refused


def _bad_sequence(rank: int, world: int) -> str:
    model = build("llama")
    model, *_ = Booster(HybridPlugin(tp_size=world, sp_mode="split_gather")).boost(model)
    try:
        model(input_ids=torch.zeros(1, 10, dtype=torch.long))
    except ConfigError as exc:
        return str(exc)
    return ""


def test_bad_input_on_ranks() -> None:
    assert run_distributed(_bad_heads, 4, timeout_s=60) == [[True, True]] * 4
    messages = run_distributed(_bad_sequence, 4, timeout_s=60)
    assert all("sequence length 10 is not divisible by the sequence-parallel size 4" in m for m in messages)


# -- user plans, generation, one process ----------------------------------------------------------------
class FusedMLP(nn.Module):
    """Not an HF model: a fused gate/up projection [2I, h] and a down projection [h, I]."""

    def __init__(self, hidden: int = 8, inner: int = 12) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.gate_up = nn.Linear(hidden, 2 * inner)
        self.down = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # per rank: its blocks of gate and of up
        return self.down(torch.nn.functional.silu(gate) * up)


USER_PLAN = TensorParallelPlan(layers={"gate_up": "colwise", "down": "rowwise"}, fused={"gate_up": (12, 12)})


def _train_fused(plugin: HybridPlugin | None) -> dict[str, torch.Tensor]:
    model = FusedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    booster = Booster(plugin) if plugin is not None else None
    if booster is not None:
        model, opt, *_ = booster.boost(model, opt)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        loss = model(x).pow(2).mean()
        booster.backward(loss, opt) if booster is not None else loss.backward()
        opt.step()
        opt.zero_grad()
    group = plugin.tp_group if plugin is not None else None
    return {k: v.clone() for k, v in full_state_dict(model, group).items()}


def extras_worker(rank: int, world: int) -> dict[str, object]:
    fused = _train_fused(HybridPlugin(tp_size=world, policy=USER_PLAN))
    model = build("llama")
    plan = replace(policy_for(model).plan_for(model), gather_logits=True)
    model, *_ = Booster(HybridPlugin(tp_size=world, policy=plan)).boost(model)
    ids = batches()[0][:1, :6]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return {"fused": fused, "logits": logits, "tokens": tokens}


def test_user_plan_and_generation_on_two_ranks() -> None:
    ref_fused = _train_fused(None)
    ref_model = build("llama")
    ids = batches()[0][:1, :6]
    with torch.no_grad():
        ref_logits = ref_model(input_ids=ids).logits
        ref_tokens = ref_model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    for res in run_distributed(extras_worker, 2, timeout_s=120):
        for name, value in ref_fused.items():
            assert float((res["fused"][name] - value).abs().max()) < 1e-6, name
        assert res["logits"].shape == (1, 6, VOCAB)  # gathered and unpadded
        assert float((res["logits"] - ref_logits).abs().max()) < 1e-5
        assert torch.equal(res["tokens"], ref_tokens)


def test_one_process_hybrid_equals_torch() -> None:
    """tp=1 without a process group: the plugin is a plain trainer (vocabulary CE over one rank)."""
    model = build("qwen2")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    booster = Booster(HybridPlugin(tp_size=1, sp_mode="split_gather"))
    model, opt, *_ = booster.boost(model, opt)
    ref = build("qwen2")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for ids in batches()[:2]:
        booster.backward(model(input_ids=ids, labels=ids).loss, opt)
        opt.step()
        opt.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for name, value in state_of(ref).items():
        assert float((dict(model.named_parameters())[name].detach() - value).abs().max()) < 1e-5, name


def _frozen(family: str) -> nn.Module:
    """``family`` with its embedding and LM head frozen (tied for qwen2: one parameter)."""
    model = build(family)
    model.get_input_embeddings().weight.requires_grad_(False)
    model.get_output_embeddings().weight.requires_grad_(False)
    return model


def _train_frozen(
    family: str, mode: str, tp: int | None
) -> tuple[dict[str, torch.Tensor], list[float], bool]:
    """Three clipped steps with the optimizer over ``model.parameters()`` (the usual way to freeze):
    the weights after them, the gradient norms, whether any vocabulary weight asks for gradients."""
    model = _frozen(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    plugin = HybridPlugin(tp_size=tp, sp_mode=mode) if tp else None
    booster = Booster(plugin) if plugin else None
    if booster:
        model, opt, *_ = booster.boost(model, opt)
    vocab = [p.requires_grad for n, p in model.named_parameters() if "embed" in n or "lm_head" in n]
    norms = []
    for ids in batches():
        loss = model(input_ids=ids, labels=labels_of(ids)).loss
        if booster:
            booster.backward(loss, opt)
            norms.append(opt.clip_grad_by_norm(0.5))
        else:
            loss.backward()
            trainable = [p for p in model.parameters() if p.requires_grad]
            norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, 0.5)))
        opt.step()
        opt.zero_grad()
    state = full_state_dict(model, plugin.tp_group) if plugin else state_of(model)
    return {k: v.clone() for k, v in state.items()}, norms, any(vocab)


def frozen_worker(rank: int, world: int) -> dict[str, tuple[dict[str, torch.Tensor], list[float], bool]]:
    return {
        f"{f}/{m}": _train_frozen(f, m, world) for f in ("llama", "qwen2") for m in ("none", "split_gather")
    }


def test_frozen_vocabulary_weights_stay_frozen_under_tp() -> None:
    """A frozen embedding / LM head (untied Llama, tied Qwen2) stays frozen when tensor parallelism
    shards it: not updated, and not in the clipped gradient norm, as in one process."""
    results = run_distributed(frozen_worker, 2, timeout_s=240)
    for key, (state, norms, wants_grad) in results[0].items():
        ref, ref_norms, _ = _train_frozen(key.split("/")[0], "none", None)
        assert not wants_grad, f"{key}: a frozen vocabulary weight asks for gradients after boost"
        assert norms == pytest.approx(ref_norms, rel=1e-5), f"{key}: grad norms {norms} != {ref_norms}"
        for name, value in ref.items():
            diff = float((state[name] - value).abs().max())
            assert diff < 1e-5, f"{key} {name}: max |diff| {diff:.2e}"
