"""megalith.kernels vs independent torch references.

On CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set below before Triton is
imported; fp32 only) and tolerances are fp32-tight; on a GPU the same tests run in bf16 on the
compiled kernels. Tolerances (max abs error, inputs ~N(0, 1)):
  fp32: 1e-5 (elementwise), 1e-4 (reductions / matmuls); bf16: 2e-2 elementwise, 5e-2 matmul paths.
Each test runs both backends: "triton" (when importable) and the "torch" fallbacks.
"""

from __future__ import annotations

import copy
import os

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from megalith.common.errors import ConfigError  # noqa: E402
from megalith.kernels import (  # noqa: E402
    FusedAdamW,
    apply_rotary,
    fused_linear_cross_entropy,
    get_kernel,
    pick_backend,
    rms_norm,
    swiglu,
    swiglu_mlp,
    triton_available,
)

DEVICE = torch.device("cuda" if GPU else "cpu")
DTYPE = torch.bfloat16 if GPU else torch.float32
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 5e-2)}[DTYPE]  # (elementwise, matmul)
BACKENDS = ["torch"] + (["triton"] if triton_available() else [])
FEW = settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("MEGALITH_KERNELS", request.param)
    return request.param


def _leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(DTYPE).requires_grad_()


def _twin(t: torch.Tensor) -> torch.Tensor:
    """An fp32 copy for the reference computation."""
    return t.detach().float().clone().requires_grad_()


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    assert err <= tol * max(1.0, want.abs().max().item()), f"{what}: max abs error {err} > {tol}"


# -- registry ---------------------------------------------------------------------------------------
def test_backend_choice_follows_env_device_and_dtype(monkeypatch):
    x32 = torch.zeros(2)
    monkeypatch.setenv("MEGALITH_KERNELS", "torch")
    assert pick_backend(x32) == "torch"
    monkeypatch.delenv("MEGALITH_KERNELS")
    if triton_available() and not GPU:
        assert pick_backend(x32) == "triton"  # interpreter is on in this module
        assert pick_backend(x32.bfloat16()) == "torch"  # the interpreter runs fp32 only
    monkeypatch.setenv("MEGALITH_KERNELS", "fastest")
    with pytest.raises(ConfigError, match="fastest"):
        pick_backend(x32)
    with pytest.raises(ConfigError, match="no_such_kernel"):
        get_kernel("no_such_kernel")


def test_bad_shapes_raise_config_error_naming_them():
    x = torch.zeros(3, 8)
    with pytest.raises(ConfigError, match=r"\(7,\)"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ConfigError, match=r"\(3, 5\)"):
        swiglu(x[:, :5], x)
    with pytest.raises(ConfigError, match=r"\[V, H\]"):
        fused_linear_cross_entropy(x, torch.zeros(10, 9), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ConfigError, match="labels"):
        fused_linear_cross_entropy(x, torch.zeros(10, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ConfigError, match="even D"):
        q = torch.zeros(1, 2, 4, 7)
        apply_rotary(q, q, torch.zeros(1, 4, 7), torch.zeros(1, 4, 7))


# -- RMSNorm ----------------------------------------------------------------------------------------
@FEW
@given(rows=st.integers(1, 6), n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_rms_norm_forward_backward(backend, rows, n, seed):
    torch.manual_seed(seed)
    x, w = _leaf(2, rows, n), _leaf(n)
    y = rms_norm(x, w, 1e-6)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr = _twin(x), _twin(w)
    yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr
    yr.backward(dy.float())
    _close(y, yr, TOL[0], "y")
    _close(x.grad, xr.grad, TOL[1], "dx")
    _close(w.grad, wr.grad, TOL[1] * rows, "dw")


# -- rotary -----------------------------------------------------------------------------------------
@FEW
@given(
    b=st.integers(1, 2), heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]), s=st.integers(1, 5),
    half=st.integers(1, 6), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_rotary_matches_hf_forward_backward(backend, b, heads, s, half, seed):
    torch.manual_seed(seed)
    h, kv = heads
    d = 2 * half
    q_base = _leaf(b, s, h, d)
    q = q_base.transpose(1, 2)  # HF's [B, H, S, D] view of [B, S, H, D]
    k = _leaf(b, kv, s, d)
    angles = torch.randn(1, s, half, device=DEVICE)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DTYPE) for f in (torch.cos, torch.sin))
    qo, ko = apply_rotary(q, k, cos, sin)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    ((qo.float() * gq).sum() + (ko.float() * gk).sum()).backward()
    qr, kr = _twin(q), _twin(k)
    qe, ke = apply_rotary_pos_emb(qr, kr, cos.float(), sin.float())
    ((qe * gq.float()).sum() + (ke * gk.float()).sum()).backward()
    _close(qo, qe, TOL[0], "q")
    _close(ko, ke, TOL[0], "k")
    _close(q_base.grad.transpose(1, 2), qr.grad, TOL[0], "dq")
    _close(k.grad, kr.grad, TOL[0], "dk")


