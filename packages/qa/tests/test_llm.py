from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megalith.common.errors import ConfigError
from megalith.common.utils import require
from megalith_qa.documents import ScoredChunk
from megalith_qa.llm import (
    COMPLETE_MARKER,
    ExtractiveGenerator,
    GenerationError,
    GenerationRequest,
    NoRepeatInAnswer,
    SmolLMGenerator,
    build_prompt,
    finish_reason_of,
    make_generator,
    repeating_tokens,
)
from megalith_qa.memory import approx_tokens

FakeSmolLM = Callable[..., tuple[SmolLMGenerator, Any]]


def _ctx(text: str, source: str = "s") -> ScoredChunk:
    return ScoredChunk(id=f"{source}:0", text=text, source=source, score=1.0)


def test_extractive_picks_best_overlapping_sentences() -> None:
    req = GenerationRequest(
        question="What does the pass statement do?",
        contexts=(
            _ctx("Loops repeat code. The pass statement does nothing at all."),
            _ctx("Classes define types. A statement ends with a newline."),
        ),
    )
    gen = ExtractiveGenerator(max_sentences=2)
    # overlap/sqrt(len): "The pass statement does nothing at all." -> {pass, statement, does} = 3/sqrt(4)=1.5
    # "A statement ends with a newline." -> {statement}=1/sqrt(3)=0.577 ; "Loops repeat code." -> 0
    assert gen.select(req) == ["The pass statement does nothing at all.", "A statement ends with a newline."]
    assert gen.generate(req) == "The pass statement does nothing at all. A statement ends with a newline."
    assert "".join(gen.stream(req)) == gen.generate(req)


def test_extractive_without_match_says_so() -> None:
    req = GenerationRequest(question="zebra?", contexts=(_ctx("Nothing relevant here."),))
    assert "could not find" in ExtractiveGenerator().generate(req)


def test_prompt_numbers_passages_and_includes_history() -> None:
    req = GenerationRequest("Q?", (_ctx("alpha", "a.txt"), _ctx("beta", "b.txt")), history="user: hi")
    msgs = build_prompt(req)
    assert msgs[0]["role"] == "system"
    assert "[1] (a.txt) alpha" in msgs[1]["content"] and "[2] (b.txt) beta" in msgs[1]["content"]
    assert "user: hi" in msgs[1]["content"] and msgs[1]["content"].endswith("Question: Q?")


def test_make_generator_rejects_unknown() -> None:
    with pytest.raises(ConfigError, match="'gpt'"):
        make_generator("gpt")


@pytest.mark.slow
def test_smollm2_generates_a_few_tokens_and_caches_conversion(tmp_path: Path) -> None:
    gen = SmolLMGenerator(cache_dir=tmp_path)
    req = GenerationRequest(
        question="What does the pass statement do?",
        contexts=(_ctx("The pass statement is a null operation; nothing happens when it executes."),),
        max_new_tokens=6,
    )
    pieces = list(gen.stream(req))
    text = "".join(pieces).strip()
    assert text, "SmolLM2 produced no text"
    assert len(gen._tokenizer(text)["input_ids"]) <= 8
    assert (tmp_path / "smollm2-135m-instruct" / "config.json").is_file()
    assert (tmp_path / "smollm2-135m-instruct" / COMPLETE_MARKER).is_file()
    assert SmolLMGenerator(cache_dir=tmp_path).cached_model_dir() == tmp_path / "smollm2-135m-instruct"
    pieces = gen.stream(GenerationRequest("Explain Python in detail.", req.contexts, max_new_tokens=3))
    assert "".join(pieces) and finish_reason_of(pieces) == "length"


def test_extractive_honours_max_new_tokens() -> None:
    ctx = (_ctx("Green tea is steeped at 80 degrees for two minutes. Black tea needs boiling water."),)
    full = ExtractiveGenerator().stream(
        GenerationRequest("How is green tea steeped?", ctx, max_new_tokens=100)
    )
    text = "".join(full)
    assert finish_reason_of(full) == "stop" and approx_tokens(text) < 100
    cut = ExtractiveGenerator().stream(GenerationRequest("How is green tea steeped?", ctx, max_new_tokens=2))
    assert "".join(cut) == "Green tea" and finish_reason_of(cut) == "length"
    exact = ExtractiveGenerator().stream(
        GenerationRequest("How is green tea steeped?", ctx, max_new_tokens=approx_tokens(text))
    )
    assert "".join(exact) == text and finish_reason_of(exact) == "stop"


