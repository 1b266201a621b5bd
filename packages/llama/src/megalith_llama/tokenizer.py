"""Vocabulary expansion for BPE (`tokenizer.json`) and SentencePiece (`.model`) tokenizers.

New tokens are read one per line; the line is the token's surface text, with a leading `▁`
(U+2581) or space marking a word-initial token (so `▁megalith` is " megalith").

BPE: a token that the pre-tokenizer keeps in one piece is added to the model itself. Its old
segmentation `p1 .. pk` is extended by merges `(p1, p2) -> p1p2`, `(p1p2, p3) -> p1p2p3`, ... appended
after every existing merge, so they fire only once the old merges are done, i.e. exactly on
`p1 .. pk`; the intermediate strings become tokens too. A token that spans several pre-tokens
(e.g. two words) cannot be a BPE token and is added as an `AddedToken` instead.

SentencePiece: pieces are appended to the model proto. Unigram: score = the highest score among
its old sub-pieces, which exceeds the sum of their (negative) scores, so Viterbi prefers the new
piece over its old segmentation. BPE: the same merge chain as above, as pieces whose scores lie
below every existing score, earlier links scoring higher.

Embeddings (`init_new_embeddings`): new row = mean of the rows of its old sub-tokens, for the input
embedding and (when untied) the output embedding, computed as one `index_add_` segment mean.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megalith.common.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

SPACE_MARK = "\u2581"


@dataclass(frozen=True)
class NewToken:
    """A token added to the vocabulary: its string, new id, and ids of its old segmentation."""

    token: str
    id: int
    sub_ids: tuple[int, ...]
    requested: bool = True  # False for intermediate merge-chain tokens
    added_token: bool = False  # True when added outside the BPE model (spans several pre-tokens)


@dataclass(frozen=True)
class Expansion:
    """The result of an expansion: new tokens, skipped requests, and requests the tokenizer does not use."""

    new_tokens: tuple[NewToken, ...]
    existing: tuple[str, ...]
    unreachable: tuple[str, ...]


def read_new_tokens(path: str | Path) -> list[str]:
    """Tokens of a file, one per line (blank lines skipped, duplicates removed, order kept)."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"new-token file not found: {file}")
    seen: dict[str, None] = {}
    for lineno, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        token = line.rstrip("\r\n")
        if token.strip(f" {SPACE_MARK}\t") == "" and token:
            raise DataError(f"{file}:{lineno}: a token must contain more than spaces")
        if token:
            seen.setdefault(token, None)
    if not seen:
        raise DataError(f"no tokens in {file}")
    return list(seen)


def _merge_pairs(raw: list[Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in raw]  # type: ignore[misc]


def expand_bpe(tokenizer: Any, tokens: Iterable[str]) -> tuple[Any, Expansion]:
    """Add `tokens` to a `tokenizers.Tokenizer` with a BPE model; returns a new tokenizer."""
    from tokenizers import AddedToken, Tokenizer

    data = json.loads(tokenizer.to_str())
    model = data["model"]
    if model.get("type") != "BPE":
        raise ConfigError(f"expected a BPE tokenizer.json, got model type {model.get('type')!r}")
    vocab: dict[str, int] = model["vocab"]
    merges = _merge_pairs(model["merges"])
    known_merges = set(merges)
    next_id = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))]) + 1
    new, existing, as_added = [], [], []
    for surface in tokens:
        text = surface.replace(SPACE_MARK, " ")
        pieces = _pre_tokenize(tokenizer, text)
        if len(pieces) != 1:
            as_added.append(text)
            continue
        if pieces[0] in vocab or tokenizer.token_to_id(text) is not None:
            existing.append(surface)
            continue
        old = [(t.value, t.id) for t in tokenizer.model.tokenize(pieces[0])]
        if "".join(v for v, _ in old) != pieces[0]:  # unknown or byte-fallback pieces: no merge path
            as_added.append(text)
            continue
        cur = old[0][0]
        for k, (piece, _) in enumerate(old[1:], start=2):
            pair, cur = (cur, piece), cur + piece
            if pair not in known_merges:
                merges.append(pair)
                known_merges.add(pair)
            if cur not in vocab:
                vocab[cur] = next_id
                new.append(NewToken(cur, next_id, tuple(i for _, i in old[:k]), requested=k == len(old)))
                next_id += 1
    model["merges"] = [list(m) for m in merges]
    expanded = Tokenizer.from_str(json.dumps(data))
    for text in as_added:
        new_id = (
            expanded.token_to_id(text) if expanded.add_tokens([AddedToken(text, normalized=True)]) else None
        )
        if new_id is not None:
            sub = tuple(tokenizer.encode(text, add_special_tokens=False).ids)
            new.append(NewToken(text, new_id, sub, added_token=True))
    unreachable = [t.token for t in new if t.requested and _bpe_ids(expanded, t) != [t.id]]
    return expanded, Expansion(tuple(new), tuple(existing), tuple(unreachable))


