"""The split-K decode matmul (``fast_gemm``) against torch in the Triton interpreter, compiled for
sm_90, its K plan, and its bad-input errors."""

from __future__ import annotations

import json

import pytest
import torch

from megalith.common.errors import ConfigError
from megalith.testing import run_triton
from megalith_chat.engine.fast_gemm import GemmConfig, gemm, plan


def _python(script: str, interpret: bool) -> str:
    """The last stdout line of ``script`` in a fresh interpreter, the Triton interpreter on or off."""
    return run_triton(script, interpret).strip().splitlines()[-1]


CHECK = """
import json, torch
from megalith_chat.engine import fast_gemm, fast_ops
from megalith_chat.engine.fast_gemm import GemmConfig, gemm
g = torch.Generator().manual_seed(0)
rel = lambda got, ref: float((got - ref).abs().max() / ref.abs().max())
errors, splits = [], []
# K split in 5, 1, 3 (the last range partial) and 2 ranges; rows and columns past the tile edges
for m, n, k, split in [(5, 40, 72, None), (5, 40, 72, 1), (3, 48, 200, 3), (70, 33, 64, 2)]:
    cfg = GemmConfig(block_n=16, block_k=16, split=split)
    splits.append(fast_gemm.plan(m, n, k, cfg).split)
    a, w, wgu = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(2 * n, k, generator=g)
    errors.append(rel(gemm(a, w, config=cfg), a @ w.T))
    x = torch.randn(m, n, generator=g)
    for _ in range(2):  # the counters were reset: a second call sums the same
        y = x.clone()
        assert gemm(a, w, "residual", out=y, config=cfg) is y
        errors.append(rel(y, x + a @ w.T))
    ref = fast_ops.norm_silu_mul(torch.nn.functional.linear(a * 3, wgu), a * 3, 1e-5)
    errors.append(rel(gemm(a * 3, wgu, "swiglu", eps=1e-5, config=cfg), ref))
counts = sum(int(b.sum()) for b in fast_gemm._BUFFERS.values() if b.dtype == torch.int32)
print(json.dumps({"err": max(errors), "splits": splits, "counters": counts}))
"""


def test_split_k_gemm_matches_torch_in_interpreter() -> None:
    got = json.loads(_python(CHECK, interpret=True))
    assert got["splits"] == [5, 1, 3, 2]
    assert got["err"] < 1e-5
    assert got["counters"] == 0  # every tile's counter back at 0 after each call


HOPPER = """
import inspect, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megalith_chat.engine import fast_gemm

kernel = fast_gemm.make_kernel()
names = list(inspect.signature(kernel.fn).parameters)
def kind(n):
    if n in ("part_ptr", "ssq_ptr"): return "*fp32"
    if n == "count_ptr": return "*i32"
    if n.endswith("_ptr"): return "*bf16"
    return "fp32" if n == "eps" else "i32"
found = {}
for epilogue in (0, 1, 2):
    for split in (1, 4):
        consts = dict(EPILOGUE=epilogue, SPLIT=split, BM=64, BN=64, BK=128)
        sig = {n: kind(n) for n in names if n not in consts}
        aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in ("K", "s_am", "s_wn", "s_om", "k_per_split")]
        src = ASTSource(kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts,
                        {(i,): [["tt.divisibility", 16]] for i in aligned})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
        found[f"{epilogue}/{split}"] = {
            "atomics": len(re.findall(r"atom[.]global[.]gpu[.]acq_rel[.]add", ptx)),
            "wgmma": len(re.findall(r"wgmma[.]mma_async", ptx)),
            "async": len(re.findall(r"cp[.]async[^;]*global", ptx)),
        }
print(json.dumps(found))
"""


def test_split_k_gemm_compiles_for_hopper() -> None:
    """Compiled for sm_90 (no GPU needed): tensor-core (wgmma) dots over asynchronously copied
    tiles, and the tile counter an acquire-release atomic exactly when K is split."""
    found = json.loads(_python(HOPPER, interpret=False))
    for key, row in found.items():
        split = int(key.split("/")[1])
        assert row["atomics"] == (1 if split > 1 else 0), (key, row)
        assert row["wgmma"] > 0 and row["async"] > 0, (key, row)


@pytest.mark.parametrize(("m", "n", "k"), [(64, 1024, 2816), (64, 3072, 1024), (256, 2816, 1024), (1, 7, 9)])
def test_plan_covers_k_with_no_empty_split(m: int, n: int, k: int) -> None:
    cfg = GemmConfig()
    p = plan(m, n, k, cfg, sms=132)
    assert p.k_per_split % cfg.block_k == 0
    assert (p.split - 1) * p.k_per_split < k <= p.split * p.k_per_split
    assert p.tiles == -(-m // p.block_m) * -(-n // cfg.block_n)
    if p.split < -(-k // cfg.block_k):  # not every K block split apart: about one program per SM
        assert 132 / 2 <= p.tiles * p.split <= 132 * 2


def test_bad_input_is_refused() -> None:
    a, w = torch.zeros(4, 8), torch.zeros(6, 8)
    with pytest.raises(ConfigError, match="'gelu'"):
        gemm(a, w, "gelu")
    with pytest.raises(ConfigError, match=r"\(4, 8\) and \(6, 7\)"):
        gemm(a, torch.zeros(6, 7))
    with pytest.raises(ConfigError, match="one dtype, got torch.float32 and torch.bfloat16"):
        gemm(a, w.bfloat16())
    with pytest.raises(ConfigError, match="unit-stride rows"):
        gemm(torch.zeros(8, 4).t(), w)
    with pytest.raises(ConfigError, match=r"residual needs out \[4, 6\]"):
        gemm(a, w, "residual")
    with pytest.raises(ConfigError, match="only taken by the residual"):
        gemm(a, w, "store", out=torch.zeros(4, 6))
    with pytest.raises(ConfigError, match="even row count, got 5"):
        gemm(a, torch.zeros(5, 8), "swiglu")
    with pytest.raises(ConfigError, match="block_n must be a power of two >= 16, got 24"):
        GemmConfig(block_n=24)
    with pytest.raises(ConfigError, match="split must be >= 1, got 0"):
        GemmConfig(split=0)


def test_tile_configuration_parsed_or_refused() -> None:
    assert GemmConfig.parse(" 32x256w8s4 ") == GemmConfig(block_n=32, block_k=256, warps=8, stages=4)
    for text, needle in (("64x128", "is not <block_n>x<block_k>"), ("48x128w4s3", "block_n must be a power")):
        with pytest.raises(ConfigError, match=needle):
            GemmConfig.parse(text)
