"""Tokenization of records into a flat on-disk token store, optionally in parallel worker processes.

See `workers` for the token layout of a document. With `num_proc > 1`, chunks of documents go to a
`spawn` process pool (one per `prepare` call) whose workers rebuild the tokenizer once; results come
back in submission order with at most `2 * num_proc` chunks in flight, so the output is identical
to the single-process output and memory stays bounded.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megalith.common.errors import ConfigError
from megalith_llama.formats import Record
from megalith_llama.workers import TOKEN_DTYPE, EncodedChunk, TokenEncoder, encode_in_worker, init_worker


def make_encoder(tokenizer: Any, add_bos: bool = False) -> TokenEncoder:
    """The document encoder of an HF tokenizer (it must have an eos token to separate documents)."""
    if tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has no eos token; it is needed to separate packed documents")
    bos = tokenizer.bos_token_id if add_bos else None
    if add_bos and bos is None:
        raise ConfigError("add_bos was requested but the tokenizer has no bos token")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return TokenEncoder(backend.to_str(), None, tokenizer.eos_token_id, bos)
    return TokenEncoder(None, tokenizer, tokenizer.eos_token_id, bos)


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of the tokenizer's full definition (fast: its JSON; slow: vocabulary + special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.all_special_tokens])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@contextlib.contextmanager
def worker_pool(num_proc: int, encoder: TokenEncoder) -> Iterator[ProcessPoolExecutor | None]:
    """A spawn pool of `num_proc` tokenization workers, or None for in-process encoding."""
    if num_proc < 1:
        raise ConfigError(f"num_proc must be >= 1, got {num_proc}")
    if num_proc == 1:
        yield None
        return
    ctx = multiprocessing.get_context("spawn")
    # ProcessPoolExecutor (unlike multiprocessing.Pool) fails with BrokenProcessPool when a worker dies.
    with ProcessPoolExecutor(num_proc, mp_context=ctx, initializer=init_worker, initargs=(encoder,)) as pool:
        yield pool


def _chunks(records: Iterable[Record], size: int, max_chars: int) -> Iterator[list[tuple[str, str]]]:
    """Consecutive records, at most `size` documents or about `max_chars` characters per chunk."""
    chunk: list[tuple[str, str]] = []
    chars = 0
    for record in records:
        chunk.append((record.prompt, record.text))
        chars += len(record.prompt) + len(record.text)
        if len(chunk) == size or chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def encode_stream(
    records: Iterable[Record],
    encoder: TokenEncoder,
    pool: ProcessPoolExecutor | None = None,
    chunk_size: int = 512,
    in_flight: int = 4,
    chunk_chars: int = 1 << 17,
) -> Iterator[EncodedChunk]:
    """Encoded chunks of `records` in input order, in `pool`'s workers (None: in this process).

    A chunk holds at most `chunk_size` documents or about `chunk_chars` characters; at most
    `in_flight` chunks are submitted and not yet consumed.
    """
    chunks = _chunks(records, chunk_size, chunk_chars)
    if pool is None:
        yield from (encoder.encode_documents(c) for c in chunks)
        return
    pending: collections.deque[Future[EncodedChunk]] = collections.deque()
    for chunk in chunks:
        pending.append(pool.submit(encode_in_worker, chunk))
        if len(pending) >= in_flight:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


@dataclass(frozen=True)
class TokenStore:
    """One input's documents on disk: flat `ids`/`loss_mask` memmaps and `offsets` [docs + 1]."""

    ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.ids[lo:hi], self.loss_mask[lo:hi]


def write_token_store(
    chunks: Iterable[EncodedChunk], directory: Path, on_chunk: Callable[[EncodedChunk], None] | None = None
) -> TokenStore:
    """Append encoded chunks to `directory/{ids,loss_mask}.bin` and return memory-mapped views."""
    directory.mkdir(parents=True, exist_ok=True)
    lengths: list[np.ndarray] = []
    with (directory / "ids.bin").open("wb") as fi, (directory / "loss_mask.bin").open("wb") as fm:
        for chunk in chunks:
            fi.write(chunk.ids.tobytes())
            fm.write(chunk.loss_mask.tobytes())
            lengths.append(chunk.lengths)
            if on_chunk is not None:
                on_chunk(chunk)
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(all_lengths)]).astype(np.int64)
    if offsets[-1] == 0:
        return TokenStore(np.zeros(0, TOKEN_DTYPE), np.zeros(0, np.uint8), offsets)
    ids = np.memmap(directory / "ids.bin", dtype=TOKEN_DTYPE, mode="r", shape=(int(offsets[-1]),))
    mask = np.memmap(directory / "loss_mask.bin", dtype=np.uint8, mode="r", shape=(int(offsets[-1]),))
    return TokenStore(ids=ids, loss_mask=mask, offsets=offsets)
