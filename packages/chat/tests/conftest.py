"""Shared fixtures for megalith-chat tests: offline Hugging Face env and a tiny chat tokenizer."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# ---- shared by the Ray engine tests (one local cluster and one tiny policy per session) ----------

ENGINE_REWARDS = textwrap.dedent(
    """
    import time

    def digits(completion, sample):
        # fraction of the answer's digit positions reproduced (partial credit, exact = 1.0)
        got, want = completion.replace(" ", ""), str(sample["answer"])
        return sum(a == b for a, b in zip(got, want)) / len(want)

    def faulty(completion, sample):
        first = completion.replace(" ", "")[:1]
        if first in "02468" and first:
            raise RuntimeError("reward exploded")
        if first in "13579" and first:
            time.sleep(3600)
        return 0.5
    """
)
RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
TINY_SPECIALS = ["<unk>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One local Ray cluster (2 CPUs, loopback only) for the whole session.

    Reward functions used by the engine tests live in ``chat_engine_test_rewards``, written to a
    temporary folder that is put on the workers' ``PYTHONPATH``.
    """
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "chat_engine_test_rewards.py").write_text(ENGINE_REWARDS)
    saved = {k: os.environ.get(k) for k in [*RAY_ENV, "PYTHONPATH", "HF_HOME"]}
    os.environ.update(RAY_ENV)
    os.environ["HF_HOME"] = str(tmp_path_factory.mktemp("hf_home_ray"))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), saved["PYTHONPATH"]) if p)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (hidden 64) and a word-level tokenizer over the reverse task's words.

    The vocabulary is the 10 digits, the words of the reverse prompt and 5 specials (26 tokens).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megalith_chat.data.tasks import reverse_digits_task

    path = tmp_path_factory.mktemp("tiny_policy")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    corpus = [p.prompt[0]["content"] for p in reverse_digits_task(50, 0, 2, 2)] + ["0 1 2 3 4 5 6 7 8 9"]
    tok.train_from_iterator(corpus, trainer=trainers.WordLevelTrainer(special_tokens=TINY_SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|end|>"
    )
    fast.chat_template = TINY_TEMPLATE
    fast.save_pretrained(str(path))
    _save_tiny_llama(path, fast, hidden=64, tie_word_embeddings=False)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer: Any) -> Path:
    """A tiny random Llama (hidden 32, 2 layers, GQA 4/2) saved with the chat tokenizer; read-only for tests."""
    path = tmp_path_factory.mktemp("tiny_llama")
    chat_tokenizer.save_pretrained(str(path))
    _save_tiny_llama(path, chat_tokenizer, hidden=32)
    return path


def _save_tiny_llama(path: Path, tokenizer: Any, hidden: int, **extra: Any) -> None:
    """A random 2-layer Llama (GQA 4/2, MLP 2 x hidden) over `tokenizer`'s vocabulary, seed 0, saved to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **extra,
    )
    LlamaForCausalLM(config).save_pretrained(str(path))
