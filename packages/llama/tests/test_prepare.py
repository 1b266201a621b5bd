"""`prepare` end to end: exactly-once packing, Colossal masking, mixing, parallelism, bad input."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megalith.common.errors import ConfigError, DataError
from megalith_llama.data import InputSpec, PrepareConfig, prepare
from megalith_llama.dataset import PackedDataset, document_attention_mask, model_inputs

WORDS = "the model learns tokens from text and data is packed into sequences zero redundancy".split()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _stream(out: Path) -> tuple[np.ndarray, np.ndarray]:
    """All (input_ids, loss_mask) rows of a prepared directory, flattened in shard order."""
    manifest = json.loads((out / "manifest.json").read_text())
    ids = [np.load(out / f"{s['name']}.input_ids.npy") for s in manifest["shards"]]
    mask = [np.load(out / f"{s['name']}.loss_mask.npy") for s in manifest["shards"]]
    return np.concatenate(ids).reshape(-1), np.concatenate(mask).reshape(-1)


def _split_on(stream: list[int], eos: int) -> list[tuple[int, ...]]:
    docs, cur = [], []
    for t in stream:
        cur.append(t)
        if t == eos:
            docs.append(tuple(cur))
            cur = []
    assert not cur, "stream must end with a complete document"
    return docs


documents = st.lists(
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=25).map(" ".join), min_size=1, max_size=15
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=documents, seq_len=st.integers(2, 24), seed=st.integers(0, 5))
def test_every_token_appears_exactly_once(bpe_tokenizer, tmp_path_factory, docs, seq_len, seed) -> None:
    tmp = tmp_path_factory.mktemp("prop")
    src = _jsonl(tmp / "in.jsonl", [{"text": d} for d in docs])
    eos, pad = bpe_tokenizer.eos_token_id, bpe_tokenizer.pad_token_id
    expected = Counter(tuple(bpe_tokenizer.encode(d, add_special_tokens=False) + [eos]) for d in docs)
    total = sum(len(d) * n for d, n in expected.items())

    inputs = (InputSpec(str(src)),)
    padded = prepare(
        PrepareConfig(inputs, seq_len=seq_len, seed=seed, sequences_per_shard=3), bpe_tokenizer, tmp / "pad"
    )
    ids, mask = _stream(tmp / "pad")
    n_pad = padded.manifest["num_padding_tokens"]
    assert len(ids) == total + n_pad and padded.manifest["num_tokens"] == total and n_pad < seq_len
    assert (ids[total:] == pad).all() and (mask[total:] == 0).all() and (mask[:total] == 1).all()
    assert Counter(_split_on(ids[:total].tolist(), eos)) == expected  # each document once, whole

    # Rule for the last partial sequence with last_sequence="drop": its tokens are counted, not kept.
    cfg = PrepareConfig(inputs, seq_len=seq_len, seed=seed, last_sequence="drop", sequences_per_shard=3)
    if total < seq_len:
        with pytest.raises(DataError, match="no complete sequence"):
            prepare(cfg, bpe_tokenizer, tmp / "drop")
        return
    dropped = prepare(cfg, bpe_tokenizer, tmp / "drop").manifest
    kept, _ = _stream(tmp / "drop")
    assert dropped["dropped_tokens"] == total % seq_len and dropped["num_padding_tokens"] == 0
    assert len(kept) + dropped["dropped_tokens"] == total
    assert kept.tolist() == ids[: len(kept)].tolist()  # same order; only the tail is cut


def test_colossal_format_masks_exactly_the_source(bpe_tokenizer, tmp_path: Path) -> None:
    source, target = "the model learns tokens from text", "zero redundancy optimizer shards states"
    src = _jsonl(tmp_path / "c.jsonl", [{"source": source, "target": target, "category": "demo"}])
    prepare(PrepareConfig((InputSpec(str(src)),), seq_len=64), bpe_tokenizer, tmp_path / "out")
    item = PackedDataset(tmp_path / "out")[0]
    s_ids = bpe_tokenizer.encode(source, add_special_tokens=False)
    t_ids = bpe_tokenizer.encode(target, add_special_tokens=False) + [bpe_tokenizer.eos_token_id]
    n = len(s_ids) + len(t_ids)
    assert item["input_ids"][:n].tolist() == s_ids + t_ids
    assert item["labels"][:n].tolist() == [-100] * len(s_ids) + t_ids
    assert (item["labels"][n:] == -100).all()


def test_text_files_and_mixing_weights(bpe_tokenizer, tmp_path: Path, make_sentences) -> None:
    a = _jsonl(tmp_path / "a.jsonl", [{"text": s} for s in make_sentences(40, 1)])
    b = tmp_path / "b.txt"
    b.write_text("\n\n".join(make_sentences(10, 2)) + "\n", encoding="utf-8")
    cfg = PrepareConfig((InputSpec.parse(f"{a}:0.25"), InputSpec.parse(f"{b}:0.75")), seq_len=16, seed=7)
    m = prepare(cfg, bpe_tokenizer, tmp_path / "out").manifest
    ia, ib = m["inputs"]
    assert (ia["weight"], ib["weight"]) == (0.25, 0.75)
    assert ib["documents"] == 10 and ia["documents"] == 40
    n = ia["tokens"] + ib["tokens"]
    assert m["mixing"]["quotas"] == [round(0.25 * n), round(0.75 * n)]
    for info, quota in zip((ia, ib), m["mixing"]["quotas"]):
        assert info["used_tokens"] >= quota  # whole documents until the quota is reached
    assert ib["epochs"] > 1 > ia["epochs"]  # the small text file repeats, the jsonl is subsampled
    assert m["num_tokens"] == ia["used_tokens"] + ib["used_tokens"]
    again = prepare(cfg, bpe_tokenizer, tmp_path / "again")
    assert np.array_equal(_stream(tmp_path / "out")[0], _stream(tmp_path / "again")[0])
    assert again.manifest["tokenizer"]["hash"] == m["tokenizer"]["hash"]


def test_parallel_tokenization_gives_identical_shards(bpe_tokenizer, tmp_path: Path, make_sentences) -> None:
    a = _jsonl(tmp_path / "a.jsonl", [{"text": s} for s in make_sentences(700, 3)])
    base = dict(inputs=(InputSpec(str(a)),), seq_len=32, document_masking=True, sequences_per_shard=50)
    prepare(PrepareConfig(**base), bpe_tokenizer, tmp_path / "p1")
    prepare(PrepareConfig(**base, num_proc=2), bpe_tokenizer, tmp_path / "p2")
    names = sorted(p.name for p in (tmp_path / "p1").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "p2").iterdir())
    for name in names:
        if name.endswith(".npy"):
            assert np.array_equal(np.load(tmp_path / "p1" / name), np.load(tmp_path / "p2" / name)), name


def test_document_masking_matches_documents_run_alone(bpe_tokenizer, tmp_path: Path) -> None:
    from megalith_llama.model import load_model

    docs = ["the model learns", "tensor parallel layers split weights", "zero shards"]
    src = _jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    prepare(
        PrepareConfig((InputSpec(str(src)),), seq_len=64, document_masking=True),
        bpe_tokenizer,
        tmp_path / "o",
    )
    ds = PackedDataset(tmp_path / "o")
    batch = torch.utils.data.default_collate([ds[0]])
    model = load_model("tiny-32", tokenizer=bpe_tokenizer).model.eval()
    with torch.no_grad():
        packed = model(**{k: v for k, v in model_inputs(batch).items() if k != "labels"}).logits[0]
        seg = batch["segment_ids"][0]
        for s in range(3):
            idx = (seg == s).nonzero().flatten()
            alone = model(input_ids=batch["input_ids"][:, idx]).logits[0]
            torch.testing.assert_close(packed[idx], alone, atol=1e-5, rtol=1e-5)
    mask = document_attention_mask(torch.tensor([[0, 0, 1]]))
    assert (mask[0, 0] == 0).tolist() == [[True, False, False], [True, True, False], [False, False, True]]


def test_malformed_lines_name_file_and_line(bpe_tokenizer, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": 3}\n{oops\n[1, 2]\n{"prompt": "x"}\n{"text": "fine"}\n')
    cfg = PrepareConfig((InputSpec(str(bad)),), seq_len=8)
    with pytest.raises(DataError, match=rf"{bad}:3: 'text' must be a string"):
        prepare(cfg, bpe_tokenizer, tmp_path / "o1")
    assert not (tmp_path / "o1").exists()  # nothing half-written
    skip = PrepareConfig((InputSpec(str(bad)),), seq_len=8, skip_bad_lines=True)
    m = prepare(skip, bpe_tokenizer, tmp_path / "o2").manifest
    assert m["bad_lines"] == 4 and m["inputs"][0]["documents"] == 2


def test_other_bad_inputs(bpe_tokenizer, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="contains no documents"):
        prepare(PrepareConfig((InputSpec(str(empty)),), seq_len=8), bpe_tokenizer, tmp_path / "o")
    with pytest.raises(DataError, match="not found: .*missing.txt"):
        prepare(
            PrepareConfig((InputSpec(str(tmp_path / "missing.txt")),), seq_len=8),
            bpe_tokenizer,
            tmp_path / "o",
        )
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"fine line\ncaf\xe9\n")
    with pytest.raises(DataError, match=rf"{latin}:2: not UTF-8"):
        prepare(PrepareConfig((InputSpec(str(latin)),), seq_len=8), bpe_tokenizer, tmp_path / "o")
    with pytest.raises(ConfigError, match="for every input"):
        PrepareConfig((InputSpec("a.jsonl", 0.5), InputSpec("b.jsonl")))
    assert InputSpec.parse("builtin:train") == InputSpec("builtin:train")
    for bad in ("nan", "inf", "-inf"):
        with pytest.raises(ConfigError, match=f"finite number >= 0, got '{bad}' in 'a.jsonl:{bad}'"):
            InputSpec.parse(f"a.jsonl:{bad}")
    for tokens in (0, -5):
        with pytest.raises(ConfigError, match=f"--num-tokens must be > 0, got {tokens}"):
            PrepareConfig((InputSpec("a.jsonl", 1.0),), target_tokens=tokens)
    assert InputSpec.parse("dir/a.jsonl:0.7") == InputSpec("dir/a.jsonl", 0.7)


def test_dataset_checks_tokenizer_and_positions(bpe_tokenizer, tmp_path: Path, make_sentences) -> None:
    from transformers import LlamaConfig

    src = _jsonl(tmp_path / "a.jsonl", [{"text": s} for s in make_sentences(5)])
    prepare(PrepareConfig((InputSpec(str(src)),), seq_len=32), bpe_tokenizer, tmp_path / "o")
    ds = PackedDataset(tmp_path / "o")
    blob = pickle.dumps(ds)  # what a DataLoader worker receives: the path, not the arrays
    assert len(blob) < 4096 and torch.equal(pickle.loads(blob)[len(ds) - 1]["labels"], ds[-1]["labels"])
    ds.check_compatible(bpe_tokenizer, LlamaConfig(max_position_embeddings=32))
    with pytest.raises(ConfigError, match="seq_len 32 exceeds the model's max_position_embeddings 16"):
        ds.check_compatible(model_config=LlamaConfig(max_position_embeddings=16))
    bpe_tokenizer.add_tokens(["brandnewtoken"])
    with pytest.raises(DataError, match="tokenized with tokenizer"):
        ds.check_compatible(bpe_tokenizer)
    with pytest.raises(DataError, match="no manifest.json"):
        PackedDataset(tmp_path)
