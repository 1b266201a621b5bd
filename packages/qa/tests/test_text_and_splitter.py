from __future__ import annotations

import pytest

from megalith.common.errors import ConfigError
from megalith_qa.config import ChunkingConfig
from megalith_qa.ingest.splitter import TextSplitter
from megalith_qa.text import cjk_ratio, detect_language, split_sentences, tokenize


def test_tokenize_english_drops_stopwords_and_lowercases() -> None:
    assert tokenize("The Quick brown fox, and the dog!") == ["quick", "brown", "fox", "dog"]


def test_tokenize_chinese_uses_character_bigrams() -> None:
    assert tokenize("检索增强") == ["检索", "索增", "增强"]
    assert tokenize("猫 BM25 排序") == ["猫", "排序", "bm25"]


def test_detect_language() -> None:
    assert detect_language("hello world") == "en"
    assert detect_language("这是一个中文句子。") == "zh"
    assert detect_language("") == "en"
    assert cjk_ratio("ab中文") == pytest.approx(0.5)


def test_split_sentences_english_and_chinese() -> None:
    assert split_sentences("One. Two? Three!") == ["One.", "Two?", "Three!"]
    assert split_sentences("第一句。第二句！第三句") == ["第一句。", "第二句！", "第三句"]


def test_english_chunks_respect_size_and_overlap() -> None:
    text = " ".join(f"word{i:03d}" for i in range(100))  # 100 words of 7 chars + spaces = 799 chars
    chunks = TextSplitter(ChunkingConfig(chunk_size=80, chunk_overlap=16)).split_text(text)
    assert all(len(c) <= 80 for c in chunks)
    assert len(chunks) >= 10
    for a, b in zip(chunks, chunks[1:]):
        assert a.split()[-1] in b.split()[:3]  # overlap carries the last word(s) over
    words = {w for c in chunks for w in c.split()}
    assert words == {f"word{i:03d}" for i in range(100)}


def test_chinese_separators_actually_split() -> None:
    # 12 sentences of 10 CJK characters each with no spaces or newlines: only 。 can split them.
    sentences = [f"第{i:02d}句话有十个字。" for i in range(12)]
    text = "".join(sentences)
    chunks = TextSplitter(ChunkingConfig(chunk_size=35, chunk_overlap=0)).split_text(text)
    assert len(chunks) == 4  # 3 sentences of 10 characters fit in 35 characters, 4 do not
    assert all(c.endswith("。") for c in chunks)
    assert chunks[0] == "".join(sentences[:3])


def test_chinese_comma_is_used_when_no_full_stop() -> None:
    text = "，".join(["甲乙丙丁戊己庚辛"] * 8)
    chunks = TextSplitter(ChunkingConfig(chunk_size=20, chunk_overlap=0)).split_text(text)
    assert len(chunks) > 1
    assert all(len(c) <= 20 for c in chunks)
    assert all("甲乙丙丁戊己庚辛" in c for c in chunks)  # never cut inside a clause


def test_long_token_falls_back_to_characters() -> None:
    chunks = TextSplitter(ChunkingConfig(chunk_size=16, chunk_overlap=0)).split_text("x" * 40)
    assert chunks == ["x" * 16, "x" * 16, "x" * 8]


def test_empty_text_gives_no_chunks() -> None:
    assert TextSplitter().split_text("  \n ") == []


@pytest.mark.parametrize(("size", "overlap"), [(8, 0), (100, 100), (100, -1)])
def test_bad_chunking_config_names_value(size: int, overlap: int) -> None:
    with pytest.raises(ConfigError, match=str(size if size < 16 else overlap)):
        ChunkingConfig(chunk_size=size, chunk_overlap=overlap)
