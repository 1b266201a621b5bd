"""Shared fixtures: offline environment, a hashing-embedder knowledge base on either Chroma backend,
a `chroma run` server on loopback, and a tiny valid PDF writer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from megalith.common.utils import free_loopback_port, require
from megalith_qa.config import ChunkingConfig
from megalith_qa.embedding import HashingEmbedder
from megalith_qa.index import ChunkStore, make_client
from megalith_qa.ingest import TextSplitter
from megalith_qa.knowledge import KnowledgeBase
from megalith_qa.llm import SmolLMGenerator


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    monkeypatch.setenv("ANONYMIZED_TELEMETRY", "False")
    monkeypatch.setenv("MEGALITH_DATA_DIR", str(tmp_path_factory.mktemp("megalith_data")))


def _chroma_executable() -> str:
    local = Path(sys.executable).parent / "chroma"
    found = str(local) if local.exists() else shutil.which("chroma")
    if not found:
        raise RuntimeError("the `chroma` command (shipped by the chromadb package) is not installed")
    return found


@pytest.fixture(scope="session")
def chroma_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`chroma run` on 127.0.0.1 with a temporary path; stopped at the end of the session."""
    port = free_loopback_port()
    path = tmp_path_factory.mktemp("chroma_server")
    log = (path / "server.log").open("wb")
    cmd = [
        _chroma_executable(),
        "run",
        "--path",
        str(path / "db"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "ANONYMIZED_TELEMETRY": "False"}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/v2/heartbeat", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"chroma server did not start: {(path / 'server.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()


SMALL_CHUNKS = ChunkingConfig(chunk_size=120, chunk_overlap=20)
ClientFactory = Callable[[], object]


@pytest.fixture(params=["embedded", "server"])
def client_factory(request: pytest.FixtureRequest, tmp_path: Path) -> ClientFactory:
    """A function returning a fresh Chroma client on the same storage (embedded dir or server)."""
    if request.param == "embedded":
        return lambda: make_client(chroma_dir=tmp_path / "chroma")
    url = request.getfixturevalue("chroma_server")
    return lambda: make_client(chroma_url=url)


@pytest.fixture
def collection_name() -> str:
    """A collection name unique to the test (the Chroma server is shared by the session)."""
    return f"test-{uuid.uuid4().hex[:16]}"


def make_kb(client: object, name: str, dim: int = 256) -> KnowledgeBase:
    return KnowledgeBase(ChunkStore(client, name), HashingEmbedder(dim), TextSplitter(SMALL_CHUNKS))


@pytest.fixture
def kb(client_factory: ClientFactory, collection_name: str) -> KnowledgeBase:
    return make_kb(client_factory(), collection_name)


@pytest.fixture
def embedded_kb(tmp_path: Path) -> KnowledgeBase:
    return make_kb(make_client(chroma_dir=tmp_path / "chroma_e"), "unit-tests")


def make_pdf(lines: list[str]) -> bytes:
    """A minimal one-page PDF 1.4 with Helvetica text lines (xref offsets computed exactly)."""
    ops = ["BT", "/F1 12 Tf", "72 720 Td", "14 TL"]
    for line in lines:
        esc = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
        ops.append(f"({esc}) Tj T*")
    ops.append("ET")
    stream = "\n".join(ops).encode("latin-1")
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length " + str(len(stream)).encode() + b" >>\nstream\n" + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    for off in offsets:
        out += f"{off:010d} 00000 n \n".encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


SAMPLE_FILES: dict[str, bytes] = {
    "notes.txt": b"The zebra migration crosses the river every spring. Lions wait at the water.",
    "guide.md": b"# Kettle guide\n\nA **kettle** boils water for tea. Descale the kettle monthly.",
    "page.html": b"<html><head><title>x</title><script>var hidden=1;</script></head><body><h1>Volcano</h1><p>Magma rises through the crater.</p></body></html>",
    "table.csv": b"planet,moons\nJupiter,95\nSaturn,146\n",
    "record.json": b'{"telescope": {"name": "Hubble", "launched": 1990}}',
    "lines.jsonl": b'{"bird": "albatross", "wingspan_m": 3.5}\n{"bird": "condor", "wingspan_m": 3.0}\n',
    "report.pdf": make_pdf(
        ["Glacier report: the glacier retreated forty metres.", "Ice cores show warming."]
    ),
}


@pytest.fixture
def sample_files() -> dict[str, bytes]:
    """One small file per supported type, each with a distinctive phrase."""
    return dict(SAMPLE_FILES)


@pytest.fixture
def pdf_factory() -> Callable[[list[str]], bytes]:
    """`make_pdf`: text lines -> the bytes of a minimal valid one-page PDF."""
    return make_pdf


@pytest.fixture
def kb_factory() -> Callable[[object, str], KnowledgeBase]:
    return make_kb


@pytest.fixture
def free_port_factory() -> Callable[[], int]:
    return free_loopback_port


@pytest.fixture
def serve_app() -> Iterator[Callable[[object], str]]:
    """`serve_app(app)` runs the ASGI app with uvicorn on a free loopback port in a thread and
    returns its base URL; every server started is stopped at the end of the test."""
    import uvicorn

    servers: list[tuple[Any, threading.Thread]] = []

    def start(app: object) -> str:
        port = free_loopback_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))  # type: ignore[arg-type]
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 20
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def make_pipeline(tmp_path: Path) -> Callable[..., object]:
    """Build a QAPipeline on an embedded database with the hashing embedder and the extractive generator."""
    from megalith_qa.config import QAConfig, ServerConfig
    from megalith_qa.llm import ExtractiveGenerator
    from megalith_qa.pipeline import build_pipeline

    def build(generator: object | None = None, **server: object) -> object:
        config = QAConfig(
            data_dir=tmp_path / "data", llm="extractive", chunking=SMALL_CHUNKS, server=ServerConfig(**server)
        )  # type: ignore[arg-type]
        pipeline = build_pipeline(config, "hashing", generator or ExtractiveGenerator())
        corpus = {
            "python.md": "The pass statement does nothing. It is a placeholder where a statement is required.",
            "tea.txt": "Green tea is steeped at 80 degrees. Black tea needs boiling water.",
            "rivers.txt": "The Nile is the longest river in Africa. The Amazon carries the most water.",
        }
        from megalith_qa.ingest import load_bytes

        for name, text in corpus.items():
            pipeline.kb.ingest(load_bytes(name, text.encode()))
        return pipeline

    return build


class _FakeTokenizer:
    eos_token_id = 0

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> dict[str, Any]:
        torch = require("torch")
        return {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(f"w{i} " for i in ids)


class _FakeModel:
    """Stands in for SmolLM2: `mode` 'fail' raises like transformers does for max_new_tokens=0, 'hang' never
    produces a token (until released), 'ok' streams `max_new_tokens` tokens without an end-of-sequence,
    'slow' streams one every 50 ms and stops when the stopping criteria say so (`stopped_after` tokens)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.release = threading.Event()
        self.stopped_after: int | None = None
        self.generation_config = type("GC", (), {"eos_token_id": 0})()

    def generate(self, **kwargs: Any) -> Any:
        torch = require("torch")
        self.kwargs = kwargs
        if self.mode == "fail":
            raise ValueError("max_new_tokens must be greater than 0")
        if self.mode == "hang":
            self.release.wait(30)
            return kwargs["input_ids"]
        streamer, prompt = kwargs["streamer"], kwargs["input_ids"]
        streamer.put(prompt)
        if self.mode == "slow":
            ids = prompt
            for i in range(kwargs["max_new_tokens"]):
                if bool(kwargs["stopping_criteria"](ids, None).all()):
                    self.stopped_after = i
                    break
                time.sleep(0.05)
                ids = torch.cat([ids, torch.tensor([[i + 1]])], dim=1)
                streamer.put(ids[:, -1])
            streamer.end()
            return ids
        new = torch.arange(1, kwargs["max_new_tokens"] + 1).unsqueeze(0)
        for i in range(new.shape[1]):
            streamer.put(new[:, i])
        streamer.end()
        return torch.cat([prompt, new], dim=1)


@pytest.fixture
def fake_smollm() -> Iterator[Callable[..., tuple[SmolLMGenerator, _FakeModel]]]:
    """`fake_smollm(mode, **SmolLMGenerator kwargs)` -> (generator, fake model): the real streaming and
    threading code of SmolLMGenerator around a fake model (no weights loaded). Hung models are released."""
    models: list[_FakeModel] = []

    def build(mode: str, **kwargs: Any) -> tuple[SmolLMGenerator, _FakeModel]:
        gen = SmolLMGenerator(**kwargs)
        models.append(_FakeModel(mode))
        gen._model, gen._tokenizer = models[-1], _FakeTokenizer()
        return gen, models[-1]

    yield build
    for model in models:
        model.release.set()
