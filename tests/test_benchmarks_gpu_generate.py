"""benchmarks/gpu_generate.py: ``--gemm-configs`` picks the tiles the engine's split-K projections run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from megalith.common.errors import ConfigError
from megalith_chat.engine.fast_gemm import GemmConfig, ProjectionConfigs

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    """The benchmark as a module (it puts ``benchmarks/`` on ``sys.path`` for its ``_common``)."""
    spec = importlib.util.spec_from_file_location(
        "_bench_gpu_generate", ROOT / "benchmarks" / "gpu_generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_configuration_or_one_per_projection() -> None:
    pick = _load().gemm_configs
    tiles = GemmConfig(block_n=32, block_k=256, warps=8, stages=4)
    assert pick("32x256w8s4", 64) == ProjectionConfigs(tiles, tiles, tiles, tiles)
    assert pick("o=32x256w8s4,down=32x256w8s4", 64) == ProjectionConfigs(o=tiles, down=tiles)
    with pytest.raises(ConfigError, match="'32x256' is not"):
        pick("qkv=32x256", 64)
    with pytest.raises(ConfigError, match="unknown projection 'up'"):
        pick("up=32x256w8s4", 64)


def test_best_measured_tiles_of_the_variant_the_engine_runs(tmp_path: Path) -> None:
    """Per projection the fastest configuration of its own epilogue's variant, at the nearest rows."""
    times = {
        "qkv": {"linear": 1.0, "triton[64x128w4s3]": 5.0, "triton[32x128w4s3]": 4.0},
        "o": {
            "triton[32x128w4s3]": 1.0,
            "triton_residual[64x128w4s3]": 2.0,
            "triton_residual[32x128w4s3]": 3.0,
        },
        "gate_up": {
            "triton[32x128w4s3]": 1.0,
            "triton_swiglu[64x64w4s4]": 6.0,
            "triton_swiglu[32x128w4s3]": 7.0,
        },
        "down": {"triton_residual[128x64w4s3]": 2.0, "triton_residual[64x128w4s3]": 3.0},
    }
    slow = {
        proj: {k: v * 10 if k.endswith("[64x128w4s3]") else v for k, v in row.items()}
        for proj, row in times.items()
    }
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"rows": {"64": times, "256": slow}}))
    got = _load().gemm_configs(f"best:{path}", 48)
    parse = GemmConfig.parse
    assert got == ProjectionConfigs(
        parse("32x128w4s3"), parse("64x128w4s3"), parse("64x64w4s4"), parse("128x64w4s3")
    )
