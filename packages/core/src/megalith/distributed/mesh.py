"""A torch `DeviceMesh` with named axes (pp, dp, sp, tp) built from `ParallelDims`."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megalith.distributed.dims import AXES, ParallelDims


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """All four axes are always present (size-1 axes included) so `mesh["dp"]` always works."""
    return init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)


def axis_group(mesh: DeviceMesh | None, axis: str) -> dist.ProcessGroup | None:
    """The process group of one mesh axis; `None` (the default group) without a mesh."""
    if mesh is None:
        return None
    return mesh[axis].get_group()
