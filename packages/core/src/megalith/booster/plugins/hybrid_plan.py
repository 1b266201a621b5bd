"""Per-rank model-state bytes of `HybridPlugin`, counted parameter by parameter from the plan.

What one tp rank holds of each parameter (no weight is moved; works on the meta device):

    colwise  weight [Σ_parts ceil(n/tp), in], bias [Σ_parts ceil(n/tp)]
    rowwise  weight [out, in/tp],            bias [out]  (replicated: added after the reduction)
    vocab    rows ceil(V/tp) (vocabulary padded to a multiple of tp)
    others   full size (norm weights, any module the plan does not name)
    all_to_all (Ulysses): every parameter at full size (weights are replicated over the tp group)

Then, with Ψ_local the trainable elements of one tp rank, b bytes per element and dp = world/(tp·pp),
the ZeRO paper's accounting on the local shard: params b·Φ_local; grads b·Ψ_local (÷ dp at ZeRO-2);
Adam states (8 + 4 fp32 masters under mixed precision)·Ψ_local (÷ dp at ZeRO-1/2).

Pipeline parallelism (pp > 1): each pp rank counts only the parameters of its own stages, split as
the engine splits them (`megalith.pipeline.stage.stage_ranges` over the layers' tp-local parameter
counts, stage s on `schedule.stage_rank(s)`): the embedding on stage 0, everything outside the layers
(final norm, LM head) on the last stage, a tied embedding on both. `pipeline_memory_plans` gives one
plan per pp rank; `plan()` reports the largest.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from megalith.booster.plugins.base import MemoryPlan
from megalith.booster.plugins.hybrid_pp import pipeline_config
from megalith.booster.precision import Precision
from megalith.distributed import ParallelDims
from megalith.pipeline.stage import is_hf_decoder, layer_list, stage_ranges
from megalith.tensor_parallel import TensorParallelPlan, validate_plan
from megalith.tensor_parallel.apply import plan_parts


def _ceil(n: int, tp: int) -> int:
    return -(-n // tp)


def local_numel(
    module: nn.Module, attr: str, style: str | None, plan: TensorParallelPlan, name: str, tp: int
) -> int:
    """Elements of parameter `attr` of `module` (named `name`) held by one tp rank."""
    p = getattr(module, attr)
    numel = int(p.numel())
    if style is None or tp == 1:
        return numel
    if style == "colwise":
        rows = sum(_ceil(n, tp) for n in plan_parts(plan, name, module))
        return rows * (numel // int(p.shape[0]))
    if style == "rowwise":
        return numel // tp if attr == "weight" else numel
    return _ceil(int(p.shape[0]), tp) * (numel // int(p.shape[0]))  # vocab rows


def local_numels(
    model: nn.Module, plan: TensorParallelPlan, tp: int, sp_mode: str
) -> dict[str, tuple[int, int, bool]]:
    """name → (elements one tp rank holds, full elements, trainable), tied parameters once."""
    styles = validate_plan(model, plan, tp, sp_mode) if sp_mode != "all_to_all" else {}
    out: dict[str, tuple[int, int, bool]] = {}
    for name, p in model.named_parameters():  # named_parameters() yields a tied parameter once
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        n = local_numel(module, attr, styles.get(module_name), plan, module_name, tp)
        out[name] = (n, int(p.numel()), p.requires_grad)
    return out


def _sums(numels: dict[str, tuple[int, int, bool]], names: Iterable[str]) -> tuple[int, int]:
    chosen = [numels[n] for n in names]
    return sum(c[0] for c in chosen), sum(c[0] for c in chosen if c[2])


def local_parameter_counts(
    model: nn.Module, plan: TensorParallelPlan, tp: int, sp_mode: str
) -> tuple[int, int, int, int]:
    """(local total, local trainable, full total, full trainable) elements, tied parameters once."""
    numels = local_numels(model, plan, tp, sp_mode)
    local, local_trainable = _sums(numels, numels)
    total = sum(c[1] for c in numels.values())
    trainable = sum(c[1] for c in numels.values() if c[2])
    return local, local_trainable, total, trainable


def pipeline_holders(
    model: nn.Module, numels: dict[str, tuple[int, int, bool]], config: Any
) -> dict[str, set[int]]:
    """name → the pp ranks holding it under `config` (a HybridConfig with pp_size > 1)."""
    schedule = pipeline_config(config).make_schedule()
    last = schedule.num_stages - 1
    names = {id(p): n for n, p in model.named_parameters()}
    layer_of: dict[str, int] = {}
    costs = []
    for i, layer in enumerate(layer_list(model)):  # the engine's balancing weight: tp-local elements
        held = {names[id(p)] for p in layer.parameters()}
        costs.append(sum(numels[n][0] for n in held))
        layer_of.update(dict.fromkeys(held, i))
    stage_of = {
        i: s
        for s, r in enumerate(stage_ranges(costs, schedule.num_stages, config.layers_per_stage))
        for i in r
    }
    embedding: set[int] = set()
    tied = False
    if is_hf_decoder(model):
        hf: Any = model  # HF attribute access
        emb = hf.get_input_embeddings()
        embedding = {id(p) for p in emb.parameters()}
        head = getattr(hf, "lm_head", None)
        tied = head is not None and getattr(head, "weight", None) is getattr(emb, "weight", None)
    holders: dict[str, set[int]] = {}
    for p_id, name in names.items():
        if name in layer_of:
            stages = {stage_of[layer_of[name]]}
        elif p_id in embedding:
            stages = {0, last} if tied else {0}
        else:  # final norm, LM head
            stages = {last}
        holders[name] = {schedule.stage_rank(s) for s in stages}
    return holders


def pipeline_memory_plans(
    name: str, model: nn.Module, plan: TensorParallelPlan, config: Any, world_size: int, precision: Precision
) -> list[MemoryPlan]:
    """One plan per pp rank (index = pp rank): the formulas on the parameters of its stages."""
    numels = local_numels(model, plan, config.tp_size, config.sp_mode)
    holders = pipeline_holders(model, numels, config)
    total = sum(c[1] for c in numels.values())
    trainable = sum(c[1] for c in numels.values() if c[2])
    plans = []
    for r in range(config.pp_size):
        local, local_trainable = _sums(numels, [n for n in numels if r in holders[n]])
        counts = (local, local_trainable, total, trainable)
        plans.append(
            hybrid_memory_plan(
                name, counts, config.tp_size, config.zero_stage, world_size, precision, config.pp_size
            )
        )
    return plans


def hybrid_memory_plan(
    name: str,
    counts: tuple[int, int, int, int],
    tp: int,
    zero_stage: int,
    world_size: int,
    precision: Precision,
    pp: int = 1,
) -> MemoryPlan:
    """The formulas of the module docstring for `local_parameter_counts` `counts` (of one pp rank)."""
    dims = ParallelDims(world_size, tp=tp, pp=pp)
    phi, psi, total, trainable = counts
    b = precision.param_bytes
    master = 4 if precision.mixed else 0
    states = (8 + master) * psi // (dims.dp if zero_stage else 1)
    grads = b * psi // (dims.dp if zero_stage == 2 else 1)
    return MemoryPlan(name, precision.name, world_size, total, trainable, b * phi, grads, states)
