"""Pure ASGI middleware: request id, body size limit (413), API key (401), readiness (503), and
the count of HTTP requests in flight (the API server's census runs only when it is 0).

Pure ASGI rather than ``BaseHTTPMiddleware`` so that streaming responses and client
disconnects pass through untouched (the disconnect is what aborts a request).
"""

from __future__ import annotations

import secrets
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlite.entrypoints.errors import error_bytes
from vlite.entrypoints.state import ServerState

MAX_REQUEST_ID_LEN = 256


async def send_error(send: Send, status: int, message: str, headers: dict[str, str] | None = None, **kw) -> None:
    """Send a complete JSON error response in OpenAI's shape."""
    body = error_bytes(status, message, **kw)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RequestIdMiddleware:
    """Take ``X-Request-Id`` from the client (or make one), store it in ``request.state.request_id``
    and echo it on every response. Every 5xx also says ``Connection: close`` (uvicorn then closes
    the connection after it), so a keep-alive client never reuses a connection in a bad state."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex
        if len(request_id) > MAX_REQUEST_ID_LEN:
            return await send_error(send, 400, f"X-Request-Id is longer than {MAX_REQUEST_ID_LEN} characters",
                                    param="X-Request-Id")
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["X-Request-Id"] = request_id
                if message["status"] >= 500:
                    headers["Connection"] = "close"
            await send(message)

        await self.app(scope, receive, send_with_id)


class _BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """Answer 413 to a body over ``max_bytes``: by Content-Length before reading anything, or,
    for a chunked body (no Content-Length), as soon as the bytes read pass the limit.

    FastAPI turns any exception raised while it reads the body into its own 400 ("There was an
    error parsing the body"); so once the limit is passed, whatever response the app starts is
    replaced by the 413 here. The 413 says ``Connection: close``: the rest of the body is never
    read, so the connection cannot carry another request.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body is larger than the server's limit of {self.max_bytes} bytes"
        close = {"Connection": "close"}
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await send_error(send, 413, too_large, code="request_too_large", headers=close)
        received = 0
        over = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if over:  # the app's answer to the body it could not read: the 413 replaces it
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await send_error(send, 413, too_large, code="request_too_large", headers=close)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                started = True
                await send_error(send, 413, too_large, code="request_too_large", headers=close)


class ApiKeyMiddleware:
    """With an API key set, every route but /health needs ``Authorization: Bearer <key>``."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.api_key or scope["path"] in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = Headers(scope=scope).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            return await send_error(send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await self.app(scope, receive, send)


class ReadinessMiddleware:
    """503 while the model loads and once shutdown has begun (only /version always answers)."""

    ALWAYS_OPEN = frozenset({"/version"})

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.ALWAYS_OPEN or self.state.status == "ready":
            return await self.app(scope, receive, send)
        messages = {"loading": "the server is loading the model; retry shortly",
                    "shutting_down": "the server is shutting down",
                    "failed": "the model failed to load; see the server log"}
        await send_error(send, 503, messages.get(self.state.status, "the server is not ready"),
                         code="service_unavailable", headers={"Retry-After": "1"})


class InFlightMiddleware:
    """Count the HTTP requests being served (``ServerState.requests_in_flight``), a streamed
    response until its last byte; the observers' routes (``OBSERVER_PATHS``, ``/debug/*``), which
    hold no request of their own, are not counted, so a scraper never delays the census."""

    OBSERVER_PATHS = frozenset({"/metrics", "/health", "/version"})

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.OBSERVER_PATHS or path.startswith("/debug/"):
            return await self.app(scope, receive, send)
        self.state.requests_in_flight += 1
        self.state.last_request_start = time.monotonic()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.requests_in_flight -= 1
            self.state.last_request_end = time.monotonic()
