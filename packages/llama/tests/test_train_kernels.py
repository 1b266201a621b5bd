"""`--kernels`: the same training run with and without megalith's fused kernels; bad values refused."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from megalith.common.errors import ConfigError
from megalith_llama.cli import build_parser
from megalith_llama.commands.train import config_from_args
from megalith_llama.train import TrainConfig, kernel_names, run_training


def _config(tmp_path: Path, tokenizer: Path, **overrides: object) -> TrainConfig:
    """4 SFT steps of the tiny model on one repeated conversation, fp32 on CPU."""
    data = tmp_path / "chat.jsonl"
    row = {
        "messages": [
            {"role": "user", "content": "shard the states"},
            {"role": "assistant", "content": "zero"},
        ]
    }
    data.write_text((json.dumps(row) + "\n") * 8)
    base = TrainConfig(
        model="tiny-32", tokenizer=str(tokenizer), sft_data=str(data), seq_len=32, batch_size=4,
        max_steps=4, lr=1e-2, warmup_steps=1, schedule="constant", save_every=4, eval_batches=1,
        data_dir=str(tmp_path / "data"), device="cpu", output=str(tmp_path / "run"),
    )  # fmt: skip
    return replace(base, **overrides)  # type: ignore[arg-type]


def _losses(cfg: TrainConfig) -> list[float]:
    rows = [json.loads(line) for line in run_training(cfg).metrics.read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_kernels_all_trains_like_plain_hf(
    tmp_path: Path, bpe_tokenizer_dir: Path, monkeypatch, caplog
) -> None:
    """fp32 on CPU (torch fallbacks of every kernel): the per-step losses of 4 SFT steps (prompt
    tokens ignored by the fused cross-entropy) equal the plain model's within 1e-5, so the patched
    forward, fused q/k/v and fused loss train the same weights."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MEGALITH_KERNELS", "torch")
    plain = _losses(_config(tmp_path, bpe_tokenizer_dir, output=str(tmp_path / "plain")))
    with caplog.at_level(logging.INFO, logger="megalith.policies.kernels"):
        fused = _losses(_config(tmp_path, bpe_tokenizer_dir, kernels="all", output=str(tmp_path / "fused")))
    assert "kernels applied to LlamaForCausalLM" in caplog.text
    assert len(plain) == len(fused) == 4
    assert plain[-1] < plain[0]
    assert fused == pytest.approx(plain, abs=1e-5)


def test_kernel_flags_parse_and_bad_values_are_named() -> None:
    args = build_parser().parse_args(["train", "--kernels", "rope,qkv", "--compile"])
    cfg = config_from_args(args)
    assert isinstance(cfg, TrainConfig) and cfg.compile and kernel_names(cfg.kernels) == {"rope", "qkv"}
    assert kernel_names("none") == frozenset() and "cross_entropy" in kernel_names("all")
    with pytest.raises(ConfigError, match="layer_norm"):
        TrainConfig(kernels="rope,layer_norm")
    with pytest.raises(ConfigError, match="--kernels all works with --tp 1 --pp 1.*--tp 2"):
        TrainConfig(kernels="all", tp=2)
    with pytest.raises(ConfigError, match="--lora"):
        TrainConfig(kernels="swiglu", lora=True)


@pytest.mark.slow  # ~1 min: inductor compiles forward and backward on CPU
def test_compile_with_kernels_trains_like_eager(tmp_path: Path, bpe_tokenizer_dir: Path, monkeypatch) -> None:
    """`--compile --kernels all` (inductor on CPU, fp32): the same 4 losses as the eager run within 1e-4."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MEGALITH_KERNELS", "torch")
    eager = _losses(_config(tmp_path, bpe_tokenizer_dir, kernels="all", output=str(tmp_path / "eager")))
    compiled = _losses(
        _config(tmp_path, bpe_tokenizer_dir, kernels="all", compile=True, output=str(tmp_path / "compiled"))
    )
    assert compiled == pytest.approx(eager, abs=1e-4)
