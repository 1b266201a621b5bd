"""Vocabulary expansion: BPE (tokenizers) and SentencePiece (unigram and BPE), plus embedding init."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from megalith.common.errors import ConfigError, DataError
from megalith_llama.tokenizer import (
    chars_per_token,
    expand_bpe,
    expand_sentencepiece,
    init_new_embeddings,
    read_new_tokens,
)

NEW_WORDS = ["▁zeppelin", "▁quartz", "▁banjo", "▁xylophonically"]


def _tiny_llama(vocab: int, tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _check_means(model, old_in, old_out, expansion) -> None:
    """Reference: a plain Python mean per new token, on the embeddings saved before expansion."""
    emb = model.get_input_embeddings().weight
    for t in expansion.new_tokens:
        torch.testing.assert_close(emb[t.id], old_in[list(t.sub_ids)].mean(0), rtol=1e-6, atol=1e-6)
        if old_out is not None:
            out = model.get_output_embeddings().weight
            torch.testing.assert_close(out[t.id], old_out[list(t.sub_ids)].mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tie", [True, False])
def test_bpe_expansion(build_bpe_tokenizer, make_sentences, tie: bool) -> None:
    hf = build_bpe_tokenizer()
    old = hf.backend_tokenizer
    assert len(old.encode(" model").ids) == 1  # a word of the training text: already one token
    new, exp = expand_bpe(old, [*NEW_WORDS, "▁model", "two words"])
    assert exp.unreachable == () and exp.existing == ("▁model",)
    requested = {t.token: t for t in exp.new_tokens if t.requested}
    assert set(requested) == {"Ġzeppelin", "Ġquartz", "Ġbanjo", "Ġxylophonically", "two words"}
    assert requested["two words"].added_token
    for word in ["zeppelin", "quartz", "banjo", "xylophonically"]:
        tok = requested["Ġ" + word]
        assert new.encode(f"a {word}").ids[-1] == tok.id  # the new token is used
        assert list(tok.sub_ids) == old.encode(" " + word).ids  # sub-tokens = old segmentation
    text = "the zeppelin trains two words on quartz " + " ".join(make_sentences(20))
    assert new.decode(new.encode(text).ids) == text
    assert old.decode(old.encode(text).ids) == text
    assert chars_per_token(lambda s: new.encode(s).ids, text) > chars_per_token(
        lambda s: old.encode(s).ids, text
    )

    model = _tiny_llama(old.get_vocab_size(), tie)
    old_in = model.get_input_embeddings().weight.detach().clone()
    old_out = None if tie else model.get_output_embeddings().weight.detach().clone()
    size = init_new_embeddings(model, exp.new_tokens)
    assert size == new.get_vocab_size() == model.get_input_embeddings().num_embeddings
    assert model.get_output_embeddings().weight.shape[0] == size
    _check_means(model, old_in, old_out, exp)
    assert torch.equal(model.get_input_embeddings().weight[: len(old_in)], old_in)  # old rows untouched
    if tie:
        assert (
            model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        )


def _train_sentencepiece(lines: list[str], model_type: str) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=60, model_type=model_type, hard_vocab_limit=False,
        character_coverage=1.0, minloglevel=2, bos_id=1, eos_id=2, unk_id=0, pad_id=3,
    )  # fmt: skip
    return buf.getvalue()


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_sentencepiece_expansion(make_sentences, model_type: str) -> None:
    import sentencepiece as spm

    lines = make_sentences(400, seed=5)
    old_bytes = _train_sentencepiece(lines, model_type)
    old = spm.SentencePieceProcessor(model_proto=old_bytes)
    assert len(old.encode("the")) == 1  # frequent word: already a piece
    new_bytes, exp = expand_sentencepiece(old_bytes, [*NEW_WORDS, "▁the"])
    new = spm.SentencePieceProcessor(model_proto=new_bytes)
    assert exp.unreachable == ()
    assert exp.existing == ("▁the",)  # already a piece of the trained model
    requested = {t.token: t for t in exp.new_tokens if t.requested}
    assert set(requested) == set(NEW_WORDS)
    for piece, tok in requested.items():
        word = piece[1:]
        assert new.id_to_piece(tok.id) == piece
        assert new.encode(f"the {word}")[-1] == tok.id  # used in running text
        assert list(tok.sub_ids) == old.encode(word)  # old segmentation, with the dummy prefix
    if model_type == "unigram":
        assert all(t.requested for t in exp.new_tokens)
    text = "the zeppelin trains on quartz " + " ".join(lines[:30])
    assert new.decode(new.encode(text)) == text
    assert len(new.encode(text)) < len(old.encode(text))

    model = _tiny_llama(old.get_piece_size(), tie=False)
    old_in = model.get_input_embeddings().weight.detach().clone()
    old_out = model.get_output_embeddings().weight.detach().clone()
    assert init_new_embeddings(model, exp.new_tokens) == new.get_piece_size()
    _check_means(model, old_in, old_out, exp)


def test_read_new_tokens(tmp_path: Path) -> None:
    f = tmp_path / "new.txt"
    f.write_text("▁alpha\nbeta\n\n▁alpha\n gamma\n", encoding="utf-8")
    assert read_new_tokens(f) == ["▁alpha", "beta", " gamma"]
    f.write_text("ok\n   \n")
    with pytest.raises(DataError, match=rf"{f}:2"):
        read_new_tokens(f)
    with pytest.raises(DataError, match="not found"):
        read_new_tokens(tmp_path / "nope.txt")


def test_rejects_wrong_model_types(build_bpe_tokenizer) -> None:
    from tokenizers import Tokenizer, models

    wordlevel = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ConfigError, match="WordLevel"):
        expand_bpe(wordlevel, ["b"])
    model = _tiny_llama(10, tie=True)
    from megalith_llama.tokenizer import NewToken

    with pytest.raises(ConfigError, match="outside the model's embedding"):
        init_new_embeddings(model, [NewToken("x", 10, (3, 12))])
