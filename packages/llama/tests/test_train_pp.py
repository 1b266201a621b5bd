"""`llama-pretrain sft --pp 2` on 2 gloo ranks (pp=2 x dp=1, 1F1B, ZeRO-2, 4 microbatches, 2
accumulated micro-steps): the per-step losses and the held-out losses before and after equal one
process training the same config without a pipeline (within 1e-5, fp32), the HF export loads with
`from_pretrained` and holds the same weights, and the pp=2 checkpoint of step 2 resumes in one process
to the reference's step-3 loss. Conversations have different lengths, so the microbatches hold
different numbers of labelled tokens (the token-weighted loss must still match). Bad input: too few
layers for the stages, microbatches that do not divide the batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers.models.llama.modeling_llama  # noqa: F401  (imported once, before the ranks fork)
from transformers import LlamaForCausalLM

from megalith.common.errors import ConfigError
from megalith.testing import run_distributed
from megalith_llama.cli import main
from megalith_llama.train import TrainConfig, run_training

WORDS = "zero redundancy optimizer shards states across ranks while pipeline stages pass activations".split()


def _conversations(path: Path, n: int = 24) -> Path:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"the model learns tokens {i % 5}"},
                {"role": "assistant", "content": " ".join(WORDS[: 2 + (i * 7) % 9])},
            ]
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


COMMON = {"seq_len": 40, "batch_size": 4, "grad_accum": 2, "lr": 5e-3, "warmup_steps": 1, "save_every": 2}
COMMON |= {"eval_batches": 2, "plugin": "zero2", "device": "cpu", "seed": 3}


def _argv(tmp: Path, tok: Path, data: Path) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in COMMON.items()]
    return [
        "sft", "--model", "tiny-32", "--tokenizer", str(tok), "--data", str(data), "--output", str(tmp / "pp2"),
        "--data-dir", str(tmp / "cache"), "--max-steps", "3", "--pp", "2", "--pp-schedule", "1f1b", *flags,
    ]  # fmt: skip


def _cli(rank: int, world: int, argv: list[str]) -> int:
    return main(argv)


def _rows(run: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]


def _reference(tmp: Path, tok: Path, data: Path, **extra: object) -> Path:
    cfg = TrainConfig(
        model="tiny-32",
        tokenizer=str(tok),
        sft_data=str(data),
        data_dir=str(tmp / "cache"),
        **{**COMMON, **extra},  # type: ignore[arg-type]
    )
    return run_training(cfg).output


def test_sft_pp2_equals_one_process_exports_and_resumes(
    tmp_path: Path, bpe_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _conversations(tmp_path / "chat.jsonl")
    assert run_distributed(_cli, 2, _argv(tmp_path, bpe_tokenizer_dir, data), timeout_s=180) == [0, 0]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ref = _reference(tmp_path, bpe_tokenizer_dir, data, output=str(tmp_path / "ref"), max_steps=3)

    pp_losses, pp_val = _rows(tmp_path / "pp2")
    ref_losses, ref_val = _rows(ref)
    assert len(pp_losses) == 3 and len(pp_val) == 2
    assert pp_losses == pytest.approx(ref_losses, abs=1e-5, rel=0)
    assert pp_val == pytest.approx(ref_val, abs=1e-5, rel=0)
    assert ref_losses[2] < ref_losses[0]  # it trains (lr 5e-3)

    exported = LlamaForCausalLM.from_pretrained(tmp_path / "pp2" / "final")
    reference = LlamaForCausalLM.from_pretrained(ref / "final")
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], value, atol=1e-5, rtol=0, msg=name)

    # the pp=2 checkpoint of step 2 resumes in one process (pp=1) to the reference's step 3
    ckpt = tmp_path / "pp2" / "checkpoints" / "step_00000002"
    resumed = _reference(
        tmp_path, bpe_tokenizer_dir, data, output=str(tmp_path / "resumed"), max_steps=3, resume=str(ckpt)
    )
    losses, _ = _rows(resumed)
    assert losses[-1] == pytest.approx(ref_losses[2], abs=1e-5, rel=0)


def test_pp_bad_input_names_the_values(
    tmp_path: Path, bpe_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="--num-microbatches 2 must divide --batch-size 3"):
        TrainConfig(pp=2, batch_size=3, num_microbatches=2)
    with pytest.raises(ConfigError, match="--num-microbatches 1 is fewer than the --pp 2"):
        TrainConfig(pp=2, batch_size=1)
    with pytest.raises(ConfigError, match="--pp must be >= 1, got 0"):
        TrainConfig(pp=0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = _conversations(tmp_path / "chat.jsonl", n=4)
    for pp, schedule, stages in ((3, "1f1b", 3), (2, "interleaved", 4)):
        with pytest.raises(ConfigError, match=f"needs {stages} pipeline stages .* the model has 2 layers"):
            _reference(
                tmp_path, bpe_tokenizer_dir, data, output=str(tmp_path / "bad"), pp=pp, pp_schedule=schedule
            )
