"""Pipeline parallelism: schedules as data, a simulator that checks them, and (elsewhere) the executor."""

from megalith.pipeline.engine import PipelineConfig, PipelineEngine, split_microbatches
from megalith.pipeline.executor import PipelineExecutor
from megalith.pipeline.p2p import PipeP2P
from megalith.pipeline.schedule import COMPUTE_OPS, Action, Op, Schedule
from megalith.pipeline.schedules import (
    SCHEDULES,
    ScheduleSpec,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    with_p2p,
    zero_bubble_h1,
    zero_bubble_v,
)
from megalith.pipeline.simulate import OpCost, SimulationResult, simulate
from megalith.pipeline.stage import balance_layers, make_stages, prune, stage_ranges
from megalith.pipeline.validate import ScheduleError, validate

__all__ = [
    "COMPUTE_OPS",
    "SCHEDULES",
    "Action",
    "Op",
    "OpCost",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "SimulationResult",
    "gpipe",
    "interleaved_1f1b",
    "make_schedule",
    "one_f_one_b",
    "simulate",
    "validate",
    "with_p2p",
    "zero_bubble_h1",
    "zero_bubble_v",
    # execution: stage split, P2P, executor, engine
    "PipeP2P",
    "PipelineConfig",
    "PipelineEngine",
    "PipelineExecutor",
    "balance_layers",
    "make_stages",
    "prune",
    "split_microbatches",
    "stage_ranges",
]
