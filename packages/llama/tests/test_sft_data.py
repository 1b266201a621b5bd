"""SFT loss mask (golden, hand-written) and NEFTune."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megalith.common.errors import ConfigError, DataError
from megalith_llama.sft_data import (
    collate_sft,
    enable_neftune,
    load_sft_jsonl,
    neftune_noise,
    tokenize_conversation,
)

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello friend"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "see you"},
]


@pytest.fixture
def word_tokenizer():
    """Word-level tokenizer: words split on spaces, newlines kept as their own token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "\n", "system", "user", "assistant"]
    words += "be brief hi there hello friend bye see you".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.Split("\n", behavior="isolated")]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    hf.chat_template = CHATML
    return hf


def test_golden_loss_mask(word_tokenizer) -> None:
    ex = tokenize_conversation(word_tokenizer, CONVERSATION)
    tokens = word_tokenizer.convert_ids_to_tokens(list(ex.input_ids))
    S, E, N = "<|im_start|>", "<|im_end|>", "\n"
    assert tokens == [
        S, "system", N, "be", "brief", E, N,
        S, "user", N, "hi", "there", E, N,
        S, "assistant", N, "hello", "friend", E, N,
        S, "user", N, "bye", E, N,
        S, "assistant", N, "see", "you", E, N,
    ]  # fmt: skip
    learned = [t for t, label in zip(tokens, ex.labels) if label != -100]
    assert learned == ["hello", "friend", E, "see", "you", E]
    positions = [i for i, label in enumerate(ex.labels) if label != -100]
    assert positions == [17, 18, 19, 30, 31, 32]
    assert all(ex.labels[i] == ex.input_ids[i] for i in positions)


def test_mask_on_byte_level_bpe(bpe_tokenizer) -> None:
    ex = tokenize_conversation(bpe_tokenizer, CONVERSATION)
    learned = [i for i, label in zip(ex.input_ids, ex.labels) if label != -100]
    spans, cur = [], []
    for i, label in zip(ex.input_ids, ex.labels):
        if label != -100:
            cur.append(i)
        elif cur:
            spans.append(bpe_tokenizer.decode(cur))
            cur = []
    assert spans == ["hello friend<|im_end|>", "see you<|im_end|>"]
    assert len(learned) < len(ex.input_ids)


def test_load_jsonl_collate_and_bad_lines(word_tokenizer, tmp_path: Path) -> None:
    f = tmp_path / "sft.jsonl"
    good = json.dumps({"messages": CONVERSATION[1:3]})
    f.write_text(f"{good}\n\n{json.dumps({'messages': [{'role': 'bot', 'content': 'x'}]})}\n{good}\n")
    with pytest.raises(DataError, match=rf"{f}:3: message 0 must be"):
        load_sft_jsonl(f, word_tokenizer)
    examples = load_sft_jsonl(f, word_tokenizer, skip_bad_lines=True)
    assert len(examples) == 2
    f.write_text(json.dumps({"messages": CONVERSATION[:2]}) + "\n")
    with pytest.raises(DataError, match=rf"{f}:1: the conversation has no assistant message"):
        load_sft_jsonl(f, word_tokenizer)
    short = tokenize_conversation(word_tokenizer, CONVERSATION, max_length=5)
    batch = collate_sft([short, examples[0]], pad_id=word_tokenizer.pad_token_id)
    assert batch["input_ids"].shape == (2, len(examples[0].input_ids))
    assert batch["attention_mask"][0].tolist() == [1] * 5 + [0] * (batch["input_ids"].shape[1] - 5)
    assert (batch["labels"][0, 5:] == -100).all()


def test_neftune_noise_bounds_and_hook() -> None:
    emb = torch.zeros(2, 8, 32)
    noisy = neftune_noise(emb, alpha=5.0, generator=torch.Generator().manual_seed(0))
    bound = 5.0 / (8 * 32) ** 0.5  # alpha / sqrt(L * d)
    assert noisy.abs().max() <= bound and noisy.abs().max() > 0.9 * bound
    assert abs(noisy.mean()) < 0.1 * bound  # uniform on [-bound, bound] is centred

    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    ids = torch.tensor([[1, 2, 3, 4]])
    model.eval()
    clean = model(input_ids=ids).logits
    handle = enable_neftune(model, alpha=5.0)
    assert torch.equal(model(input_ids=ids).logits, clean)  # eval mode: no noise
    model.train()
    assert not torch.allclose(model(input_ids=ids).logits, clean)
    handle.remove()
    model.eval()
    assert torch.equal(model(input_ids=ids).logits, clean)
    with pytest.raises(ConfigError, match="-1"):
        enable_neftune(model, alpha=-1)
