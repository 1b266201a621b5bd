"""`llama-pretrain train` end to end on 2 ranks: HF-loadable output, and exact resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 16  # checkpoints at steps 5, 10, 15 and 16 (the last); the second run is killed after step 7


def _tokenizer_dir(root: Path) -> Path:
    """A small byte-level BPE trained on Python's own docs (built here, nothing downloaded)."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:200], trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<pad>"
    )
    out = root / "tokenizer"
    hf.save_pretrained(str(out))
    return out


def _cmd(tmp: Path, output: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megalith_llama.cli",
        "train",
        "--model",
        "tiny-32",
        "--tokenizer",
        str(tmp / "tokenizer"),
        "--data-dir",
        str(tmp / "data"),
        "--output",
        str(output),
        "--nproc-per-node",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--max-steps",
        str(STEPS),
        "--save-every",
        "5",
        "--lr",
        "3e-3",
        "--eval-batches",
        "2",
        "--device",
        "cpu",
        *extra,
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:]


def _losses(output: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_train_two_ranks_exports_hf_and_resumes_exactly(tmp_path):
    _tokenizer_dir(tmp_path)
    straight = tmp_path / "straight"
    done = subprocess.run(_cmd(tmp_path, straight), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "held-out perplexity:" in done.stdout and "final model:" in done.stdout

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(straight / "final")
    assert model.config.num_hidden_layers == 2
    assert (straight / "loss.png").stat().st_size > 0
    reference = _losses(straight)
    assert sorted(reference) == list(range(1, STEPS + 1))

    # Same run, killed with SIGKILL once step 7 is logged (a checkpoint exists at step 5) ...
    killed = tmp_path / "killed"
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(
        _cmd(tmp_path, killed),
        env=_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (killed / "metrics.jsonl").exists() and 7 in _losses(killed):
            break
        time.sleep(0.05)
    if proc.poll() is not None:
        pytest.fail(
            f"the run ended (rc {proc.returncode}) before step 7 was logged:\n{_tail(tmp_path / 'killed.log')}"
        )
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    log.close()
    assert STEPS not in _losses(killed), "the run finished before it could be killed"

    # ... and restarted with --resume auto: the same per-step losses, bitwise.
    resumed = subprocess.run(
        _cmd(tmp_path, killed, "--resume", "auto"), env=_env(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _losses(killed) == reference


def test_unknown_plugin_lists_the_choices(tmp_path, capsys):
    from megalith_llama.cli import main

    argv = _cmd(tmp_path, tmp_path / "o", "--plugin", "zero9")[3:]  # the CLI's own arguments
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown plugin 'zero9'; choose one of ddp, " in err and "zero2" in err
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_data_that_is_not_prepared_is_refused_before_ranks_start(tmp_path, capsys, monkeypatch):
    """--data naming a raw file (not a `prepare` output): one error with the command that makes
    one, from the launching process (no ranks are started), and nothing written."""
    import megalith.distributed as distributed
    from megalith_llama.cli import main

    monkeypatch.setattr(distributed, "relaunch", lambda *a, **k: pytest.fail("ranks were started"))
    raw = tmp_path / "corpus.jsonl"
    raw.write_text('{"text": "hello"}\n')
    argv = _cmd(tmp_path, tmp_path / "o", "--data", str(raw))[3:]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"not a prepared dataset (no manifest.json): {raw}" in err
    assert f"llama-pretrain prepare --input {raw} --output DIR" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("model", ["nosuch", "missing/model_dir"])
def test_unknown_model_is_refused_before_ranks_start(tmp_path, capsys, monkeypatch, model):
    """An unknown --model name or a missing path: one error from the launching process (it used to
    reach the ranks, where rank 0 failed to load it and rank 1 timed out at a barrier)."""
    import megalith.distributed as distributed
    from megalith_llama.cli import main

    monkeypatch.setattr(distributed, "relaunch", lambda *a, **k: pytest.fail("ranks were started"))
    argv = _cmd(tmp_path, tmp_path / "o")[3:]
    argv[argv.index("--model") + 1] = model
    assert main(argv) == 2
    err = capsys.readouterr().err
    expected = (
        "unknown model 'nosuch'" if model == "nosuch" else "model path does not exist: missing/model_dir"
    )
    assert expected in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("command", "extra", "expected"),
    [
        ("sft", ["--data", "{tmp}/none.jsonl"], "SFT file not found: {tmp}/none.jsonl"),
        ("train", ["--resume", "{tmp}/step_9"], "checkpoint {tmp}/step_9 does not exist"),
        ("train", ["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
    ],
)
def test_missing_inputs_are_refused_before_ranks_start(
    tmp_path, capsys, monkeypatch, command, extra, expected
):
    """A missing SFT file or --resume checkpoint, or no ranks at all: one error from the launching
    process (the first two reached the ranks, and --nproc-per-node 0 ran one process)."""
    import megalith.distributed as distributed
    from megalith_llama import train
    from megalith_llama.cli import main

    monkeypatch.setattr(distributed, "relaunch", lambda *a, **k: pytest.fail("ranks were started"))
    monkeypatch.setattr(train, "run_training", lambda cfg: pytest.fail("training started"))
    argv = [command, *_cmd(tmp_path, tmp_path / "o")[4:], *(a.format(tmp=tmp_path) for a in extra)]
    assert main(argv) == 2
    assert expected.format(tmp=tmp_path) in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