@pytest.mark.parametrize("bad", [0, -5])
def test_generation_request_refuses_non_positive_max_new_tokens(bad: int) -> None:
    with pytest.raises(ConfigError, match=f"got {bad}"):
        GenerationRequest("q", (), max_new_tokens=bad)


@pytest.mark.timeout(60)
def test_smollm_generation_error_reaches_the_reader(fake_smollm: FakeSmolLM) -> None:
    """The worker's exception is re-raised in the reader at once; it used to leave the reader waiting forever."""
    gen, _ = fake_smollm("fail")
    require("transformers")  # its first import takes seconds on a slow machine; not what is timed here
    start = time.monotonic()
    with pytest.raises(ValueError, match="max_new_tokens must be greater than 0"):
        list(gen.stream(GenerationRequest("q", (_ctx("c"),))))
    assert time.monotonic() - start < 10
    gen._model.mode = "ok"  # the generation lock was released: the next request works
    assert gen.generate(GenerationRequest("q", (_ctx("c"),), max_new_tokens=2)) == "w1 w2"


@pytest.mark.timeout(60)
def test_smollm_stalled_generation_times_out(fake_smollm: FakeSmolLM) -> None:
    gen, model = fake_smollm("hang", stall_timeout_s=0.5, poll_s=0.05)
    require("transformers")
    try:
        start = time.monotonic()
        with pytest.raises(GenerationError, match="no text for 0.5s"):
            list(gen.stream(GenerationRequest("q", (_ctx("c"),))))
        assert time.monotonic() - start < 10
    finally:
        model.release.set()


@pytest.mark.timeout(60)
def test_smollm_reports_length_when_cut(fake_smollm: FakeSmolLM) -> None:
    gen, _ = fake_smollm("ok")
    pieces = gen.stream(GenerationRequest("q", (_ctx("c"),), max_new_tokens=3))
    assert "".join(pieces).split() == ["w1", "w2", "w3"]
    assert finish_reason_of(pieces) == "length"


