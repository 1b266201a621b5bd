"""A fast rollout engine for HF Llama / Qwen2 / Mistral decoders: static KV cache + CUDA graphs.

The engine copies the model's weights into its own fused storage (:mod:`.fast_weights`) and runs
its own forward (:mod:`.fast_ops`; decode attention by the split-KV Triton kernel of
:mod:`.fast_attention` on CUDA, SDPA otherwise) against a preallocated cache

    ``k_cache, v_cache : [layers, max_batch, kv_heads, max_len, head_dim]``.

Prompts are left-padded to a common width ``P``; row ``r``'s prompt starts at ``start[r]``.

* **prefill** (not captured; the norms, rotary and SwiGLU by ``megalith.kernels``): one pass over
  ``[b, P]`` fills cache slots ``0 .. P-1`` and samples the first token from the last position's
  logits;
* **decode**: feeds the token at cache slot ``s`` (same slot for every row), writes its K/V there,
  attends to slots ``start[r] .. s`` of the first ``Lb`` slots (``Lb`` = ``s + 1`` rounded up to
  ``kv_block``), samples the next token, records it and its log-prob and advances ``s``. Every
  input lives in a static buffer and the step advances its own counters, so on CUDA the step is
  captured once per :class:`StepKey` (batch bucket, ``Lb``, top-k/p on/off, rows per shared
  prompt, the engine's switches) in a ``torch.cuda.CUDAGraph`` and replayed; batch buckets are
  powers of two (padded with dummy rows). On CPU the same code runs eagerly.
* **shared prompts** (``generate(..., group=G)``, ``share_prompts``): runs of ``G`` rows with
  one prompt are prefilled once (into the run's first row) and the decode attention reads the
  prompt's slots from that row once for the run (:mod:`.fast_attention`). By default only in
  batch buckets with at least ``SHARE_MIN_PAIRS`` (row, key/value head) pairs: on the H200 it was
  25 % faster at 4096 pairs and even (-2 %, +3 %) at 1024, where the pass over each row's own
  slots is latency-bound (2048 lies between the two measured points).
* :meth:`FastEngine.update_weights` copies new weights into the existing storage (no re-capture).

Log-probs are ``log softmax(logits / T)[y]`` (see :mod:`.sampling`), the convention of the GRPO
trainer. Not thread-safe: one ``generate`` at a time.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megalith.common.errors import ConfigError
from megalith.kernels import get_kernel
from megalith_chat.engine import fast_gemm, fast_mlp, fast_ops, fast_sample
from megalith_chat.engine.fast_attention import (
    Prologue,
    choose_attention,
    decode_attention,
    shared_prompts_error,
)
from megalith_chat.engine.fast_gemm import ProjectionConfigs
from megalith_chat.engine.fast_prologue import rope_store, rope_store_reference, supported
from megalith_chat.engine.fast_state import DecodeState
from megalith_chat.engine.fast_weights import EngineWeights, ModelShape, effective_weights, unwrap_peft
from megalith_chat.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

# the prefill's elementwise kernels (per-call dispatch: Triton on CUDA, the torch fallbacks elsewhere)
_rms_norm, _rope, _swiglu = (get_kernel(name) for name in ("rms_norm_fwd", "rope", "swiglu_fwd"))

SHARE_MIN_PAIRS = 2048  # share_prompts=None: share in buckets of at least this many (row, KV head) pairs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SyncHook = Callable[[torch.Tensor], Sequence[int]]


class StepKey(NamedTuple):
    """What a decode step's graph is captured for."""

    batch: int  # rows run (the batch bucket)
    kv_len: int  # cache slots attended (``Lb``)
    filtered: bool  # top-k / top-p sampling
    members: int  # rows per shared prompt (1: unshared)
    in_attention: bool  # the attention kernel does the QKV prologue
    gemm: ProjectionConfigs | None  # projections by :mod:`.fast_gemm` (split-K Triton); None: cuBLAS


