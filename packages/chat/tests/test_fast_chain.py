"""The persistent decode-projection chain (``fast_chain``) against torch in the Triton interpreter,
compiled for sm_90, and its bad-input errors."""

from __future__ import annotations

import json

import pytest
import torch

from megalith.common.errors import ConfigError
from megalith.testing import run_triton
from megalith_chat.engine.fast_chain import ChainWeights, mlp_block, run_chain
from megalith_chat.engine.fast_gemm import GemmConfig


def _python(script: str, interpret: bool) -> str:
    """The last stdout line of ``script`` in a fresh interpreter, the Triton interpreter on or off."""
    return run_triton(script, interpret).strip().splitlines()[-1]


CHECK = """
import json, torch
from megalith_chat.engine.fast_chain import PHASES, ChainWeights, reference_chain, run_chain
from megalith_chat.engine.fast_gemm import GemmConfig
g = torch.Generator().manual_seed(0)
rnd = lambda *s: torch.randn(*s, generator=g) * 0.3
L, H, I = 3, 32, 40  # I not a multiple of block_n: partial tiles in gate/up and down's K
w = ChainWeights(rnd(L, 3 * H, H), rnd(L, H, H), rnd(L, 2 * I, H), rnd(L, H, I))
split = {"qkv": GemmConfig(16, 16, split=3), "o": GemmConfig(16, 16, split=2),
         "gate_up": GemmConfig(16, 16, split=2), "down": GemmConfig(16, 16, split=3)}
out = []
for rows, configs in [(5, None), (1, None), (7, split), (64, dict.fromkeys(PHASES, GemmConfig(32, 32)))]:
    x = rnd(rows, H)
    ref = reference_chain(x, w)
    for _ in range(2):  # tile counters are reset by the last split of each tile
        y = x.clone()
        buf = run_chain(y, w, configs=configs)
        out.append({"err": float((y - ref).abs().max() / (ref - x).abs().max()),
                    "flag": int(buf.error), "barrier": int(buf.barrier), "counters": int(buf.counters.sum())})
print(json.dumps(out))
"""


def test_chain_matches_torch_in_interpreter() -> None:
    for got in json.loads(_python(CHECK, interpret=True)):
        assert got["err"] < 1e-5, got
        assert got["flag"] == 0 and got["counters"] == 0, got
        assert got["barrier"] == 3 * 4  # one arrival (one program) at each of 4 barriers per layer


BLOCK = """
import json, torch
from megalith_chat.engine import fast_chain, fast_ops
from megalith_chat.engine.fast_gemm import GemmConfig
g = torch.Generator().manual_seed(0)
rnd = lambda *s: torch.randn(*s, generator=g) * 0.3
H, I, Q = 32, 40, 48  # attention width != hidden; I not a multiple of block_n
split = {"o": GemmConfig(16, 16, split=3), "gate_up": GemmConfig(16, 16, split=2), "down": GemmConfig(16, 16, split=3)}
out = []
for rows, configs in [(5, None), (7, split), (64, None)]:
    x, attn = rnd(rows, H) * 3, rnd(rows, Q)
    wo, wgu, wd = rnd(H, Q), rnd(2 * I, H), rnd(H, I)
    mid = x + attn @ wo.T
    ref = mid + fast_ops.norm_silu_mul(mid @ wgu.T, mid, 1e-5) @ wd.T
    for _ in range(2):  # the kernel reset its barrier counts: a second call runs the same
        y = x.clone()
        same = fast_chain.mlp_block(y, attn, wo, wgu, wd, 1e-5, configs=configs) is y
        buf = list(fast_chain._BLOCK_BUFFERS.values())[-1]
        out.append({"same": same, "err": float((y - ref).abs().max() / (ref - x).abs().max()),
                    "sync": buf.sync.tolist(), "counters": int(buf.counters.sum())})
print(json.dumps({"calls": out, "flagged": fast_chain.block_error(x)}))
"""


def test_mlp_block_matches_torch_in_interpreter() -> None:
    """o with the residual, 1 / rms + gate/up + SwiGLU, down with the residual in one launch,
    against the engine's torch ops; its barrier counts and tile counters back at 0 after each call
    (K split in 1-3 ranges, partial tiles, 64 rows)."""
    got = json.loads(_python(BLOCK, interpret=True))
    assert not got["flagged"]
    for call in got["calls"]:
        assert call["same"] and call["err"] < 1e-5, call
        assert call["sync"] == [0, 0, 0] and call["counters"] == 0, call


HOPPER = """
import inspect, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megalith_chat.engine import _chain_kernel
kernel = _chain_kernel.chain
names = list(inspect.signature(kernel.fn).parameters)
def kind(n):
    if n == "part_ptr": return "*fp32"
    if n in ("count_ptr", "bar_ptr", "err_ptr"): return "*i32"
    return "*bf16" if n.endswith("_ptr") else "i32"
found = {}
for split, prefetch, idle in ((1, 0, False), (4, 0, False), (4, 2, False), (4, 4, False), (4, 0, True)):
    consts = dict(SP0=1, SP1=split, SP2=1, SP3=split, BN0=32, BN1=32, BN2=32, BN3=32, BM=64, BK=128,
                  SPIN=1 << 20, PREFETCH=prefetch, IDLE=idle)
    sig = {n: kind(n) for n in names if n not in consts}
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in ("hidden", "inter", "KP0", "KP1", "KP2", "KP3")]
    src = ASTSource(kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts,
                    {(i,): [["tt.divisibility", 16]] for i in aligned})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
    found[f"{split}/{prefetch}" + ("/idle" if idle else "")] = {
        "arrive": len(re.findall(r"atom[.]global[.]gpu[.]release[.]add", ptx)),
        "poll": len(re.findall(r"ld[.]global[.]gpu[.]acquire", ptx)),
        "tile_count": len(re.findall(r"atom[.]global[.]gpu[.]acq_rel[.]add", ptx)),
        "wgmma": len(re.findall(r"wgmma[.]mma_async", ptx)),
        "prefetch": len(re.findall(r"cp[.]async[.]bulk[.]prefetch[.]L2[.]global", ptx)),
    }
print(json.dumps(found))
"""