class _FakeSaver:
    def __init__(self, files: dict[str, str], fail: bool = False) -> None:
        self.files, self.fail = files, fail
        self.config = type("Config", (), {})()

    def save_pretrained(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        for name, text in self.files.items():
            Path(path, name).write_text(text)
        if self.fail:
            raise OSError("disk full")


def test_converted_model_cache_is_published_atomically(tmp_path: Path) -> None:
    target = tmp_path / "models" / "smollm2-135m-instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # what an interrupted conversion of an older version left
    gen = SmolLMGenerator(cache_dir=tmp_path / "models")
    assert gen.cached_model_dir() is None  # half-written: converted again, never loaded

    with pytest.raises(OSError, match="disk full"):
        SmolLMGenerator._save_converted(
            _FakeSaver({"config.json": "{}"}), _FakeSaver({"tokenizer.json": "{}"}, fail=True), target
        )
    assert gen.cached_model_dir() is None
    assert sorted(p.name for p in target.parent.iterdir()) == ["smollm2-135m-instruct"]  # no temp left

    SmolLMGenerator._save_converted(
        _FakeSaver({"config.json": "{}", "model.safetensors": "w"}),
        _FakeSaver({"tokenizer.json": "t"}),
        target,
    )
    assert gen.cached_model_dir() == target
    assert {p.name for p in target.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        COMPLETE_MARKER,
    }
    assert sorted(p.name for p in target.parent.iterdir()) == ["smollm2-135m-instruct"]


def test_abandoned_conversion_folders_are_removed(tmp_path: Path) -> None:
    target = tmp_path / "smollm2-135m-instruct"
    dead = tmp_path / f".{target.name}.tmp-999999999-abcd1234"  # no such pid
    dead.mkdir()
    SmolLMGenerator._save_converted(
        _FakeSaver({"config.json": "{}"}), _FakeSaver({"tokenizer.json": "t"}), target
    )
    assert not dead.exists() and (target / COMPLETE_MARKER).is_file()


@pytest.mark.parametrize(
    ("answer", "n", "banned"),
    [
        ([5, 6, 7, 5, 6], 3, [7]),  # "5 6" was followed by 7
        ([5, 6, 7, 5, 6], 2, [7]),  # "6" was followed by 7
        ([1, 2, 1, 2, 1], 2, [2, 2]),  # "1" was followed by 2, twice
        ([5, 6, 7, 5, 6], 4, []),  # "7 5 6" not seen before
        ([5, 6], 3, []),  # shorter than n
    ],
)
def test_repeating_tokens_by_hand(answer: list[int], n: int, banned: list[int]) -> None:
    assert repeating_tokens(answer, n) == banned


def test_no_repeat_in_answer_leaves_the_prompt_quotable() -> None:
    torch = require("torch")
    # prompt "5 6 8", answer "5 6 7 5 6": only 7 (the answer's own "5 6 7") is banned, not the
    # prompt's 8; a second row without a repeat is left alone
    ids = torch.tensor([[5, 6, 8, 5, 6, 7, 5, 6], [5, 6, 8, 1, 2, 3, 4, 5]])
    scores = torch.zeros(2, 10)
    out = NoRepeatInAnswer(prompt_len=3, n=3)(ids, scores.clone())
    assert out[0, 7] == -float("inf")
    assert torch.isfinite(out[0, [i for i in range(10) if i != 7]]).all()
    assert torch.equal(out[1], scores[1])


@pytest.mark.parametrize("n", [6, 0])
def test_smollm_passes_the_no_repeat_processor(fake_smollm: FakeSmolLM, n: int) -> None:
    gen, model = fake_smollm("ok", no_repeat_ngram=n)
    req = GenerationRequest(question="q?", contexts=(_ctx("Some text."),), max_new_tokens=3)
    assert "".join(gen.stream(req))
    processors = model.kwargs.get("logits_processor")
    if n == 0:
        assert processors is None
    else:
        (proc,) = processors
        assert isinstance(proc, NoRepeatInAnswer)
        assert (proc.n, proc.prompt_len) == (n, model.kwargs["input_ids"].shape[-1])


@pytest.mark.parametrize("bad", [1, -2])
def test_no_repeat_ngram_refuses_one_and_negatives(bad: int) -> None:
    with pytest.raises(ConfigError, match=f"no_repeat_ngram must be 0 \\(off\\) or >= 2, got {bad}"):
        SmolLMGenerator(no_repeat_ngram=bad)


EXIT_SCRIPT = """
import sys, torch
from megalith_qa.documents import ScoredChunk
from megalith_qa.llm import GenerationRequest, SmolLMGenerator

class Tokenizer:
    eos_token_id = 0
    def apply_chat_template(self, messages, **kwargs):
        return {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    def decode(self, ids, **kwargs):
        return "".join(f"w{i} " for i in ids)

class Model:  # torch work per token, as SmolLM2's forward is: exiting under it aborted the process
    generation_config = None
    def generate(self, **kwargs):
        streamer, ids, a = kwargs["streamer"], kwargs["input_ids"], torch.randn(384, 384)
        streamer.put(ids)
        for i in range(kwargs["max_new_tokens"]):
            if bool(kwargs["stopping_criteria"](ids, None).all()):
                break
            for _ in range(20):
                a = torch.tanh(a @ a)
            ids = torch.cat([ids, torch.tensor([[i + 1]])], dim=1)
            streamer.put(ids[:, -1])
        streamer.end()
        return ids

gen = SmolLMGenerator()
gen._model, gen._tokenizer = Model(), Tokenizer()
ctx = (ScoredChunk("c", "Some context.", "s", 1.0),)
stream = gen.stream(GenerationRequest("Go on and on.", ctx, max_new_tokens=100000))
print("first piece:", next(stream), flush=True)
if sys.argv[1] == "close":
    stream.close()
"""


@pytest.mark.parametrize("how", ["close", "leave"])
def test_exit_while_generating_does_not_abort(tmp_path: Path, how: str) -> None:
    """A script that reads one piece and exits (closing the stream or not) while `generate` still
    runs torch work in its thread: exit code 0. It was 134 ("terminate called without an active
    exception"): the interpreter tore torch down under the running thread."""
    import subprocess
    import sys

    script = tmp_path / "exit_while_generating.py"
    script.write_text(EXIT_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), how], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "first piece: w1" in done.stdout
    assert "terminate called" not in done.stderr


def test_cache_dir_may_be_a_string(tmp_path: Path) -> None:
    gen = SmolLMGenerator(cache_dir=str(tmp_path))
    assert gen.cache_dir == tmp_path and gen.cached_model_dir() is None  # nothing converted there yet
