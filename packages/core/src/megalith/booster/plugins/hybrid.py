"""`HybridPlugin`: tensor (+ sequence) parallelism inside each tp group, data parallelism (all-reduce
or ZeRO-1/2) across the dp axis of a 2-D mesh `build_mesh(ParallelDims(world, tp=tp_size))`.

    ranks  = dp × tp (tp innermost: the ranks of one tp group are neighbours)
    model  = the user's module, sharded in place by a policy (megalith.policies) over the tp group
    grads  = sequence-partial ones summed over tp, then averaged over dp (all-reduce, or ZeRO's
             reduce-scatter of flat buckets of the *local* shards)
    ‖g‖    = sqrt(Σ over all ranks of Σ g²), where a tp-sharded gradient counts on every tp rank (each
             holds a different block) and a replicated one (norm weights) on tp rank 0 only

Checkpoints are the ordinary formats, so tp2×dp2 → tp1×dp4 → DDP → one process needs no conversion,
and back. Model: `booster.save_model` / `load_model` go through this plugin's `export_state` /
`load_model_pieces` (tp blocks gathered to full tensors; full tensors sliced into blocks).
Optimizer: `plugin.save_optimizer` / `load_optimizer` (every rank) write / read pieces of *full*
parameters, and read the sharded (DCP) optimizer checkpoints the other plugins' `save_state` writes
(`ShardedDCPReader`); the booster's generic optimizer path refuses a tp > 1 optimizer with a
CheckpointError (it would store blocks as if they were ranges of the full parameters).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.booster.optim_state import _meta, check_param_numels
from megalith.booster.plugins import hybrid_pp
from megalith.booster.plugins.base import Boosted, MemoryPlan, Plugin, fp32_snapshot
from megalith.booster.plugins.hybrid_optim import TPReplicatedOptimizer, TPZeroOptimizer, load_pieces
from megalith.booster.plugins.hybrid_plan import (
    hybrid_memory_plan,
    local_parameter_counts,
    pipeline_memory_plans,
)
from megalith.booster.plugins.registry import register_plugin
from megalith.booster.precision import Precision
from megalith.checkpoint import (
    commit,
    fresh_staging,
    is_dcp,
    resolve,
    staging_path,
    unique_tensors,
    write_meta,
    write_pieces,
)
from megalith.common.errors import ConfigError
from megalith.common.validate import check_fraction, check_int, check_positive
from megalith.distributed import ParallelDims, axis_group, barrier, build_mesh, rank, world_size
from megalith.optim import BoostedOptimizer
from megalith.policies import Policy, policy_for
from megalith.tensor_parallel import (
    SEQUENCE_MODES,
    ShardedDCPReader,
    ShardedPieceReader,
    TensorParallelInfo,
    TensorParallelPlan,
    apply_tensor_parallel,
    dropout_rate,
    full_model_pieces,
    full_shapes,
    full_state_dict,
    gather_optimizer_pieces,
    load_full_pieces,
    shard_spec,
    validate_plan,
)
from megalith.zero import ZeroConfig, ZeroOptimizer, named_parameter_map

logger = logging.getLogger(__name__)
Group = dist.ProcessGroup | None


@dataclass(frozen=True)
class HybridConfig:
    """tp_size: ranks per tensor-parallel group (the rest of the world is dp).
    sp_mode: "none" | "split_gather" (Megatron-SP on the tp group) | "all_to_all" (Ulysses on the tp
        group: weights replicated there, sequence sharded, heads exchanged around attention).
    zero_stage: 0 = gradients all-reduced over dp (DDP-style), 1/2 = ZeRO over dp.
    bucket_size_mb: ZeRO bucket size (> 0); checkpoint_ratio: share of each pipeline stage's layers
        recomputed in backward, in [0, 1]. Sizes are positive ints (not 2.0 or True): ConfigError.
    policy: a `Policy` or `TensorParallelPlan`; None picks the registered policy by model class."""

    tp_size: int = 1
    sp_mode: str = "none"
    zero_stage: int = 0
    bucket_size_mb: float = 25.0
    policy: Policy | TensorParallelPlan | None = None
    # pipeline parallelism (booster/plugins/hybrid_pp.py): stages over pp ranks, `execute_pipeline`
    pp_size: int = 1
    pp_schedule: str = "1f1b"
    num_microbatches: int | None = None
    num_model_chunks: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    checkpoint_ratio: float = 0.0

    def __post_init__(self) -> None:
        # types and ranges first: 2.0 or True would pass `>= 1` and fail at boost as a mesh stride
        for name in ("tp_size", "pp_size", "num_model_chunks"):
            check_int(name, getattr(self, name))
        if self.num_microbatches is not None:
            check_int("num_microbatches", self.num_microbatches)
        if self.layers_per_stage is not None:
            if not isinstance(self.layers_per_stage, tuple | list):
                raise ConfigError(f"layers_per_stage must be a tuple of ints, got {self.layers_per_stage!r}")
            for n in self.layers_per_stage:
                check_int(f"every entry of layers_per_stage={self.layers_per_stage!r}", n)
        check_positive("bucket_size_mb", self.bucket_size_mb)
        check_fraction("checkpoint_ratio", self.checkpoint_ratio)
        if self.sp_mode not in SEQUENCE_MODES:
            raise ConfigError(f"sp_mode must be one of {SEQUENCE_MODES}, got {self.sp_mode!r}")
        hybrid_pp.check_options(self)  # (names ZeRO-3 with pp_size > 1 specifically)
        zero = self.zero_stage
        if isinstance(zero, bool) or not isinstance(zero, int) or zero not in (0, 1, 2):  # 2.0 == 2
            raise ConfigError(f"zero_stage must be 0, 1 or 2, got {zero!r}")


def _recomputes(model: nn.Module) -> bool:
    """Whether HF activation checkpointing is on (transformers 5 renamed the property; the old name
    warns where the new one exists)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