@dataclass(frozen=True)
class FastEngineConfig:
    """Sizes and switches; ``dtype=None`` means bfloat16 on CUDA and float32 on CPU.

    ``cuda_graphs``, ``compile_ops`` (``torch.compile`` of the elementwise pieces) and
    ``fused_prologue`` (:mod:`.fast_prologue`, :mod:`.fast_mlp`), ``fused_sampling``
    (:mod:`.fast_sample`) and ``fast_gemm`` (:mod:`.fast_gemm`) apply on CUDA only.
    ``sync_every``: decode steps between host checks (stop strings, all rows finished).
    """

    max_batch: int = 64
    max_len: int = 1024
    dtype: str | None = None
    cuda_graphs: bool = True
    compile_ops: bool = True
    kv_block: int = 64
    sync_every: int = 16
    attention: str = "auto"  # decode attention: "sdpa", "triton" (split-KV kernel), "auto" = triton on CUDA
    # CUDA: Triton kernels for the decode step's QKV prologue (1 / rms, bias, RoPE, cache write) and
    # its MLP activation (1 / rms, SwiGLU)
    fused_prologue: bool = True
    # CUDA: unfiltered sampling (no top-k / top-p) by two Triton kernels with in-kernel Philox noise
    fused_sampling: bool = True
    # Triton attention: a group's prompt is prefilled and read once. None (auto): where it pays
    # (module doc); True: at every batch (warns when unusable); False: never
    share_prompts: bool | None = None
    # CUDA: the decode step's projections by the split-K Triton matmul of :mod:`.fast_gemm` (QKV; o
    # and down with the residual add; gate/up with 1 / rms and SwiGLU) instead of cuBLAS. Off by
    # default: 5 % slower end to end on an H100 (README)
    fast_gemm: bool = False

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_len < 2:
            raise ConfigError(f"need max_batch >= 1 and max_len >= 2, got {self.max_batch}, {self.max_len}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attention not in ("auto", "sdpa", "triton"):
            raise ConfigError(f"attention must be auto, sdpa or triton, got {self.attention!r}")
        if self.kv_block < 1 or self.sync_every < 1:
            raise ConfigError(
                f"need kv_block >= 1 and sync_every >= 1, got {self.kv_block}, {self.sync_every}"
            )


@dataclass(frozen=True)
class EngineOutput:
    """``tokens``/``logprobs`` ``[B, R]`` on the CPU (``R`` = decode steps run, ``<= max_new_tokens``).

    After a row's first EOS its tokens are ``pad_id`` and its log-probs 0. A row the ``on_sync``
    hook finished keeps the tokens it sampled up to the host sync that reported it (the hook knows
    where its stop string ended, e.g. :attr:`.fast_rollout.StopStrings.ends`) and is padded after
    that sync."""

    tokens: torch.Tensor
    logprobs: torch.Tensor


class FastEngine:
    """Static-cache, CUDA-graph decoder over a copy of an HF causal LM's weights (see module doc)."""

    def __init__(self, model: nn.Module, config: FastEngineConfig | None = None, device: Any = None) -> None:
        self.config = config or FastEngineConfig()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cuda = self.device.type == "cuda"
        default = "bfloat16" if cuda else "float32"
        self.dtype = DTYPES[self.config.dtype or default]
        base = unwrap_peft(model)
        self.shape = ModelShape.of(base, self.config.max_len)
        # a copy: computing the tables must not change the training model's module state
        self._rotary = copy.deepcopy(base.model.rotary_emb)
        self.weights = EngineWeights(self.shape, self.device, self.dtype)
        self.update_weights(model)
        self.use_graphs = cuda and self.config.cuda_graphs
        self.ops = fast_ops.Ops.make(cuda and self.config.compile_ops)
        self.compiled_ops = cuda and self.config.compile_ops
        self.attention = choose_attention(self.config.attention, self.device, self.shape.head_dim)
        self.fused_prologue = cuda and self.config.fused_prologue and supported(self.shape.head_dim)
        self.fused_sampling = cuda and self.config.fused_sampling
        # the split-K projections' tiles, None for cuBLAS (benchmarks change it; graphs are keyed by it)
        self.gemm = ProjectionConfigs() if cuda and self.config.fast_gemm else None
        # unshared steps: the attention kernel takes the prologue over (benchmarks switch it off; the
        # step's graphs are keyed by it)
        self.prologue_in_attention = self.attention == "triton" and self.fused_prologue
        self.share_prompts = self.config.share_prompts is not False and self._sharing_works()
        self._graphs: dict[StepKey, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self.scale = self.shape.head_dim**-0.5
        # the prefill's norm weight (the layers' own are folded into their projections)
        self._ones = torch.ones(self.shape.hidden, device=self.device, dtype=self.dtype)
        self.max_batch, self.max_len = 0, 0
        self.reserve(self.config.max_batch, self.config.max_len)

    def _sharing_works(self) -> bool:
        """Whether the shared-prompt attention runs here; says why not (a warning if it was asked
        for, ``share_prompts=True``)."""
        log = logger.warning if self.config.share_prompts else logger.debug
        if self.attention != "triton":
            log("share_prompts needs the Triton decode attention (CUDA); prompts are not shared")
            return False
        error = shared_prompts_error(self.device, self.shape.head_dim)
        if error is not None:
            log("shared-prompt decode attention unusable (%s); prompts are not shared", error)
        return error is None

    # ---------------------------------------------------------------- storage
    def reserve(self, max_batch: int, max_len: int) -> None:
        """(Re)allocate the cache and buffers for at least ``max_batch`` rows of ``max_len`` slots.

        Growing drops the captured graphs (they point at the old buffers).
        """
        if max_batch <= self.max_batch and max_len <= self.max_len:
            return
        self.shape.check_len(max(max_len, self.max_len))
        s = self.shape
        self.max_batch, self.max_len = max(max_batch, self.max_batch), max(max_len, self.max_len)
        self._graphs.clear()
        self.k_cache = self.v_cache = torch.empty(0)  # free before allocating the larger cache
        size = (s.layers, self.max_batch, s.kv_heads, self.max_len, s.head_dim)
        self.k_cache = torch.zeros(size, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(size, device=self.device, dtype=self.dtype)
        where = next(self._rotary.buffers()).device
        positions = torch.arange(self.max_len, device=where).unsqueeze(0)
        cos, sin = self._rotary(torch.zeros(1, dtype=torch.float32, device=where), positions)
        self._cos = cos[0].to(device=self.device, dtype=self.dtype)  # [max_len, D]
        self._sin = sin[0].to(device=self.device, dtype=self.dtype)
        self.state = DecodeState(self.max_batch, self.max_len, s.vocab, self.device)

    @torch.no_grad()
    def update_weights(
        self, source: nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> int:
        """Copy new weights in place (a model, LoRA merged; a state dict; or ``(name, tensor)`` pairs).

        Returns the number of tensors copied. Captured graphs stay valid: storage is reused.
        """
        named = effective_weights(source) if isinstance(source, nn.Module) else source
        return self.weights.load(named)

    # ---------------------------------------------------------------- forward
    def _prefill(self, ids: torch.Tensor, start: torch.Tensor, every: int = 1) -> torch.Tensor:
        """Fill cache slots ``0..P-1`` of cache rows ``0, every, .., (b-1)·every`` from ``ids [b, P]``;
        returns last-position logits ``[b, V]``.

        The norms, rotary and SwiGLU are ``megalith.kernels``' (Triton on CUDA, torch elsewhere):
        the inputs of a projection are normalised before it (``x / rms(x)``, the norm weight is
        folded into the projection), so every elementwise pass reads each tensor once."""
        w, s = self.weights, self.shape
        b, p = ids.shape
        ar = torch.arange(p, device=self.device)
        pos = (ar.unsqueeze(0) - start.unsqueeze(1)).clamp(min=0)
        cos, sin = self._cos[pos], self._sin[pos]  # [b, P, D]
        causal = ar.unsqueeze(1) >= ar.unsqueeze(0)  # [query, key]
        allowed = (ar.unsqueeze(0) >= start.unsqueeze(1)).unsqueeze(1) | torch.eye(
            p, dtype=torch.bool, device=self.device
        )
        mask = (causal.unsqueeze(0) & allowed).unsqueeze(1)  # pad queries attend to themselves only
        x = w.embed[ids].view(b * p, s.hidden)
        q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
        group = s.heads // s.kv_heads
        for i in range(s.layers):
            qkv = F.linear(_rms_norm(x, self._ones, s.eps)[0], w.wqkv[i], w.bqkv[i]).view(b, p, -1)
            q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
            q = _rope(q.view(b, p, s.heads, s.head_dim).transpose(1, 2), cos, sin, False)
            k = _rope(k.view(b, p, s.kv_heads, s.head_dim).transpose(1, 2), cos, sin, False)
            v = v.view(b, p, s.kv_heads, s.head_dim).transpose(1, 2)
            self.k_cache[i, : b * every : every, :, :p] = k
            self.v_cache[i, : b * every : every, :, :p] = v
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            x = self._residual(x, attn.transpose(1, 2).reshape(b * p, q_width), w.wo[i], w.bo[i])
            gate, up = F.linear(_rms_norm(x, self._ones, s.eps)[0], w.wgu[i]).chunk(2, dim=-1)
            x = self._residual(x, _swiglu(gate, up), w.wd[i], None)
        last = x.view(b, p, s.hidden)[:, -1]
        return F.linear(self.ops.rms_norm(last, w.norm, s.eps), w.lm_head)

    @staticmethod
    def _residual(
        x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x + linear(a, weight, bias)``, the residual add inside the matmul (``x`` is overwritten)."""
        flat = x.view(-1, x.shape[-1])
        flat.addmm_(a.reshape(flat.shape[0], -1), weight.t())
        return x if bias is None else x + bias

    def _key(self, b: int, kv_len: int, filtered: bool, members: int = 1) -> StepKey:
        """What a decode step is captured by: its arguments and the engine's switches."""
        in_attention = self.prologue_in_attention and members == 1
        return StepKey(b, kv_len, filtered, members, in_attention, self.gemm)

    def _decode_body(self, key: StepKey) -> None:
        """One decode step over static buffers (the graph-captured unit; see module doc)."""
        b, kv_len, filtered, members, in_attention, tiles = key
        w, s, st, ops = self.weights, self.shape, self.state, self.ops
        x, cos, sin, mask = ops.decode_prelude(
            st.tok[:b], st.slot, st.start[:b], w.embed, self._cos, self._sin, st.arange[:kv_len]
        )
        gemm = fast_gemm.gemm
        # the unfused QKV path (ops.norm_linear) stays on cuBLAS: its bias and 1 / rms are torch ops
        qkv_linear = F.linear if tiles is None else partial(gemm, config=tiles.qkv)
        for i in range(s.layers):
            kc, vc = self.k_cache[i, :b, :, :kv_len], self.v_cache[i, :b, :, :kv_len]
            q: torch.Tensor | Prologue
            if in_attention:  # the attention kernel rotates q and writes k, v itself
                q = Prologue(qkv_linear(x, w.wqkv[i]), cos, sin, x, w.bqkv[i], s.eps)
            elif self.fused_prologue:
                qkv = qkv_linear(x, w.wqkv[i])
                q = rope_store(qkv, cos, sin, kc, vc, st.slot, s.kv_heads, s.head_dim, x, w.bqkv[i], s.eps)
            else:
                qkv = ops.norm_linear(x, w.wqkv[i], w.bqkv[i], s.eps)
                q = rope_store_reference(
                    qkv, cos, sin, kc, vc, st.slot, s.kv_heads, s.head_dim, ops.split_rope_decode
                )
            if self.attention == "triton":
                attn = decode_attention(
                    q, kc, vc, st.start[:b], st.slot, self.scale, members=members, prompt_end=st.prompt_end
                )
            else:
                assert isinstance(q, torch.Tensor)
                attn = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=self.scale)
            if tiles is not None:  # residual adds in the matmuls' epilogues; 1 / rms + SwiGLU in gate/up's
                x = gemm(attn.reshape(b, -1), w.wo[i], "residual", out=x, config=tiles.o)
                bias = w.bo[i]
                x = x if bias is None else x + bias
                h = gemm(x, w.wgu[i], "swiglu", eps=s.eps, config=tiles.gate_up)
                gemm(h, w.wd[i], "residual", out=x, config=tiles.down)
                continue
            x = self._residual(x, attn.reshape(b, -1), w.wo[i], w.bo[i])
            norm_silu_mul = fast_mlp.norm_silu_mul if self.fused_prologue else ops.norm_silu_mul
            x = self._residual(x, norm_silu_mul(F.linear(x, w.wgu[i]), x, s.eps), w.wd[i], None)
        self._emit(F.linear(ops.rms_norm(x, w.norm, s.eps), w.lm_head), b, filtered)

    def _emit(self, logits: torch.Tensor, b: int, filtered: bool) -> None:
        """Sample, mask finished rows, record token + log-prob at column ``ridx``, advance counters."""
        st = self.state
        if self.fused_sampling and not filtered:
            fast_sample.sample_step(logits, st, b)
        else:
            extra = (st.top_p[:b], st.top_k[:b]) if filtered else ()
            tok, lp = self.ops.sample(logits, st.inv_t[:b], st.greedy[:b], st.noise[:b], *extra)
            done = st.done[:b]
            tok = torch.where(done, st.pad, tok)
            lp = lp.masked_fill(done, 0.0)
            done.logical_or_(torch.isin(tok, st.eos))
            col = st.ridx.view(1)
            st.out_tok[:b].index_copy_(1, col, tok.unsqueeze(1))
            st.out_lp[:b].index_copy_(1, col, lp.unsqueeze(1))
            st.tok[:b].copy_(tok)
        st.slot.add_(1)
        st.ridx.add_(1)

    # ---------------------------------------------------------------- graphs
    def _step(self, b: int, kv_len: int, filtered: bool, members: int = 1) -> None:
        key = self._key(b, kv_len, filtered, members)
        if not self.use_graphs:
            self._decode_body(key)
            return
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key)
        graph.replay()

    def _warm_up(self, key: StepKey) -> None:
        """Run the step once on a side stream (compiles the ops), then restore the counters."""
        st = self.state
        saved = [t.clone() for t in (st.tok, st.slot, st.ridx, st.done)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                self._decode_body(key)
        except RuntimeError as exc:
            self._drop_compiled(exc)
            with torch.cuda.stream(stream):
                self._decode_body(key)
        torch.cuda.current_stream().wait_stream(stream)
        for dst, src in zip((st.tok, st.slot, st.ridx, st.done), saved):
            dst.copy_(src)

    def _drop_compiled(self, exc: RuntimeError) -> None:
        """Fall back to eager ops after a failure of the compiled ones (torch.compile failures surface
        as RuntimeError subclasses); re-raise if already eager or out of memory."""
        if not self.compiled_ops or isinstance(exc, torch.OutOfMemoryError):
            raise exc
        logger.warning("compiled engine ops failed (%s); falling back to eager ops", exc)
        self.ops, self.compiled_ops = fast_ops.Ops.make(False), False

    def _capture(self, key: StepKey) -> torch.cuda.CUDAGraph:
        self._warm_up(key)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._decode_body(key)
        self._graphs[key] = graph
        logger.debug("captured decode graph %s", key)
        return graph

    def bucket(self, batch: int) -> int:
        """Rows actually run for ``batch`` requests: the next power of two (capped) with graphs."""
        if not self.use_graphs:
            return batch
        return min(1 << (batch - 1).bit_length(), self.max_batch)

    # ---------------------------------------------------------------- generate
    def _check(
        self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, on_sync: SyncHook | None
    ) -> None:
        """Refuse bad ``generate`` input with a :class:`ConfigError` naming the value."""
        if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ConfigError(
                f"prompt_ids must be 2-D [batch >= 1, width >= 1], got shape {tuple(ids.shape)}"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ConfigError(f"prompt_ids must hold integer token ids, got dtype {ids.dtype}")
        if tuple(mask.shape) != tuple(ids.shape):
            raise ConfigError(
                f"prompt_mask must have prompt_ids' shape {tuple(ids.shape)}, got {tuple(mask.shape)}"
            )
        if params.stop and on_sync is None:
            raise ConfigError(
                f"SamplingParams.stop={params.stop!r} needs an on_sync hook: the engine holds no tokenizer, "
                "so stop strings are matched by the caller (fast_rollout.StopStrings; FastGenerator does it)"
            )
        batch, width = ids.shape
        if batch > self.max_batch:
            raise ConfigError(f"batch of {batch} rows exceeds the engine's max_batch {self.max_batch}")
        need = width + params.max_new_tokens
        if need > self.max_len:
            raise ConfigError(
                f"prompt length {width} + max_new_tokens {params.max_new_tokens} = {need} exceeds max_len {self.max_len}"
            )

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        eos_ids: Sequence[int] = (),
        pad_id: int = 0,
        generator: torch.Generator | None = None,
        on_sync: SyncHook | None = None,
        group: int = 1,
    ) -> EngineOutput:
        """Decode up to ``params.max_new_tokens`` tokens for left-padded ``prompt_ids [B, P]``.

        ``generator`` (on the engine's device) drives the sampling noise. ``on_sync(tokens [B, n])``
        (CPU tokens so far) is called every ``sync_every`` steps and returns rows to finish (stop
        strings); rows also finish at any of ``eos_ids``; all finished ends the loop early. The
        engine has no tokenizer: a non-empty ``params.stop`` needs an ``on_sync`` hook that matches
        it (:class:`.fast_rollout.StopStrings`, as :class:`.fast_rollout.FastGenerator` passes) and
        is refused without one.
        ``group``: the rows come in runs of ``group`` identical prompts (GRPO's samples of one
        prompt; checked); with the Triton attention and ``share_prompts`` (see the module doc for
        when by default), each run's prompt is prefilled once and its cache slots are read once per
        decode step for the whole run.
        """
        self._check(prompt_ids, prompt_mask, params, on_sync)
        batch, width = prompt_ids.shape
        b = self.bucket(batch)
        members = self._members(prompt_ids, prompt_mask, group, b)
        st = self.state
        start = st.prepare(prompt_ids, prompt_mask, b, params, eos_ids, pad_id)
        rows = st.prompt_rows(prompt_ids, b, pad_id)
        leaders = (rows[::members], start[::members], members)
        try:
            logits = self._prefill(*leaders)
        except RuntimeError as exc:
            self._drop_compiled(exc)
            logits = self._prefill(*leaders)
        logits = logits.repeat_interleave(members, 0) if members > 1 else logits
        st.slot.fill_(width - 1)
        st.prompt_end.fill_(width)
        noise = not params.greedy and not (self.fused_sampling and not params.filtered)
        if self.fused_sampling:  # the fused sampler's Philox key for this call
            st.seed.copy_(torch.randint(0, 2**62, (), generator=generator, device=self.device))
        if noise:
            st.noise[:b].exponential_(generator=generator)
        self._emit(logits, b, params.filtered)
        steps = params.max_new_tokens
        watch = bool(eos_ids) or on_sync is not None
        for k in range(1, params.max_new_tokens):
            if noise:
                st.noise[:b].exponential_(generator=generator)
            kv_len = min(-(-(width + k) // self.config.kv_block) * self.config.kv_block, self.max_len)
            self._step(b, kv_len, params.filtered, members)
            if watch and (k % self.config.sync_every == 0) and self._all_done(batch, k + 1, on_sync):
                steps = k + 1
                break
        if on_sync is not None:
            self._all_done(batch, steps, on_sync)
        # copy=True: on a CPU engine .cpu() would alias the buffers the next call overwrites
        tokens = st.out_tok[:batch, :steps].to("cpu", copy=True)
        return EngineOutput(tokens, st.out_lp[:batch, :steps].to("cpu", torch.float32, copy=True))

    def _members(self, ids: torch.Tensor, mask: torch.Tensor, group: int, rows: int) -> int:
        """Rows per shared prompt in this call: ``group`` if it is used (see :meth:`generate`), else 1.

        The ``rows - B`` dummy rows of the batch bucket share one prompt too, so they must also come
        in whole groups; otherwise the call runs unshared. With ``share_prompts=None`` (auto) the
        bucket also needs ``SHARE_MIN_PAIRS`` (row, key/value head) pairs."""
        batch = ids.shape[0]
        if group < 1 or batch % group:
            raise ConfigError(f"group must be >= 1 and divide the batch of {batch} rows, got {group}")
        if group == 1:
            return 1
        for name, t in (("prompt_ids", ids), ("prompt_mask", mask)):
            runs = t.reshape(batch // group, group, -1)
            differ = (runs != runs[:, :1]).flatten(2).any(-1).flatten().nonzero()
            if len(differ):
                row = int(differ[0])
                raise ConfigError(
                    f"{name} row {row} differs from row {row - row % group}, the first of its group of {group}"
                )
        pays = self.config.share_prompts or rows * self.shape.kv_heads >= SHARE_MIN_PAIRS
        return group if self.share_prompts and pays and (rows - batch) % group == 0 else 1

    def _all_done(self, batch: int, steps: int, on_sync: SyncHook | None) -> bool:
        st = self.state
        if on_sync is not None:
            rows = list(on_sync(st.out_tok[:batch, :steps].cpu()))
            if rows:
                st.done[torch.tensor(rows, device=self.device)] = True
        return bool(st.done[:batch].all())
