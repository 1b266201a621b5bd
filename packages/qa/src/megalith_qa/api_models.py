"""Request/response bodies of the HTTP API (OpenAI-compatible where OpenAI defines the shape)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

MAX_TEXT = 20_000
Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str = Field(max_length=MAX_TEXT)


class ChatCompletionRequest(BaseModel):
    """OpenAI chat-completions request; `session_id` and `top_k` are extensions."""

    model: str | None = Field(default=None, max_length=200)
    messages: list[ChatMessage] = Field(min_length=1, max_length=200)
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1, le=1024)
    temperature: float | None = Field(default=None, ge=0, le=2)
    session_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")
    top_k: int | None = Field(default=None, ge=1, le=50)


class CitationOut(BaseModel):
    source: str
    chunk_id: str
    score: float
    snippet: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] = "stop"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    citations: list[CitationOut]
    session_id: str


class EmbeddingRequest(BaseModel):
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=256)]
    model: str | None = Field(default=None, max_length=200)


class EmbeddingItem(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float]


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingItem]
    model: str
    usage: Usage


class DocumentOut(BaseModel):
    id: str
    source: str
    hash: str
    chunks: int


class IngestOut(BaseModel):
    id: str
    source: str
    status: Literal["added", "replaced", "unchanged"]
    chunks: int


class DeleteOut(BaseModel):
    id: str
    deleted_chunks: int


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    index_version: int
    llm: str
    embedder: str
