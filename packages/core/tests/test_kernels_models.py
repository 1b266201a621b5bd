"""Kernel policy on tiny HF models: same loss and gradients with and without kernels.

CPU/fp32 (Triton interpreter): loss within 1e-5, every gradient within 1e-4 (max abs).
GPU/bf16: loss within 2e-2 relative, gradients within 5e-2 of the gradient's max magnitude.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config
from transformers.models.llama import modeling_llama
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

from megalith.booster import Booster
from megalith.booster.plugins import ZeroPlugin
from megalith.common.errors import ConfigError
from megalith.kernels import KernelRMSNorm
from megalith.policies.kernels import apply_kernels, remove_kernels

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
DTYPE = torch.bfloat16 if GPU else torch.float32
LOSS_TOL, GRAD_TOL = (2e-2, 5e-2) if GPU else (1e-5, 1e-4)
SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa",
)  # fmt: skip


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (1, 8), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


# Llama runs the Triton kernels (the interpreter on CPU); Qwen2 and Mistral check the policy's
# wiring on the torch fallbacks (the interpreter costs seconds per model on CPU).
@pytest.mark.parametrize(
    ("cls", "config", "backend"),
    [
        (LlamaForCausalLM, LlamaConfig, "auto"),
        (Qwen2ForCausalLM, Qwen2Config, "torch"),
        (MistralForCausalLM, MistralConfig, "torch"),
    ],
)
def test_kernels_give_same_loss_and_grads(cls, config, backend, monkeypatch):
    monkeypatch.setenv("MEGALITH_KERNELS", "auto" if GPU else backend)
    torch.manual_seed(0)
    ref = cls(config(**SMALL)).to(DEVICE, DTYPE)
    fused = copy.deepcopy(ref)
    patch = apply_kernels(fused)
    assert patch.summary() == {"rms_norm": 5, "forwards": 5, "rope": 2}  # 2 MLPs, 2 attentions, the LM
    loss_ref, grads_ref = _loss_and_grads(ref)
    loss, grads = _loss_and_grads(fused)
    assert fused(input_ids=_batch()[0], labels=_batch()[1]).logits is None
    assert abs(loss.item() - loss_ref.item()) <= LOSS_TOL * max(1.0, abs(loss_ref.item()))
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        err = (g - grads_ref[name]).abs().max().item()
        assert err <= GRAD_TOL * max(1.0, grads_ref[name].abs().max().item()), f"{name}: {err}"
    remove_kernels(fused)
    assert not any(isinstance(m, KernelRMSNorm) for m in fused.modules())
    assert "forward" not in fused.__dict__


def test_kernels_stay_inside_the_patched_model(monkeypatch):
    """The rotary kernel runs in the patched model's attention only: the family's module-level
    function is untouched, another Llama in the process keeps HF's code, `remove_kernels` ends it."""
    import megalith.policies.attention as attention

    monkeypatch.setenv("MEGALITH_KERNELS", "torch")
    calls: list[int] = []
    real = attention.apply_rotary
    monkeypatch.setattr(attention, "apply_rotary", lambda *a: calls.append(1) or real(*a))
    original = modeling_llama.apply_rotary_pos_emb
    torch.manual_seed(0)
    patched = LlamaForCausalLM(LlamaConfig(**SMALL))
    plain = copy.deepcopy(patched)
    apply_kernels(patched, only=["rope"])
    assert modeling_llama.apply_rotary_pos_emb is original
    ids = _batch()[0].cpu()
    want = plain(input_ids=ids).logits
    assert calls == []
    torch.testing.assert_close(patched(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2  # one per layer
    remove_kernels(patched)
    patched(input_ids=ids)
    assert len(calls) == 2


def test_kernel_subset_swaps_only_what_is_named(monkeypatch):
    """`only=`: RMSNorm and RoPE stay HF's (left to torch.compile), the MLP and the loss are fused;
    the loss and gradients still match the plain model."""
    monkeypatch.setenv("MEGALITH_KERNELS", "auto" if GPU else "torch")
    original = modeling_llama.apply_rotary_pos_emb
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**SMALL)).to(DEVICE, DTYPE)
    fused = copy.deepcopy(ref)
    patch = apply_kernels(fused, only=["swiglu", "cross_entropy"])
    assert patch.summary() == {"rms_norm": 0, "forwards": 3, "rope": 0}
    assert modeling_llama.apply_rotary_pos_emb is original
    loss_ref, grads_ref = _loss_and_grads(ref)
    loss, grads = _loss_and_grads(fused)
    assert abs(loss.item() - loss_ref.item()) <= LOSS_TOL * max(1.0, abs(loss_ref.item()))
    for name, g in grads.items():
        err = (g - grads_ref[name]).abs().max().item()
        assert err <= GRAD_TOL * max(1.0, grads_ref[name].abs().max().item()), f"{name}: {err}"
    remove_kernels(fused)


