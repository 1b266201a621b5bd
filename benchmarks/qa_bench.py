"""megalith-qa benchmark: ingestion throughput, retrieval latency at 10k chunks (embedded Chroma,
Chroma server, in-memory numpy baseline), end-to-end answer latency (extractive and SmolLM2), and 50
concurrent HTTP retrieval requests on loopback. Prints a table and writes benchmarks/results/qa_bench.json.

    uv run python benchmarks/qa_bench.py [--chunks 10000] [--queries 200] [--skip-smollm]

Retrieval-latency corpora use the hashing embedder at 384 dimensions (MiniLM's width): the store's
latency does not depend on where the vectors came from, and embedding 10k chunks with MiniLM on two
CPU cores would dominate the run. Ingestion throughput is measured with the real MiniLM model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megalith.common.utils import free_loopback_port
from megalith_qa.config import ChunkingConfig, QAConfig
from megalith_qa.documents import Chunk, content_hash, doc_id_for
from megalith_qa.embedding import HashingEmbedder, MiniLMEmbedder
from megalith_qa.index import ChunkStore, make_client
from megalith_qa.ingest import TextSplitter, builtin_documents
from megalith_qa.knowledge import KnowledgeBase
from megalith_qa.llm import ExtractiveGenerator, SmolLMGenerator
from megalith_qa.pipeline import QAPipeline, build_pipeline

RESULTS = Path(__file__).parent / "results" / "qa_bench.json"
QUESTIONS = [
    "How does the with statement work?",
    "What does the pass statement do?",
    "How are default parameter values evaluated?",
    "What is the difference between is and ==?",
    "How do I raise an exception from another one?",
]


def pct(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values) * 1000
    return {
        "p50_ms": round(float(np.percentile(arr, 50)), 3),
        "p95_ms": round(float(np.percentile(arr, 95)), 3),
    }


def bench_ingest(tmp: Path, docs: int) -> dict[str, float]:
    """Chunks per second through split + MiniLM embedding + embedded Chroma add."""
    kb = KnowledgeBase(
        ChunkStore(make_client(tmp / "ingest"), "bench-ingest"), MiniLMEmbedder(), TextSplitter()
    )
    sample = builtin_documents()[:docs]
    kb.embedder.embed(["warm up"])
    start = time.perf_counter()
    results = kb.ingest_many(sample)
    elapsed = time.perf_counter() - start
    chunks = sum(r.chunks for r in results)
    return {
        "docs": len(sample),
        "chunks": chunks,
        "seconds": round(elapsed, 2),
        "chunks_per_s": round(chunks / elapsed, 2),
    }


def synthetic_chunks(n: int) -> list[str]:
    splitter = TextSplitter(ChunkingConfig(chunk_size=240, chunk_overlap=0))
    base = [c for d in builtin_documents() for c in splitter.split_text(d.text)]
    return [f"{base[i % len(base)]} [variant {i // len(base)}]" for i in range(n)]


def fill_store(store: ChunkStore, texts: list[str], vectors: np.ndarray, per_doc: int = 1000) -> None:
    for start in range(0, len(texts), per_doc):
        source = f"synthetic-{start // per_doc}.txt"
        doc_id = doc_id_for(source)
        part = texts[start : start + per_doc]
        chunks = [
            Chunk(f"{doc_id}:{i}", t, source, doc_id, i, content_hash(source)) for i, t in enumerate(part)
        ]
        store.replace(doc_id, chunks, vectors[start : start + len(part)])


def time_queries(search, queries: np.ndarray) -> dict[str, float]:  # type: ignore[no-untyped-def]
    lat = []
    for q in queries:
        t = time.perf_counter()
        search(q)
        lat.append(time.perf_counter() - t)
    return pct(lat)


def start_chroma_server(path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_loopback_port()
    exe = (
        str(Path(sys.executable).parent / "chroma")
        if (Path(sys.executable).parent / "chroma").exists()
        else shutil.which("chroma")
    )
    cmd = [str(exe), "run", "--path", str(path), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "ANONYMIZED_TELEMETRY": "False"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/api/v2/heartbeat", timeout=2).close()
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("chroma server did not start")


def bench_retrieval(tmp: Path, n: int, n_queries: int) -> dict[str, object]:
    emb = HashingEmbedder(384)
    texts = synthetic_chunks(n)
    vectors = emb.embed(texts)
    queries = emb.embed([texts[i] for i in np.random.default_rng(0).integers(0, n, n_queries)])
    out: dict[str, object] = {"chunks": n, "queries": n_queries, "k": 10}
    matrix = vectors.copy()
    out["numpy_baseline"] = time_queries(lambda q: np.argpartition(-(matrix @ q), 10)[:10], queries)
    embedded = ChunkStore(make_client(tmp / "retrieval"), "bench-retrieval")
    fill_store(embedded, texts, vectors)
    out["chroma_embedded"] = time_queries(lambda q: embedded.search(q, 10), queries)
    kb = KnowledgeBase(embedded, emb, TextSplitter())
    kb.bm25()
    out["bm25"] = time_queries(lambda q: kb.bm25_search(QUESTIONS[0], 10), queries[:50])
    proc, url = start_chroma_server(tmp / "server")
    try:
        remote = ChunkStore(make_client(chroma_url=url), "bench-retrieval")
        fill_store(remote, texts, vectors)
        out["chroma_server"] = time_queries(lambda q: remote.search(q, 10), queries)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    return out


def small_pipeline(tmp: Path, generator) -> QAPipeline:  # type: ignore[no-untyped-def]
    config = QAConfig(data_dir=tmp / "e2e", llm="extractive")
    pipe = build_pipeline(config, HashingEmbedder(384), generator)
    pipe.kb.ingest_many([d for d in builtin_documents() if d.source.startswith("pydoc:")][:30])
    return pipe


def bench_end_to_end(tmp: Path, skip_smollm: bool) -> dict[str, object]:
    gens: list[tuple[str, object]] = [("extractive", ExtractiveGenerator())]
    if not skip_smollm:
        gens.append(("smollm2", SmolLMGenerator(cache_dir=tmp / "models")))
    out: dict[str, object] = {}
    for name, gen in gens:
        pipe = small_pipeline(tmp / name, gen)
        load = time.perf_counter()
        getattr(gen, "load", lambda: None)()
        load_s = time.perf_counter() - load
        lat = []
        for q in QUESTIONS:
            t = time.perf_counter()
            pipe.answer(q, max_new_tokens=48)
            lat.append(time.perf_counter() - t)
        out[name] = {**pct(lat), "load_s": round(load_s, 2), "max_new_tokens": 48}
    return out


def bench_http(tmp: Path, concurrency: int = 50) -> dict[str, object]:
    import httpx
    import uvicorn

    from megalith_qa.server import create_app

    pipe = small_pipeline(tmp / "http", ExtractiveGenerator())
    port = free_loopback_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(pipe), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, float]:
        t = time.perf_counter()
        body = {"messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}]}
        resp = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        return resp.status_code, time.perf_counter() - t

    async def run() -> list[tuple[int, float]]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, i) for i in range(concurrency)))

    start = time.perf_counter()
    results = asyncio.run(run())
    wall = time.perf_counter() - start
    server.should_exit = True
    thread.join(timeout=10)
    errors = sum(code != 200 for code, _ in results)
    return {
        "requests": concurrency,
        "errors": errors,
        "wall_s": round(wall, 2),
        **pct([t for _, t in results]),
    }


def bench_restart(data_dir: Path) -> dict[str, float]:
    """Time to ready for a start that finds the built-in knowledge base already indexed (MiniLM)."""
    start = time.perf_counter()
    pipe = build_pipeline(QAConfig(data_dir=data_dir, llm="extractive"), "minilm", ExtractiveGenerator())
    results = pipe.ingest_builtin()
    return {
        "ready_s": round(time.perf_counter() - start, 2),
        "reembedded": sum(r.status != "unchanged" for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--chunks", type=int, default=10_000, help="corpus size for the retrieval latency runs"
    )
    parser.add_argument("--queries", type=int, default=200, help="queries timed per backend")
    parser.add_argument(
        "--ingest-docs", type=int, default=12, help="built-in documents embedded for the ingestion rate"
    )
    parser.add_argument("--skip-smollm", action="store_true", help="skip the SmolLM2 end-to-end timing")
    parser.add_argument(
        "--restart-data-dir", default=None, help="a data dir already holding the built-in index"
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="qa-bench-"))
    results: dict[str, object] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        results["ingest_minilm"] = bench_ingest(tmp, args.ingest_docs)
        results["retrieval"] = bench_retrieval(tmp, args.chunks, args.queries)
        results["end_to_end"] = bench_end_to_end(tmp, args.skip_smollm)
        results["http_concurrency"] = bench_http(tmp)
        if args.restart_data_dir:
            results["restart"] = bench_restart(Path(args.restart_data_dir))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
