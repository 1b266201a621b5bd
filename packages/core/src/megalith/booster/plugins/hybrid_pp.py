"""Pipeline parallelism inside `HybridPlugin` (pp × dp × tp on the 4-D mesh).

    mesh    build_mesh(ParallelDims(world, tp=tp, pp=pp)): pp outermost, tp innermost
    model   TP applied to the whole model first, then pruned to this pp rank's stages
            (`megalith.pipeline.PipelineEngine`); kept parameters keep their full-model names
    grads   Σ over microbatches in .grad; tied copies (tie_word_embeddings: embedding on the first
            stage, LM head on the last) summed between their pp ranks (Megatron's embedding
            group), then the usual tp / dp reduction (all-reduce or ZeRO-1/2 over dp)
    ‖g‖     sqrt(Σ over every rank of Σ g²): pp ranks hold disjoint parameters, tied copies count
            on their first holder only, tp-replicated pieces on tp rank 0, dp replicas once

Checkpoints use the full model's parameter names, so any pp × tp × dp layout (or one process) reads
what another wrote: the HF export streams each full tensor from the pp rank that owns it to rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.booster.optim_state import _meta
from megalith.booster.plugins.base import Boosted, unique_state
from megalith.booster.plugins.hybrid_optim import (
    TPReplicatedOptimizer,
    TPZeroOptimizer,
    _sum_over,
    tp_grad_sq,
)
from megalith.booster.precision import Precision
from megalith.checkpoint import write_meta, write_pieces
from megalith.common.errors import ConfigError
from megalith.optim import BoostedOptimizer, clip_grads_
from megalith.pipeline.engine import PipelineConfig, PipelineEngine
from megalith.pipeline.executor import Criterion
from megalith.pipeline.stage import is_hf_decoder
from megalith.tensor_parallel import (
    TensorParallelInfo,
    check_sequence_length,
    full_state_dict,
    gather_optimizer_pieces,
    load_full_pieces,
    shard_spec,
)
from megalith.zero import ZeroConfig, ZeroOptimizer, named_parameter_map

Group = dist.ProcessGroup | None


@dataclass
class PipelineState:
    """What the plugin knows about the split: `owners[name]` is the pp rank that owns (exports,
    writes) full-model tensor `name`; `alias` maps this rank's state names to full-model names."""

    engine: PipelineEngine
    pp_group: Group
    order: list[str]
    owners: dict[str, int]
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    alias: dict[str, str]
    tied: list[str] = field(default_factory=list)
    tied_group: Group = None

    @property
    def pp_rank(self) -> int:
        return self.engine.rank


def pipeline_config(cfg: Any) -> PipelineConfig:
    """The `PipelineConfig` of a `HybridConfig`."""
    layers = tuple(cfg.layers_per_stage) if cfg.layers_per_stage is not None else None
    return PipelineConfig(
        cfg.pp_size, cfg.pp_schedule, cfg.num_microbatches, cfg.num_model_chunks, layers, cfg.checkpoint_ratio
    )


def check_options(cfg: Any) -> None:
    """`HybridConfig` validation of the pipeline options (ConfigError naming the numbers)."""
    if cfg.pp_size > 1 and cfg.zero_stage == 3:
        raise ConfigError(
            f"ZeRO-3 (zero_stage=3) shards every parameter over dp and cannot be combined with pipeline "
            f"parallelism (pp_size={cfg.pp_size}); use zero_stage 0, 1 or 2"
        )
    if cfg.pp_size != 1 or cfg.num_microbatches is not None:
        pipeline_config(cfg).make_schedule()  # sizes, schedule name, microbatches vs stages


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    spec = shard_spec(t)
    return tuple(spec.full_shape) if spec is not None else tuple(t.shape)


@dataclass(frozen=True)
class _Index:
    """Over the pp group: the lowest pp rank holding each full-model tensor (its owner), every
    holder, and the full shape / dtype."""

    owners: dict[str, int]
    holders: dict[str, list[int]]
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]


def _index(model: nn.Module, canonical: dict[int, str], group: Group) -> _Index:
    mine = {canonical[id(t)]: (_full_shape(t), t.dtype) for t in unique_state(model).values()}
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    index = _Index({}, {}, {})
    for r, names in enumerate(everyone):
        for name, meta in names.items():
            index.owners.setdefault(name, r)
            index.shapes.setdefault(name, meta)
            index.holders.setdefault(name, []).append(r)
    return index