# -- SwiGLU -----------------------------------------------------------------------------------------
@FEW
@given(rows=st.integers(1, 5), n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_swiglu_forward_backward(backend, rows, n, seed):
    torch.manual_seed(seed)
    g, u = _leaf(rows, 2, n), _leaf(rows, 2, n)
    y = swiglu(g, u)
    dy = torch.randn_like(y)
    y.backward(dy)
    gr, ur = _twin(g), _twin(u)
    (gr * torch.sigmoid(gr) * ur).backward(dy.float())
    _close(y, F.silu(gr) * ur, TOL[0], "y")
    _close(g.grad, gr.grad, TOL[0], "dg")
    _close(u.grad, ur.grad, TOL[0], "du")


@FEW
@given(rows=st.integers(1, 5), n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_swiglu_backward_rebuilds_the_hidden(backend, rows, n, seed):
    """swiglu_bwd_h on [g | u] halves of one strided buffer: the gradients of swiglu_bwd plus h."""
    torch.manual_seed(seed)
    gu = torch.randn(rows, 2 * n, device=DEVICE).to(DTYPE)
    g, u = gu[:, :n], gu[:, n:]
    dy = torch.randn(rows, n, device=DEVICE).to(DTYPE)
    dgu, h = get_kernel("swiglu_bwd_h", backend)(dy, g, u)
    gf, uf = g.float(), u.float()
    _close(h, F.silu(gf) * uf, TOL[0], "h")
    _close(dgu, get_kernel("swiglu_bwd", "torch")(dy, g, u), TOL[0], "[dg | du]")


@FEW
@given(
    tokens=st.integers(1, 6), hidden=st.integers(2, 12), inter=st.integers(1, 20), seed=st.integers(0, 2**16)
)
def test_swiglu_mlp_matches_three_linears(backend, tokens, hidden, inter, seed):
    torch.manual_seed(seed)
    x = _leaf(1, tokens, hidden)
    wg, wu, wd = (
        _leaf(inter, hidden, scale=0.3),
        _leaf(inter, hidden, scale=0.3),
        _leaf(hidden, inter, scale=0.3),
    )
    y = swiglu_mlp(x, wg, wu, wd)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = [_twin(t) for t in (x, wg, wu, wd)]
    xr, wgr, wur, wdr = ref
    ((F.silu(xr @ wgr.t()) * (xr @ wur.t())) @ wdr.t()).backward(dy.float())
    _close(y, (F.silu(xr @ wgr.t()) * (xr @ wur.t())) @ wdr.t(), TOL[1], "y")
    for got, want, name in zip((x, wg, wu, wd), ref, ("dx", "dgate", "dup", "ddown"), strict=True):
        _close(got.grad, want.grad, TOL[1], name)


def test_swiglu_mlp_saves_x_gate_and_up_not_the_hidden(backend):
    """Activations kept for backward: x [M, H], g and u [M, I] (2I + H per token); the three-linear
    module also keeps silu(g) and h. Weights are not counted (they are parameters)."""
    tokens, hidden, inter = 6, 8, 20
    x = _leaf(tokens, hidden)
    weights = [_leaf(inter, hidden), _leaf(inter, hidden), _leaf(hidden, inter)]
    params = {w.data_ptr() for w in weights}

    def saved_activation_numel(fn) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() not in params:
                seen[t.data_ptr()] = t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(seen.values())

    fused = saved_activation_numel(lambda: swiglu_mlp(x, *weights))
    plain = saved_activation_numel(
        lambda: (F.silu(x @ weights[0].t()) * (x @ weights[1].t())) @ weights[2].t()
    )
    assert fused == tokens * (hidden + 2 * inter), fused
    assert plain > fused, (plain, fused)


_PTX_SCRIPT = """
import json, re, triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megalith.kernels import _tl as K

def accesses(fn, sig, consts, aligned):
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn, {**sig, **{k: "constexpr" for k in consts}}, consts, attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    return {k: len(re.findall(p, ptx)) for k, p in (("v4", r"(ld|st)[.]global[.]v4"), ("b16", r"(ld|st)[.]global[.]b16"))}

f32 = ["lr", "beta1", "beta2", "eps", "weight_decay", "step_size", "bc2_sqrt"]
one = {"P": "*bf16", "G": "*bf16", "M": "*bf16", "V": "*bf16", "n": "i32", **dict.fromkeys(f32, "fp32"),
       "STEP": "*fp32", "LR": "*fp32"}
multi = {"ADDRS": "*i64", "BLOCK_TENSOR": "*i64", "BLOCK_START": "*i64", "NUMELS": "*i64", **dict.fromkeys(f32, "fp32"),
         "LR": "*fp32"}
out = {}
for captured in (False, True):
    out[f"one{captured:d}"] = accesses(K.adamw_kernel, one, {"BLOCK": 4096, "CAPTURED": captured}, range(5))
    out[f"multi{captured:d}"] = accesses(
        K.adamw_multi_kernel, multi, {"P_TY": tl.bfloat16, "S_TY": tl.bfloat16, "BLOCK": 4096, "CAPTURED": captured},
        range(4))
print(json.dumps(out))
"""


@pytest.mark.skipif(not triton_available(), reason="needs triton (shipped with torch on Linux)")
def test_multi_tensor_adamw_compiles_to_vector_accesses():
    """Compiled for an H100/H200 (sm_90, PTX only: no GPU needed), the multi-tensor AdamW kernel,
    whose addresses come from a table, and both kernels' captured forms use the per-tensor kernel's 16-byte accesses and no 16-bit
    scalar ones (without its alignment hints: 16-bit scalar accesses, which cost ~9 ms per step of
    the 1.1B benchmark on an H200)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", _PTX_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["one0"]["v4"] > 0 and counts["one0"]["b16"] == 0, counts
    # the table-driven and the captured forms (step and lr read from memory) access alike
    assert counts["multi0"] == counts["one1"] == counts["multi1"] == counts["one0"], counts


# -- fused linear cross-entropy ----------------------------------------------------------------------
@FEW
@given(
    tokens=st.integers(1, 40), hidden=st.integers(1, 16), vocab=st.integers(2, 70),
    reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_fused_linear_cross_entropy(backend, tokens, hidden, vocab, reduction, seed):
    torch.manual_seed(seed)
    h, w = _leaf(tokens, hidden), _leaf(vocab, hidden, scale=0.5)
    labels = torch.randint(0, vocab, (tokens,), device=DEVICE)
    labels[torch.rand(tokens, device=DEVICE) < 0.3] = -100
    loss = fused_linear_cross_entropy(h, w, labels, reduction=reduction)
    (loss * 2.0).backward()
    hr, wr = _twin(h), _twin(w)
    ref = F.cross_entropy(hr @ wr.t(), labels, ignore_index=-100, reduction="sum")
    if reduction == "mean":
        ref = ref / (labels != -100).sum().clamp(min=1)
    (ref * 2.0).backward()
    _close(loss, ref, TOL[1], "loss")
    _close(h.grad, hr.grad, TOL[1], "dh")
    _close(w.grad, wr.grad, TOL[1], "dw")


def test_fused_linear_cross_entropy_over_several_chunks_with_a_partial_last(backend):
    from megalith.kernels.custom_ops import chunk_rows

    tokens, hidden, vocab = 37, 4, 64
    rows = chunk_rows(tokens, vocab, hidden)
    assert 1 < rows < tokens and tokens % rows, rows  # several chunks, the last one shorter
    torch.manual_seed(3)
    h, w = _leaf(tokens, hidden), _leaf(vocab, hidden, scale=0.5)
    labels = torch.randint(0, vocab, (tokens,), device=DEVICE)
    labels[::5] = -100
    fused_linear_cross_entropy(h, w, labels).backward()
    hr, wr = _twin(h), _twin(w)
    ref = F.cross_entropy(hr @ wr.t(), labels, ignore_index=-100)
    ref.backward()
    _close(h.grad, hr.grad, TOL[1], "dh")
    _close(w.grad, wr.grad, TOL[1], "dw")


def test_fused_linear_cross_entropy_without_grad_skips_gradients(backend):
    h, w = torch.randn(5, 4, device=DEVICE, dtype=DTYPE), torch.randn(9, 4, device=DEVICE, dtype=DTYPE)
    labels = torch.tensor([1, 2, -100, 3, 8], device=DEVICE)
    got = fused_linear_cross_entropy(h, w, labels)
    want = F.cross_entropy((h @ w.t()).float(), labels)
    _close(got, want, TOL[1], "loss")


# -- AdamW ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("weight_decay", "multi_tensor"), [(0.0, False), (0.1, False), (0.1, True)])
def test_fused_adamw_matches_torch_adamw(backend, weight_decay, multi_tensor, monkeypatch):
    from megalith.kernels import adamw

    batched: list[int] = []
    multi = adamw._triton_adamw_multi
    monkeypatch.setattr(adamw, "_triton_adamw_multi", lambda ps, *a: (batched.append(len(ps)), multi(ps, *a)))
    torch.manual_seed(0)
    shapes = [(33, 7), (5,), (4, 3, 2), (16, 8), (48,)]
    # the last one transposed (non-contiguous): stepped on its own
    ours = [torch.randn(s, device=DEVICE) for s in shapes] + [torch.randn(3, 4, device=DEVICE).t()]
    ref = [p.clone() for p in ours]
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.05}]  # noqa: E731
    opt = FusedAdamW(
        groups(ours),
        lr=0.1,
        betas=(0.8, 0.95),
        eps=1e-6,
        weight_decay=weight_decay,
        multi_tensor=multi_tensor,
    )
    torch_opt = torch.optim.AdamW(groups(ref), lr=0.1, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    for _ in range(3):
        for a, b in zip(ours, ref, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref, strict=True):
        _close(a, b, 1e-5, "param")
        _close(opt.state[a]["exp_avg_sq"], torch_opt.state[b]["exp_avg_sq"], 1e-5, "exp_avg_sq")
    # numel % 16 == 0 and contiguous: (16, 8) and (48,) in one launch per step, the rest alone
    assert batched == ([2] * 3 if multi_tensor and backend == "triton" else [])
    with pytest.raises(ConfigError, match="betas"):
        FusedAdamW(ours, betas=(0.9, 1.5))


@pytest.mark.parametrize("multi_tensor", [False, True])
def test_capturable_fused_adamw_matches_torch_adamw_with_a_changing_tensor_lr(
    backend, multi_tensor, monkeypatch
):
    """`capturable=True`: step counts on the parameters' device, lr and the bias corrections read
    from device memory; a tensor lr changed in place between steps (as a scheduler does) is used,
    a float lr too; every step is torch's AdamW."""
    from megalith.kernels import adamw

    batched: list[int] = []
    multi = adamw._triton_adamw_multi_captured
    monkeypatch.setattr(
        adamw, "_triton_adamw_multi_captured", lambda ps, *a: (batched.append(len(ps)), multi(ps, *a))
    )
    torch.manual_seed(0)
    shapes = [(16, 8), (48,), (5,), (33, 7)]
    ours = [torch.randn(s, device=DEVICE) for s in shapes] + [torch.randn(3, 4, device=DEVICE).t()]
    ref = [p.clone() for p in ours]
    lr = torch.tensor(0.1, device=DEVICE)
    opt = FusedAdamW(
        [{"params": ours[:3], "lr": lr}, {"params": ours[3:], "lr": 0.05}],
        betas=(0.8, 0.999), eps=1e-6, weight_decay=0.1, multi_tensor=multi_tensor, capturable=True,
    )  # fmt: skip
    torch_opt = torch.optim.AdamW(
        [{"params": ref[:3], "lr": 0.1}, {"params": ref[3:], "lr": 0.05}], betas=(0.8, 0.999), eps=1e-6,
        weight_decay=0.1,
    )  # fmt: skip
    for step, rate in enumerate((0.1, 0.02, 0.3, 0.07)):
        lr.fill_(rate)
        torch_opt.param_groups[0]["lr"] = rate
        for a, b in zip(ours, ref, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        torch_opt.step()
        for a, b in zip(ours, ref, strict=True):
            _close(a, b, 1e-5, f"param after step {step + 1}")
    for a, b in zip(ours, ref, strict=True):
        assert opt.state[a]["step"].device == a.device and float(opt.state[a]["step"]) == 4.0
        _close(opt.state[a]["exp_avg"], torch_opt.state[b]["exp_avg"], 1e-5, "exp_avg")
        _close(opt.state[a]["exp_avg_sq"], torch_opt.state[b]["exp_avg_sq"], 1e-5, "exp_avg_sq")
    # numel % 16 == 0 and contiguous: (16, 8) and (48,) of the first group in one launch per step
    assert batched == ([2] * 4 if multi_tensor and backend == "triton" else [])


def test_fused_adamw_refuses_unsupported_group_options_by_name():
    """amsgrad / maximize / differentiable are not implemented: refused wherever a group comes from
    (constructor group, add_param_group, a torch AdamW state dict), never silently ignored."""
    p = torch.nn.Parameter(torch.randn(3))
    for key in ("amsgrad", "maximize", "differentiable"):
        with pytest.raises(ConfigError, match=f"param group 0: {key}=True"):
            FusedAdamW([{"params": [p], key: True}])
        opt = FusedAdamW([p])
        with pytest.raises(ConfigError, match=f"param group 1: {key}=True"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], key: True})
        assert len(opt.param_groups) == 1
        q = torch.nn.Parameter(torch.randn(3))
        saved = torch.optim.AdamW([q], **{key: True}).state_dict()
        with pytest.raises(ConfigError, match=f"loaded param group 0: {key}=True"):
            opt.load_state_dict(saved)
        assert not opt.param_groups[0].get(key)  # the refused state left the optimizer as it was
    # torch.optim.Adam's L2 penalty (not decoupled) with weight decay is a different update
    adam = torch.optim.Adam([torch.nn.Parameter(torch.randn(3))], weight_decay=0.1).state_dict()
    with pytest.raises(ConfigError, match="weight_decay=0.1"):
        FusedAdamW([p]).load_state_dict(adam)


@pytest.mark.parametrize(
    ("group", "named"),
    [
        ({"lr": -1.0}, r"lr=-1\.0"),
        ({"lr": float("nan")}, "lr=nan"),
        ({"eps": -1e-08}, "eps=-1e-08"),
        ({"weight_decay": -0.5}, r"weight_decay=-0\.5"),
        ({"betas": (0.9, 1.0)}, r"betas=\(0\.9, 1\.0\)"),
        ({"betas": (-0.1, 0.9)}, r"betas=\(-0\.1, 0\.9\)"),
        ({"betas": (0.9,)}, r"betas=\(0\.9,\)"),
    ],
)
def test_fused_adamw_checks_every_group_like_torch(group, named):
    """torch.optim.AdamW's bounds, as ConfigError naming the value, for the defaults, each group
    given to the constructor or add_param_group, and each group of a loaded state dict."""
    p = torch.nn.Parameter(torch.randn(3))
    if "betas" not in group or len(group["betas"]) == 2:
        with pytest.raises(ConfigError, match=named):
            FusedAdamW([p], **group)
    with pytest.raises(ConfigError, match="param group 0: " + named):
        FusedAdamW([{"params": [p], **group}])
    opt = FusedAdamW([p])
    with pytest.raises(ConfigError, match="param group 1: " + named):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], **group})
    saved = opt.state_dict()
    saved["param_groups"][0].update(group)
    with pytest.raises(ConfigError, match="loaded param group 0: " + named):
        opt.load_state_dict(saved)