def test_chain_compiles_for_hopper() -> None:
    """Compiled for sm_90 (no GPU needed): four barriers per layer, each a release arrival and an
    acquire poll; tile counters (acquire-release) only in the projections whose K is split; bulk L2
    prefetches (gate/up: both halves) only with ``prefetch``."""
    found = json.loads(_python(HOPPER, interpret=False))
    assert found["1/0"]["arrive"] == 4 and found["1/0"]["poll"] == 4, found
    assert found["1/0"]["tile_count"] == 0 and found["4/0"]["tile_count"] == 2, found
    assert found["1/0"]["wgmma"] > 0, found
    # five prefetch sites (qkv, o, gate/up's two halves, down: one per projection), each [32, 8]
    # requests over 128 threads: two per thread; whatever the distance
    assert found["4/0"]["prefetch"] == 0, found
    assert found["4/2"]["prefetch"] == found["4/4"]["prefetch"] == 5 * 2, found
    # idle programs: four shares (o, gate/up; down, the next qkv), 128 pieces over 128 threads
    assert found["4/0/idle"]["prefetch"] == 4, found


def _weights(layers: int = 2, hidden: int = 8, inter: int = 12) -> ChainWeights:
    z = torch.zeros
    return ChainWeights(
        z(layers, 3 * hidden, hidden),
        z(layers, hidden, hidden),
        z(layers, 2 * inter, hidden),
        z(layers, hidden, inter),
    )


def test_bad_mlp_block_input_is_refused() -> None:
    x, attn, wo, wgu, wd = (
        torch.zeros(3, 8),
        torch.zeros(3, 6),
        torch.zeros(8, 6),
        torch.zeros(24, 8),
        torch.zeros(8, 12),
    )
    with pytest.raises(ConfigError, match=r"wo must be contiguous \[8, 6\], got \(6, 8\)"):
        mlp_block(x, attn, wo.t(), wgu, wd, 1e-5)
    with pytest.raises(ConfigError, match=r"wgu must be contiguous \[24, 8\], got \(22, 8\)"):
        mlp_block(x, attn, wo, torch.zeros(22, 8), wd, 1e-5)
    with pytest.raises(ConfigError, match="attn is torch.bfloat16"):
        mlp_block(x, attn.bfloat16(), wo, wgu, wd, 1e-5)
    with pytest.raises(ConfigError, match=r"mlp_block takes 1-64 rows \(one row tile\), got 65"):
        mlp_block(torch.zeros(65, 8), torch.zeros(65, 6), wo, wgu, wd, 1e-5)
    with pytest.raises(ConfigError, match="configs are keyed by"):
        mlp_block(x, attn, wo, wgu, wd, 1e-5, configs={"qkv": GemmConfig()})


def test_bad_input_is_refused() -> None:
    w = _weights()
    with pytest.raises(ConfigError, match=r"ChainWeights.o: shape \(2, 8, 9\), expected \(2, 8, 8\)"):
        ChainWeights(w.qkv, torch.zeros(2, 8, 9), w.gate_up, w.down)
    with pytest.raises(ConfigError, match="ChainWeights.down: needs a contiguous torch.float32"):
        ChainWeights(w.qkv, w.o, w.gate_up, torch.zeros(2, 12, 8).transpose(1, 2))
    with pytest.raises(ConfigError, match=r"x must be contiguous \[M, 8\], got \(3, 7\)"):
        run_chain(torch.zeros(3, 7), w)
    with pytest.raises(ConfigError, match="takes 1-64 rows"):
        run_chain(torch.zeros(65, 8), w)
    with pytest.raises(ConfigError, match="x is torch.bfloat16"):
        run_chain(torch.zeros(3, 8, dtype=torch.bfloat16), w)
    with pytest.raises(ConfigError, match="one block_k"):
        run_chain(torch.zeros(3, 8), w, configs={"o": GemmConfig(block_k=64)})
    with pytest.raises(ConfigError, match="configs are keyed by"):
        run_chain(torch.zeros(3, 8), w, configs={"attn": GemmConfig()})
    with pytest.raises(ConfigError, match="prefetch must be 0-4 projections ahead, got 5"):
        run_chain(torch.zeros(3, 8), w, prefetch=5)
    with pytest.raises(ConfigError, match="prefetch needs bf16 weights on a CUDA device"):
        run_chain(torch.zeros(3, 8), w, prefetch=1)
    with pytest.raises(ConfigError, match="prefetch needs bf16 weights on a CUDA device"):
        run_chain(torch.zeros(3, 8), w, idle_prefetch=True)
    with pytest.raises(ConfigError, match="programs must be >= 1, got 0"):
        run_chain(torch.zeros(3, 8), w, programs=0)
