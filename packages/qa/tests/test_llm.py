from __future__ import annotations

from pathlib import Path

import pytest

from megalith.common.errors import ConfigError
from megalith_qa.documents import ScoredChunk
from megalith_qa.llm import (
    ExtractiveGenerator,
    GenerationRequest,
    SmolLMGenerator,
    build_prompt,
    make_generator,
)


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
