"""Evaluation against a hand-written loss reference, and the streaming chat loop."""

from __future__ import annotations

import io
import math

import numpy as np
import torch

from megalith_llama.chat import ChatConfig, chat_loop
from megalith_llama.corpus import builtin_documents
from megalith_llama.eval import SequenceList, evaluate, heldout_sequences
from megalith_llama.model import load_model


def test_evaluate_matches_manual_cross_entropy(bpe_tokenizer) -> None:
    model = load_model("tiny-32", tokenizer=bpe_tokenizer, seed=4).model.eval()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 400, size=(5, 12))
    mask = (rng.random((5, 12)) > 0.3).astype(np.uint8)
    result = evaluate(model, SequenceList(ids, mask), batch_size=2)

    total, count = 0.0, 0
    with torch.no_grad():
        for row, m in zip(ids, mask):
            logp = torch.log_softmax(model(torch.tensor(row[None])).logits[0], dim=-1)
            for t in range(1, 12):  # token t is predicted from position t - 1
                if m[t]:
                    total -= logp[t - 1, row[t]].item()
                    count += 1
    assert result.tokens == count and result.sequences == 5
    assert math.isclose(result.loss, total / count, rel_tol=1e-5)
    assert math.isclose(result.perplexity, math.exp(total / count), rel_tol=1e-5)


def test_heldout_sequences_cover_the_heldout_split(bpe_tokenizer) -> None:
    data = heldout_sequences(bpe_tokenizer, seq_len=256)
    docs = builtin_documents("heldout")
    n_tokens = sum(len(bpe_tokenizer.encode(d.text, add_special_tokens=False)) + 1 for d in docs)
    assert data.input_ids.shape[1] == 256
    assert int((data.labels != -100).sum()) == n_tokens
    assert len(heldout_sequences(bpe_tokenizer, seq_len=256, max_sequences=3)) == 3


def test_chat_loop_streams_the_greedy_reply(bpe_tokenizer) -> None:
    model = load_model("tiny-32", tokenizer=bpe_tokenizer, seed=5).model.eval()
    out = io.StringIO()
    config = ChatConfig(max_new_tokens=6, temperature=0.0, system="be brief")
    messages = chat_loop(model, bpe_tokenizer, config, io.StringIO("the model\n\n/exit\n"), out)
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]

    prompt = bpe_tokenizer.apply_chat_template(
        messages[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        ref = model.generate(
            **prompt, max_new_tokens=6, do_sample=False, pad_token_id=bpe_tokenizer.pad_token_id
        )
    expected = bpe_tokenizer.decode(ref[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert messages[2]["content"] == expected
    assert out.getvalue() == f"you> assistant> {expected}\nyou> you> "


def test_chat_config_names_the_bad_flag() -> None:
    import pytest

    from megalith.common.errors import ConfigError

    for kwargs, message in (
        ({"max_new_tokens": 0}, "--max-new-tokens must be > 0, got 0"),
        ({"temperature": -0.5}, "--temperature must be >= 0 (0 is greedy), got -0.5"),
        ({"temperature": float("nan")}, "--temperature must be >= 0 (0 is greedy), got nan"),
        ({"top_p": 0.0}, "--top-p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "--top-p must be in (0, 1], got 1.5"),
    ):
        with pytest.raises(ConfigError) as err:
            ChatConfig(**kwargs)
        assert str(err.value) == message
    assert ChatConfig(temperature=0.0, top_p=1.0).max_new_tokens == 256
