"""HTTP guards: Bearer API-key auth (everything except the health check and the static page) and the
request-body size limit.

The limit is enforced twice: a `Content-Length` above it is refused before anything is read, and the
body stream itself is counted as the application reads it (pure ASGI `receive` wrapper), so a chunked
upload without `Content-Length` is stopped with 413 as soon as it passes the limit instead of being
spooled to disk in full by the multipart parser.
"""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPEN_PATHS = frozenset({"/healthz", "/"})
MULTIPART_OVERHEAD = 64 * 1024


class BodyTooLargeError(HTTPException):
    """Raised from `receive` when the streamed body passes the limit (FastAPI turns it into a 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than the upload limit ({limit} bytes)")


class GuardMiddleware:
    """Pure ASGI middleware: 401 without the API key, 413 for bodies above `max_upload_bytes` + multipart
    overhead (declared or streamed)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_upload_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body = max_upload_bytes + MULTIPART_OVERHEAD

    def _authorized(self, request: Request) -> bool:
        if self.api_key is None or request.url.path in OPEN_PATHS:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )

    def _too_large(self, request: Request) -> bool:
        raw = request.headers.get("content-length")
        return raw is not None and raw.isdigit() and int(raw) > self.max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)  # headers and path only; the body is never read here
        if not self._authorized(request):
            response = JSONResponse(
                {"detail": "missing or wrong API key (send 'Authorization: Bearer <key>')"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        if self._too_large(request):
            await self._refuse(scope, receive, send)
            return
        await self._call_counted(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = BodyTooLargeError(self.max_body).detail
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)

    async def _call_counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app with a `receive` that raises BodyTooLargeError once more than `max_body` bytes came."""
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLargeError(self.max_body)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLargeError:
            if started:  # too late for a status code: let the server close the connection
                raise
            await self._refuse(scope, receive, send)
