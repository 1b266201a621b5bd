"""Document encoding that runs inside tokenization worker processes.

Kept free of torch and megalith imports so a spawned worker starts in well under a second:
it imports only numpy and, lazily, the `tokenizers` library.

Token layout of a document `(prompt, text)`: `[bos]? + enc(prompt) + enc(text) + [eos]`, with loss
mask `0 ... 0 | 1 ... 1 | 1` (BOS and prompt are context only; text and the end token are learned).
Prompt and text are encoded separately so the mask boundary is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

TOKEN_DTYPE = np.int32


@dataclass(frozen=True)
class EncodedChunk:
    """Tokens of consecutive documents, concatenated: `ids`/`loss_mask` [tokens], `lengths` [docs]."""

    ids: np.ndarray
    loss_mask: np.ndarray
    lengths: np.ndarray


class TokenEncoder:
    """A picklable document encoder: a fast tokenizer travels as its JSON, a slow one as a pickle."""

    def __init__(self, tokenizer_json: str | None, tokenizer: Any, eos_id: int, bos_id: int | None) -> None:
        self._json = tokenizer_json
        self._tokenizer = tokenizer  # the HF tokenizer, only when there is no fast backend
        self._backend: Any = None
        self.eos_id = eos_id
        self.bos_id = bos_id

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_backend": None}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""
        if self._json is None:
            return self._tokenizer(texts, add_special_tokens=False)["input_ids"]
        if self._backend is None:
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_str(self._json)
        # encode_batch_fast skips character offsets, which packing does not need.
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def encode_documents(self, docs: list[tuple[str, str]]) -> EncodedChunk:
        """Encode `(prompt, text)` documents; returns their concatenation with per-document lengths."""
        prompts = self._encode_nonempty([p for p, _ in docs])
        texts = self._encode_nonempty([t for _, t in docs])
        head = [] if self.bos_id is None else [self.bos_id]
        encoded = [head + p + t + [self.eos_id] for p, t in zip(prompts, texts)]
        lengths = np.fromiter((len(d) for d in encoded), dtype=np.int64, count=len(encoded))
        masked = np.fromiter((len(head) + len(p) for p in prompts), dtype=np.int64, count=len(encoded))
        ids = np.fromiter((t for d in encoded for t in d), dtype=TOKEN_DTYPE, count=int(lengths.sum()))
        within = np.arange(ids.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        mask = (within >= np.repeat(masked, lengths)).astype(np.uint8)
        return EncodedChunk(ids=ids, loss_mask=mask, lengths=lengths)

    def _encode_nonempty(self, texts: list[str]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in texts]
        idx = [i for i, t in enumerate(texts) if t]
        for i, ids in zip(idx, self.encode_batch([texts[i] for i in idx])):
            out[i] = ids
        return out


_WORKER: TokenEncoder | None = None


def init_worker(encoder: TokenEncoder) -> None:
    """Pool initializer: keep this process's encoder."""
    global _WORKER
    _WORKER = encoder


def encode_in_worker(docs: list[tuple[str, str]]) -> EncodedChunk:
    """Pool task: encode one chunk with this process's encoder."""
    if _WORKER is None:
        raise RuntimeError("tokenization worker used before init_worker")
    return _WORKER.encode_documents(docs)
