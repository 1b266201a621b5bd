"""Recursive character splitting, English- and Chinese-aware.

The text is cut at the coarsest separator that occurs in it (paragraph, line, sentence, clause, word,
character); pieces still longer than `chunk_size` are cut again with the next separator. Pieces are then
merged greedily into chunks of at most `chunk_size` characters, each chunk starting with up to
`chunk_overlap` characters of the previous one. Separators stay attached to the end of their piece, so
joining the pieces of one chunk gives back a contiguous span of the source text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megalith_qa.config import ChunkingConfig
from megalith_qa.text import detect_language

ENGLISH_SEPARATORS: tuple[str, ...] = ("\n\n", "\n", ". ", "? ", "! ", "; ", ", ", " ", "")
CHINESE_SEPARATORS: tuple[str, ...] = ("\n\n", "\n", "。", "！", "？", "；", "，", "、", " ", "")


def _split_keep(text: str, sep: str) -> list[str]:
    """Split `text` after every `sep` (the separator stays with the left piece); '' splits characters."""
    if sep == "":
        return list(text)
    parts = text.split(sep)
    pieces = [p + sep for p in parts[:-1]] + [parts[-1]]
    return [p for p in pieces if p]


@dataclass(frozen=True)
class TextSplitter:
    """Split text into overlapping chunks; the separator list is chosen per text by its language."""

    config: ChunkingConfig = ChunkingConfig()

    def separators_for(self, text: str) -> tuple[str, ...]:
        return CHINESE_SEPARATORS if detect_language(text) == "zh" else ENGLISH_SEPARATORS

    def split_text(self, text: str) -> list[str]:
        """Chunks of at most `chunk_size` characters, whitespace-trimmed, empty ones dropped."""
        if not text.strip():
            return []
        pieces = self._atomize(text, self.separators_for(text))
        return [c.strip() for c in self._merge(pieces) if c.strip()]

    def _atomize(self, text: str, separators: Sequence[str]) -> list[str]:
        """Pieces no longer than chunk_size, cut at the coarsest separator that occurs in `text`."""
        if len(text) <= self.config.chunk_size:
            return [text]
        for i, sep in enumerate(separators):
            if sep == "" or sep in text:
                out: list[str] = []
                for piece in _split_keep(text, sep):
                    out.extend(
                        self._atomize(piece, separators[i + 1 :])
                        if len(piece) > self.config.chunk_size
                        else [piece]
                    )
                return out
        return [text]

    def _merge(self, pieces: list[str]) -> list[str]:
        """Greedy merge into chunks <= chunk_size, carrying <= chunk_overlap trailing characters over."""
        size, overlap = self.config.chunk_size, self.config.chunk_overlap
        chunks: list[str] = []
        window: list[str] = []
        length = 0
        for piece in pieces:
            if window and length + len(piece) > size:
                chunks.append("".join(window))
                while window and (length > overlap or length + len(piece) > size):
                    length -= len(window.pop(0))
            window.append(piece)
            length += len(piece)
        if window:
            chunks.append("".join(window))
        return chunks
