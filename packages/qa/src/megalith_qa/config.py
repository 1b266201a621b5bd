"""Configuration of the QA service: one frozen dataclass that validates itself."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from megalith.common.errors import ConfigError

DEFAULT_DATA_DIR = Path("~/.cache/megalith/qa")
DATA_DIR_ENV = "MEGALITH_DATA_DIR"
LLM_CHOICES = ("smollm2", "extractive")


def resolve_data_dir(explicit: str | Path | None = None) -> Path:
    """`--data-dir` wins, then env `MEGALITH_DATA_DIR`, then `~/.cache/megalith/qa`."""
    raw = explicit if explicit else os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
    return Path(raw).expanduser().resolve()


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_chroma_url(url: str) -> tuple[str, int, bool]:
    """(host, port, ssl) of a Chroma server URL `http(s)://host[:port]` (port defaults: 8000, https 443)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https"):
        raise ConfigError(f"--chroma-url must start with http:// or https://, got {url!r}")
    if not parsed.hostname:
        raise ConfigError(f"--chroma-url {url!r} has no host")
    try:
        port = parsed.port
    except ValueError as exc:  # urllib: "Port out of range 0-65535" or "Port could not be cast to integer"
        raise ConfigError(f"--chroma-url {url!r}: invalid port ({exc})") from exc
    return parsed.hostname, port or (443 if parsed.scheme == "https" else 8000), parsed.scheme == "https"


@dataclass(frozen=True)
class FusionWeights:
    """Reciprocal-rank-fusion weights: score(d) = w_dense/(k + r_dense(d)) + w_bm25/(k + r_bm25(d))."""

    dense: float = 1.0
    bm25: float = 1.0

    def __post_init__(self) -> None:
        if self.dense < 0 or self.bm25 < 0 or self.dense + self.bm25 == 0:
            raise ConfigError(f"fusion weights must be >= 0 and not both 0, got {self}")


def _default_weights() -> dict[str, FusionWeights]:
    """English: MiniLM is the stronger ranker on the shipped evaluation set, BM25 adds exact terms.
    Chinese: MiniLM was trained on English, so character-bigram BM25 leads."""
    return {"en": FusionWeights(1.0, 0.5), "zh": FusionWeights(0.5, 1.0)}


@dataclass(frozen=True)
class RetrievalConfig:
    """How many chunks to fetch from each retriever, the RRF constant k and per-language weights."""

    top_k: int = 5
    candidates: int = 30
    rrf_k: int = 60
    weights: dict[str, FusionWeights] = field(default_factory=_default_weights)
    cache_size: int = 1024

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.candidates < self.top_k:
            raise ConfigError(
                f"need 1 <= top_k <= candidates, got top_k={self.top_k} candidates={self.candidates}"
            )
        if self.rrf_k < 1:
            raise ConfigError(f"rrf_k must be >= 1, got {self.rrf_k}")

    def weights_for(self, language: str) -> FusionWeights:
        return self.weights.get(language, self.weights.get("en", FusionWeights()))


@dataclass(frozen=True)
class ChunkingConfig:
    """Chunk size and overlap in characters (Chinese text is denser: one character is roughly one word)."""

    chunk_size: int = 800
    chunk_overlap: int = 100

    def __post_init__(self) -> None:
        if self.chunk_size < 16:
            raise ConfigError(f"chunk_size must be >= 16, got {self.chunk_size}")
        if not 0 <= self.chunk_overlap < self.chunk_size:
            raise ConfigError(f"need 0 <= chunk_overlap < chunk_size, got {self.chunk_overlap}")


def check_no_repeat_ngram(n: int, name: str = "no_repeat_ngram") -> None:
    """`n` turns the answer's no-repeat rule off (0) or sets its n-gram length (>= 2)."""
    if n < 0 or n == 1:
        raise ConfigError(f"{name} must be 0 (off) or >= 2, got {n}")


@dataclass(frozen=True)
class ServerConfig:
    """Network and limits. A non-loopback host requires an API key (Bearer auth)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_upload_bytes: int = 10 * 1024 * 1024
    max_new_tokens: int = 128
    no_repeat_ngram: int = 6  # SmolLM2 never repeats an n-gram of its own answer (0: off)

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            # an empty key (say `--api-key "$UNSET"`) would admit `Authorization: Bearer ` with no
            # token, and one with outer spaces could never match (the header's token is stripped)
            raise ConfigError(
                "--api-key is empty or starts or ends with whitespace; give a non-empty key without "
                "outer spaces, or leave the option out to run without one (loopback hosts only)"
            )
        if not is_loopback(self.host) and not self.api_key:
            raise ConfigError(f"--host {self.host!r} is not loopback: an --api-key is required")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.max_upload_bytes < 1:
            raise ConfigError(f"max_upload_bytes must be >= 1, got {self.max_upload_bytes}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_no_repeat_ngram(self.no_repeat_ngram, "--no-repeat-ngram")


@dataclass(frozen=True)
class QAConfig:
    """Everything the pipeline needs; `chroma_url=None` means the embedded persistent database."""

    data_dir: Path = field(default_factory=resolve_data_dir)
    chroma_url: str | None = None
    collection: str = "megalith_qa"
    llm: str = "smollm2"
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    memory_tokens: int = 512

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        if self.llm not in LLM_CHOICES:
            raise ConfigError(f"llm must be one of {LLM_CHOICES}, got {self.llm!r}")
        if self.chroma_url is not None:
            parse_chroma_url(self.chroma_url)
        if self.memory_tokens < 32:
            raise ConfigError(f"memory_tokens must be >= 32, got {self.memory_tokens}")

    @property
    def chroma_dir(self) -> Path:
        return self.data_dir / "chroma"