def test_fused_adamw_continues_a_torch_adamw_state_dict(backend):
    """A torch.optim.AdamW state dict (amsgrad/maximize False, decoupled) loads and the next steps
    equal torch's within fp32 rounding."""
    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(4, 3, device=DEVICE))
    ours = torch.nn.Parameter(ref.detach().clone())
    torch_opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.05)
    ref.grad = torch.randn_like(ref)
    torch_opt.step()
    ours.data.copy_(ref.data)
    opt = FusedAdamW([ours], lr=0.5)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert opt.param_groups[0]["lr"] == 0.1
    for _ in range(3):
        ref.grad = torch.randn_like(ref)
        ours.grad = ref.grad.clone()
        torch_opt.step()
        opt.step()
    _close(ours, ref, 1e-6, "param")


# -- strided operands and label bounds ---------------------------------------------------------------
def test_strided_rms_weight_and_labels_match_contiguous(backend):
    """The Triton kernels index the RMSNorm weight and the labels with unit stride: strided views
    (a column of a matrix, every other label) give the reference result and gradients."""
    torch.manual_seed(1)
    x = _leaf(3, 8)
    w_big = _leaf(8, 2)
    y = rms_norm(x, w_big[:, 0])
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr = _twin(x), _twin(w_big)
    (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr[:, 0]).backward(dy.float())
    _close(y, xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr[:, 0], TOL[0], "y")
    _close(x.grad, xr.grad, TOL[1], "dx")
    _close(w_big.grad, wr.grad, TOL[1], "dw")  # column 1 gets zeros

    h, w = _leaf(6, 4), _leaf(9, 4, scale=0.5)
    labels = torch.tensor([3, 0, 8, 1, 8, 2, -100, 5, 4, 7, 0, 6], device=DEVICE)[::2]
    assert not labels.is_contiguous()
    loss = fused_linear_cross_entropy(h, w, labels)
    loss.backward()
    hr, wr = _twin(h), _twin(w)
    ref = F.cross_entropy(hr @ wr.t(), labels)
    ref.backward()
    _close(loss, ref, TOL[1], "loss")
    _close(h.grad, hr.grad, TOL[1], "dh")
    _close(w.grad, wr.grad, TOL[1], "dw")


