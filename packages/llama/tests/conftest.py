"""Shared fixtures: offline HF environment, a tiny BPE tokenizer with a ChatML template, a tiny model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

WORDS = (
    "the model learns tokens from text and the data is packed into sequences of fixed length "
    "zero redundancy optimizer shards states across ranks while pipeline stages pass activations "
    "tensor parallel layers split weights megalith trains llama on cpu with gloo"
).split()

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_sentences(n: int, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English lines from WORDS."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


@pytest.fixture(name="make_sentences")
def _make_sentences_fixture():
    """The `make_sentences(n, seed)` helper (test modules cannot import conftest under importlib mode)."""
    return make_sentences


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.getbasetemp() / "hf_home"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def build_bpe_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on generated sentences, wrapped as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_sentences(300), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<|endoftext|>",
    )
    hf.chat_template = CHATML
    return hf


@pytest.fixture(name="build_bpe_tokenizer")
def _build_bpe_tokenizer_fixture():
    return build_bpe_tokenizer


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bpe_tok")
    build_bpe_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def bpe_tokenizer(bpe_tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bpe_tokenizer_dir))
