"""HTTP guards: Bearer API-key auth (everything except the health check and the static page) and an
early refusal of request bodies larger than the upload limit (before multipart parsing spools them)."""

from __future__ import annotations

import hmac

from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

OPEN_PATHS = frozenset({"/healthz", "/"})
MULTIPART_OVERHEAD = 64 * 1024


class GuardMiddleware(BaseHTTPMiddleware):
    def __init__(self, app: ASGIApp, api_key: str | None, max_upload_bytes: int) -> None:
        super().__init__(app)
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

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if not self._authorized(request):
            return JSONResponse(
                {"detail": "missing or wrong API key (send 'Authorization: Bearer <key>')"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        if self._too_large(request):
            return JSONResponse(
                {"detail": f"request body larger than the upload limit ({self.max_body} bytes)"},
                status_code=413,
            )
        return await call_next(request)
