"""`PackedDataset`: the torch view of `prepare`'s memory-mapped shards, for the trainer and `eval`."""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from megalith.common.errors import DataError
from megalith_llama.data import FORMAT_NAME, FORMAT_VERSION, MANIFEST
from megalith_llama.encoding import tokenizer_hash
from megalith_llama.model import check_seq_len

IGNORE_INDEX = -100


def load_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a prepared directory, checked for format and version."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        hint = f"`llama-pretrain prepare --input {path} --output DIR`, then --data DIR"
        raise DataError(f"not a prepared dataset (no {MANIFEST}): {path}; make one with {hint}")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise DataError(f"{file}: unreadable manifest: {exc}") from exc
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise DataError(
            f"{file}: format {manifest.get('format')!r} v{manifest.get('version')}, "
            f"expected {FORMAT_NAME!r} v{FORMAT_VERSION}"
        )
    return manifest


class PackedDataset(Dataset[dict[str, torch.Tensor]]):
    """Packed sequences of a `prepare` output directory.

    Item i is a dict of int64 tensors of shape [seq_len]:
      `input_ids`; `labels` (= input_ids where the loss mask is 1, else -100; the model shifts them);
      with document masking also `position_ids` (restart at 0 at each document) and `segment_ids`
      (document index inside the sequence; build the attention mask with `document_attention_mask`).
    Shards are opened with `np.load(mmap_mode="r")`, so only touched rows are read from disk.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.manifest = load_manifest(self.path)
        self.seq_len: int = self.manifest["seq_len"]
        self.document_masking: bool = self.manifest["document_masking"]
        self._open_shards()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into DataLoader workers: send the path, not copies of the memory maps.
        return {k: v for k, v in self.__dict__.items() if k not in ("_shards", "_ends")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open_shards()

    def _open_shards(self) -> None:
        fields = ["input_ids", "loss_mask"] + (
            ["position_ids", "segment_ids"] if self.document_masking else []
        )
        self._shards: list[dict[str, np.ndarray]] = []
        self._ends: list[int] = []
        for shard in self.manifest["shards"]:
            arrays = {f: self._open(f"{shard['name']}.{f}.npy", shard["num_sequences"]) for f in fields}
            self._shards.append(arrays)
            self._ends.append((self._ends[-1] if self._ends else 0) + shard["num_sequences"])

    def _open(self, name: str, rows: int) -> np.ndarray:
        file = self.path / name
        if not file.is_file():
            raise DataError(f"shard file missing: {file}")
        array = np.load(file, mmap_mode="r")
        if array.shape != (rows, self.seq_len):
            raise DataError(f"{file}: shape {array.shape}, manifest says {(rows, self.seq_len)}")
        return array

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} sequences")
        index %= len(self)
        s = bisect.bisect_right(self._ends, index)
        row = index - (self._ends[s - 1] if s else 0)
        arrays = self._shards[s]
        ids = torch.from_numpy(arrays["input_ids"][row].astype(np.int64))
        mask = torch.from_numpy(arrays["loss_mask"][row].astype(np.bool_))
        item = {"input_ids": ids, "labels": ids.masked_fill(~mask, IGNORE_INDEX)}
        if self.document_masking:
            item["position_ids"] = torch.from_numpy(arrays["position_ids"][row].astype(np.int64))
            item["segment_ids"] = torch.from_numpy(arrays["segment_ids"][row].astype(np.int64))
        return item

    def check_compatible(self, tokenizer: Any = None, model_config: Any = None) -> None:
        """Raise if the shards were made with another tokenizer or do not fit the model's positions."""
        if tokenizer is not None:
            expected, actual = self.manifest["tokenizer"]["hash"], tokenizer_hash(tokenizer)
            if expected != actual:
                raise DataError(
                    f"{self.path} was tokenized with tokenizer {expected[:12]}, not this one ({actual[:12]})"
                )
        if model_config is not None:
            check_seq_len(model_config, self.seq_len)


def document_attention_mask(segment_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive causal block-diagonal mask [B, 1, S, S] from `segment_ids` [B, S].

    Query t may attend to key s iff s <= t and segment[s] == segment[t]: 0 there, dtype-min elsewhere
    (HF Llama accepts this 4D mask for the eager and sdpa attention implementations).
    """
    seq = segment_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def model_inputs(
    batch: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Keyword arguments for an HF causal LM forward from a collated `PackedDataset` batch."""
    out = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    if "segment_ids" in batch:
        out["attention_mask"] = document_attention_mask(batch["segment_ids"], dtype)
        out["position_ids"] = batch["position_ids"]
    return out
