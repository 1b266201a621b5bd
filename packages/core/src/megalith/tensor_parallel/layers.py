"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019) and the `ShardSpec`
that records how each sharded parameter maps onto its full tensor.

    Y = X A B   with A split by columns (output features) and B split by rows (input features):
    X [.., h] --f--> X A_r [.., 4h/tp] --> (X A_r) B_r [.., h] partial --g--> Σ_r = Y

Swapped in for `nn.Linear` modules from outside the model, the parameters keep their names
(`weight`, `bias`), so a state dict of full tensors is the HF one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from megalith.common.errors import ConfigError
from megalith.tensor_parallel.comm import (
    Group,
    copy_to_tp,
    gather_from_tp,
    gather_sequence,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_sequence,
    scatter_to_tp,
)

SPEC_ATTR = "_megalith_tp_spec"
InputOp = Literal["copy", "gather_sequence", "none"]


@dataclass(frozen=True)
class ShardSpec:
    """A parameter of `full_shape` split over `tp_size` ranks along `dim`.

    The full dimension is the concatenation of `parts` (one part normally; the q/k/v or gate/up
    sizes of a fused projection). Each part of size n is padded to ceil(n/tp)*tp (vocabulary
    padding) and split into equal blocks of c = ceil(n/tp); rank r holds block r of every part:

        local[dim] = [part0[r*c:(r+1)*c] | part1[r*c:(r+1)*c] | ...]   (zero rows past n)
    """

    full_shape: tuple[int, ...]
    dim: int
    parts: tuple[int, ...]
    tp_size: int
    tp_rank: int

    def block(self, n: int) -> int:
        return -(-n // self.tp_size)

    def valid(self, n: int, rank: int | None = None) -> int:
        """How many real (unpadded) entries of a part of size n rank `rank` holds."""
        r = self.tp_rank if rank is None else rank
        c = self.block(n)
        return max(0, min(c, n - r * c))

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = sum(self.block(n) for n in self.parts)
        return tuple(shape)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a full tensor (a new tensor, zero padded)."""
        if tuple(full.shape) != self.full_shape:
            raise ConfigError(f"expected a tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        out = full.new_zeros(self.local_shape)
        src = dst = 0
        for n in self.parts:
            c, v = self.block(n), self.valid(n)
            if v:
                out.narrow(self.dim, dst, v).copy_(full.narrow(self.dim, src + self.tp_rank * c, v))
            src, dst = src + n, dst + c
        return out

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's block (rank order), padding dropped."""
        pieces = []
        dst = 0
        for n in self.parts:
            c = self.block(n)
            for r, s in enumerate(shards):
                v = self.valid(n, r)
                if v:
                    pieces.append(s.narrow(self.dim, dst, v))
            dst += c
        return torch.cat(pieces, dim=self.dim)


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The `ShardSpec` of a tensor-parallel parameter, None for a replicated one."""
    return getattr(param, SPEC_ATTR, None)


def sharded_parameter(full: torch.Tensor, spec: ShardSpec, requires_grad: bool = True) -> nn.Parameter:
    param = nn.Parameter(spec.shard(full.detach()).contiguous(), requires_grad=requires_grad)
    setattr(param, SPEC_ATTR, spec)
    return param


def _check_divisible(what: str, n: int, tp: int) -> None:
    if n % tp:
        raise ConfigError(f"{what} = {n} is not divisible by the tensor-parallel size {tp}")


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_rᵀ (+ b_r): weight [out/tp, in], output features split over the group.

    `input_op`: "copy" applies Megatron's f (identity forward, all-reduce backward) to a replicated
    input; "gather_sequence" all-gathers a sequence-sharded input [b, s/tp, in] (Megatron-SP,
    reduce-scatter backward); "none" means the caller already did one of those for several layers
    (e.g. one gather feeding q, k and v). `gather_output` all-gathers [.., out] for replicated consumers.
    """

    def __init__(
        self,
        linear: nn.Linear,
        group: Group,
        parts: tuple[int, ...] | None = None,
        input_op: InputOp = "copy",
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        tp = group_size(group)
        parts = parts or (linear.out_features,)
        if sum(parts) != linear.out_features:
            raise ConfigError(f"fused parts {parts} do not add up to out_features={linear.out_features}")
        for n in parts:
            _check_divisible("output features", n, tp)
        if gather_output and len(parts) > 1:
            raise ConfigError("gather_output is not supported for a fused projection")
        self.group, self.input_op, self.gather_output = group, input_op, gather_output
        self.in_features, self.out_features = linear.in_features, linear.out_features
        spec = ShardSpec(tuple(linear.weight.shape), 0, parts, tp, group_rank(group))
        self.weight = sharded_parameter(linear.weight, spec, linear.weight.requires_grad)
        self.bias: nn.Parameter | None = None
        if linear.bias is not None:
            bspec = ShardSpec(tuple(linear.bias.shape), 0, parts, tp, group_rank(group))
            self.bias = sharded_parameter(linear.bias, bspec, linear.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_op == "copy":
            x = copy_to_tp(x, self.group)
        elif self.input_op == "gather_sequence":
            x = gather_sequence(x, self.group)
        y = F.linear(x, self.weight, self.bias)  # [.., out/tp]
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={group_size(self.group)}, input_op={self.input_op}"


class RowParallelLinear(nn.Module):
    """Y = Σ_r X_r B_rᵀ (+ b): weight [out, in/tp], input features split over the group.

    The partial products are summed by Megatron's g (all-reduce forward, identity backward), or with
    `sequence_parallel` reduce-scattered along the sequence ([b, s, out] → [b, s/tp, out]). The bias is
    replicated and added after the reduction; on sequence shards its gradient is partial, so it passes
    through f (all-reduce in backward).
    """

    def __init__(
        self,
        linear: nn.Linear,
        group: Group,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        tp = group_size(group)
        _check_divisible("input features", linear.in_features, tp)
        self.group, self.input_is_parallel, self.sequence_parallel = (
            group,
            input_is_parallel,
            sequence_parallel,
        )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        spec = ShardSpec(tuple(linear.weight.shape), 1, (linear.in_features,), tp, group_rank(group))
        self.weight = sharded_parameter(linear.weight, spec, linear.weight.requires_grad)
        self.bias: nn.Parameter | None = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = F.linear(x, self.weight)  # [.., out] partial over ranks
        if self.sequence_parallel:
            y = reduce_scatter_sequence(y, self.group)
            return y if self.bias is None else y + copy_to_tp(self.bias, self.group)
        y = reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={group_size(self.group)}, sp={self.sequence_parallel}"
