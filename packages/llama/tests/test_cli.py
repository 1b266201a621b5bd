"""The command line, end to end on tiny models and tokenizers built in the tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalith_llama.cli import COMMAND_MODULES, build_parser, main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    names = ["train", "sft", "prepare", "expand-vocab", "eval", "chat", "convert"]
    assert len(COMMAND_MODULES) == len(names)
    for name in names:
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([name, "--help"])
        assert exc.value.code == 0
        assert "--data-dir" in capsys.readouterr().out


def test_help_does_not_import_torch() -> None:
    """`--help` of every command reads only argparse and dataclass defaults (the cli module's
    promise): neither torch nor transformers is imported to build the parser."""
    code = (
        "import sys; from megalith_llama.cli import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_train_flag_defaults_are_the_config_defaults() -> None:
    from megalith_llama.train_config import TrainConfig

    args = build_parser().parse_args(["train"])
    config = TrainConfig()
    for name in ("plugin", "precision", "lr", "batch_size", "seq_len", "max_steps", "kernels", "tp"):
        assert getattr(args, name) == getattr(config, name), name


def test_prepare_then_eval(
    capsys, bpe_tokenizer_dir: Path, bpe_tokenizer, tmp_path: Path, make_sentences
) -> None:
    from megalith_llama.model import load_model

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": s}) + "\n" for s in make_sentences(60)))
    code, out, _ = _run(
        capsys, "prepare", "--input", str(src), "--tokenizer", str(bpe_tokenizer_dir), "--output",
        str(tmp_path / "data"), "--seq-len", "32", "--document-masking",
    )  # fmt: skip
    assert code == 0 and json.loads(out)["num_sequences"] > 0
    model_dir = tmp_path / "model"
    tiny = load_model("tiny-32", tokenizer=bpe_tokenizer)
    tiny.model.save_pretrained(model_dir)
    bpe_tokenizer.save_pretrained(model_dir)
    code, out, _ = _run(
        capsys, "eval", "--model", str(model_dir), "--data", str(tmp_path / "data"), "--device", "cpu"
    )
    result = json.loads(out)
    assert code == 0 and result["tokens"] > 0
    assert abs(result["loss"] - torch.log(torch.tensor(400.0)).item()) < 1.0  # untrained: close to log(vocab)


def test_prepare_reports_bad_line(capsys, bpe_tokenizer_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\nnot json\n')
    args = [
        "prepare",
        "--input",
        str(src),
        "--tokenizer",
        str(bpe_tokenizer_dir),
        "--output",
        str(tmp_path / "o"),
    ]
    code, _, err = _run(capsys, *args, "--seq-len", "8")
    assert code == 2 and f"{src}:2:" in err
    code, out, _ = _run(capsys, *args, "--seq-len", "8", "--skip-bad-lines")
    assert code == 0 and "skipped 1 malformed line(s)" in out


def test_expand_vocab_bpe_directory(capsys, bpe_tokenizer, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megalith_llama.model import load_model

    src = tmp_path / "src"
    load_model("tiny-32", tokenizer=bpe_tokenizer).model.save_pretrained(src)
    bpe_tokenizer.save_pretrained(src)
    (tmp_path / "new.txt").write_text("\u2581zeppelin\n\u2581model\n", encoding="utf-8")
    (tmp_path / "text.txt").write_text("a zeppelin and a model " * 20)
    code, out, _ = _run(
        capsys, "expand-vocab", "--tokenizer", str(src), "--new-tokens", str(tmp_path / "new.txt"),
        "--output", str(tmp_path / "out"), "--text", str(tmp_path / "text.txt"),
    )  # fmt: skip
    report = json.loads(out)
    assert code == 0 and report["model_resized"] and report["existing"] == ["\u2581model"]
    assert report["chars_per_token_after"] > report["chars_per_token_before"]
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert len(tok) == report["vocab_after"] == model.get_input_embeddings().num_embeddings
    new_id = tok.convert_tokens_to_ids("\u0120zeppelin")
    assert new_id >= 400 and tok.encode(" zeppelin", add_special_tokens=False) == [new_id]
    assert tok.decode(tok.encode("a zeppelin flies")) == "a zeppelin flies"


def test_expand_vocab_sentencepiece_file(capsys, make_sentences, tmp_path: Path) -> None:
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(make_sentences(300)), model_writer=buf, vocab_size=60, hard_vocab_limit=False,
        minloglevel=2,
    )  # fmt: skip
    (tmp_path / "sp.model").write_bytes(buf.getvalue())
    (tmp_path / "new.txt").write_text("\u2581zeppelin\n", encoding="utf-8")
    code, out, _ = _run(
        capsys, "expand-vocab", "--tokenizer", str(tmp_path / "sp.model"), "--new-tokens", str(tmp_path / "new.txt"),
        "--output", str(tmp_path / "out"), "--text", str(tmp_path / "new.txt"), "--tokenizer-only",
    )  # fmt: skip
    assert code == 0 and json.loads(out)["kind"] == "sentencepiece"
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "sp.model"))
    assert sp.encode("zeppelin", out_type=str) == ["\u2581zeppelin"]


def test_missing_model_is_a_clean_error(capsys, tmp_path: Path) -> None:
    code, _, err = _run(
        capsys, "eval", "--model", str(tmp_path / "absent"), "--tokenizer", str(tmp_path / "absent")
    )
    assert code == 2 and f"does not exist: {tmp_path / 'absent'}" in err


def test_existing_output_is_exit_2_before_any_work(capsys, bpe_tokenizer_dir: Path, tmp_path: Path) -> None:
    """prepare / expand-vocab / convert into an existing directory: `error: ...` naming it, exit 2,
    before the work (convert is given a GGUF that does not exist: the output check comes first)."""
    src = tmp_path / "in.txt"
    src.write_text("the model learns tokens\n\nfrom text and the data\n")
    out = tmp_path / "out"
    prepare = ["prepare", "--input", str(src), "--tokenizer", str(bpe_tokenizer_dir), "--seq-len", "4"]
    assert _run(capsys, *prepare, "--output", str(out))[0] == 0
    before = sorted(p.name for p in out.iterdir())
    code, _, err = _run(capsys, *prepare, "--output", str(out))
    assert code == 2 and f"error: output {out} already exists (pass --overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == before
    assert _run(capsys, *prepare, "--output", str(out), "--overwrite")[0] == 0
    (tmp_path / "new.txt").write_text("\u2581zeppelin\n", encoding="utf-8")
    code, _, err = _run(
        capsys, "expand-vocab", "--tokenizer", str(bpe_tokenizer_dir), "--new-tokens", str(tmp_path / "new.txt"),
        "--output", str(out), "--tokenizer-only",
    )  # fmt: skip
    assert code == 2 and f"output {out} already exists" in err
    code, _, err = _run(capsys, "convert", "--gguf", str(tmp_path / "absent.gguf"), "--output", str(out))
    assert code == 2 and f"output {out} already exists" in err


def test_bad_values_name_the_value(capsys, bpe_tokenizer_dir: Path, tmp_path: Path) -> None:
    code, _, err = _run(
        capsys, "eval", "--model", "tiny-32", "--tokenizer", str(bpe_tokenizer_dir), "--batch-size", "0"
    )
    assert code == 2 and "--batch-size must be > 0, got 0" in err
    (tmp_path / "new.txt").write_text("\u2581zeppelin\n", encoding="utf-8")
    missing = tmp_path / "missing.txt"
    code, _, err = _run(
        capsys, "expand-vocab", "--tokenizer", str(bpe_tokenizer_dir), "--new-tokens", str(tmp_path / "new.txt"),
        "--output", str(tmp_path / "ev"), "--tokenizer-only", "--text", str(missing),
    )  # fmt: skip
    assert code == 2 and f"--text {missing}: no such file" in err
    assert not (tmp_path / "ev").exists()
    src = tmp_path / "in.txt"
    src.write_text("the model learns tokens\n")
    prepare = ["prepare", "--tokenizer", str(bpe_tokenizer_dir), "--output", str(tmp_path / "p")]
    code, _, err = _run(capsys, *prepare, "--input", f"{src}:1", "--num-tokens", "0")
    assert code == 2 and "--num-tokens must be > 0, got 0" in err
    for weight in ("nan", "inf"):
        code, _, err = _run(capsys, *prepare, "--input", f"{src}:{weight}")
        assert code == 2 and f"input weight must be a finite number >= 0, got '{weight}'" in err
    train = ["train", "--model", "tiny-32", "--nproc-per-node", "1", "--output", str(tmp_path / "run")]
    code, _, err = _run(capsys, *train, "--clip", "-1")
    assert code == 2 and "--clip must be >= 0 (0 turns clipping off), got -1.0" in err
    code, _, err = _run(capsys, *train, "--keep-checkpoints", "0")
    assert code == 2 and "--keep-checkpoints must be > 0, got 0" in err
    for flag, value, message in (  # these reached the ranks: torch's ValueError, or the schedule's check
        ("--weight-decay", "-1", "--weight-decay must be >= 0, got -1.0"),
        ("--warmup-steps", "-2", "--warmup-steps must be >= 0, got -2"),
        ("--min-lr-ratio", "nan", "--min-lr-ratio must be in [0, 1], got nan"),
        ("--decay-fraction", "0", "--decay-fraction must be in (0, 1], got 0.0"),
    ):
        code, _, err = _run(capsys, *train, flag, value)
        assert code == 2 and message in err, err
    code, _, err = _run(capsys, "sft", *train[1:], "--data", str(src), "--neftune-alpha", "-1")
    assert code == 2 and "--neftune-alpha must be >= 0, got -1.0" in err
    (tmp_path / "run" / "checkpoints" / "step_00000010").mkdir(parents=True)
    code, _, err = _run(capsys, *train)  # refused before any rank or model is started
    assert code == 2 and "already holds checkpoints of an earlier run (step_00000010)" in err
