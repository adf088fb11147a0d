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

from vlite.entrypoints.protocol import REQUEST_FIELD_NAMES, ErrorInfo, ErrorResponse

logger = logging.getLogger("vlite.server")


class APIError(Exception):
    """An error to return to the client with ``status`` (an int HTTP status)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        # Messages may quote client text: escape anything UTF-8 cannot encode (a lone surrogate),
        # so that encoding the error body can never fail.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
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


def _is_type_mismatch(error: dict) -> bool:
    return error.get("type", "").endswith(("_type", "_parsing"))


def _field_path(loc) -> list[str]:
    """The request-field part of a pydantic error location: field names and list indices, without
    "body" and without pydantic's union-member tags ("str", "list[int]", "function-after[...]")."""
    return [str(p) for p in loc if isinstance(p, int) or p in REQUEST_FIELD_NAMES]


def _validation_message(exc: RequestValidationError, content_type: str = "") -> tuple[str, str | None]:
    """(message, param) for a body that failed validation (``content_type``: the request's header).

    Of several errors (a value that matches no member of a union gives one per member), the one
    reported is a constraint or value error (bound, bad Unicode, boolean for an integer) before a
    mere type mismatch, then the deepest one: for ``"prompt": [[false]]`` that is
    ``prompt.0.0: must be a number, not a boolean``, not "prompt is not a string".
    """
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    if any(e.get("type") == "json_invalid" for e in errors):
        first = next(e for e in errors if e.get("type") == "json_invalid")
        return f"the request body is not valid JSON: {first.get('msg', '')}", None
    # the body itself is not an object (form data, an array, nothing): not errors inside one
    if any(tuple(e.get("loc", ())) == ("body",) and e.get("type") in ("model_attributes_type", "dict_type", "missing")
           for e in errors):
        sent = f" (it was sent as {content_type.split(';')[0]})" if content_type and "json" not in content_type else ""
        return f"the request body must be a JSON object with Content-Type: application/json{sent}", None
    best = min(errors, key=lambda e: (_is_type_mismatch(e), -len(_field_path(e.get("loc", ())))))
    path = _field_path(best.get("loc", ()))
    param = ".".join(path) or None
    msg = best.get("msg", "invalid value").removeprefix("Value error, ")
    if best.get("type") == "string_unicode":  # pydantic's own check of constrained strings
        msg = "text is not valid Unicode (it holds a lone surrogate); send UTF-8 text"
    value = best.get("input")
    if isinstance(value, (int, float, str)) and best.get("type") != "missing":
        shown = ascii(value)
        msg += f", got {shown if len(shown) <= 40 else shown[:37] + '...'}"
    where = f"'{param}'" if param else "the request body"
    top = {(_field_path(e.get("loc", ())) or [""])[0] for e in errors} - {(path or [""])[0]}
    extra = f" (and errors in {len(top)} other field(s))" if top else ""
    return f"{where}: {msg}{extra}", param


def install_error_handlers(app: FastAPI) -> None:
    """Make FastAPI/Starlette errors (422, 404, 405, 500) speak OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc, request.headers.get("content-type", ""))
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
        # Starlette re-raises after this response and uvicorn then drops the connection: say so,
        # so that a keep-alive client does not send its next request into a closing socket.
        response = error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
        response.headers["Connection"] = "close"
        return response
