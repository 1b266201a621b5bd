"""`prepare`: tokenize, mix and pack inputs into memory-mapped numpy shards plus a manifest.

Output directory layout (written atomically: built under a temporary name, fsynced, renamed):

    manifest.json
    shard-00000.input_ids.npy      [n, seq_len]  uint16 (vocab <= 65536) or int32
    shard-00000.loss_mask.npy      [n, seq_len]  uint8; labels = input_ids where 1, else -100
    shard-00000.position_ids.npy   [n, seq_len]  only with document masking
    shard-00000.segment_ids.npy    [n, seq_len]  only with document masking
    ...

Labels are stored as a 1-byte loss mask instead of a 4-byte copy of the ids; `PackedDataset`
returns `labels` built from it. See `packing` for the mixing and packing rules and `formats` for
the input formats.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from megalith.common.errors import ConfigError, DataError
from megalith_llama.encoding import (
    TokenStore,
    encode_stream,
    make_encoder,
    tokenizer_hash,
    worker_pool,
    write_token_store,
)
from megalith_llama.formats import TEXT_UNITS, ReadStats, input_format, iter_records
from megalith_llama.io import atomic_directory, check_output_free, write_json
from megalith_llama.packing import MixPlan, pack_tokens, plan_mixture
from megalith_llama.workers import TokenEncoder

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_NAME = "megalith-llama-packed"
FORMAT_VERSION = 1
FIELDS = ("input_ids", "loss_mask", "position_ids", "segment_ids")


@dataclass(frozen=True)
class InputSpec:
    """One input: a path (or "builtin:train") and an optional mixing weight."""

    path: str
    weight: float | None = None

    @classmethod
    def parse(cls, text: str) -> InputSpec:
        """`PATH` or `PATH:WEIGHT` (the part after the last ':' is a weight only if it is a number)."""
        head, sep, tail = text.rpartition(":")
        if sep and head:
            try:
                weight = float(tail)
            except ValueError:
                return cls(text)
            if not math.isfinite(weight) or weight < 0:
                raise ConfigError(f"input weight must be a finite number >= 0, got {tail!r} in {text!r}")
            return cls(head, weight)
        return cls(text)


@dataclass(frozen=True)
class PrepareConfig:
    """Options of `prepare` (see the CLI help for each)."""

    inputs: tuple[InputSpec, ...]
    seq_len: int = 2048
    num_proc: int = 1
    skip_bad_lines: bool = False
    document_masking: bool = False
    last_sequence: Literal["pad", "drop"] = "pad"
    seed: int = 0
    target_tokens: int | None = None
    sequences_per_shard: int = 8192
    text_unit: str = "paragraph"
    add_bos: bool = False

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ConfigError("at least one input is required")
        if self.seq_len <= 0 or self.sequences_per_shard <= 0 or self.num_proc <= 0:
            raise ConfigError(
                f"seq_len ({self.seq_len}), sequences_per_shard ({self.sequences_per_shard}) and "
                f"num_proc ({self.num_proc}) must be positive"
            )
        if self.last_sequence not in ("pad", "drop"):
            raise ConfigError(f"last_sequence must be 'pad' or 'drop', got {self.last_sequence!r}")
        if self.text_unit not in TEXT_UNITS:
            raise ConfigError(f"text_unit must be one of {TEXT_UNITS}, got {self.text_unit!r}")
        if self.target_tokens is not None and self.target_tokens <= 0:
            raise ConfigError(f"--num-tokens must be > 0, got {self.target_tokens}")
        given = [s.weight is not None for s in self.inputs]
        if any(given) and not all(given):
            raise ConfigError("give a weight for every input (PATH:WEIGHT) or for none")

    @property
    def weights(self) -> list[float] | None:
        if self.inputs[0].weight is None:
            return None
        return [float(s.weight) for s in self.inputs]  # type: ignore[arg-type]


@dataclass(frozen=True)
class PrepareResult:
    """Where the shards went and the manifest that describes them."""

    output: Path
    manifest: dict[str, Any]


class _ShardWriter:
    """Streams documents into packed shards of `sequences_per_shard` rows."""

    def __init__(self, out: Path, config: PrepareConfig, pad_id: int, id_dtype: np.dtype) -> None:
        self.out, self.config, self.pad_id, self.id_dtype = out, config, pad_id, id_dtype
        self.shard_tokens = config.seq_len * config.sequences_per_shard
        self._ids: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._starts: list[int] = []
        self._n = 0
        self.shards: list[dict[str, Any]] = []
        self.padding = 0
        self.dropped = 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self._starts.append(self._n)
        self._ids.append(np.asarray(ids))
        self._masks.append(np.asarray(mask))
        self._n += len(ids)
        if self._n >= self.shard_tokens:
            self._flush(final=False)

    def finish(self) -> None:
        if self._ids:
            self._flush(final=True)

    def _flush(self, final: bool) -> None:
        ids, mask = np.concatenate(self._ids), np.concatenate(self._masks)
        starts = np.asarray(self._starts, dtype=np.int64)
        cut = 0
        while len(ids) - cut >= self.shard_tokens:
            self._write(ids[cut : cut + self.shard_tokens], mask[cut : cut + self.shard_tokens], starts - cut)
            cut += self.shard_tokens
        ids, mask, starts = ids[cut:], mask[cut:], starts[starts >= cut] - cut
        if final:
            keep = (
                len(ids)
                if self.config.last_sequence == "pad"
                else len(ids) // self.config.seq_len * self.config.seq_len
            )
            self.dropped = len(ids) - keep
            if keep:
                self._write(ids[:keep], mask[:keep], starts[starts < keep])
        self._ids, self._masks, self._starts, self._n = [ids], [mask], starts.tolist(), len(ids)

    def _write(self, ids: np.ndarray, mask: np.ndarray, starts: np.ndarray) -> None:
        starts = starts[(starts >= 0) & (starts < len(ids))]
        packed, pad = pack_tokens(ids, mask, starts, self.config.seq_len, self.pad_id)
        self.padding += pad
        name = f"shard-{len(self.shards):05d}"
        small = np.uint16 if self.config.seq_len <= np.iinfo(np.uint16).max else np.int32
        np.save(self.out / f"{name}.input_ids.npy", packed.input_ids.astype(self.id_dtype))
        np.save(self.out / f"{name}.loss_mask.npy", packed.loss_mask)
        if self.config.document_masking:
            np.save(self.out / f"{name}.position_ids.npy", packed.position_ids.astype(small))
            np.save(self.out / f"{name}.segment_ids.npy", packed.segment_ids.astype(small))
        self.shards.append({"name": name, "num_sequences": int(packed.input_ids.shape[0])})


def _tokenize_inputs(
    config: PrepareConfig, encoder: TokenEncoder, work: Path, progress: Callable[[int], None] | None
) -> tuple[list[TokenStore], list[ReadStats]]:
    stores, stats = [], []
    with worker_pool(config.num_proc, encoder) as pool:
        for i, spec in enumerate(config.inputs):
            store, st = _tokenize_one(config, spec, encoder, pool, work / f"input-{i}", progress)
            stores.append(store)
            stats.append(st)
    return stores, stats


def _tokenize_one(
    config: PrepareConfig,
    spec: InputSpec,
    encoder: TokenEncoder,
    pool: ProcessPoolExecutor | None,
    work: Path,
    progress: Callable[[int], None] | None,
) -> tuple[TokenStore, ReadStats]:
    st = ReadStats()
    records = iter_records(
        spec.path, text_unit=config.text_unit, skip_bad_lines=config.skip_bad_lines, stats=st
    )
    chunks = encode_stream(records, encoder, pool, in_flight=2 * config.num_proc)
    on_chunk = None if progress is None else (lambda c: progress(int(c.ids.size)))
    store = write_token_store(chunks, work, on_chunk=on_chunk)
    if store.num_documents == 0:
        raise DataError(f"input {spec.path} contains no documents")
    return store, st


def prepare(
    config: PrepareConfig,
    tokenizer: Any,
    output: str | os.PathLike[str],
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> PrepareResult:
    """Tokenize, mix and pack `config.inputs` with `tokenizer` into shards under `output`.

    `progress(n)` is called with the number of tokens of each encoded chunk.
    """
    check_output_free(output, overwrite)
    encoder = make_encoder(tokenizer, add_bos=config.add_bos)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else encoder.eos_id
    id_dtype = np.dtype(np.uint16 if len(tokenizer) <= 1 << 16 else np.int32)
    with atomic_directory(output, overwrite=overwrite) as tmp:
        work = tmp / "_work"
        stores, stats = _tokenize_inputs(config, encoder, work, progress)
        lengths = [np.diff(s.offsets) for s in stores]
        plan = plan_mixture(lengths, config.weights, seed=config.seed, target_tokens=config.target_tokens)
        writer = _ShardWriter(tmp, config, pad_id, id_dtype)
        for owner, doc in plan.order:
            writer.add(*stores[owner].document(int(doc)))
        writer.finish()
        del stores
        shutil.rmtree(work)
        if not writer.shards:
            raise DataError(
                f"no complete sequence of {config.seq_len} tokens: all {writer.dropped} tokens dropped"
            )
        manifest = _manifest(config, tokenizer, writer, plan, lengths, stats, id_dtype)
        write_json(tmp / MANIFEST, manifest)
    _log_summary(manifest)
    return PrepareResult(output=Path(output), manifest=manifest)


def _manifest(
    config: PrepareConfig,
    tokenizer: Any,
    writer: _ShardWriter,
    plan: MixPlan,
    lengths: list[np.ndarray],
    stats: list[ReadStats],
    id_dtype: np.dtype,
) -> dict[str, Any]:
    inputs = []
    for i, spec in enumerate(config.inputs):
        tokens = int(lengths[i].sum())
        inputs.append({
            "path": spec.path,
            "format": input_format(spec.path),
            "weight": spec.weight,
            "documents": len(lengths[i]),
            "tokens": tokens,
            "used_documents": plan.used_documents[i],
            "used_tokens": plan.used_tokens[i],
            "epochs": plan.used_tokens[i] / tokens,
            "bad_lines": stats[i].bad_lines,
            "empty_documents": stats[i].empty,
        })  # fmt: skip
    num_sequences = sum(s["num_sequences"] for s in writer.shards)
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seq_len": config.seq_len,
        "num_sequences": num_sequences,
        "num_tokens": num_sequences * config.seq_len - writer.padding,
        "num_padding_tokens": writer.padding,
        "dropped_tokens": writer.dropped,
        "last_sequence": config.last_sequence,
        "document_masking": config.document_masking,
        "add_bos": config.add_bos,
        "dtype": id_dtype.name,
        "pad_token_id": writer.pad_id,
        "tokenizer": {
            "hash": tokenizer_hash(tokenizer),
            "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
            "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id,
        },
        "mixing": {"seed": config.seed, "target_tokens": config.target_tokens, "quotas": list(plan.quotas)},
        "bad_lines": sum(s.bad_lines for s in stats),
        "inputs": inputs,
        "shards": writer.shards,
    }


def _log_summary(manifest: dict[str, Any]) -> None:
    logger.info(
        "packed %d tokens into %d sequences of %d (%d padding, %d dropped) in %d shard(s)",
        manifest["num_tokens"],
        manifest["num_sequences"],
        manifest["seq_len"],
        manifest["num_padding_tokens"],
        manifest["dropped_tokens"],
        len(manifest["shards"]),
    )
    if manifest["bad_lines"]:
        logger.warning("skipped %d malformed line(s)", manifest["bad_lines"])
