"""JSONL dataset formats and file:line errors for malformed records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megalith.common.errors import DataError
from megalith_chat.data import load_preference_dataset, load_prompt_dataset, load_sft_dataset


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_sft_formats(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "sft.jsonl",
        [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            "",  # blank lines are skipped
            {"prompt": "what is two plus two", "response": "four", "system": "be brief"},
        ],
    )
    a, b = load_sft_dataset(path)
    assert a.messages[-1] == {"role": "assistant", "content": "hello"}
    assert a.source == f"{path}:1"
    assert [m["role"] for m in b.messages] == ["system", "user", "assistant"]
    assert b.source == f"{path}:3"


def test_preference_formats(tmp_path: Path) -> None:
    shared = [{"role": "user", "content": "what is two plus two"}]
    path = _write(
        tmp_path / "pref.jsonl",
        [
            {"prompt": "what is two plus two", "chosen": "four", "rejected": "five"},
            {
                "chosen": [*shared, {"role": "assistant", "content": "four"}],
                "rejected": [*shared, {"role": "assistant", "content": "five"}],
            },
        ],
    )
    a, b = load_preference_dataset(path)
    assert (a.prompt, a.chosen, a.rejected) == (tuple(shared), "four", "five")
    assert (b.prompt, b.chosen, b.rejected) == (tuple(shared), "four", "five")


def test_prompt_format_keeps_extras_for_rewards(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "prompts.jsonl",
        [
            {"prompt": "What is 2 + 3?", "answer": 5},
            {"prompt": [{"role": "user", "content": "write square"}], "tests": "assert square(2) == 4"},
        ],
    )
    a, b = load_prompt_dataset(path)
    assert a.answer == "5"
    assert a.reward_sample() == {
        "prompt": "What is 2 + 3?",
        "answer": "5",
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
    }
    assert a.to_record() == {"prompt": "What is 2 + 3?", "answer": "5"}
    assert b.answer is None and b.reward_sample()["tests"] == "assert square(2) == 4"


@pytest.mark.parametrize(
    ("loader", "bad_line", "match"),
    [
        (load_sft_dataset, '{"messages": [', "invalid JSON"),
        (load_sft_dataset, "[1, 2]", "expected a JSON object, got list"),
        (load_sft_dataset, {"text": "hello"}, "needs 'messages' or 'prompt'\\+'response'"),
        (load_sft_dataset, {"messages": [{"role": "user", "content": "hi"}]}, "no assistant"),
        (load_sft_dataset, {"messages": [{"role": "bot", "content": "hi"}]}, "'bot'"),
        (load_preference_dataset, {"prompt": "p", "chosen": "a"}, "both be strings"),
        (load_preference_dataset, {"prompt": "", "chosen": "a", "rejected": "b"}, "'prompt' must be"),
        (
            load_preference_dataset,
            {
                "chosen": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
            },
            "same prompt",
        ),
        (load_prompt_dataset, {"prompt": "p", "answer": True}, "'answer' must be"),
        (load_prompt_dataset, {"prompt": "p", "system": 1}, "'system' must be a string"),
        (load_prompt_dataset, {"question": "p"}, "'prompt' must be"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, loader: Any, bad_line: Any, match: str) -> None:
    good = {"prompt": "what is two plus two", "response": "four", "chosen": "four", "rejected": "five"}
    path = _write(tmp_path / "data.jsonl", [good, "", bad_line])
    with pytest.raises(DataError, match=match) as info:
        loader(path)
    assert f"{path}:3:" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        load_prompt_dataset(tmp_path / "absent.jsonl")


@pytest.mark.parametrize("loader", [load_sft_dataset, load_preference_dataset, load_prompt_dataset])
def test_non_utf8_line_names_file_and_line(tmp_path: Path, loader: Any) -> None:
    """A Latin-1 byte (0xe9, 'é') on line 3 is a DataError at file:3, not a UnicodeDecodeError."""
    good = json.dumps({"prompt": "what is two plus two", "response": "four", "chosen": "a", "rejected": "b"})
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(f"{good}\n\n".encode() + '{"prompt": "caf\xe9", "response": "x"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="not valid UTF-8") as info:
        loader(path)
    assert f"{path}:3:" in str(info.value) and "0xe9" in str(info.value)
