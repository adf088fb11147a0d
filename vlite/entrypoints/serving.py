"""What the completion and chat routes share: origin, sampling params, engine requests, SSE
streaming and the abort-on-disconnect plumbing."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from vlite.engine.async_engine import EngineNotRunningError, EngineRequest, RequestGroup
from vlite.engine.llm_engine import RequestRejectedError
from vlite.engine.outputs import RequestOutput
from vlite.engine.sampling_params import SamplingParams
from vlite.engine.sequence import RequestOrigin
from vlite.entrypoints.errors import APIError
from vlite.entrypoints.protocol import SamplingRequest
from vlite.entrypoints.state import ServerState

logger = logging.getLogger("vlite.server")

CLIENT_TAG_HEADER = "x-vlite-client-tag"
CLIENT_ACTION_HEADER = "x-vlite-client-action"


@dataclass(frozen=True)
class RequestInfo:
    """Where an HTTP request came from: becomes each engine request's RequestOrigin."""

    request_id: str
    route: str
    client_tag: str | None
    client_action: str | None
    arrival_time: float

    @classmethod
    def from_request(cls, request: Request) -> RequestInfo:
        return cls(request.state.request_id, request.url.path, request.headers.get(CLIENT_TAG_HEADER),
                   request.headers.get(CLIENT_ACTION_HEADER), time.time())

    def engine_request_id(self, index: int, total: int) -> str:
        """One engine request per choice: the HTTP id itself, or ``<id>-<index>`` when several."""
        return self.request_id if total == 1 else f"{self.request_id}-{index}"

    def origin(self, engine_request_id: str) -> RequestOrigin:
        return RequestOrigin(engine_request_id, self.arrival_time, self.route, self.client_tag, self.client_action)


def served_model(state: ServerState, model: str | None) -> str:
    """The name to answer with; 404 (OpenAI's model_not_found) for a model this server does not serve."""
    if model is None or model == "":
        return state.model_name
    if model not in state.model_names:
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                       f"{', '.join(state.model_names)}", param="model", code="model_not_found")
    return model


def warn_ignored_fields(req: BaseModel) -> None:
    if req.model_extra:
        logger.warning("ignored unknown request fields: %s", ", ".join(sorted(req.model_extra)))


def sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """SamplingParams from an OpenAI request (OpenAI's defaults where a field is null).

    Raises:
        APIError: 400 for a value out of range or an unsupported option.
    """
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed, stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, n=1, logprobs=logprobs)
    except ValueError as exc:
        message = str(exc)
        raise APIError(400, message, param=message.split(" ", 1)[0]) from None


def check_n(n: int) -> None:
    if n < 1:
        raise APIError(400, f"n must be an integer >= 1, got {n}", param="n")


async def add_to_engine(state: ServerState, requests: list[EngineRequest]) -> RequestGroup:
    """Queue the engine requests of one HTTP request; 400 if the engine rejects one, 503 if stopping."""
    try:
        return await state.engine.add_requests(requests)
    except RequestRejectedError as exc:
        message = str(exc)
        if "request id" in message:  # a client reused the X-Request-Id of a request still running
            raise APIError(400, message, param="X-Request-Id", code="duplicate_request_id") from None
        raise APIError(400, message, param="prompt") from None
    except EngineNotRunningError as exc:
        raise APIError(503, str(exc), code="service_unavailable") from None


async def collect_final(group: RequestGroup) -> list[RequestOutput]:
    """Wait for every request of ``group`` to finish; their final outputs in index order.

    Raises APIError 503 if the server aborted them (shutdown) and 500 if one failed.
    """
    finals: list[RequestOutput | None] = [None] * len(group.request_ids)
    async with group:
        try:
            async for i, out in group:
                if out.finished:
                    finals[i] = out
        except RuntimeError as exc:
            raise APIError(500, str(exc)) from None
    for out in finals:
        reason = out.outputs[0].finish_reason
        if reason == "abort":
            raise APIError(503, "the request was aborted because the server is shutting down",
                           code="service_unavailable")
        if reason == "error":
            raise APIError(500, f"the engine failed on this request: {out.error}")
    return finals


class TextStreamer:
    """Turns one request's cumulative outputs into text deltas, holding back a possible
    stop-string start (``stream_holdback``) until it is known not to be one."""

    def __init__(self) -> None:
        self.sent_chars = 0
        self.sent_tokens = 0

    def advance(self, out: RequestOutput) -> tuple[str, int, int]:
        """Returns (new text, first new token index, end token index)."""
        c = out.outputs[0]
        end = len(c.text) if out.finished else max(self.sent_chars, len(c.text) - out.stream_holdback)
        delta = c.text[self.sent_chars:end]
        self.sent_chars = max(self.sent_chars, end)
        first, self.sent_tokens = self.sent_tokens, len(c.token_ids)
        return delta, first, self.sent_tokens


def sse(payload: BaseModel | dict) -> str:
    """One Server-Sent Event ``data:`` line (OpenAI streaming)."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json")
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class AbortOnCloseStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its engine requests however the stream ends.

    Starlette cancels the stream when the client disconnects; the generator may then be left
    suspended, so the abort is done here, where every exit path passes.
    """

    def __init__(self, content: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.group.all_finished:
                logger.info("client of %s went away; aborting %s", scope.get("path"), self.group.request_ids)
            self.group.abort()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """Cancel ``handler`` when its client disconnects (as vLLM does): the cancellation reaches
    the ``async with group`` inside it, which aborts the engine requests.

    The handler must take the ``request: Request`` keyword argument.
    """

    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        request: Request = kwargs["request"]
        work = asyncio.ensure_future(handler(*args, **kwargs))
        watch = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            watch.cancel()
        if not work.done():
            work.cancel()
            logger.info("client of %s disconnected before the response; request %s cancelled",
                        request.url.path, request.state.request_id)
            try:
                await work
            except (asyncio.CancelledError, Exception):  # nobody is left to answer
                logger.debug("cancelled handler ended", exc_info=True)
            return None
        return work.result()

    return wrapper
