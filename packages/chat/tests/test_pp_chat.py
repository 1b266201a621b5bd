"""Pipeline parallelism in the chat trainers (2 gloo ranks, pp=2 x dp=1, 1F1B, 4 microbatches): a GRPO
learner step on a tiny Llama with tied embeddings and a left-padded prompt equals the single-process
reference update, its metrics equal the unpipelined learner's, and the weight-sync payload is the full
plain-model parameter list (names, order, shapes, values); `chat-train sft --pp 2` equals the pp=1
run. Bad combinations fail with ConfigError before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers.models.llama.modeling_llama  # noqa: F401  (imported once, before the ranks fork)

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
from megalith_chat.trainer.pp import check_pipeline, full_parameters, pipeline_options
from megalith_chat.trainer.setup import make_booster, make_optimizer


def _model() -> torch.nn.Module:
    return tiny_llama(seed=0, vocab_size=VOCAB, tie=True)


def _batch() -> RolloutBatch:
    return grpo_batch(_model(), ((0, 2), (5, 1)), 0.05)


def _reference_update() -> dict[str, torch.Tensor]:
    return grpo_reference_update(_model(), _batch())


CONFIG = LearnerConfig(loss=PolicyLossConfig(), micro_batch_size=3, max_grad_norm=1.0, track_kl=False)


def _grpo_step(pp: int) -> tuple[dict[str, float], list[tuple[str, torch.Tensor]]]:
    model = _model()
    pipeline = pipeline_options(pp, "1f1b", 4) if pp > 1 else None
    booster = make_booster("zero2", "fp32", model=model, pipeline=pipeline)
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, LR))
    metrics = GRPOLearner(model, optimizer, booster, CONFIG).step(_batch())
    if pp == 1:
        return metrics, sync_parameters(model, trainable_only=False)
    return metrics, full_parameters(booster, booster.unwrap(model))


def worker(rank: int, world: int, sft_argv: list[str]) -> dict[str, Any]:
    metrics, payload = _grpo_step(pp=2)
    return {"metrics": metrics, "payload": payload, "sft": main(sft_argv)}  # sft last: it shuts down


def _sft_argv(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "sft", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--no-progress",
        "--batch-size", "4", "--steps", "2", "--lr", "1e-2", "--plugin", "zero1", *extra,
    ]  # fmt: skip


def test_pp2_grpo_step_weight_payload_and_sft_match_one_process(model_dir: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    rows = [
        ("what is two plus two", "four"),
        ("hello there", "i am fine thanks a lot"),
        ("how are you", "ok"),
    ]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": c}) + "\n" for p, c in rows * 3))
    pp_out, ref_out = tmp_path / "sft_pp2", tmp_path / "sft_pp1"
    results = run_distributed(worker, 2, _sft_argv(model_dir, data, pp_out, "--pp", "2"), timeout_s=240)

    reference = _reference_update()
    plain = sync_parameters(_model(), trainable_only=False)
    ref_metrics, _ = _grpo_step(pp=1)  # the unpipelined learner, one process
    for res in results:
        payload = res["payload"]
        # what the producers verify: same names, order, shapes (layout hash) as a plain model
        assert [n for n, _ in payload] == [n for n, _ in plain]
        idx = list(range(len(plain)))
        assert layout_hash(payload, idx) == layout_hash(plain, idx)
        for name, value in payload:
            diff = float((value - reference[name]).abs().max())
            assert diff < 1e-5, f"{name}: {diff:.2e}"
        for key in ("ratio_mean", "clip_fraction", "mismatch_kl", "grad_norm"):
            assert res["metrics"][key] == pytest.approx(ref_metrics[key], abs=1e-5), key
    embed = "model.embed_tokens.weight"  # tied: the LM head is this tensor
    assert not torch.equal(reference[embed], _model().get_input_embeddings().weight)  # the step moved it

    assert [r["sft"] for r in results] == [0, 0]
    assert main(_sft_argv(model_dir, data, ref_out)) == 0  # one process, no pipeline
    pp_rows = [json.loads(line) for line in (pp_out / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(line) for line in (ref_out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in pp_rows] == pytest.approx([r["loss"] for r in ref_rows], abs=1e-5)
    pp_model = LlamaForCausalLM.from_pretrained(pp_out / "model")
    ref_model = LlamaForCausalLM.from_pretrained(ref_out / "model")
    for (name, value), (_, ref) in zip(pp_model.state_dict().items(), ref_model.state_dict().items()):
        assert value.shape == ref.shape, name
        assert float((value - ref).abs().max()) < 1e-5, name


def test_bad_pp_combinations_fail_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="--pp 2 together with --tp 2 is not supported"):
        check_pipeline(2, 2, lora=False)
    with pytest.raises(ConfigError, match="--pp-schedule 'wavy' is not one of"):
        check_pipeline(2, 1, lora=False, schedule="wavy")
    with pytest.raises(ConfigError, match=r"LoRA \(--lora-r > 0\) with --pp 2 is not supported"):
        GRPORunConfig(pp=2, lora=LoraSpec(r=4, alpha=8.0), engine=EngineConfig(num_consumers=2))
    with pytest.raises(ConfigError, match="num_consumers = 3 is not divisible by tp x pp = 1 x 2"):
        GRPORunConfig(pp=2, engine=EngineConfig(num_consumers=3))
    with pytest.raises(
        ConfigError, match="--num-microbatches 3 must divide the 16 samples per data-parallel"
    ):
        GRPORunConfig(pp=2, num_microbatches=3, engine=EngineConfig(num_consumers=2))
    with pytest.raises(ConfigError, match="eval_every = 2 needs generation .* pp = 2"):
        GRPORunConfig(pp=2, eval_every=2, engine=EngineConfig(num_consumers=2))
    assert GRPORunConfig(pp=2, engine=EngineConfig(num_consumers=4)).microbatches == 4
    base = ["--model", str(tmp_path / "no-such-model"), "--data", str(tmp_path / "x.jsonl")]
    base += ["--out", str(tmp_path / "o"), "--pp", "2"]  # the model is never reached: checks come first
    assert main(["dpo", *base]) == 2
    assert "--pp 2 is supported for grpo and sft, not for dpo" in capsys.readouterr().err
    assert main(["sft", *base, "--lora-r", "4"]) == 2
    assert "LoRA (--lora-r > 0) with --pp 2 is not supported" in capsys.readouterr().err
    assert main(["sft", *base, "--batch-size", "6", "--num-microbatches", "4"]) == 2
    assert "--num-microbatches 4 must divide the 6 examples of --batch-size" in capsys.readouterr().err
