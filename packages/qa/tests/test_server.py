"""Every endpoint through FastAPI's TestClient (hashing embedder + extractive generator)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
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


def test_max_tokens_is_honoured_with_finish_reason_length(client: TestClient) -> None:
    question = "How hot for green tea?"
    full = _ask(client, question).json()
    assert full["choices"][0]["finish_reason"] == "stop" and full["usage"]["completion_tokens"] > 2
    cut = _ask(client, question, max_tokens=2).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] == 2
    assert full["choices"][0]["message"]["content"].startswith(cut["choices"][0]["message"]["content"])
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": question}], "stream": True, "max_tokens": 3},
    ) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len([e for e in events if e["choices"][0]["delta"].get("content")]) == 3


def test_empty_reupload_is_refused_and_keeps_the_document(client: TestClient) -> None:
    assert (
        client.post("/documents", files={"file": ("notes.txt", b"Real notes about zebras.")}).status_code
        == 201
    )
    before = client.get("/documents").json()
    empty = client.post("/documents", files={"file": ("notes.txt", b"   \n  ")})
    assert empty.status_code == 422 and "notes.txt: no text to index" in empty.json()["detail"]
    assert client.get("/documents").json() == before


def test_upload_names_keep_types_and_never_merge(client: TestClient) -> None:
    long_jsonl = "a" * 195 + ".jsonl"
    resp = client.post("/documents", files={"file": (long_jsonl, b'{"x": 1}\n{"y": 2}\n')})
    assert resp.status_code == 201, resp.text
    assert resp.json()["source"].endswith(".jsonl")
    first = client.post("/documents", files={"file": ("my notes?.txt", b"alice: quokkas")}).json()
    second = client.post("/documents", files={"file": ("my notes!.txt", b"bob: wombats")}).json()
    assert first["status"] == second["status"] == "added" and first["source"] != second["source"]


@pytest.mark.parametrize(
    ("name", "data", "where"),
    [
        ("deep.json", b"[" * 5000 + b"]" * 5000, "deep.json:1:201: nested deeper than 200 levels"),
        ("big.jsonl", b'{"a": 1}\n{"n": ' + b"1" * 5000 + b"}\n", "big.jsonl:2:7: integer with 5000 digits"),
        ("big.csv", b"h\n" + b"x" * 200_000 + b"\n", "big.csv:2: field larger than field limit"),
    ],
)
def test_bad_upload_data_is_422_naming_file_and_line(
    make_pipeline: Callable[..., object], name: str, data: bytes, where: str
) -> None:
    client = TestClient(
        create_app(make_pipeline(max_upload_bytes=1024 * 1024)), raise_server_exceptions=False
    )
    resp = client.post("/documents", files={"file": (name, data)})
    assert resp.status_code == 422 and where in resp.json()["detail"]


def _multipart_stream(total: int, chunk: int = 64 * 1024) -> tuple[list[bytes], int]:
    head = b'--b0\r\nContent-Disposition: form-data; name="file"; filename="huge.txt"\r\n\r\n'
    parts = [head] + [b"x" * chunk for _ in range(total // chunk)] + [b"\r\n--b0--\r\n"]
    return parts, sum(len(p) for p in parts)


def test_chunked_upload_is_stopped_at_the_limit(client: TestClient) -> None:
    """Without Content-Length the body is counted as it is read: 413 right after the limit is passed,
    not after the whole (here 64 MiB) body has been received and spooled."""
    parts, total = _multipart_stream(64 * 1024 * 1024)
    sent = 0

    async def receive() -> dict[str, object]:
        nonlocal sent
        if sent < len(parts):
            sent += 1
            return {"type": "http.request", "body": parts[sent - 1], "more_body": sent < len(parts)}
        return {"type": "http.disconnect"}

    messages: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        messages.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/documents",
        "raw_path": b"/documents",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"multipart/form-data; boundary=b0"),
            (b"transfer-encoding", b"chunked"),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(client.app(scope, receive, send))  # type: ignore[arg-type]
    start = next(m for m in messages if m["type"] == "http.response.start")
    assert start["status"] == 413
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")  # type: ignore[misc]
    assert b"upload limit" in body
    consumed = sum(len(p) for p in parts[:sent])
    assert consumed < 4096 + 64 * 1024 + 2 * 64 * 1024 < total


def test_upload_parsing_runs_off_the_event_loop(
    make_pipeline: Callable[..., object], monkeypatch: pytest.MonkeyPatch
) -> None:
    import megalith_qa.server as server_module

    started, release = threading.Event(), threading.Event()
    real_load = server_module.load_bytes

    def slow_load(name: str, data: bytes):  # type: ignore[no-untyped-def]
        started.set()
        if not release.wait(timeout=10):
            raise TimeoutError("parse was never released: it blocked the event loop")
        return real_load(name, data)

    monkeypatch.setattr(server_module, "load_bytes", slow_load)
    app = create_app(make_pipeline())

    async def scenario() -> tuple[int, bool, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as ac:
            upload = asyncio.create_task(ac.post("/documents", files={"file": ("n.txt", b"Quokkas smile.")}))
            await asyncio.to_thread(started.wait, 10)
            health = await asyncio.wait_for(ac.get("/healthz"), timeout=5)
            pending = not upload.done()
            release.set()
            return health.status_code, pending, (await upload).status_code

    health, pending, upload = asyncio.run(scenario())
    assert health == 200 and pending and upload == 201


@pytest.mark.timeout(120)
def test_failing_generation_ends_the_request(
    make_pipeline: Callable[..., object], fake_smollm: Callable[..., tuple[object, object]]
) -> None:
    """A generation error gives a 500 (or ends the event stream) instead of a request that never returns."""
    gen, _ = fake_smollm("fail")
    client = TestClient(create_app(make_pipeline(generator=gen)), raise_server_exceptions=False)
    resp = _ask(client, "What is the capital of France?")
    assert resp.status_code == 500
    with pytest.raises(ValueError, match="max_new_tokens"):
        with TestClient(create_app(make_pipeline(generator=gen))).stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "capital?"}], "stream": True},
        ) as stream:
            list(stream.iter_lines())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_stops_the_generation(
    make_pipeline: Callable[..., object],
    fake_smollm: Callable[..., tuple[object, object]],
    serve_app: Callable[[object], str],
    stream: bool,
) -> None:
    """A client that goes away (streaming: after the first piece; plain: after 0.5 s without a
    reply): the generation stops within a few tokens (its stopping criterion sees the cancel)
    instead of running on to max_tokens (400 tokens, 20 s here)."""
    gen, model = fake_smollm("slow")
    url = serve_app(create_app(make_pipeline(generator=gen)))
    body = {"messages": [{"role": "user", "content": "tea?"}], "stream": stream, "max_tokens": 400}
    if stream:
        with (
            httpx.Client(timeout=10) as http,
            http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp,
        ):
            for line in resp.iter_lines():
                if '"content"' in line:
                    break  # the first piece arrived: hang up
    else:
        with httpx.Client(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
            http.post(f"{url}/v1/chat/completions", json=body)
    deadline = time.monotonic() + 15
    while model.stopped_after is None and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.05)
    assert model.stopped_after is not None and model.stopped_after < 100  # type: ignore[attr-defined]
