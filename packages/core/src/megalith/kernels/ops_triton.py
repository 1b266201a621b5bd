"""Launch wrappers of the Triton kernels (same signatures as `ops_torch`). `_tl` (and with it
Triton) is imported on first use only."""

from __future__ import annotations

import math
from functools import cache, lru_cache
from types import ModuleType
from typing import Any

import torch

from megalith.kernels.registry import interpret_mode, register_kernel


def _tl() -> ModuleType:
    from megalith.kernels import _tl as module

    return module


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(rows: int, device: torch.device, per_sm: int = 2) -> int:
    """Programs for row-loop kernels: `per_sm` per SM on a GPU, a handful in the interpreter."""
    if device.type == "cuda":
        return min(rows, per_sm * _sm_count(device.index if device.index is not None else 0))
    return min(rows, 4)


def _rows_per_tile(block: int) -> int:
    """Rows per RMSNorm tile: ~8k elements per program on a GPU (more bytes in flight per SM)."""
    return max(1, min(16, (1024 if interpret_mode() else 8192) // block))


@register_kernel("rms_norm_fwd", "triton")
def rms_norm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    tl_ = _tl()
    m, n = x.shape
    w = w.contiguous()  # the kernel reads w with unit stride
    y = torch.empty_like(x)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    block = tl_.block_for(n)
    bm = _rows_per_tile(block)
    if m:
        tl_.rms_fwd_kernel[(-(-m // bm),)](
            x, w, y, rstd, x.stride(0), y.stride(0), m, n, eps, BLOCK_M=bm, BLOCK=block,
            num_warps=tl_.warps_for(bm * block),
        )  # fmt: skip
    return y, rstd


@register_kernel("rms_norm_bwd", "triton")
def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    tl_ = _tl()
    m, n = x.shape
    w = w.contiguous()  # the kernel reads w with unit stride
    dx = torch.empty_like(x)
    block = tl_.block_for(n)
    # 4-row tiles, 2 programs per SM up to 2k columns and 1 beyond: the best of a sweep on an H200
    # (78 % -> 81 % of copy at 16k x 2048, 66 % -> 85 % at 16k x 4096).
    bm = _rows_per_tile(block) if interpret_mode() else max(1, min(4, 16384 // block))
    tiles = max(1, -(-m // bm))
    per_prog = -(-tiles // max(1, _programs(tiles, x.device, 2 if block <= 2048 else 1)))
    progs = -(-tiles // per_prog)
    partial = torch.empty(progs, n, dtype=torch.float32, device=x.device)  # every program writes its row
    if m:
        tl_.rms_bwd_kernel[(progs,)](
            dy, x, w, rstd, dx, partial, dy.stride(0), x.stride(0), dx.stride(0), m, n, per_prog,
            BLOCK_M=bm, BLOCK=block, num_warps=tl_.warps_for(bm * block),
        )  # fmt: skip
    return dx, partial.sum(0).to(w.dtype)


@register_kernel("rope", "triton")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    tl_ = _tl()
    b, h, s, d = x.shape
    cos, sin = cos.expand(b, s, d), sin.expand(b, s, d)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    half = d // 2
    hp, dp = tl_.block_for(h), tl_.block_for(half)
    bs = min(tl_.block_for(s), max(1, (256 if interpret_mode() else 4096) // (hp * dp)))
    if x.numel():
        tl_.rope_kernel[(b * (-(-s // bs)),)](
            x, cos, sin, y, s, h, *x.stride(), *y.stride(), *cos.stride(),
            HALF=half, BS=bs, HP=hp, DP=dp, BACKWARD=backward, num_warps=4 if bs * hp * dp <= 2048 else 8,
        )  # fmt: skip
    return y


def _grid2d(m: int, n: int) -> tuple[int, tuple[int, int]]:
    block = min(1024 if not interpret_mode() else 256, max(16, 1 << (max(1, n) - 1).bit_length()))
    return block, (m, -(-n // block))


@register_kernel("swiglu_fwd", "triton")
def swiglu_fwd(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    tl_ = _tl()
    m, n = g.shape
    y = torch.empty((m, n), dtype=g.dtype, device=g.device)
    block, grid = _grid2d(m, n)
    if y.numel():
        tl_.swiglu_fwd_kernel[grid](g, u, y, g.stride(0), u.stride(0), y.stride(0), n, BLOCK=block)
    return y


def _swiglu_bwd(
    dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor, with_h: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    tl_ = _tl()
    m, n = g.shape
    out = torch.empty((m, 2 * n), dtype=g.dtype, device=g.device)
    h = torch.empty((m, n) if with_h else (0, 0), dtype=g.dtype, device=g.device)
    dg, du = out[:, :n], out[:, n:]
    block, grid = _grid2d(m, n)
    if out.numel():
        tl_.swiglu_bwd_kernel[grid](
            dy, g, u, dg, du, h, dy.stride(0), g.stride(0), u.stride(0), dg.stride(0), du.stride(0),
            h.stride(0), n, BLOCK=block, STORE_H=with_h,
        )  # fmt: skip
    return out, h


@register_kernel("swiglu_bwd", "triton")
def swiglu_bwd(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _swiglu_bwd(dy, g, u, False)[0]


@register_kernel("swiglu_bwd_h", "triton")
def swiglu_bwd_h(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _swiglu_bwd(dy, g, u, True)


@register_kernel("ce_rows", "triton")
def ce_rows(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    tl_ = _tl()
    c, v = logits.shape
    labels = labels.contiguous()  # one label per row, read with unit stride
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    block = tl_.block_for(v, cap=4096 if not interpret_mode() else 256)
    if c:
        tl_.ce_rows_kernel[(c,)](
            logits, labels, loss, scale, logits.stride(0), v, ignore_index, BLOCK=block,
            num_warps=tl_.warps_for(block),
        )  # fmt: skip
    return loss


def _adamw_block() -> int:
    """Elements per program of the AdamW kernels (smaller under the interpreter)."""
    return 1024 if interpret_mode() else 4096


def _tl_dtype(dtype: torch.dtype) -> Any:
    """The Triton element type of a floating-point torch dtype."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


@register_kernel("adamw", "triton")
def adamw_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    hyper: tuple[float, float, float, float, float],
    step: int,
) -> None:
    tl_ = _tl()
    lr, beta1, beta2, eps, wd = hyper
    n = p.numel()
    block = _adamw_block()
    tl_.adamw_kernel[(-(-n // block),)](
        p, g, m, v, n, lr, beta1, beta2, eps, wd, lr / (1 - beta1**step),
        math.sqrt(1 - beta2**step), BLOCK=block, num_warps=tl_.warps_for(block),
    )  # fmt: skip


@register_kernel("adamw_captured", "triton")
def adamw_captured_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    hyper: tuple[float, float, float, float, float],
    step: torch.Tensor,
    lr: torch.Tensor,
) -> None:
    """`adamw_` with the step count (`step`, float32, already advanced) and lr (`lr`, one element)
    read from device memory: nothing of the launch depends on host values that change per step."""
    tl_ = _tl()
    _, beta1, beta2, eps, wd = hyper
    n = p.numel()
    block = _adamw_block()
    tl_.adamw_kernel[(-(-n // block),)](
        p, g, m, v, n, 0.0, beta1, beta2, eps, wd, 0.0, 1.0, BLOCK=block, STEP=step, LR=lr,
        CAPTURED=True, num_warps=tl_.warps_for(block),
    )  # fmt: skip


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 table on `device` without a host sync (pinned staging: torch's host allocator keeps
    the pinned block until the copy has run)."""
    host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


@lru_cache(maxsize=64)  # one entry per optimizer layout (parameter group, chunk); a few in practice
def _block_tables(numels: tuple[int, ...], block: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(tensor index, start offset) per program and the numels."""
    owner: list[int] = []
    start: list[int] = []
    for t, n in enumerate(numels):
        owner.extend([t] * -(-n // block))
        start.extend(range(0, n, block))
    return _to_device(owner, device), _to_device(start, device), _to_device(list(numels), device)


def multi_tensor_ok(*tensors: torch.Tensor) -> bool:
    """What `adamw_multi` requires of each tensor: contiguous, 16-byte aligned, numel % 16 == 0."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.numel() % 16 == 0 for t in tensors)


@register_kernel("adamw_multi", "triton")
def adamw_multi_(
    ps: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    hyper: tuple[float, float, float, float, float],
    step: int,
) -> None:
    """`adamw_` on many tensors (`multi_tensor_ok`; one dtype for p and g, one for m and v) in one
    launch, addresses read from a table: one launch's host cost instead of one per tensor."""
    tl_ = _tl()
    lr, beta1, beta2, eps, wd = hyper
    block = _adamw_block()
    device = ps[0].device
    owner, start, numels = _block_tables(tuple(p.numel() for p in ps), block, device)
    addrs = _to_device([t.data_ptr() for four in zip(ps, gs, ms, vs, strict=True) for t in four], device)
    tl_.adamw_multi_kernel[(owner.numel(),)](
        addrs, owner, start, numels, lr, beta1, beta2, eps, wd, lr / (1 - beta1**step),
        math.sqrt(1 - beta2**step), P_TY=_tl_dtype(ps[0].dtype), S_TY=_tl_dtype(ms[0].dtype), BLOCK=block,
        num_warps=tl_.warps_for(block),
    )  # fmt: skip


@lru_cache(maxsize=64)
def _captured_table(addrs: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (p, g, m, v, step) address table on `device`, and its pinned host copy: the table is
    built once per set of addresses (a replayed CUDA graph reads the same buffers), and the host
    copy stays alive with it, so a copy recorded in a graph reads valid memory at every replay."""
    host = torch.tensor(addrs, dtype=torch.int64)
    if device.type != "cuda":
        return host, host
    host = host.pin_memory()
    return host, host.to(device, non_blocking=True)


@register_kernel("adamw_multi_captured", "triton")
def adamw_multi_captured_(
    ps: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hyper: tuple[float, float, float, float, float],
    lr: torch.Tensor,
) -> None:
    """`adamw_multi_` with each tensor's step count and the group's lr read from device memory
    (see `adamw_captured_`)."""
    tl_ = _tl()
    _, beta1, beta2, eps, wd = hyper
    block = _adamw_block()
    device = ps[0].device
    owner, start, numels = _block_tables(tuple(p.numel() for p in ps), block, device)
    rows = tuple(t.data_ptr() for five in zip(ps, gs, ms, vs, steps, strict=True) for t in five)
    addrs = _captured_table(rows, device)[1]
    tl_.adamw_multi_kernel[(owner.numel(),)](
        addrs, owner, start, numels, 0.0, beta1, beta2, eps, wd, 0.0, 1.0, P_TY=_tl_dtype(ps[0].dtype),
        S_TY=_tl_dtype(ms[0].dtype), BLOCK=block, LR=lr, CAPTURED=True, num_warps=tl_.warps_for(block),
    )  # fmt: skip
