"""Packing and mixing rules, checked against hand-written references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megalith.common.errors import ConfigError
from megalith_llama.packing import pack_tokens, plan_mixture


def _reference_positions(doc_lengths: list[int], seq_len: int) -> tuple[list[int], list[int]]:
    """Position and segment id of every real token, by walking the stream one token at a time."""
    positions, segments = [], []
    t, start, segment = 0, 0, -1
    for length in doc_lengths:
        for j in range(length):
            if t % seq_len == 0 or j == 0:  # a new segment starts at a document or sequence start
                start = t
                segment = 0 if t % seq_len == 0 else segment + 1
            positions.append(t - start)
            segments.append(segment)
            t += 1
    return positions, segments


@settings(max_examples=60, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 999), min_size=1, max_size=30), min_size=1, max_size=12),
    seq_len=st.integers(1, 17),
)
def test_pack_tokens_keeps_every_token_once(docs: list[list[int]], seq_len: int) -> None:
    flat = np.array([t for d in docs for t in d], dtype=np.int32)
    mask = np.ones(len(flat), dtype=np.uint8)
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    packed, pad = pack_tokens(flat, mask, starts, seq_len, pad_id=-1)

    rows = packed.input_ids.reshape(-1)
    assert packed.input_ids.shape[1] == seq_len
    assert pad == packed.input_ids.size - len(flat) and 0 <= pad < seq_len
    assert rows[: len(flat)].tolist() == flat.tolist()  # every token exactly once, in order
    assert (rows[len(flat) :] == -1).all()
    assert packed.loss_mask.reshape(-1).tolist() == [1] * len(flat) + [0] * pad
    positions, segments = _reference_positions([len(d) for d in docs], seq_len)
    assert packed.position_ids.reshape(-1)[: len(flat)].tolist() == positions
    assert packed.segment_ids.reshape(-1)[: len(flat)].tolist() == segments
    if pad:  # padding is its own segment, after every real one in the last row
        last = packed.segment_ids[-1]
        assert last[-1] == last[seq_len - pad] > (last[seq_len - pad - 1] if seq_len - pad else -1)


def test_pack_tokens_small_example_by_hand() -> None:
    ids = np.array([10, 11, 12, 20, 21, 30, 31, 32, 33], dtype=np.int32)  # docs of 3, 2, 4 tokens
    packed, pad = pack_tokens(ids, np.ones(9, np.uint8), np.array([0, 3, 5]), seq_len=4, pad_id=0)
    assert pad == 3
    assert packed.input_ids.tolist() == [[10, 11, 12, 20], [21, 30, 31, 32], [33, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0], [0, 0, 1, 2], [0, 0, 1, 2]]
    assert packed.segment_ids.tolist() == [[0, 0, 0, 1], [0, 1, 1, 1], [0, 1, 1, 1]]


def test_plan_mixture_weights_by_hand() -> None:
    ones = np.ones(10, dtype=np.int64)  # two inputs of ten 1-token documents; weights 3:1 of 20 tokens
    plan = plan_mixture([ones, ones], weights=[3.0, 1.0], seed=0)
    assert plan.quotas == (15, 5)
    assert plan.used_tokens == (15, 5) and plan.used_documents == (15, 5)
    a_docs = plan.order[plan.order[:, 0] == 0, 1]
    b_docs = plan.order[plan.order[:, 0] == 1, 1]
    assert sorted(np.bincount(a_docs, minlength=10).tolist()) == [1] * 5 + [2] * 5  # 1.5 epochs
    assert len(set(b_docs.tolist())) == 5  # subsampled, no repeats
    assert set(a_docs[:10].tolist()) == set(range(10))  # the first epoch is a full permutation
    # midpoint keys a: (k-.5)/15, b: (k-.5)/5 -> a a b a a a b ...
    assert plan.order[:7, 0].tolist() == [0, 0, 1, 0, 0, 0, 1]


def test_plan_mixture_without_weights_uses_every_document_once() -> None:
    lengths = [np.array([3, 1, 4]), np.array([1, 5]), np.array([9, 2, 6, 5])]
    plan = plan_mixture(lengths, weights=None, seed=3)
    used = sorted(map(tuple, plan.order.tolist()))
    assert used == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (2, 3)]


def test_plan_mixture_is_seeded() -> None:
    lengths = [np.arange(1, 40), np.arange(1, 30)]
    a = plan_mixture(lengths, [0.5, 0.5], seed=1).order
    assert np.array_equal(a, plan_mixture(lengths, [0.5, 0.5], seed=1).order)
    assert not np.array_equal(a, plan_mixture(lengths, [0.5, 0.5], seed=2).order)


def test_plan_mixture_rejects_bad_weights() -> None:
    with pytest.raises(ConfigError, match=r"\[-1.0, 2.0\]"):
        plan_mixture([np.ones(2), np.ones(2)], weights=[-1.0, 2.0])
    with pytest.raises(ConfigError, match="target_tokens"):
        plan_mixture([np.ones(2)], weights=None, target_tokens=5)
    with pytest.raises(ConfigError, match=r"\[nan, 1.0\]"):
        plan_mixture([np.ones(2), np.ones(2)], weights=[float("nan"), 1.0])
    with pytest.raises(ConfigError, match="target_tokens must be > 0, got 0"):
        plan_mixture([np.ones(2)], weights=[1.0], target_tokens=0)