@pytest.mark.parametrize(("bad", "ignore_index"), [(9, -100), (-5, -100), (-100, 0), (12, 12 - 1)])
def test_fused_linear_cross_entropy_refuses_labels_outside_the_vocab(backend, bad, ignore_index):
    """CPU: a ConfigError naming the label and its position, on both backends (the Triton kernel
    would read outside the row). On a GPU the check is a device-side assert (no host sync), which
    ends the CUDA context, so on a GPU machine only the torch backend runs this on CPU tensors."""
    if GPU and backend == "triton":
        pytest.skip("the Triton kernels need CUDA tensors, whose check is a context-ending device assert")
    h, w = torch.randn(5, 4), torch.randn(9, 4)
    labels = torch.tensor([1, 2, ignore_index, bad, 8])
    with pytest.raises(
        ConfigError, match=rf"label {bad} at position 3 .*\[0, 9\).*ignore_index={ignore_index}"
    ):
        fused_linear_cross_entropy(h, w, labels, ignore_index=ignore_index)
    labels[3] = ignore_index  # the same batch with the label ignored runs
    fused_linear_cross_entropy(h, w, labels, ignore_index=ignore_index)


# -- autocast ----------------------------------------------------------------------------------------
def test_swiglu_mlp_and_fused_ce_under_autocast_match_torch_autocast(backend):
    """Under torch.autocast (bf16; CPU autocast here, CUDA on a GPU) with fp32 parameters, as in HF
    mixed-precision training: swiglu_mlp equals three F.linear and fused CE equals F.cross_entropy
    of the upcast F.linear logits (HF's loss), outputs, loss and gradients within bf16 tolerance;
    outputs in the autocast dtype, gradients in fp32 like the parameters."""
    torch.manual_seed(2)
    tokens, hidden, inter, vocab = 12, 16, 24, 40
    leaves = [torch.randn(*s, device=DEVICE).requires_grad_() for s in ((tokens, hidden),)]
    x = leaves[0]
    wg, wu, wd = (torch.randn(*s, device=DEVICE).mul_(0.3).requires_grad_() for s in
                  ((inter, hidden), (inter, hidden), (hidden, inter)))  # fmt: skip
    head = torch.randn(vocab, hidden, device=DEVICE).mul_(0.3).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=DEVICE)
    labels[::4] = -100
    ref = [t.detach().clone().requires_grad_() for t in (x, wg, wu, wd, head)]
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = swiglu_mlp(x, wg, wu, wd)
        loss = fused_linear_cross_entropy(y.float(), head, labels)
        xr, wgr, wur, wdr, headr = ref
        yr = F.linear(F.silu(F.linear(xr, wgr)) * F.linear(xr, wur), wdr)
        loss_r = F.cross_entropy(F.linear(yr.float(), headr).float(), labels)
    assert y.dtype == yr.dtype == torch.bfloat16 and loss.dtype == torch.float32
    (loss + y.float().pow(2).mean()).backward()
    (loss_r + yr.float().pow(2).mean()).backward()
    _close(y, yr, 2e-2, "y")  # bf16 tolerance (module docstring); observed ≤ 1 bf16 ulp
    _close(loss, loss_r, 2e-2, "loss")
    for got, want, name in zip(
        (x, wg, wu, wd, head), ref, ("dx", "dgate", "dup", "ddown", "dhead"), strict=True
    ):
        assert got.grad.dtype == torch.float32, name
        _close(got.grad, want.grad, 2e-2, name)
