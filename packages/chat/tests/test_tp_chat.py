"""Tensor parallelism in the chat trainers (2 gloo ranks, tp=2 x dp=1): a GRPO learner step with
and without Megatron-SP equals the single-process reference update; the weight-sync payload is the
full HF-shaped parameters; `chat-train sft --tp 2 --sp-mode split_gather` equals the tp=1 run.
Bad combinations fail with ConfigError before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megalith.common.errors import ConfigError
from megalith.testing import run_distributed
from megalith.testing.models import tiny_llama
from megalith_chat.algorithms import PolicyLossConfig
from megalith_chat.cli import main
from megalith_chat.engine.config import EngineConfig, GRPORunConfig
from megalith_chat.messages import RolloutBatch
from megalith_chat.modeling import LoraSpec
from megalith_chat.rollout.weight_sync import layout_hash, sync_parameters
from megalith_chat.testing import LR, VOCAB, grpo_batch, grpo_reference_update
from megalith_chat.trainer.grpo import GRPOLearner, LearnerConfig
from megalith_chat.trainer.parallel import check_parallel, full_parameters, pad_sequence_to_multiple
from megalith_chat.trainer.setup import make_booster, make_optimizer


def _batch() -> RolloutBatch:
    return grpo_batch(tiny_llama(seed=0, vocab_size=VOCAB))


def _reference_update() -> dict[str, torch.Tensor]:
    return grpo_reference_update(tiny_llama(seed=0, vocab_size=VOCAB), _batch())


def _grpo_step(sp_mode: str) -> list[tuple[str, torch.Tensor]]:
    model = tiny_llama(seed=0, vocab_size=VOCAB)
    booster = make_booster("zero2", "fp32", tp=2, sp_mode=sp_mode, model=model)
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, LR))
    if sp_mode == "split_gather":
        pad_sequence_to_multiple(model, 2)
    config = LearnerConfig(loss=PolicyLossConfig(), micro_batch_size=3, max_grad_norm=1.0, track_kl=False)
    GRPOLearner(model, optimizer, booster, config).step(_batch())
    return full_parameters(booster, booster.unwrap(model), trainable_only=False)


def worker(rank: int, world: int, sft_argv: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {mode: _grpo_step(mode) for mode in ("none", "split_gather")}
    out["sft"] = main(sft_argv)  # last: it shuts the process group down
    return out


def _sft_argv(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "sft", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--no-progress",
        "--batch-size", "2", "--steps", "2", "--lr", "1e-3", "--plugin", "zero1", *extra,
    ]  # fmt: skip


def test_tp2_grpo_step_weight_payload_and_sft_match_one_process(model_dir: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    rows = [("what is two plus two", "four"), ("hello there", "i am fine thanks"), ("how are you", "fine")]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": c}) + "\n" for p, c in rows * 2))
    tp_out, ref_out = tmp_path / "sft_tp2", tmp_path / "sft_tp1"
    argv = _sft_argv(model_dir, data, tp_out, "--tp", "2", "--sp-mode", "split_gather")
    results = run_distributed(worker, 2, argv, timeout_s=240)

    reference = _reference_update()
    plain = sync_parameters(tiny_llama(seed=0, vocab_size=VOCAB), trainable_only=False)
    for mode in ("none", "split_gather"):
        for res in results:
            payload = res[mode]
            # what the producers verify: same names, order, shapes (layout hash) as a plain model
            assert [n for n, _ in payload] == [n for n, _ in plain]
            idx = list(range(len(plain)))
            assert layout_hash(payload, idx) == layout_hash(plain, idx), mode
            for name, value in payload:
                diff = float((value - reference[name]).abs().max())
                assert diff < 1e-5, f"{mode} {name}: {diff:.2e}"
    assert not torch.equal(reference["lm_head.weight"], tiny_llama(seed=0, vocab_size=VOCAB).lm_head.weight)

    assert [r["sft"] for r in results] == [0, 0]
    assert main(_sft_argv(model_dir, data, ref_out)) == 0  # one process, no tp
    tp_model = LlamaForCausalLM.from_pretrained(tp_out / "model")
    ref_model = LlamaForCausalLM.from_pretrained(ref_out / "model")
    for (name, value), (_, ref) in zip(tp_model.state_dict().items(), ref_model.state_dict().items()):
        assert value.shape == ref.shape, name  # full HF shapes from the tp run
        assert float((value - ref).abs().max()) < 1e-5, name


def test_bad_tp_combinations_fail_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="'all_to_all' is not supported by chat-train"):
        check_parallel(2, "all_to_all", lora=False)
    with pytest.raises(ConfigError, match="--sp-mode split_gather .* needs --tp > 1, got --tp 1"):
        check_parallel(1, "split_gather", lora=False)
    with pytest.raises(ConfigError, match=r"LoRA \(--lora-r > 0\) with --tp 2 is not supported"):
        GRPORunConfig(tp=2, lora=LoraSpec(r=4, alpha=8.0))
    with pytest.raises(ConfigError, match="num_consumers = 3 is not divisible by tp = 2"):
        GRPORunConfig(tp=2, engine=EngineConfig(num_consumers=3))
    with pytest.raises(ConfigError, match="16 samples must divide evenly over 3 data-parallel"):
        GRPORunConfig(tp=2, engine=EngineConfig(num_consumers=6))
    assert GRPORunConfig(tp=2, engine=EngineConfig(num_consumers=4)).tp == 2
    missing = str(tmp_path / "no-such-model")  # never reached: the check comes first
    base = [
        "--model",
        missing,
        "--data",
        str(tmp_path / "x.jsonl"),
        "--out",
        str(tmp_path / "o"),
        "--tp",
        "2",
    ]
    assert main(["sft", *base, "--lora-r", "4"]) == 2
    assert "LoRA (--lora-r > 0) with --tp 2 is not supported" in capsys.readouterr().err
    assert main(["rm", *base]) == 2
    assert "--tp 2 is supported for grpo, sft and dpo, not for rm" in capsys.readouterr().err
