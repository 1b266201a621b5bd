"""Language detection and BM25 tokenisation (English words; Chinese character bigrams)."""

from __future__ import annotations

import re

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_CJK_RUN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
_WORD = re.compile(r"[A-Za-z0-9_]+")
_SENTENCE = re.compile(r"(?<=[.!?。！？；;])\s*|\n{2,}")

STOPWORDS = frozenset(
    """a an and are as at be but by can do does for from how i if in into is it its of on or so that the
    their then there these they this to was what when where which who why will with you your""".split()
)


def cjk_ratio(text: str) -> float:
    """Fraction of non-space characters that are CJK ideographs."""
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    return sum(1 for c in chars if _CJK.match(c)) / len(chars)


def detect_language(text: str) -> str:
    """'zh' when at least 20% of the visible characters are CJK ideographs, else 'en'."""
    return "zh" if cjk_ratio(text) >= 0.2 else "en"


def _cjk_bigrams(run: str) -> list[str]:
    """Overlapping character bigrams: '检索增强' -> ['检索', '索增', '增强']; a single char stays a unigram."""
    if len(run) == 1:
        return [run]
    return [run[i : i + 2] for i in range(len(run) - 1)]


def tokenize(text: str) -> list[str]:
    """BM25 tokens: lower-cased English words without stopwords, plus CJK character bigrams."""
    tokens: list[str] = []
    for run in _CJK_RUN.findall(text):
        tokens.extend(_cjk_bigrams(run))
    for word in _WORD.findall(_CJK_RUN.sub(" ", text)):
        low = word.lower()
        if low not in STOPWORDS:
            tokens.append(low)
    return tokens


def split_sentences(text: str) -> list[str]:
    """Split on sentence punctuation (English and Chinese) and blank lines; drops empty pieces."""
    return [s.strip() for s in _SENTENCE.split(text) if s and s.strip()]
