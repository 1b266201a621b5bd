"""Apply a `TensorParallelPlan` to a plain model from outside: swap `nn.Linear` / `nn.Embedding`
modules for their parallel versions, adjust per-rank head counts, attach sequence-parallel hooks and
replace the loss. The model's own forward functions are never copied or patched.

A plan is data: module-name patterns (fnmatch, e.g. "model.layers.*.mlp.up_proj") → style:

    "colwise"          ColumnParallelLinear (output features split; `fused` gives part sizes)
    "rowwise"          RowParallelLinear (input features split)
    "vocab_embedding"  VocabParallelEmbedding (vocabulary rows split, padded to a multiple of tp)
    "vocab_head"       VocabParallelLMHead + vocabulary-parallel cross-entropy as the model's loss
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase

import torch
from torch import nn

from megalith.common.errors import ConfigError
from megalith.tensor_parallel.comm import Group, group_size
from megalith.tensor_parallel.layers import ColumnParallelLinear, InputOp, RowParallelLinear, shard_spec
from megalith.tensor_parallel.rng import TensorParallelRNG, attach_rank_rng, seed_tensor_parallel_rng
from megalith.tensor_parallel.sequence import (
    SEQUENCE_MODES,
    add_ulysses,
    check_sequence_at_entry,
    enter_block,
    sequence_sharded_lm_loss,
    split_sequence_before,
)
from megalith.tensor_parallel.vocab import VocabParallelEmbedding, VocabParallelLMHead, causal_lm_loss

logger = logging.getLogger(__name__)

STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head")
_EXPECTED = {
    "colwise": nn.Linear,
    "rowwise": nn.Linear,
    "vocab_embedding": nn.Embedding,
    "vocab_head": nn.Linear,
}
HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "hidden_size", "embed_dim")


@dataclass(frozen=True)
class TensorParallelPlan:
    """What to shard and how (see the module docstring). Block patterns drive sequence parallelism:
    `attention` / `mlp` blocks get one entry operator shared by their column-parallel linears (f, or
    the sequence all-gather under split_gather), attention blocks get the Ulysses exchange (all_to_all); `sequence_start` is the module whose input is split
    into sequence shards (the first decoder layer); `sequence_norms` are the replicated modules
    working on shards, whose gradients are summed over the group. `gather_logits` all-gathers the
    vocabulary-parallel logits (for `generate`; the model's own loss is then used).
    Dropout (megalith.tensor_parallel.rng): `rank_rng` are the modules whose activations are
    tp-sharded in every mode (default: the attention modules: this rank's heads), `sequence_rng`
    the modules working on sequence shards under sequence parallelism (default: `sequence_norms`);
    both draw from the per-tp-rank stream, everything else from the stream shared by the tp group."""

    layers: Mapping[str, str]
    fused: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    attention: str = ""
    attention_projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    attention_output: str = "o_proj"
    mlp: str = ""
    sequence_start: str = ""
    sequence_norms: tuple[str, ...] = ()
    num_heads: int | None = None
    num_kv_heads: int | None = None
    hidden_size: int | None = None
    gather_logits: bool = False
    rank_rng: tuple[str, ...] = ()
    sequence_rng: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = {p: s for p, s in self.layers.items() if s not in STYLES}
        if bad:
            raise ConfigError(f"unknown parallel style(s) {bad}; choose from {STYLES}")


@dataclass(frozen=True)
class TensorParallelInfo:
    """What `apply_tensor_parallel` did: `sharded` parameters hold a block of a full tensor
    (`shard_spec(p)`); `partial` parameters are replicated but get per-rank partial gradients that
    must be summed over `group` before the optimizer uses them."""

    group: Group
    size: int
    sequence_mode: str
    sharded: frozenset[str]
    partial: frozenset[str]
    rng: TensorParallelRNG | None = None


def _matches(model: nn.Module, pattern: str) -> list[str]:
    return [name for name, _ in model.named_modules() if name and fnmatchcase(name, pattern)]


def resolve_plan(model: nn.Module, plan: TensorParallelPlan) -> dict[str, str]:
    """Module name → style, checking that every pattern matches modules of the expected type."""
    out: dict[str, str] = {}
    for pattern, style in plan.layers.items():
        names = _matches(model, pattern)
        if not names:
            raise ConfigError(
                f"plan pattern {pattern!r} ({style}) matches no module of {type(model).__name__}; "
                "the policy does not fit this model (renamed modules?)"
            )
        for name in names:
            module = model.get_submodule(name)
            if not isinstance(module, _EXPECTED[style]):
                raise ConfigError(
                    f"{name} is a {type(module).__name__}, style {style!r} needs {_EXPECTED[style].__name__}"
                )
            out[name] = style
    return out


def validate_plan(
    model: nn.Module, plan: TensorParallelPlan, size: int, sequence_mode: str
) -> dict[str, str]:
    """All checks, before any weight moves: ConfigError naming the offending numbers."""
    if sequence_mode not in SEQUENCE_MODES:
        raise ConfigError(f"sp_mode must be one of {SEQUENCE_MODES}, got {sequence_mode!r}")
    for what, n in (("attention heads", plan.num_heads), ("key/value heads", plan.num_kv_heads)):
        if n is not None and n % size:
            raise ConfigError(
                f"{what} = {n} is not divisible by the tensor-parallel size tp = {size} (each tp rank "
                f"holds whole heads; key/value heads are not replicated: use a tp that divides {n})"
            )
    if sequence_mode == "all_to_all" and plan.hidden_size is not None and plan.hidden_size % size:
        raise ConfigError(
            f"hidden size {plan.hidden_size} is not divisible by the sequence-parallel size {size}"
        )
    styles = resolve_plan(model, plan)
    if sequence_mode != "none" and not plan.sequence_start:
        raise ConfigError(f"sp_mode={sequence_mode!r} needs a plan with `sequence_start` set")
    if sequence_mode != "none" and not _matches(model, plan.sequence_start):
        raise ConfigError(f"sequence_start {plan.sequence_start!r} matches no module")
    if sequence_mode == "split_gather" and "vocab_head" not in styles.values():
        raise ConfigError("sp_mode='split_gather' needs a 'vocab_head' in the plan (it gathers the sequence)")
    if sequence_mode == "all_to_all" and not plan.attention:
        raise ConfigError("sp_mode='all_to_all' needs the plan's `attention` pattern")
    if sequence_mode != "all_to_all":
        _check_shardable(model, plan, styles, size)
    return styles


def _check_shardable(model: nn.Module, plan: TensorParallelPlan, styles: dict[str, str], size: int) -> None:
    for name, style in styles.items():
        module = model.get_submodule(name)
        if style == "colwise":
            for n in plan_parts(plan, name, module):
                if n % size:
                    raise ConfigError(f"{name}: output features {n} not divisible by tp = {size}")
        elif style == "rowwise" and module.in_features % size:  # type: ignore[operator]
            raise ConfigError(f"{name}: input features {module.in_features} not divisible by tp = {size}")


def plan_parts(plan: TensorParallelPlan, name: str, module: nn.Module) -> tuple[int, ...]:
    for pattern, parts in plan.fused.items():
        if fnmatchcase(name, pattern):
            return tuple(parts)
    return (int(module.out_features),)  # type: ignore[arg-type]


def _in_block(name: str, blocks: list[str]) -> bool:
    return any(name.startswith(b + ".") for b in blocks)


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _build(
    model: nn.Module,
    plan: TensorParallelPlan,
    name: str,
    style: str,
    group: Group,
    seq: bool,
    blocks: list[str],
    shared: dict[int, nn.Parameter],
) -> nn.Module:
    module = model.get_submodule(name)
    entry_op: InputOp = "gather_sequence" if seq else "copy"
    if style == "colwise":
        op: InputOp = "none" if _in_block(name, blocks) else entry_op
        return ColumnParallelLinear(module, group, plan_parts(plan, name, module), input_op=op)  # type: ignore[arg-type]
    if style == "rowwise":
        return RowParallelLinear(module, group, sequence_parallel=seq)  # type: ignore[arg-type]
    weight = shared.get(id(module.weight))
    new: VocabParallelEmbedding | VocabParallelLMHead
    if style == "vocab_embedding":
        new = VocabParallelEmbedding(module, group, weight=weight)  # type: ignore[arg-type]
    else:
        new = VocabParallelLMHead(
            module,  # type: ignore[arg-type]
            group,
            weight=weight,
            input_op=entry_op,
            gather_output=plan.gather_logits,
        )
    shared[id(module.weight)] = new.weight
    return new


def apply_tensor_parallel(
    model: nn.Module, plan: TensorParallelPlan, group: Group, sequence_mode: str = "none"
) -> TensorParallelInfo:
    """Shard `model` in place over `group` (every rank must hold the same full weights).
    Everything is validated before the first module is swapped."""
    size = group_size(group)
    styles = validate_plan(model, plan, size, sequence_mode)
    if sequence_mode != "none" and size > 1:
        check_sequence_at_entry(model, size)
    if sequence_mode == "all_to_all":
        info = _apply_ulysses(model, plan, group)
    else:
        info = _apply_megatron(model, plan, styles, group, sequence_mode == "split_gather" and size > 1)
    if size == 1:
        return info
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    rng = seed_tensor_parallel_rng(group, device)
    attach_rank_rng(model, rank_rng_patterns(plan, info.sequence_mode), rng)
    return replace(info, rng=rng)


def rank_rng_patterns(plan: TensorParallelPlan, sequence_mode: str) -> tuple[str, ...]:
    """Module patterns whose dropout must differ per tp rank (see `TensorParallelPlan`)."""
    patterns = plan.rank_rng or ((plan.attention,) if plan.attention else ())
    if sequence_mode != "none":
        patterns += plan.sequence_rng or plan.sequence_norms
    return patterns


def _apply_ulysses(model: nn.Module, plan: TensorParallelPlan, group: Group) -> TensorParallelInfo:
    size = group_size(group)
    for name in _matches(model, plan.attention):
        add_ulysses(model.get_submodule(name), plan.attention_projections, plan.attention_output, group)
        _divide_head_attributes(model.get_submodule(name), size)
    split_sequence_before(model.get_submodule(plan.sequence_start), group, pad_grad=True)
    _set_loss(model, sequence_sharded_lm_loss(group) if size > 1 else None)
    everything = frozenset(n for n, p in model.named_parameters() if p.requires_grad)
    return TensorParallelInfo(group, size, "all_to_all", frozenset(), everything)


def _apply_megatron(
    model: nn.Module, plan: TensorParallelPlan, styles: dict[str, str], group: Group, seq: bool
) -> TensorParallelInfo:
    size = group_size(group)
    attention = _matches(model, plan.attention) if plan.attention else []
    blocks = attention + (_matches(model, plan.mlp) if plan.mlp else [])
    shared: dict[int, nn.Parameter] = {}
    head: nn.Module | None = None
    for name, style in styles.items():
        new = _build(model, plan, name, style, group, seq, blocks, shared)
        _swap(model, name, new)
        head = new if style == "vocab_head" else head
    for name in attention:
        _divide_head_attributes(model.get_submodule(name), size)
    for name in blocks:
        enter_block(model.get_submodule(name), group, sequence_parallel=seq)
    partial: set[str] = set()
    if seq:
        split_sequence_before(model.get_submodule(plan.sequence_start), group, pad_grad=False)
        norms = [m for pattern in plan.sequence_norms for m in _matches(model, pattern)]
        partial = {f"{m}.{n}" for m in norms for n, _ in model.get_submodule(m).named_parameters()}
    if isinstance(head, VocabParallelLMHead) and not plan.gather_logits:
        _set_loss(model, causal_lm_loss(head))
    sharded = {n for n, p in model.named_parameters() if shard_spec(p) is not None}
    mode = "split_gather" if seq else "none"
    logger.info("tensor parallel over %d ranks (sp=%s): %d parameters sharded", size, mode, len(sharded))
    return TensorParallelInfo(group, size, mode, frozenset(sharded), frozenset(partial))


def _divide_head_attributes(attention: nn.Module, size: int) -> None:
    """Per-rank head counts on the attention module itself (its shared `config` is left alone; HF
    Llama-family modules infer heads from the projection width, older ones read these attributes)."""
    for attr in HEAD_ATTRS:
        value = getattr(attention, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(attention, attr, value // size)


def _set_loss(model: nn.Module, loss: Callable[..., torch.Tensor] | None) -> None:
    """HF models compute their loss through the settable `loss_function` attribute."""
    if loss is not None and hasattr(type(model), "loss_function"):
        object.__setattr__(model, "loss_function", loss)