class HybridPlugin(Plugin):
    """TP/SP over the tp axis composed with DDP-style all-reduce or ZeRO-1/2 over the dp axis.

    `HybridPlugin(tp_size=2, sp_mode="split_gather", zero_stage=2)` or `HybridPlugin(config=...)`.
    With `pp_size > 1` the model is also split into pipeline stages (hybrid_pp.py) and trained with
    `booster.execute_pipeline(data_iter, model, criterion, optimizer)`.
    """

    name = "hybrid"

    def __init__(
        self,
        tp_size: int = 1,
        sp_mode: str = "none",
        zero_stage: int = 0,
        config: HybridConfig | None = None,
        **kwargs: object,
    ) -> None:
        options = {"tp_size": tp_size, "sp_mode": sp_mode, "zero_stage": zero_stage, **kwargs}
        self.config = config or HybridConfig(**options)  # type: ignore[arg-type]
        self.name = f"hybrid_tp{self.config.tp_size}_{self.config.sp_mode}_zero{self.config.zero_stage}"
        self.tp_group: Group = None
        self._dp_group: Group = None
        self._mesh_built = False
        self.info: TensorParallelInfo | None = None
        self._params: dict[str, nn.Parameter] = {}
        self.pp_group: Group = None
        self.mesh: Any = None
        self.pipeline: hybrid_pp.PipelineState | None = None
        if self.config.pp_size > 1:
            self.name += f"_pp{self.config.pp_size}_{self.config.pp_schedule}"

    def plan_for(self, model: nn.Module) -> TensorParallelPlan:
        """The plan of `policy` (or the model's registered policy) with the model's head counts; a
        bare `TensorParallelPlan` gets the counts it leaves out from the standard config names, so
        the divisibility checks run for it too."""
        policy = self.config.policy
        if isinstance(policy, TensorParallelPlan):
            counts = Policy("user plan", (), policy).plan_for(model)
            return replace(
                policy,
                num_heads=policy.num_heads if policy.num_heads is not None else counts.num_heads,
                num_kv_heads=policy.num_kv_heads if policy.num_kv_heads is not None else counts.num_kv_heads,
                hidden_size=policy.hidden_size if policy.hidden_size is not None else counts.hidden_size,
            )
        return (policy or policy_for(model)).plan_for(model)

    # -- setup ------------------------------------------------------------------------------------
    def configure(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: Precision
    ) -> Boosted:
        dims = ParallelDims(world_size(), tp=self.config.tp_size, pp=self.config.pp_size)
        plan = self.plan_for(model)
        validate_plan(model, plan, dims.tp, self.config.sp_mode)  # before any weight moves
        recompute = _recomputes(model) or (dims.pp > 1 and self.config.checkpoint_ratio > 0)
        if dims.tp > 1 and recompute and (rate := dropout_rate(model)) > 0:
            raise ConfigError(
                f"dropout {rate:g} with activation recomputation under tp_size={dims.tp}: a recomputed "
                "module would draw a different dropout mask on its tensor-parallel rank stream than its "
                "forward did. Set dropout to 0 or turn recomputation off (checkpoint_ratio=0, no "
                "gradient_checkpointing_enable())"
            )
        if optimizer is not None and len(optimizer.state):
            raise ConfigError("HybridPlugin needs a fresh optimizer (its state is re-created for the shards)")
        old_names = named_parameter_map(model)
        self._build_groups()
        if dist.is_initialized() and dims.world_size > 1:
            _broadcast_from_rank0(model)  # every tp rank shards the same full weights
        self.info = apply_tensor_parallel(model, plan, self.tp_group, self.config.sp_mode)
        if self.config.pp_size > 1:
            return hybrid_pp.configure_pipeline(self, model, optimizer, precision, old_names)
        if optimizer is None:
            return Boosted(model, None)
        names = named_parameter_map(model)
        _repoint(optimizer, old_names, {n: p for p, n in names.items()})
        self._params = {names[p]: p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
        fp32 = fp32_snapshot(model) if precision.mixed else {}
        model.to(precision.dtype)
        wrapped = self._wrap(optimizer, names, precision)
        if precision.mixed:
            with wrapped.local_loads():  # the snapshot holds this rank's blocks
                wrapped.load_master_values(lambda name, s, e: fp32[name].view(-1)[s:e])
        logger.info(
            "hybrid: tp=%d dp=%d sp=%s zero=%d", dims.tp, dims.dp, self.config.sp_mode, self.config.zero_stage
        )
        return Boosted(model, wrapped)

    def _wrap(
        self, optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str], precision: Precision
    ) -> TPReplicatedOptimizer | TPZeroOptimizer:
        assert self.info is not None
        if self.config.zero_stage == 0:
            return TPReplicatedOptimizer(optimizer, names, self.info, self._dp_group, precision.make_scaler())
        # Sequence-partial gradients are summed over tp before the dp reduction: no overlap hooks.
        config = ZeroConfig(self.config.zero_stage, self.config.bucket_size_mb, overlap_communication=False)
        return TPZeroOptimizer(optimizer, names, config, self.info, self._dp_group, precision.make_scaler())

    def _build_groups(self) -> None:
        """The tp and dp groups of the 2-D mesh (a collective, once; before `boost` too, e.g. when
        `prepare_dataloader` asks for the dp size)."""
        if self._mesh_built or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        mesh = build_mesh(ParallelDims(dist.get_world_size(), tp=self.config.tp_size, pp=self.config.pp_size))
        self.tp_group, self._dp_group = axis_group(mesh, "tp"), axis_group(mesh, "dp")
        self.pp_group, self.mesh = axis_group(mesh, "pp"), mesh
        self._mesh_built = True

    @property
    def dp_group(self) -> Group:
        self._build_groups()
        return self._dp_group

    def memory_plan(
        self, num_params: int, num_trainable: int, world_size: int, precision: Precision
    ) -> MemoryPlan:
        """Approximation from counts alone (every parameter sharded over tp, pp stages of equal size);
        `plan(model, ...)` uses `model_memory_plan`, which counts each parameter where it lives."""
        tp, pp = self.config.tp_size, self.config.pp_size
        dims = ParallelDims(world_size, tp=tp, pp=pp)
        b, phi, psi = precision.param_bytes, num_params // (tp * pp), num_trainable // (tp * pp)
        master = 4 if precision.mixed else 0
        stage = self.config.zero_stage
        states = (8 + master) * psi // (dims.dp if stage else 1)
        grads = b * psi // (dims.dp if stage == 2 else 1)
        return MemoryPlan(
            self.name, precision.name, world_size, num_params, num_trainable, b * phi, grads, states
        )

    def model_memory_plan(self, model: nn.Module, world_size: int, precision: Precision) -> MemoryPlan:
        """Per-rank bytes with each parameter counted as one tp rank holds it (booster/plugins/hybrid_plan.py):
        norms, row-parallel biases and everything under all_to_all at full size, vocabulary padded."""
        ParallelDims(world_size, tp=self.config.tp_size, pp=self.config.pp_size)  # the size checks first
        if self.config.pp_size > 1:  # each pp rank counts its own stages; the largest (hybrid_plan.py)
            plans = pipeline_memory_plans(
                self.name, model, self.plan_for(model), self.config, world_size, precision
            )
            return max(plans, key=lambda p: p.total)
        counts = local_parameter_counts(model, self.plan_for(model), self.config.tp_size, self.config.sp_mode)
        return hybrid_memory_plan(
            self.name, counts, self.config.tp_size, self.config.zero_stage, world_size, precision
        )

    # -- checkpoints (collective: every rank calls them) ------------------------------------------
    sharded_params = True  # tp shards: a checkpoint needs the full tensors of `export_state`

    def export_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) per state-dict entry, tied parameters once (collective over tp)."""
        if self.pipeline is not None:  # collective over pp too: full-model names and order
            yield from hybrid_pp.export_state(self, model)
            return
        yield from unique_tensors(full_state_dict(model, self.tp_group)).items()

    def model_pieces(self, model: nn.Module) -> list[tuple[str, int, int, torch.Tensor]]:
        """Full-tensor pieces for `booster.save_state` (each tensor written by one rank)."""
        if self.pipeline is not None:
            return hybrid_pp.model_pieces(self, model)
        return full_model_pieces(model, self.tp_group, rank(), world_size())

    def model_shapes(self, model: nn.Module) -> dict[str, tuple[list[int], str]]:
        """Full (not tp-local) shapes for the sharded checkpoint's meta.json (`export_hf`, resume)."""
        if self.pipeline is not None:  # every stage's tensors, not only this rank's
            return hybrid_pp.model_shapes(self)
        return full_shapes(model)

    def load_model_pieces(self, model: nn.Module, optimizer: BoostedOptimizer | None, reader: Any) -> None:
        """`booster.load_model`: every rank slices its tp blocks out of the full tensors."""
        if self.pipeline is not None:
            return hybrid_pp.load_model_pieces(self, model, optimizer, reader)
        load_full_pieces(model, reader)
        if optimizer is not None:
            optimizer.load_masters_from_model()

    def save_optimizer_state(self, optimizer: BoostedOptimizer, directory: Path) -> None:
        """Write optimizer pieces of *full* parameters (one writer per parameter) plus meta.json
        into `directory` (collective; the booster's generic writer would store tp blocks)."""
        if self.pipeline is not None:
            return hybrid_pp.save_optimizer_state(self, optimizer, directory, rank())
        pieces = gather_optimizer_pieces(
            optimizer,
            self._params,
            self.tp_group,
            self._dp_group,
            isinstance(optimizer, ZeroOptimizer),
            rank(),
            world_size(),
        )
        write_pieces(directory, rank(), pieces)
        if rank() == 0:
            write_meta(directory, _meta(optimizer))

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Any = None,
        optimizer: BoostedOptimizer | None = None,
        return_loss: bool = True,
    ) -> dict[str, Any]:
        """One step's forward + backward of `next(data_iter)` through the pipeline (pp_size > 1)."""
        return hybrid_pp.execute_pipeline(self, data_iter, model, criterion, optimizer, return_loss)

    def load_optimizer_state(self, optimizer: BoostedOptimizer, directory: Path) -> None:
        """Read an optimizer checkpoint of any layout (any tp × dp, DDP, ZeRO, FSDP2, one process):
        the per-rank piece format or a sharded (DCP) one, full parameters sliced into this rank's blocks."""
        full = {n: math.prod(full_shape(p)) for n, p in self._params.items()}
        if not is_dcp(directory):
            reader = ShardedPieceReader(directory, self._params)
            check_param_numels(full, reader.numel, directory)
            load_pieces(optimizer, reader)
            return
        from megalith.booster.checkpointing import load_optimizer_dcp  # (imports the plugins)

        dcp_reader = ShardedDCPReader(directory, self._params)
        check_param_numels(full, dcp_reader.master_numel, directory)
        with getattr(optimizer, "local_loads", nullcontext)():  # tp optimizers read in block coordinates
            load_optimizer_dcp(optimizer, directory, dcp_reader)

    def save_optimizer(self, optimizer: BoostedOptimizer, path: str | Path) -> Path:
        """Atomic `save_optimizer_state` into `path` (every rank calls it)."""
        path = Path(path)
        if rank() == 0:
            fresh_staging(path)
        barrier()
        self.save_optimizer_state(optimizer, staging_path(path))
        barrier()
        if rank() == 0:
            commit(path)
        barrier()
        return path

    def load_optimizer(self, optimizer: BoostedOptimizer, path: str | Path) -> None:
        self.load_optimizer_state(optimizer, resolve(path))


def full_shape(p: torch.Tensor) -> list[int]:
    """The shape of the full tensor a tp block is a block of (its own shape if not a block)."""
    spec = shard_spec(p)
    return list(spec.full_shape) if spec is not None else list(p.shape)


def _repoint(
    optimizer: torch.optim.Optimizer, old_names: dict[nn.Parameter, str], new: dict[str, nn.Parameter]
) -> None:
    """Point the optimizer's param groups at the parameters that replaced the originals, by name."""
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = old_names.get(p)
            if name is None or name not in new:
                raise ConfigError("the optimizer holds a parameter that is not in the model")
            params.append(new[name])
        group["params"] = params


def _broadcast_from_rank0(model: nn.Module) -> None:
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


register_plugin("hybrid", HybridPlugin)  # `make_plugin("hybrid", tp_size=2, sp_mode=..., zero_stage=...)`
