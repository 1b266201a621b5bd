"""Bad constructor arguments are refused at construction with a ConfigError naming the value."""

from __future__ import annotations

import pytest

from megalith.booster import Booster
from megalith.booster.plugins import (
    DDPConfig,
    DDPPlugin,
    FSDPPlugin,
    HybridConfig,
    HybridPlugin,
    ZeroPlugin,
)
from megalith.common.errors import ConfigError
from megalith.distributed import ParallelDims


@pytest.mark.parametrize("plugin", ["zero2", 2])
def test_booster_refuses_a_plugin_that_is_not_a_plugin(plugin: object) -> None:
    with pytest.raises(ConfigError, match=f"got {plugin!r}"):
        Booster(plugin=plugin)  # type: ignore[arg-type]


# -- plugin configs: every value checked at construction, before any process group exists ------------
BAD_PLUGIN_ARGS = [
    # (build, the message must name the value)
    (lambda: DDPPlugin(bucket_cap_mb="25"), r"bucket_cap_mb must be a number > 0, got '25' \(str\)"),
    (lambda: DDPPlugin(bucket_cap_mb=-5), "bucket_cap_mb must be > 0, got -5"),
    (lambda: DDPPlugin(bucket_cap_mb=0), "bucket_cap_mb must be > 0, got 0"),
    (lambda: DDPPlugin(bucket_cap_mb=True), "bucket_cap_mb must be a number > 0, got True"),
    (
        lambda: DDPPlugin(find_unused_parameters="yes"),
        "find_unused_parameters must be True or False, got 'yes'",
    ),
    (lambda: DDPPlugin(broadcast_buffers=1), "broadcast_buffers must be True or False, got 1"),
    (lambda: DDPConfig(bucket_cap_mb=float("nan")), "bucket_cap_mb must be > 0, got nan"),
    (lambda: DDPPlugin(config=DDPConfig(), bucket_cap_mb=5), r"not both: got \['bucket_cap_mb'\]"),
    (lambda: HybridPlugin(tp_size=2.0), r"tp_size must be an integer >= 1, got 2.0 \(float\)"),
    (lambda: HybridPlugin(tp_size=True), r"tp_size must be an integer >= 1, got True \(bool\)"),
    (lambda: HybridPlugin(tp_size=0), "tp_size must be >= 1, got 0"),
    (lambda: HybridPlugin(pp_size=2.0), "pp_size must be an integer >= 1, got 2.0"),
    (
        lambda: HybridPlugin(pp_size=2, num_microbatches=4.0),
        "num_microbatches must be an integer >= 1, got 4.0",
    ),
    (lambda: HybridPlugin(num_model_chunks=0), "num_model_chunks must be >= 1, got 0"),
    (lambda: HybridPlugin(pp_size=2, layers_per_stage=(1, 1.5)), r"layers_per_stage=\(1, 1.5\).*got 1.5"),
    (lambda: HybridPlugin(zero_stage=2.0), "zero_stage must be 0, 1 or 2, got 2.0"),
    (lambda: HybridPlugin(zero_stage=True), "zero_stage must be 0, 1 or 2, got True"),
    (lambda: HybridPlugin(bucket_size_mb=0), "bucket_size_mb must be > 0, got 0"),
    (lambda: HybridPlugin(bucket_size_mb="25"), "bucket_size_mb must be a number > 0, got '25'"),
    (lambda: HybridPlugin(checkpoint_ratio=2.0), r"checkpoint_ratio must be in \[0, 1\], got 2.0"),
    (lambda: HybridPlugin(checkpoint_ratio=-0.1), r"checkpoint_ratio must be in \[0, 1\], got -0.1"),
    (
        lambda: HybridConfig(checkpoint_ratio="0.5"),
        r"checkpoint_ratio must be a number in \[0, 1\], got '0.5'",
    ),
    (lambda: ZeroPlugin(stage=2.0), r"ZeRO stage must be one of \(1, 2, 3\), got 2.0"),
    (lambda: ZeroPlugin(stage=2, cpu_offload="no"), "cpu_offload must be True or False, got 'no'"),
    (
        lambda: ZeroPlugin(stage=2, overlap_communication=1),
        "overlap_communication must be True, False or None, got 1",
    ),
    (lambda: FSDPPlugin(group_size_mb="25"), "group_size_mb must be a number > 0, got '25'"),
]


@pytest.mark.parametrize(("build", "message"), BAD_PLUGIN_ARGS, ids=[m for _, m in BAD_PLUGIN_ARGS])
def test_bad_plugin_arguments_are_refused_at_construction(build, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 4, "tp": 2.0}, r"tp must be an integer >= 1, got 2.0 \(float\)"),
        ({"world_size": 4, "pp": True}, r"pp must be an integer >= 1, got True \(bool\)"),
        ({"world_size": 4, "sp": 0}, "sp must be >= 1, got 0"),
        ({"world_size": 4, "dp": 2.0, "tp": 2}, r"dp must be an integer >= 1 or -1 \(infer\), got 2.0"),
        ({"world_size": 4, "dp": 0}, r"dp must be an integer >= 1 or -1 \(infer\), got 0"),
        ({"world_size": 4.0}, "world_size must be an integer >= 1, got 4.0"),
        ({"world_size": 0}, "world_size must be >= 1, got 0"),
    ],
)
def test_parallel_dims_needs_positive_ints(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ParallelDims(**kwargs)


def test_good_plugin_arguments_still_work() -> None:
    assert DDPPlugin(bucket_cap_mb=1).config.bucket_cap_mb == 1
    assert DDPPlugin(bucket_cap_mb=0.5, find_unused_parameters=True).config.find_unused_parameters
    assert HybridPlugin(tp_size=2, bucket_size_mb=0.5, checkpoint_ratio=1.0).config.tp_size == 2
    assert HybridPlugin(pp_size=2, num_microbatches=4, layers_per_stage=(1, 1)).config.pp_size == 2
    assert ParallelDims(8, tp=2, pp=2).dp == 2
    assert ParallelDims(4, dp=-1, tp=2).dp == 2