def _tied_group(mesh: Any, holders: list[int]) -> Group:
    """One process group per (dp, sp, tp) coordinate over the pp ranks in `holders`."""
    grid = mesh.mesh  # [pp, dp, sp, tp] global ranks
    groups = [
        [int(grid[h, d, s, t]) for h in holders]
        for d in range(grid.shape[1])
        for s in range(grid.shape[2])
        for t in range(grid.shape[3])
    ]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine if isinstance(mine, dist.ProcessGroup) else None


def build_pipeline(plugin: Any, model: nn.Module, precision: Precision) -> tuple[PipelineState, dict]:
    """Prune `model` (already tensor-parallel) to this rank's stages and cast it; returns the
    state and {param: full-model name} for the held parameters."""
    config = pipeline_config(plugin.config)
    state_names = {id(t): n for n, t in unique_state(model).items()}
    order = list(state_names.values())
    param_names = named_parameter_map(model)
    engine = PipelineEngine(model, config, plugin.pp_group)
    model.to(precision.dtype)
    alias = {n: state_names[id(t)] for n, t in model.state_dict(keep_vars=True).items()}
    index = _index(model, state_names, plugin.pp_group)
    tied = sorted(n for n, h in index.holders.items() if len(h) > 1)
    state = PipelineState(engine, plugin.pp_group, order, index.owners, index.shapes, alias, tied)
    if tied:
        holder_sets = {tuple(index.holders[n]) for n in tied}
        if len(holder_sets) > 1:
            raise ConfigError(f"tied parameters {tied} are shared by different pipeline ranks {holder_sets}")
        state.tied_group = _tied_group(plugin.mesh, list(holder_sets.pop()))
    held = {p: param_names[p] for p in model.parameters()}
    return state, held


def configure_pipeline(
    plugin: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
    old_names: dict[nn.Parameter, str],
) -> Boosted:
    """`HybridPlugin.configure` from the point where tensor parallelism has been applied."""
    fp32 = (
        {n: p.detach().float().clone() for p, n in named_parameter_map(model).items()}
        if precision.mixed
        else {}
    )
    state, held = build_pipeline(plugin, model, precision)
    plugin.pipeline = state
    if optimizer is None:
        return Boosted(model, None)
    by_name = {n: p for p, n in held.items()}
    for group in optimizer.param_groups:  # keep this rank's parameters, by full-model name
        group["params"] = [by_name[old_names[p]] for p in group["params"] if old_names.get(p) in by_name]
    plugin._params = {held[p]: p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    wrapped = _wrap(plugin, optimizer, held, precision, state)
    if precision.mixed:
        with wrapped.local_loads():
            wrapped.load_master_values(lambda name, s, e: fp32[name].view(-1)[s:e])
    return Boosted(model, wrapped)


# -- optimizer ------------------------------------------------------------------------------------
class _PipelineGrads:
    """Tied-copy gradient sum and the global norm over pp × dp × tp."""

    info: TensorParallelInfo
    dp_group: Group
    _tied: list[nn.Parameter]
    _partial: list[nn.Parameter]
    _tied_group: Group
    _skip: frozenset[str]

    def _setup_pp(self, state: PipelineState, names: dict[nn.Parameter, str], params: list) -> None:
        self._tied = [p for p in params if names[p] in state.tied]
        self._tied_group = state.tied_group
        self._skip = frozenset(n for n in state.tied if state.owners[n] != state.pp_rank)

    def _summed(self) -> list[nn.Parameter]:
        """Sequence-partial parameters (summed over tp) and tied copies (summed over their stages)."""
        return self._partial + [p for p in self._tied if all(p is not q for q in self._partial)]

    def _sum_tied(self) -> None:
        if self._tied_group is not None:
            _sum_over([p.grad for p in self._tied if p.grad is not None], self._tied_group)

    def _pp_norm(self, replicated_over_dp: bool) -> float:
        opt: BoostedOptimizer = self  # type: ignore[assignment]
        local = tp_grad_sq(opt, self.info, self._skip)
        dist.all_reduce(local)
        if replicated_over_dp:
            local /= dist.get_world_size(self.dp_group)
        return math.sqrt(float(local))


class PPReplicatedOptimizer(_PipelineGrads, TPReplicatedOptimizer):
    def _finish_backward(self) -> None:
        self._sum_tied()
        super()._finish_backward()

    def clip_grad_by_norm(self, max_norm: float) -> float:
        grads = self._prepare()
        total = self._pp_norm(replicated_over_dp=True)
        self.last_grad_norm = total
        clip_grads_(grads, max_norm, total)
        return total


class PPZeroOptimizer(_PipelineGrads, TPZeroOptimizer):
    def _finish_backward(self) -> None:
        self._sum_tied()
        super()._finish_backward()

    def clip_grad_by_norm(self, max_norm: float) -> float:
        grads = self._prepare()
        total = self._pp_norm(replicated_over_dp=False)
        self.last_grad_norm = total
        clip_grads_(grads, max_norm, total)
        return total


def _wrap(
    plugin: Any,
    optimizer: torch.optim.Optimizer,
    names: dict[nn.Parameter, str],
    precision: Precision,
    state: PipelineState,
) -> PPReplicatedOptimizer | PPZeroOptimizer:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    cfg = plugin.config
    wrapped: PPReplicatedOptimizer | PPZeroOptimizer
    if cfg.zero_stage == 0:
        wrapped = PPReplicatedOptimizer(
            optimizer, names, plugin.info, plugin._dp_group, precision.make_scaler()
        )
    else:
        zc = ZeroConfig(cfg.zero_stage, cfg.bucket_size_mb, overlap_communication=False)
        wrapped = PPZeroOptimizer(
            optimizer, names, zc, plugin.info, plugin._dp_group, precision.make_scaler()
        )
    wrapped._setup_pp(state, names, params)
    return wrapped


# -- training step ----------------------------------------------------------------------------------
def default_criterion(model: nn.Module) -> Criterion:
    """The model's own causal-LM loss on the last stage's logits (vocabulary-parallel under tp)."""
    if not is_hf_decoder(model):
        raise ConfigError(
            f"execute_pipeline needs a criterion(outputs, microbatch) for {type(model).__name__}"
        )

    def criterion(logits: torch.Tensor, mb: Any) -> torch.Tensor:
        labels = mb.get("labels", mb["input_ids"]) if isinstance(mb, dict) else mb
        return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)  # type: ignore[operator,union-attr]

    return criterion