@pytest.mark.parametrize(
    ("cls", "config"),
    [(LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config), (MistralForCausalLM, MistralConfig)],
)
def test_fused_qkv_matches_separate_projections(cls, config):
    """`only=["qkv"]` (fp32, CPU): logits, loss and every gradient of a left-padded batch equal the
    plain model's and the q/k/v modules are never called (one matmul replaces them); with a KV
    cache (greedy generation) the tokens are unchanged.
    Qwen2 has q/k/v biases, Llama and Mistral none."""
    torch.manual_seed(0)
    ref = cls(config(**SMALL)).to(DEVICE, DTYPE)
    fused = copy.deepcopy(ref)
    assert apply_kernels(fused, only=["qkv"]).summary() == {"rms_norm": 0, "forwards": 2, "rope": 0}
    calls: list[str] = []
    for layer in fused.model.layers:
        layer.self_attn.q_proj.register_forward_hook(lambda *_: calls.append("q"))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: HF builds an explicit mask, which the fused path must pass on
    outs = [m(input_ids=ids, attention_mask=mask, labels=ids) for m in (ref, fused)]
    assert calls == []
    tol = dict(atol=LOSS_TOL, rtol=LOSS_TOL)
    torch.testing.assert_close(outs[1].logits, outs[0].logits, **tol)
    for out in outs:
        out.loss.backward()
    for (name, p), q in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=GRAD_TOL, rtol=GRAD_TOL, msg=name)
    with torch.no_grad():
        want = ref.generate(ids[:1], max_new_tokens=4, do_sample=False)
        got = fused.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want) and calls == []
    remove_kernels(fused)
    assert all("forward" not in layer.self_attn.__dict__ for layer in fused.model.layers)


def test_wrapped_projections_are_not_fused(monkeypatch):
    """A projection that is not a plain nn.Linear (e.g. a LoRA wrapper) is never fused: with only
    "qkv" that attention keeps HF's forward; with "rope" too it runs its modules one by one, and
    the logits equal the plain model's."""
    monkeypatch.setenv("MEGALITH_KERNELS", "torch")
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(**SMALL))
    model = copy.deepcopy(plain)
    model.model.layers[0].self_attn.k_proj = torch.nn.Sequential(model.model.layers[0].self_attn.k_proj)
    assert apply_kernels(model, only=["qkv"]).summary()["forwards"] == 1
    assert "forward" not in model.model.layers[0].self_attn.__dict__
    assert "forward" in model.model.layers[1].self_attn.__dict__
    remove_kernels(model)
    assert apply_kernels(model, only=["qkv", "rope"]).summary() == {"rms_norm": 0, "forwards": 2, "rope": 2}
    ids = _batch()[0].cpu()
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_unknown_kernel_name_is_refused_by_name():
    with pytest.raises(ConfigError, match="layer_norm"):
        apply_kernels(LlamaForCausalLM(LlamaConfig(**SMALL)), only=["rope", "layer_norm"])
    with pytest.raises(ConfigError, match="fused_mlp"):
        Booster(plugin=ZeroPlugin(stage=2), kernels=["fused_mlp"])


def test_unsupported_model_is_refused_by_name():
    with pytest.raises(ConfigError, match="Sequential.*LlamaForCausalLM"):
        apply_kernels(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_booster_kernels_zero2_step_matches_plain_adamw(monkeypatch):
    """Booster(kernels=True) + ZeRO-2 (one process) + FusedAdamW: the loss of two steps equals plain
    HF + torch AdamW within 1e-4 (fp32; torch fallbacks on CPU, Triton on a GPU)."""
    if not GPU:
        monkeypatch.setenv("MEGALITH_KERNELS", "torch")
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(**SMALL)).to(DEVICE)
    model = copy.deepcopy(plain)
    from megalith.kernels import FusedAdamW

    booster = Booster(plugin=ZeroPlugin(stage=2), precision="fp32", kernels=True)
    model, opt, *_ = booster.boost(model, FusedAdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    ids, labels = _batch(1)
    for _ in range(2):
        loss = model(input_ids=ids, labels=labels).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        ref = plain(input_ids=ids, labels=labels).loss
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref.item()) <= 1e-4, (loss.item(), ref.item())
    remove_kernels(model)


@pytest.fixture
def untraceable_autocast_query(monkeypatch):
    """`torch.amp.is_autocast_available` as torch 2.11's Dynamo sees it: a graph break when called
    while compiling (newer torch traces it), so `fullgraph=True` fails if the kernels consult it."""
    available = torch.amp.is_autocast_available

    def graph_break_when_compiling(device_type: str) -> bool:
        if torch.compiler.is_compiling():
            torch._dynamo.graph_break()
        return available(device_type)

    monkeypatch.setattr(torch.amp, "is_autocast_available", graph_break_when_compiling)


