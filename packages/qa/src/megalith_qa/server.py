"""FastAPI application: OpenAI-compatible chat and embeddings, document management, health, web page.

Blocking work (embedding, retrieval, generation, parsing uploads, ingestion) runs in the thread pool,
never on the event loop, so `/healthz` answers while answers are generated or files are parsed.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Annotated, Any

from fastapi import FastAPI, File, Header, HTTPException, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from megalith.common.errors import ConfigError, DataError, MegalithError
from megalith_qa import __version__
from megalith_qa.api_models import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    CitationOut,
    DeleteOut,
    DocumentOut,
    EmbeddingItem,
    EmbeddingRequest,
    EmbeddingResponse,
    Health,
    IngestOut,
    Usage,
)
from megalith_qa.ingest import UnsafeNameError, UnsupportedTypeError, file_kind, load_bytes, sanitize_filename
from megalith_qa.llm import GenerationStream, finish_reason_of
from megalith_qa.memory import approx_tokens
from megalith_qa.pipeline import Citation, QAPipeline
from megalith_qa.security import GuardMiddleware

logger = logging.getLogger(__name__)
SESSION_HEADER = "X-Session-Id"


def _citations(cites: tuple[Citation, ...]) -> list[CitationOut]:
    return [
        CitationOut(source=c.source, chunk_id=c.chunk_id, score=c.score, snippet=c.snippet) for c in cites
    ]


def _question(body: ChatCompletionRequest) -> str:
    users = [m.content for m in body.messages if m.role == "user"]
    if not users or not users[-1].strip():
        raise HTTPException(422, "messages must contain a non-empty 'user' message")
    return users[-1].strip()


def _session(pipeline: QAPipeline, body: ChatCompletionRequest, header: str | None) -> str:
    """Session id from the body, else the X-Session-Id header, else a fresh random one.

    A new session seeded by a client that sends its whole conversation gets that conversation as memory.
    """
    sid = body.session_id or header or pipeline.new_session_id()
    if sid not in pipeline.memory:
        for msg in body.messages[:-1]:
            if msg.role in ("user", "assistant") and msg.content.strip():
                pipeline.memory.add(sid, msg.role, msg.content)
    return sid


class _ClosingStream(StreamingResponse):
    """A streaming response that calls `on_close` once it ends for any reason: done, failed, or the
    client gone (Starlette notices that at the next send or through `http.disconnect`), so that the
    generation behind it stops instead of running on for nobody."""

    def __init__(self, content: Iterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await run_in_threadpool(self._on_close)


async def _collect(request: Request, pieces: GenerationStream) -> str | None:
    """The whole answer, or None once the client has gone away (checked after every piece); the
    answer stream is closed either way, which stops a generation still running."""
    parts: list[str] = []
    try:
        async for piece in iterate_in_threadpool(pieces):
            parts.append(piece)
            if await request.is_disconnected():
                return None
    finally:
        await run_in_threadpool(pieces.close)
    return "".join(parts).strip()


def _sse(payload: dict[str, object]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _stream_events(
    model: str, cites: tuple[Citation, ...], pieces: Iterator[str], session_id: str
) -> Iterator[str]:
    """OpenAI `chat.completion.chunk` events; the first and last carry the citations, then [DONE].

    The last event's `finish_reason` is "length" when `max_tokens` cut the answer, else "stop"."""
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "session_id": session_id,
    }
    cited = [c.model_dump() for c in _citations(cites)]
    yield _sse(
        {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}],
            "citations": cited,
        }
    )
    for piece in pieces:
        yield _sse({**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
    reason = finish_reason_of(pieces)
    yield _sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": reason}], "citations": cited})
    yield "data: [DONE]\n\n"


def _register_errors(app: FastAPI) -> None:
    @app.exception_handler(UnsupportedTypeError)
    async def _unsupported(_: Request, exc: UnsupportedTypeError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=415)

    @app.exception_handler(UnsafeNameError)
    async def _unsafe(_: Request, exc: UnsafeNameError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(DataError)
    async def _data(_: Request, exc: DataError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    @app.exception_handler(MegalithError)
    async def _megalith(_: Request, exc: MegalithError) -> JSONResponse:
        status = 400 if isinstance(exc, ConfigError) else 500
        return JSONResponse({"detail": str(exc)}, status_code=status)


def _page() -> str:
    return resources.files("megalith_qa").joinpath("static/index.html").read_text(encoding="utf-8")


def _add_chat_routes(app: FastAPI, pipeline: QAPipeline) -> None:
    model_name = f"megalith-qa-{pipeline.generator.name}"

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, tags=["openai"])
    async def chat_completions(
        request: Request,
        body: ChatCompletionRequest,
        x_session_id: Annotated[str | None, Header(max_length=128)] = None,
    ) -> Response:
        """Answer the last user message from the knowledge base; `citations` lists the passages used.
        With `stream: true` the answer arrives as server-sent events (`data: {chunk}` ... `data: [DONE]`)."""
        question = _question(body)
        sid = _session(pipeline, body, x_session_id)
        headers = {SESSION_HEADER: sid}
        cites, pieces = await run_in_threadpool(pipeline.stream, question, sid, body.top_k, body.max_tokens)
        if body.stream:
            events = _stream_events(model_name, cites, pieces, sid)
            return _ClosingStream(events, pieces.close, media_type="text/event-stream", headers=headers)
        text = await _collect(request, pieces)
        if text is None:  # the client went away: its generation is stopped, nobody reads a reply
            return Response(status_code=499)
        prompt_tokens = sum(approx_tokens(m.content) for m in body.messages)
        completion_tokens = approx_tokens(text)
        out = ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model_name,
            choices=[
                Choice(
                    message=AssistantMessage(content=text),
                    finish_reason="length" if finish_reason_of(pieces) == "length" else "stop",
                )
            ],
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
            citations=_citations(cites),
            session_id=sid,
        )
        return JSONResponse(out.model_dump(), headers=headers)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, tags=["openai"])
    async def embeddings(body: EmbeddingRequest) -> EmbeddingResponse:
        """Unit-norm vectors of the configured embedding model (cosine similarity = dot product)."""
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        vectors = await run_in_threadpool(pipeline.kb.embedder.embed, texts)
        tokens = sum(approx_tokens(t) for t in texts)
        return EmbeddingResponse(
            data=[EmbeddingItem(index=i, embedding=[float(x) for x in v]) for i, v in enumerate(vectors)],
            model=pipeline.kb.embedder.name,
            usage=Usage(prompt_tokens=tokens, total_tokens=tokens),
        )


def _add_document_routes(app: FastAPI, pipeline: QAPipeline, max_bytes: int) -> None:
    @app.post("/documents", response_model=IngestOut, status_code=201, tags=["documents"])
    async def upload(file: Annotated[UploadFile, File(description="the file to ingest")]) -> IngestOut:
        """Upload one file (txt, md, html, pdf, csv, json, jsonl). Re-uploading identical bytes is a no-op;
        changed bytes under the same name replace the old chunks; a file without text is refused (422)
        and leaves a stored document of that name as it is. The stored name is `sanitize_filename`'s."""
        name = sanitize_filename(file.filename or "")
        file_kind(name)
        data = await file.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise HTTPException(413, f"{name}: larger than the upload limit of {max_bytes} bytes")
        doc = await run_in_threadpool(load_bytes, name, data)
        res = await run_in_threadpool(pipeline.kb.ingest, doc)
        return IngestOut(id=res.doc_id, source=res.source, status=res.status, chunks=res.chunks)  # type: ignore[arg-type]

    @app.get("/documents", response_model=list[DocumentOut], tags=["documents"])
    async def list_documents() -> list[DocumentOut]:
        records = await run_in_threadpool(pipeline.kb.sources)
        return [
            DocumentOut(id=r.doc_id, source=r.source, hash=r.source_hash, chunks=r.chunks) for r in records
        ]

    @app.delete("/documents/{doc_id}", response_model=DeleteOut, tags=["documents"])
    async def delete_document(doc_id: str) -> DeleteOut:
        """Delete a document (by id, or by source name) from the dense and the BM25 index."""
        removed = await run_in_threadpool(pipeline.kb.delete, doc_id)
        if not removed:
            raise HTTPException(404, f"no document with id or source {doc_id!r}")
        return DeleteOut(id=doc_id, deleted_chunks=removed)


def create_app(pipeline: QAPipeline) -> FastAPI:
    """The ASGI app for one pipeline; limits and the API key come from `pipeline.config.server`."""
    server = pipeline.config.server
    app = FastAPI(
        title="megalith-qa",
        version=__version__,
        description="Retrieval-augmented question answering over a local knowledge base, with citations.",
    )
    app.state.pipeline = pipeline
    app.add_middleware(GuardMiddleware, api_key=server.api_key, max_upload_bytes=server.max_upload_bytes)
    _register_errors(app)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> str:
        return _page()

    @app.get("/healthz", response_model=Health, tags=["service"])
    async def healthz() -> Health:
        """Liveness: answers from the event loop without touching the index."""
        return Health(
            index_version=pipeline.kb.version, llm=pipeline.generator.name, embedder=pipeline.kb.embedder.name
        )

    _add_chat_routes(app, pipeline)
    _add_document_routes(app, pipeline, server.max_upload_bytes)
    return app
