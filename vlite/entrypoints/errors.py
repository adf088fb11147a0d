"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every status.

Types and codes follow the OpenAI API reference: 400/404/413 are ``invalid_request_error``,
401 has code ``invalid_api_key``, 404 for a model has code ``model_not_found``, 5xx are
``server_error``.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlite.entrypoints.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("vlite.server")


class APIError(Exception):
    """An error to return to the client with ``status`` (an int HTTP status)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def sse(self) -> str:
        """The error as one Server-Sent Event (for failures after a stream has started)."""
        return f"data: {json.dumps(self.body(), separators=(',', ':'))}\n\n"


def error_response(status: int, message: str, **kw) -> JSONResponse:
    """A JSONResponse with OpenAI's error body."""
    return JSONResponse(APIError(status, message, **kw).body(), status_code=status)


def error_bytes(status: int, message: str, **kw) -> bytes:
    """The error body as bytes, for pure ASGI middleware."""
    return json.dumps(APIError(status, message, **kw).body()).encode()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {msg}", None
    where = f"'{param}'" if param else "the request body"
    extra = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return f"{where}: {msg}{extra}", param


def install_error_handlers(app: FastAPI) -> None:
    """Make FastAPI/Starlette errors (422, 404, 405, 500) speak OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = f"route {request.method} {request.url.path} not found"
            code = "not_found"
        else:
            message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
            code = None
        return JSONResponse(APIError(status, message, code=code).body(), status_code=status,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