@pytest.mark.usefixtures("untraceable_autocast_query")
def test_kernel_functions_trace_without_graph_breaks():
    """`torch.compile(fullgraph=True)` traces the kernels (custom ops + autograd.Functions); the
    aot_eager backend checks tracing and the joint graph without spending minutes in codegen."""
    from megalith.kernels import fused_linear_cross_entropy, rms_norm, swiglu_mlp

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, device=DEVICE, dtype=DTYPE, requires_grad=True)
    w = torch.ones(8, device=DEVICE, dtype=DTYPE, requires_grad=True)
    wg, wu = (torch.randn(12, 8, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    wd = torch.randn(8, 12, device=DEVICE, dtype=DTYPE, requires_grad=True)
    head = torch.randn(10, 8, device=DEVICE, dtype=DTYPE, requires_grad=True)
    labels = torch.tensor([1, 2, 3, -100, 5, 6], device=DEVICE)

    def step(x: torch.Tensor) -> torch.Tensor:
        h = swiglu_mlp(rms_norm(x, w), wg, wu, wd)
        return fused_linear_cross_entropy(h.reshape(-1, 8), head, labels)

    eager = step(x)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    compiled.backward()
    assert abs(compiled.item() - eager.item()) <= LOSS_TOL
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_kernels_under_autocast_match_hf_autocast(monkeypatch):
    """HF mixed-precision training (fp32 parameters, bf16 torch.autocast; CPU autocast here): the
    kernel-patched model runs and its loss and every gradient match the plain model's under the
    same autocast within bf16 tolerance (2e-2 relative loss, 5e-2 of each gradient's max)."""
    monkeypatch.setenv("MEGALITH_KERNELS", "auto" if GPU else "torch")
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**SMALL)).to(DEVICE)
    fused = copy.deepcopy(ref)
    apply_kernels(fused)
    results = []
    for model in (ref, fused):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            ids, labels = _batch()
            out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_ref, grads_ref), (loss, grads) = results
    assert loss.dtype == loss_ref.dtype == torch.float32
    assert abs(loss.item() - loss_ref.item()) <= 2e-2 * max(1.0, abs(loss_ref.item()))
    for name, g in grads.items():
        assert g.dtype == torch.float32, name
        err = (g - grads_ref[name]).abs().max().item()
        assert err <= 5e-2 * max(1.0, grads_ref[name].abs().max().item()), f"{name}: {err}"


@pytest.mark.usefixtures("untraceable_autocast_query")
def test_kernel_functions_trace_under_autocast():
    """The autocast casts in `swiglu_mlp` / `fused_linear_cross_entropy` trace with
    `torch.compile(fullgraph=True)` (aot_eager) and give the eager result."""
    from megalith.kernels import fused_linear_cross_entropy, swiglu_mlp

    torch.manual_seed(0)
    x = torch.randn(6, 8, device=DEVICE, requires_grad=True)
    wg, wu = (torch.randn(12, 8, device=DEVICE, requires_grad=True) for _ in range(2))
    wd = torch.randn(8, 12, device=DEVICE, requires_grad=True)
    head = torch.randn(10, 8, device=DEVICE, requires_grad=True)
    labels = torch.tensor([1, 2, 3, -100, 5, 6], device=DEVICE)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            return fused_linear_cross_entropy(swiglu_mlp(x, wg, wu, wd).float(), head, labels)

    eager = step(x)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    compiled.backward()
    assert compiled.dtype == torch.float32
    assert abs(compiled.item() - eager.item()) <= 1e-6 * max(1.0, abs(eager.item()))
    assert x.grad is not None and x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("how", ["argument", "config"])
def test_return_dict_false_gives_hf_tuple_with_the_loss_first(how, monkeypatch):
    """`return_dict=False` with labels: a tuple like HF's, the fused loss first (equal to HF's), the
    cache next, the logits (None) left out. `config.return_dict = False` gives the same tuple (the
    base model is always asked for its output object; HF 5.24's own forward fails that way)."""
    monkeypatch.setenv("MEGALITH_KERNELS", "torch")
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**SMALL))
    fused = copy.deepcopy(ref)
    apply_kernels(fused)
    ids, labels = (t.cpu() for t in _batch())
    want = ref(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(want, tuple)
    if how == "argument":
        got = fused(input_ids=ids, labels=labels, return_dict=False)
    else:
        fused.config.return_dict = False
        got = fused(input_ids=ids, labels=labels)
    assert isinstance(got, tuple) and len(got) == len(want) - 1  # no logits
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert type(got[1]) is type(want[2])  # the KV cache
    got[0].backward()
    assert fused.lm_head.weight.grad is not None