def execute_pipeline(
    plugin: Any,
    data_iter: Iterator[Any],
    model: nn.Module,
    criterion: Criterion | None,
    optimizer: BoostedOptimizer | None,
    return_loss: bool = True,
) -> dict[str, Any]:
    """Forward + backward of `next(data_iter)` (this dp rank's batch) through the pipeline; then
    the gradient reduction (unless inside `no_sync`). Returns {"loss": Σ_i ℓ_i or None, "outputs": None}.
    Under `torch.no_grad()` only the forward passes run (no gradients, no reduction): evaluation."""
    state: PipelineState | None = plugin.pipeline
    if state is None:
        raise ConfigError("execute_pipeline needs HybridPlugin(pp_size > 1) and a boosted model")
    batch = next(data_iter)
    _check_sequence(plugin, batch)
    if not torch.is_grad_enabled():  # evaluation: forward only (ColossalAI's rule under no_grad)
        loss = state.engine.forward_only(batch, criterion or default_criterion(model))
        return {"loss": loss if return_loss else None, "outputs": None}
    scale = optimizer.scaler.scale if optimizer is not None and optimizer.scaler is not None else 1.0
    if optimizer is not None:
        optimizer._before_backward()
    loss = state.engine.step(batch, criterion or default_criterion(model), scale)
    if optimizer is not None and optimizer.sync_gradients:
        optimizer._finish_backward()
    return {"loss": loss if return_loss else None, "outputs": None}


def _check_sequence(plugin: Any, batch: Any) -> None:
    """Sequence parallelism: a length the tp size does not divide is refused on every rank before
    any stage communicates (the first stage's own check would leave the others waiting)."""
    cfg = plugin.config
    if cfg.sp_mode == "none" or cfg.tp_size == 1:
        return
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        check_sequence_length(ids.shape[1], cfg.tp_size)