def _pre_tokenize(tokenizer: Any, text: str) -> list[str]:
    if tokenizer.normalizer is not None:
        text = tokenizer.normalizer.normalize_str(text)
    if tokenizer.pre_tokenizer is None:
        return [text]
    return [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def _bpe_ids(tokenizer: Any, token: NewToken) -> list[int]:
    if token.added_token:
        return tokenizer.encode(token.token, add_special_tokens=False).ids
    return [t.id for t in tokenizer.model.tokenize(token.token)]


def _raw_processor(proto: Any) -> Any:
    """A SentencePiece processor that segments a piece as-is (no dummy prefix, no space cleanup)."""
    import sentencepiece as spm

    raw = type(proto)()
    raw.CopyFrom(proto)
    raw.normalizer_spec.add_dummy_prefix = False
    raw.normalizer_spec.remove_extra_whitespaces = False
    return spm.SentencePieceProcessor(model_proto=raw.SerializeToString())


def expand_sentencepiece(model_proto: bytes, tokens: Iterable[str]) -> tuple[bytes, Expansion]:
    """Add `tokens` to a serialized SentencePiece model (unigram or BPE); returns the new bytes."""
    pb: Any = importlib.import_module("sentencepiece.sentencepiece_model_pb2")  # generated, untyped
    proto = pb.ModelProto()
    proto.ParseFromString(model_proto)
    if proto.trainer_spec.model_type not in (pb.TrainerSpec.UNIGRAM, pb.TrainerSpec.BPE):
        raise ConfigError(
            f"only unigram and BPE SentencePiece models are supported, got {proto.trainer_spec.model_type}"
        )
    old = _raw_processor(proto)
    ids = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = pb.ModelProto.SentencePiece.NORMAL
    bottom = min(p.score for p in proto.pieces if p.type == normal) - 1.0
    new, existing = [], []
    for surface in tokens:
        piece = surface.replace(" ", SPACE_MARK)
        if piece in ids:
            existing.append(surface)
            continue
        segs = list(old.encode_as_proto(piece.replace(SPACE_MARK, " ")).pieces)
        if proto.trainer_spec.model_type == pb.TrainerSpec.UNIGRAM:
            scores = [proto.pieces[s.id].score for s in segs if proto.pieces[s.id].type == normal]
            chain = [(piece, tuple(s.id for s in segs), max(scores, default=bottom))]
        else:
            chain, bottom = _bpe_chain(segs, ids, bottom)
        for text, sub, score in chain:
            proto.pieces.add(piece=text, score=score, type=normal)
            ids[text] = len(proto.pieces) - 1
            new.append(NewToken(text, ids[text], sub, requested=text == piece))
    data = proto.SerializeToString()
    check = _raw_processor(proto)
    unreachable = [
        t.token for t in new if t.requested and check.encode(t.token.replace(SPACE_MARK, " ")) != [t.id]
    ]
    return data, Expansion(tuple(new), tuple(existing), tuple(unreachable))


def _bpe_chain(
    segs: list[Any], ids: dict[str, int], score: float
) -> tuple[list[tuple[str, tuple[int, ...], float]], float]:
    """Merge-chain pieces over a SentencePiece segmentation (byte pieces fold into their character)."""
    symbols: list[tuple[str, list[int]]] = []
    for s in segs:
        if s.surface or not symbols:
            symbols.append((s.surface.replace(" ", SPACE_MARK), [s.id]))
        else:
            symbols[-1][1].append(s.id)
    chain = []
    cur, sub = symbols[0][0], list(symbols[0][1])
    for text, sym_ids in symbols[1:]:
        cur, sub = cur + text, sub + sym_ids
        if cur not in ids:
            chain.append((cur, tuple(sub), score))
            score -= 1.0
    return chain, score


@torch.no_grad()
def init_new_embeddings(model: Any, new_tokens: Iterable[NewToken]) -> int:
    """Resize `model` to hold every new id and set each new row to the mean of its sub-token rows.

    With `flat` the concatenated sub-token ids and `seg` the owning new token of each, the new rows
    are `index_add_(0, seg, W[flat]) / counts` [n_new, hidden] - one gather and one scatter-add,
    done on the old input embedding and (when not tied) on the old output embedding.
    Returns the new vocabulary size.
    """
    tokens = list(new_tokens)
    inp = model.get_input_embeddings()
    old_rows = inp.num_embeddings
    size = max([old_rows, *(t.id + 1 for t in tokens)])
    if not tokens:
        return old_rows
    if any(i >= old_rows for t in tokens for i in t.sub_ids):
        raise ConfigError("a sub-token id is outside the model's embedding; is this the model's tokenizer?")
    out = model.get_output_embeddings()
    old_in = inp.weight.detach().clone()
    tied = out is None or out.weight.data_ptr() == inp.weight.data_ptr()
    old_out = None if tied else out.weight.detach().clone()
    model.resize_token_embeddings(size, mean_resizing=False)
    lengths = torch.tensor([len(t.sub_ids) for t in tokens])
    flat = torch.tensor([i for t in tokens for i in t.sub_ids], dtype=torch.long)
    seg = torch.repeat_interleave(torch.arange(len(tokens)), lengths)
    rows = torch.tensor([t.id for t in tokens], dtype=torch.long)
    targets = [(model.get_input_embeddings().weight, old_in)]
    if old_out is not None:
        targets.append((model.get_output_embeddings().weight, old_out))
    for weight, old in targets:
        sums = torch.zeros(len(tokens), old.shape[1], dtype=old.dtype).index_add_(0, seg, old[flat])
        weight[rows] = (sums / lengths[:, None].to(old.dtype)).to(weight.dtype)
    model.config.vocab_size = size
    return size


def chars_per_token(encode: Callable[[str], list[int]], text: str) -> float:
    """Compression rate: characters of `text` per token."""
    n = len(encode(text))
    if n == 0:
        raise DataError("cannot measure compression on an empty text")
    return len(text) / n
