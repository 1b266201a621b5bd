"""Shared fixtures for megalith-chat tests: offline Hugging Face env and a tiny chat tokenizer."""

from __future__ import annotations

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CORPUS = [
    "hello there how are you today",
    "i am fine thanks what is two plus two",
    "four the answer is four",
    "you are a helpful assistant",
    "reverse the digits 1 2 3 think answer",
]


@pytest.fixture(autouse=True)
def _offline_hf(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))


def build_chat_tokenizer(template: str | None = CHAT_TEMPLATE, specials: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    """A word-level tokenizer built in-process, with a Jinja chat template; no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = [*SPECIAL_TOKENS, *specials]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    trainer = trainers.WordLevelTrainer(special_tokens=special, min_frequency=1)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|end|>"
    )
    fast.add_special_tokens({"additional_special_tokens": special[2:]})
    if template is not None:
        fast.chat_template = template
    return fast


@pytest.fixture(scope="session")
def chat_tokenizer():  # type: ignore[no-untyped-def]
    return build_chat_tokenizer()


@pytest.fixture(scope="session")
def make_chat_tokenizer():  # type: ignore[no-untyped-def]
    """The builder itself, for tests that need another template or extra special tokens."""
    return build_chat_tokenizer
