"""Weighted mixing of inputs and packing of documents into fixed-length sequences.

Mixing (`plan_mixture`). Input i has documents with lengths `l_i` (tokens, end token included),
total `T_i`, and weight `w_i` (normalised to sum 1). The target is `N` tokens (default
`sum_i T_i`); input i contributes `q_i = round(w_i * N)` tokens: its documents are visited in a
seeded random order (a fresh permutation per epoch, `rng = default_rng([seed, i, epoch])`) and
taken until their total reaches `q_i` (so an input repeats when `q_i > T_i` and is subsampled when
`q_i < T_i`). Without weights every document of every input is used exactly once (`q_i = T_i`).
The inputs are then interleaved smoothly: documents are ordered by the fraction of their input's
quota reached at their midpoint, `(tokens before + l/2) / q_i`, ties broken by input index.

Packing (`pack_tokens`). Documents are concatenated in that order and cut every `seq_len`
tokens; a document may continue into the next sequence. Per token we also compute
`position_ids` (offset from the start of its document, restarting at every sequence start) and
`segment_ids` (index of its document inside the sequence) so attention can be restricted to one
document. The last partial sequence is either padded (`pad_id`, loss mask 0, its own segment) or
dropped (its token count is reported) - see `PrepareConfig.last_sequence`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megalith.common.errors import ConfigError


@dataclass(frozen=True)
class MixPlan:
    """`order` [docs, 2]: (input index, document index) in emission order, plus per-input usage."""

    order: np.ndarray
    used_tokens: tuple[int, ...]
    used_documents: tuple[int, ...]
    quotas: tuple[int, ...]


def _take_documents(lengths: np.ndarray, quota: int, seed: int, index: int) -> np.ndarray:
    """Document indices of one input, in seeded per-epoch order, until `quota` tokens are reached."""
    total = int(lengths.sum())
    if quota <= 0 or total == 0:
        return np.zeros(0, dtype=np.int64)
    epochs = -(-quota // total)
    order = np.concatenate(
        [np.random.default_rng([seed, index, e]).permutation(len(lengths)) for e in range(epochs)]
    )
    cum = np.cumsum(lengths[order])
    count = int(np.searchsorted(cum, quota, side="left")) + 1
    return order[: min(count, len(order))]


def plan_mixture(
    doc_lengths: list[np.ndarray],
    weights: list[float] | None,
    seed: int = 0,
    target_tokens: int | None = None,
) -> MixPlan:
    """Which documents of which input go where (see the module docstring for the rule)."""
    totals = [int(x.sum()) for x in doc_lengths]
    if weights is None:
        if target_tokens is not None:
            raise ConfigError("target_tokens needs explicit weights (PATH:WEIGHT) for every input")
        quotas = totals
    else:
        bad = any(not math.isfinite(w) or w < 0 for w in weights)
        if len(weights) != len(doc_lengths) or bad or sum(weights) <= 0:
            raise ConfigError(f"need one non-negative weight per input with a positive sum, got {weights}")
        if target_tokens is not None and target_tokens <= 0:
            raise ConfigError(f"target_tokens must be > 0, got {target_tokens}")
        n = sum(totals) if target_tokens is None else target_tokens
        quotas = [round(w / sum(weights) * n) for w in weights]
    picks, keys, owners = [], [], []
    for i, (lengths, quota) in enumerate(zip(doc_lengths, quotas)):
        docs = _take_documents(lengths, quota, seed, i)
        taken = lengths[docs].astype(np.float64)
        picks.append(docs)
        keys.append((np.cumsum(taken) - taken / 2) / max(quota, 1))
        owners.append(np.full(len(docs), i, dtype=np.int64))
    key, owner, doc = (np.concatenate(x) for x in (keys, owners, picks))
    perm = np.lexsort((owner, key))
    return MixPlan(
        order=np.stack([owner[perm], doc[perm]], axis=1),
        used_tokens=tuple(int(lengths[d].sum()) for lengths, d in zip(doc_lengths, picks)),
        used_documents=tuple(len(d) for d in picks),
        quotas=tuple(quotas),
    )


@dataclass(frozen=True)
class PackedArrays:
    """Packed sequences, each [num_sequences, seq_len]."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray


def pack_tokens(
    ids: np.ndarray, loss_mask: np.ndarray, doc_starts: np.ndarray, seq_len: int, pad_id: int
) -> tuple[PackedArrays, int]:
    """Cut the concatenated documents `ids` [n] into rows of `seq_len`, padding the last row.

    `doc_starts`: offsets in `ids` where a document begins (offset 0 is always treated as one).
    Returns the packed arrays and the number of padding tokens added.
    """
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be positive, got {seq_len}")
    n = len(ids)
    rows = -(-n // seq_len)
    pad = rows * seq_len - n
    flat_ids = np.concatenate([ids, np.full(pad, pad_id, dtype=ids.dtype)])
    flat_mask = np.concatenate([loss_mask, np.zeros(pad, dtype=np.uint8)]).astype(np.uint8)
    seq_starts = np.arange(0, rows * seq_len, seq_len, dtype=np.int64)
    extra = [n] if pad else []
    bounds = np.union1d(np.union1d(np.asarray(doc_starts, dtype=np.int64), seq_starts), extra)
    t = np.arange(rows * seq_len, dtype=np.int64)
    k = np.searchsorted(bounds, t, side="right") - 1
    first = np.searchsorted(bounds, (t // seq_len) * seq_len, side="right") - 1
    shape = (rows, seq_len)
    packed = PackedArrays(
        input_ids=flat_ids.reshape(shape),
        loss_mask=flat_mask.reshape(shape),
        position_ids=(t - bounds[k]).reshape(shape),
        segment_ids=(k - first).reshape(shape),
    )
    return packed, pad
