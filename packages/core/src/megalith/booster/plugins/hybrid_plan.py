"""Per-rank model-state bytes of `HybridPlugin`, counted parameter by parameter from the plan.

What one tp rank holds of each parameter (no weight is moved; works on the meta device):

    colwise  weight [Σ_parts ceil(n/tp), in], bias [Σ_parts ceil(n/tp)]
    rowwise  weight [out, in/tp],            bias [out]  (replicated: added after the reduction)
    vocab    rows ceil(V/tp) (vocabulary padded to a multiple of tp)
    others   full size (norm weights, any module the plan does not name)
    all_to_all (Ulysses): every parameter at full size (weights are replicated over the tp group)

Then, with Ψ_local the trainable elements of one tp rank, b bytes per element and dp = world/tp,
the ZeRO paper's accounting on the local shard: params b·Φ_local; grads b·Ψ_local (÷ dp at ZeRO-2);
Adam states (8 + 4 fp32 masters under mixed precision)·Ψ_local (÷ dp at ZeRO-1/2).
"""

from __future__ import annotations

from torch import nn

from megalith.booster.plugins.base import MemoryPlan
from megalith.booster.precision import Precision
from megalith.distributed import ParallelDims
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


def local_parameter_counts(
    model: nn.Module, plan: TensorParallelPlan, tp: int, sp_mode: str
) -> tuple[int, int, int, int]:
    """(local total, local trainable, full total, full trainable) elements, tied parameters once."""
    styles = validate_plan(model, plan, tp, sp_mode) if sp_mode != "all_to_all" else {}
    local = local_trainable = total = trainable = 0
    for name, p in model.named_parameters():  # named_parameters() yields a tied parameter once
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        n = local_numel(module, attr, styles.get(module_name), plan, module_name, tp)
        local += n
        total += p.numel()
        if p.requires_grad:
            local_trainable += n
            trainable += p.numel()
    return local, local_trainable, total, trainable


def hybrid_memory_plan(
    name: str,
    counts: tuple[int, int, int, int],
    tp: int,
    zero_stage: int,
    world_size: int,
    precision: Precision,
) -> MemoryPlan:
    """The formulas of the module docstring for `local_parameter_counts` `counts`."""
    dims = ParallelDims(world_size, tp=tp)
    phi, psi, total, trainable = counts
    b = precision.param_bytes
    master = 4 if precision.mixed else 0
    states = (8 + master) * psi // (dims.dp if zero_stage else 1)
    grads = b * psi // (dims.dp if zero_stage == 2 else 1)
    return MemoryPlan(name, precision.name, world_size, total, trainable, b * phi, grads, states)