# -- checkpoints --------------------------------------------------------------------------------------
def export_state(plugin: Any, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(full-model name, full tensor) in the whole model's order; each tensor is broadcast over the
    pp group from its owner (a collective: every rank iterates to the end)."""
    state: PipelineState = plugin.pipeline
    local = {state.alias[n]: t for n, t in full_state_dict(model, plugin.tp_group).items()}
    for name in state.order:
        shape, dtype = state.shapes[name]
        owner = state.owners[name]
        t = local[name].contiguous() if owner == state.pp_rank else torch.empty(shape, dtype=dtype)
        src = dist.get_global_rank(state.pp_group, owner) if state.pp_group is not None else owner
        dist.broadcast(t, src=src, group=state.pp_group)
        yield name, t


class _AliasReader:
    """A model reader seen under this rank's state names (tied copies read the owner's tensor)."""

    def __init__(self, reader: Any, alias: dict[str, str]) -> None:
        self.reader, self.alias, self.directory = reader, alias, reader.directory

    def names(self) -> set[str]:
        have = self.reader.names()
        return have | {local for local, full in self.alias.items() if full in have}

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.reader.read(self.alias.get(name, name), start, end)


def load_model_pieces(plugin: Any, model: nn.Module, optimizer: BoostedOptimizer | None, reader: Any) -> None:
    load_full_pieces(model, _AliasReader(reader, plugin.pipeline.alias))
    if optimizer is not None:
        optimizer.load_masters_from_model()


def save_optimizer_state(plugin: Any, optimizer: BoostedOptimizer, directory: Path, rank: int) -> None:
    """Full-parameter pieces; each parameter written once, by one rank of its owner's stage."""
    state: PipelineState = plugin.pipeline
    mine = {n: p for n, p in plugin._params.items() if state.owners[n] == state.pp_rank}
    stage_rank, stage_world = _stage_rank_world(plugin)
    pieces = gather_optimizer_pieces(
        optimizer,
        mine,
        plugin.tp_group,
        plugin._dp_group,
        isinstance(optimizer, ZeroOptimizer),
        stage_rank,
        stage_world,
    )
    write_pieces(directory, rank, pieces)
    meta = _merged_meta(optimizer, state.pp_group)
    if rank == 0:
        write_meta(directory, meta)


def _merged_meta(optimizer: BoostedOptimizer, pp_group: Group) -> dict[str, Any]:
    """meta.json over every pp rank: a param group's tensor keys and scalars (Adam's step) come
    from the ranks that hold its parameters, which need not include rank 0 (a collective)."""
    metas: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(metas, _meta(optimizer), group=pp_group)
    merged = metas[0]
    for other in metas[1:]:
        for group, more in zip(merged["groups"], other["groups"], strict=True):
            group["tensor_keys"] = sorted(set(group["tensor_keys"]) | set(more["tensor_keys"]))
            group["scalars"] = {**more["scalars"], **group["scalars"]}
            group["names"] = group["names"] + [n for n in more["names"] if n not in group["names"]]
    return dict(merged)


def _stage_rank_world(plugin: Any) -> tuple[int, int]:
    """This rank's index among the dp × tp ranks of its pp stage, and their number."""
    tp = dist.get_world_size(plugin.tp_group)
    return (
        dist.get_rank(plugin._dp_group) * tp + dist.get_rank(plugin.tp_group),
        dist.get_world_size(plugin._dp_group) * tp,
    )


def model_pieces(plugin: Any, model: nn.Module) -> list[tuple[str, int, int, torch.Tensor]]:
    """(full-model name, 0, numel, full flat values) of the tensors this rank writes in a sharded
    save: the i-th tensor its stage owns is written by stage rank i mod (dp × tp)."""
    state: PipelineState = plugin.pipeline
    local = {state.alias[n]: t for n, t in full_state_dict(model, plugin.tp_group).items()}
    me, world = _stage_rank_world(plugin)
    mine = [n for n in state.order if state.owners[n] == state.pp_rank]
    return [
        (n, 0, local[n].numel(), local[n].reshape(-1).clone()) for i, n in enumerate(mine) if i % world == me
    ]


def model_shapes(plugin: Any) -> dict[str, tuple[list[int], str]]:
    """Full shapes and dtypes of every tensor of the whole model (all stages)."""
    state: PipelineState = plugin.pipeline
    return {n: (list(state.shapes[n][0]), str(state.shapes[n][1])) for n in state.order}
