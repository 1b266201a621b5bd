"""Parallel dimensions, device mesh, launch, collectives and the stateful sampler (layer 2)."""

from megalith.distributed.collectives import (
    Handle,
    all_gather_flat,
    all_reduce_flat,
    all_reduce_scalar,
    barrier,
    broadcast_object,
    rank,
    reduce_scatter_flat,
    world_size,
)
from megalith.distributed.comm_counter import CommCounter, count_comm
from megalith.distributed.dims import AXES, ParallelDims
from megalith.distributed.launch import LaunchInfo, launch, relaunch, shutdown, under_launcher
from megalith.distributed.mesh import axis_group, build_mesh
from megalith.distributed.sampler import StatefulDataLoader, StatefulDistributedSampler

__all__ = [
    "AXES",
    "Handle",
    "all_gather_flat",
    "reduce_scatter_flat",
    "LaunchInfo",
    "ParallelDims",
    "StatefulDataLoader",
    "StatefulDistributedSampler",
    "all_reduce_scalar",
    "axis_group",
    "barrier",
    "broadcast_object",
    "build_mesh",
    "launch",
    "rank",
    "relaunch",
    "shutdown",
    "under_launcher",
    "world_size",
    "all_reduce_flat",
    "CommCounter",
    "count_comm",
]

from megalith.distributed.collectives import comm_device

__all__ += ["comm_device"]
