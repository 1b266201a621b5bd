"""`llama-pretrain train --tp 2` end to end on 2 gloo ranks (tp=2 x dp=1, Megatron-SP): the CLI
trains a tiny Llama for 2 steps, the HF export and the sharded checkpoint (through `export_hf`)
load with `from_pretrained` at full shapes, and the tp=2 checkpoint resumes under ZeRO-2 at dp=2."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers.models.llama.modeling_llama  # noqa: F401  (imported once, before the ranks fork)
from transformers import LlamaForCausalLM

from megalith.checkpoint import export_hf
from megalith.testing import run_distributed
from megalith_llama.cli import main

HIDDEN = 32  # the "tiny-32" model: 2 layers, 4 heads, 2 KV heads


def _train(rank: int, world: int, argv: list[str]) -> int:
    return main(argv)


def _argv(tmp: Path, tok: Path, *extra: str) -> list[str]:
    return [
        "train", "--model", "tiny-32", "--tokenizer", str(tok), "--data", str(tmp / "data"),
        "--output", str(tmp / "run"), "--data-dir", str(tmp / "cache"), "--seq-len", "32",
        "--batch-size", "2", "--save-every", "2", "--eval-batches", "1", "--lr", "1e-3",
        "--device", "cpu", *extra,
    ]  # fmt: skip


def test_train_tp2_exports_full_shapes_and_resumes_at_tp1(
    capsys, bpe_tokenizer_dir: Path, tmp_path: Path, make_sentences
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": s}) + "\n" for s in make_sentences(80)))
    prepare = ["prepare", "--input", str(src), "--tokenizer", str(bpe_tokenizer_dir)]
    assert main([*prepare, "--output", str(tmp_path / "data"), "--seq-len", "32"]) == 0
    capsys.readouterr()

    # --max-tokens counts dp ranks only: 128 tokens / (2 sequences x 32 tokens x dp 1) = 2 steps
    tp2 = _argv(tmp_path, bpe_tokenizer_dir, "--tp", "2", "--sp-mode", "split_gather", "--max-tokens", "128")
    assert run_distributed(_train, 2, tp2, timeout_s=180) == [0, 0]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # tokens counted once per data-parallel rank: 2 sequences x 32 tokens at dp=1
    assert [r["tokens"] for r in rows if "loss" in r] == [64, 64]

    final = LlamaForCausalLM.from_pretrained(run / "final")
    vocab = 400  # the BPE tokenizer's size (conftest)
    assert final.model.embed_tokens.weight.shape == (vocab, HIDDEN)  # full, not 200 rows per tp rank
    assert final.model.layers[0].self_attn.o_proj.weight.shape == (HIDDEN, HIDDEN)
    sharded = run / "checkpoints" / "step_00000002" / "model_sharded"
    meta = json.loads((sharded / "meta.json").read_text())
    assert meta["shapes"]["lm_head.weight"] == [vocab, HIDDEN]
    from_ckpt = LlamaForCausalLM.from_pretrained(export_hf(sharded, tmp_path / "hf_from_checkpoint"))
    for name, value in final.state_dict().items():
        assert torch.equal(from_ckpt.state_dict()[name], value), name

    # resume the tp=2 checkpoint with ZeRO-2 over 2 data-parallel ranks (tp=1) for one more step
    resume = _argv(tmp_path, bpe_tokenizer_dir, "--resume", "auto", "--max-steps", "3", "--plugin", "zero2")
    assert run_distributed(_train, 2, resume, timeout_s=180) == [0, 0]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert LlamaForCausalLM.from_pretrained(run / "final").lm_head.weight.shape == (vocab, HIDDEN)
