"""Every endpoint through FastAPI's TestClient (hashing embedder + extractive generator)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from megalith_qa.llm import ExtractiveGenerator, GenerationRequest
from megalith_qa.server import create_app


@pytest.fixture
def client(make_pipeline: Callable[..., object]) -> TestClient:
    return TestClient(create_app(make_pipeline(max_upload_bytes=4096)))


def _ask(client: TestClient, text: str, **extra: object) -> httpx.Response:
    return client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}], **extra}
    )


def test_healthz_and_page_and_openapi(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    page = client.get("/")
    assert page.status_code == 200 and "<title>megalith-qa</title>" in page.text
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/embeddings", "/documents", "/documents/{doc_id}", "/healthz"} <= set(
        paths
    )
    assert client.get("/docs").status_code == 200


def test_chat_completion_has_answer_and_real_citations(client: TestClient) -> None:
    resp = _ask(client, "What does the pass statement do?")
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert "pass statement does nothing" in body["choices"][0]["message"]["content"]
    assert resp.headers["x-session-id"] == body["session_id"]
    cites = body["citations"]
    assert cites and cites[0]["source"] == "python.md"
    # citations point at real chunks: the chunk id resolves and the snippet is its text
    pipeline = _pipeline(client)
    stored = pipeline.kb.store.get([c["chunk_id"] for c in cites])
    for c in cites:
        text, meta = stored[c["chunk_id"]]
        assert text.startswith(c["snippet"]) and meta["source"] == c["source"]


def _pipeline(client: TestClient):  # type: ignore[no-untyped-def]
    return client.app.state.pipeline


def test_chat_streaming_sse(client: TestClient) -> None:
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "How hot for green tea?"}], "stream": True},
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[0]["citations"][0]["source"] == "tea.txt"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert "Green tea is steeped at 80 degrees." in text
    assert len(chunks) > 3  # the answer arrives in several pieces


def test_sessions_are_isolated(client: TestClient) -> None:
    _ask(client, "Tell me about the Nile river", session_id="alice")
    _ask(client, "Green tea temperature?", session_id="bob")
    memory = _pipeline(client).memory
    assert [t.content for t in memory.turns("alice") if t.role == "user"] == ["Tell me about the Nile river"]
    assert [t.content for t in memory.turns("bob") if t.role == "user"] == ["Green tea temperature?"]
    # a follow-up in alice's session is rewritten with alice's history only
    follow = _ask(client, "Which one is longest?", session_id="alice").json()
    assert follow["citations"][0]["source"] == "rivers.txt"
    # without a session id every request gets its own fresh session
    a, b = _ask(client, "tea").json()["session_id"], _ask(client, "tea").json()["session_id"]
    assert a != b and a not in ("alice", "bob")


def test_embeddings_endpoint(client: TestClient) -> None:
    resp = client.post("/v1/embeddings", json={"input": ["red apples", "red apples", "blue sea"]})
    assert resp.status_code == 200
    data = resp.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    assert data[0]["embedding"] == data[1]["embedding"] != data[2]["embedding"]
    assert sum(x * x for x in data[0]["embedding"]) == pytest.approx(1.0, abs=1e-5)
    assert len(client.post("/v1/embeddings", json={"input": "one"}).json()["data"]) == 1
    assert client.post("/v1/embeddings", json={"input": []}).status_code == 422


def test_documents_upload_list_delete(client: TestClient, sample_files: dict[str, bytes]) -> None:
    for name, data in sample_files.items():
        resp = client.post("/documents", files={"file": (name, data)})
        assert resp.status_code == 201, resp.text
        assert resp.json()["status"] == "added"
    again = client.post("/documents", files={"file": ("notes.txt", sample_files["notes.txt"])}).json()
    assert again["status"] == "unchanged"
    listed = {d["source"]: d for d in client.get("/documents").json()}
    assert set(sample_files) <= set(listed)
    doc_id = listed["notes.txt"]["id"]
    assert client.delete(f"/documents/{doc_id}").json()["deleted_chunks"] == listed["notes.txt"]["chunks"]
    assert "notes.txt" not in {d["source"] for d in client.get("/documents").json()}
    assert client.delete(f"/documents/{doc_id}").status_code == 404
    cites = _ask(client, "zebra migration river").json()["citations"]
    assert "notes.txt" not in {c["source"] for c in cites}


def test_refusals(client: TestClient) -> None:
    traversal = client.post("/documents", files={"file": ("../../etc/evil.txt", b"x")})
    assert traversal.status_code == 400 and "traversal" in traversal.json()["detail"]
    assert client.post("/documents", files={"file": ("tool.exe", b"MZ")}).status_code == 415
    big = client.post("/documents", files={"file": ("big.txt", b"a " * 5000)})
    assert big.status_code == 413
    bad_json = client.post("/documents", files={"file": ("bad.json", b"{oops")})
    assert bad_json.status_code == 422 and "bad.json:1:2" in bad_json.json()["detail"]
    malformed = client.post(
        "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 422 and "json" in json.dumps(malformed.json()).lower()
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 422
    no_user = client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "x"}]})
    assert no_user.status_code == 422 and "user" in no_user.json()["detail"]


def test_api_key_required_for_everything_but_healthz(make_pipeline: Callable[..., object]) -> None:
    client = TestClient(create_app(make_pipeline(host="0.0.0.0", api_key="s3cret")))
    assert client.get("/healthz").status_code == 200
    for method, path in [
        ("GET", "/documents"),
        ("POST", "/v1/embeddings"),
        ("GET", "/openapi.json"),
        ("DELETE", "/documents/x"),
    ]:
        assert client.request(method, path).status_code == 401
        assert client.request(method, path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = client.get("/documents", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


class _BlockingGenerator(ExtractiveGenerator):
    """Holds every generation until released, to prove generation runs off the event loop."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()

    def stream(self, request: GenerationRequest) -> Iterator[str]:
        self.started.set()
        if not self.release.wait(timeout=30):
            raise TimeoutError("test generator was never released")
        yield from super().stream(request)


def test_health_stays_responsive_during_generation(make_pipeline: Callable[..., object]) -> None:
    gen = _BlockingGenerator()
    app = create_app(make_pipeline(generator=gen))

    async def scenario() -> tuple[int, bool, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as ac:
            chat = asyncio.create_task(
                ac.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "tea"}]})
            )
            await asyncio.to_thread(gen.started.wait, 10)
            health = await asyncio.wait_for(ac.get("/healthz"), timeout=5)
            pending = not chat.done()
            gen.release.set()
            return health.status_code, pending, (await chat).status_code

    health, pending, chat = asyncio.run(scenario())
    assert health == 200 and pending and chat == 200
