"""The OpenAI request pipeline that the completion and chat routes share (``OpenAIServing``):
validation, tokenizing off the event loop, engine requests, SSE streaming, the final response,
usage, logprobs, errors and the abort-on-disconnect plumbing. A route supplies only its prompt
rendering and the shape of its choices and chunks.

One engine request per prompt: its ``n`` choices (parallel samples or beams) are the
sequences of that one request, which share the prompt's KV blocks by ref_count. Choice ``j``
of the request is ``RequestOutput.outputs[j]`` (``CompletionOutput.index == j``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from vlite.engine import (
    CompletionOutput,
    EngineNotRunningError,
    EngineRequest,
    RequestOrigin,
    RequestOutput,
    RequestRejectedError,
    RequestStreamGroup,
    SamplingParams,
)
from vlite.entrypoints.errors import APIError
from vlite.entrypoints.protocol import SamplingRequest, UsageInfo
from vlite.entrypoints.state import ServerState
from vlite.entrypoints.streaming import (  # noqa: F401 (the routes import them from here)
    SSE_DONE,
    AbortOnCloseStreamingResponse,
    ChoiceDelta,
    ChoiceStreamer,
    GroupStreamer,
    sse,
)
from vlite.entrypoints.structured_output import (
    REMOVED_GUIDED_FIELDS,
    compile_constraint,
    structured_outputs_params,
)

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

    def engine_request_id(self, prompt_index: int, num_prompts: int) -> str:
        """One engine request per prompt (its n choices are sequences of it): the HTTP id
        itself, or ``<id>-<prompt_index>`` when one completions request carries several prompts."""
        return self.request_id if num_prompts == 1 else f"{self.request_id}-{prompt_index}"

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
    # vLLM's removed guided_* fields are not ignored: they get a 400 (structured_outputs_params)
    ignored = sorted(k for k in req.model_extra or () if k not in REMOVED_GUIDED_FIELDS)
    if ignored:  # ascii(): a field name may hold anything, a lone surrogate included
        logger.warning("ignored unknown request fields: %s", ", ".join(ascii(k) for k in ignored))


# vLLM's OpenAI layer reports log-probabilities as max(logprob, -9999.0): JSON has no -inf.
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    """A log-probability (nats) as a finite JSON number: -inf (and NaN) become -9999.0, as vLLM."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


def check_limits(state: ServerState, req: SamplingRequest, max_tokens: int, num_prompts: int = 1,
                 max_tokens_param: str = "max_tokens") -> None:
    """The bounds that depend on the server or the loaded model (docs/serve.md, "Limits"):
    ``n`` and ``best_of`` <= ``--max-n``, and so is the fan-out ``num_prompts * max(n, best_of)``;
    ``max_tokens`` <= max_model_len; ``stop_token_ids`` inside the vocabulary.

    Raises:
        APIError: 400 naming the field.
    """
    max_n = state.settings.max_n
    if req.n > max_n:
        raise APIError(400, f"n must be an integer in [1, {max_n}] (--max-n), got {req.n}", param="n")
    if req.best_of is not None and req.best_of > max_n:
        raise APIError(400, f"best_of must be an integer in [1, {max_n}] (--max-n), got {req.best_of}",
                       param="best_of")
    width = max(req.n, req.best_of or 1) if req.use_beam_search else req.n
    if num_prompts * width > max_n:
        raise APIError(400, f"this request asks for {num_prompts * width} choices ({num_prompts} prompts x {width}); "
                       f"the server allows at most {max_n} (--max-n)", param="n")
    if max_tokens > state.max_model_len:
        raise APIError(400, f"{max_tokens_param} must be an integer in [1, {state.max_model_len}] (the model's "
                       f"maximum context length), got {max_tokens}", param=max_tokens_param)
    vocab = state.engine.hf_config.vocab_size
    bad = [t for t in req.stop_token_ids or () if t >= vocab]
    if bad:
        raise APIError(400, f"stop_token_ids must be token ids in [0, {vocab}), got {bad[0]}", param="stop_token_ids")
    bad = [t for t in req.allowed_token_ids or () if t >= vocab]
    if bad:
        raise APIError(400, f"allowed_token_ids must be token ids in [0, {vocab}), got {bad[0]}",
                       param="allowed_token_ids")
    check_logit_bias(req, vocab)


def check_logit_bias(req: SamplingRequest, vocab: int) -> None:
    """``logit_bias`` keys must be token ids in [0, vocab) written as decimal strings (OpenAI
    sends them as JSON object keys); the values' range is in the schema.

    Raises:
        APIError: 400 naming ``logit_bias`` and the first bad key.
    """
    for key in req.logit_bias or ():
        tid = int(key) if key.isascii() and key.isdigit() and len(key) <= 12 else -1
        if not 0 <= tid < vocab:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab}) written as decimal strings, "
                           f"got {key!r}", param="logit_bias")


def max_prompt_chars(state: ServerState) -> int:
    """Characters above which a text prompt cannot fit ``max_model_len`` tokens, known without
    tokenizing: a token decodes to at most as many characters as its longest vocabulary entry
    (for byte-level BPE the entry is one character per byte, so this is an upper bound). Assumes
    the tokenizer's normalizer does not shorten text (true of byte-level BPE and SentencePiece)."""
    if state.max_prompt_chars is None:
        vocab = state.engine.tokenizer.get_vocab()
        state.max_prompt_chars = state.max_model_len * max(len(t) for t in vocab)
    return state.max_prompt_chars


def check_prompt_chars(state: ServerState, num_chars: int, param: str) -> None:
    """400 at once (before tokenizing) for text that has more characters than any prompt that fits.

    Raises:
        APIError: 400 with ``param``.
    """
    bound = max_prompt_chars(state)
    if num_chars > bound:
        raise APIError(400, f"the prompt has {num_chars} characters, so it is longer than this model's maximum "
                       f"context length of {state.max_model_len} tokens (at most {bound} characters can fit)",
                       param=param)


async def off_loop(state: ServerState, fn: Callable, *args):
    """Run ``fn(*args)`` (tokenizing, a chat template, detokenizing) in the server's small
    tokenizer thread pool, so the event loop keeps answering other requests meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool(), functools.partial(fn, *args))


def sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from an OpenAI request (OpenAI's defaults where a field is null).

    ``n`` choices become ``SamplingParams(n=n)``: one engine request whose samples fork from
    the prompt. ``use_beam_search`` (vLLM's older API field) becomes beam search with width
    ``best_of`` (default ``n``), see ``beam_search_params``. ``response_format`` /
    ``structured_outputs`` become ``SamplingParams.structured_outputs``
    (``vlite.entrypoints.structured_output``; not with beam search).

    Raises:
        APIError: 400 for a value out of range or an unsupported option.
    """
    check_n(req.n)
    structured = structured_outputs_params(req)
    if req.use_beam_search:
        if structured is not None:
            raise APIError(400, "beam search does not support structured outputs (response_format / "
                           "structured_outputs)", param="use_beam_search")
        return beam_search_params(req, max_tokens, logprobs, prompt_logprobs)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of other than n is only supported with use_beam_search", param="best_of")
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
            ignore_eos=req.ignore_eos, n=req.n, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words or None,
            structured_outputs=structured)
    except ValueError as exc:
        message = str(exc)
        raise APIError(400, message, param=message.split(" ", 1)[0]) from None


def beam_search_params(req: SamplingRequest, max_tokens: int, logprobs: int | None,
                       prompt_logprobs: int | None = None) -> SamplingParams:
    """Beam search as vLLM's OpenAI server took it up to v0.6 (its "extra parameters":
    ``use_beam_search: true``, ``best_of`` = beam width W, ``length_penalty``): W defaults to
    ``n`` and must be >= max(n, 2); the ``n`` best beams are returned, best first; score = sum
    of token logprobs (nats) / generated_len ** length_penalty (default 1.0).

    The engine's beam search scores with raw log-probabilities (transformers' ``num_beams``
    without sampling), so anything that would change them or end a beam early is refused
    rather than ignored: temperature > 0, penalties, stop strings, stop_token_ids,
    min_tokens, logprobs. top_p / top_k / min_p do not apply (no sampling).

    Raises:
        APIError: 400 naming the offending field.
    """
    width = req.n if req.best_of is None else req.best_of
    if width < max(req.n, 2):
        raise APIError(400, f"beam search needs best_of (the beam width) >= max(n, 2); got best_of={width}, "
                       f"n={req.n}", param="best_of")
    refused = [
        ("temperature", req.temperature not in (None, 0, 0.0), "beam search needs temperature 0"),
        ("stop", bool(req.stop), "beam search does not support stop strings"),
        ("stop_token_ids", bool(req.stop_token_ids), "beam search does not support stop_token_ids"),
        ("min_tokens", req.min_tokens > 0, "beam search does not support min_tokens"),
        ("logprobs", logprobs is not None, "beam search does not return logprobs"),
        ("logit_bias", bool(req.logit_bias), "beam search does not support logit_bias"),
        ("allowed_token_ids", req.allowed_token_ids is not None, "beam search does not support allowed_token_ids"),
        ("bad_words", bool(req.bad_words), "beam search does not support bad_words"),
        ("presence_penalty", bool(req.presence_penalty), "beam search does not support penalties"),
        ("frequency_penalty", bool(req.frequency_penalty), "beam search does not support penalties"),
        ("repetition_penalty", req.repetition_penalty not in (None, 1, 1.0),
         "beam search does not support penalties"),
    ]
    for param, bad, message in refused:
        if bad:
            raise APIError(400, message, param=param)
    length_penalty = 1.0 if req.length_penalty is None else req.length_penalty
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=req.ignore_eos, n=req.n,
                              beam_width=width, length_penalty=length_penalty, prompt_logprobs=prompt_logprobs)
    except ValueError as exc:
        message = str(exc)
        raise APIError(400, message, param=message.split(" ", 1)[0]) from None


def check_n(n: int) -> None:
    if n < 1:  # pydantic already refuses it; kept for callers that build requests themselves
        raise APIError(400, f"n must be an integer >= 1, got {n}", param="n")


async def add_to_engine(state: ServerState, requests: list[EngineRequest]) -> RequestStreamGroup:
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


def engine_error(message: str | None, kind: str | None) -> APIError:
    """The API error of a request the engine ended with an error: 400 when the request's own
    parameters contradict each other (``RequestOutput.error_kind == "request"``), else 500."""
    if kind == "request":
        return APIError(400, message or "the request's parameters contradict each other")
    return APIError(500, f"the engine failed on this request: {message}")


async def collect_final(group: RequestStreamGroup) -> list[RequestOutput]:
    """Wait for every request of ``group`` (one per prompt) to finish; their final outputs in
    prompt order, each with its choices in ``outputs``.

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
        reasons = {c.finish_reason for c in out.outputs}
        if "error" in reasons or out.error:
            raise engine_error(out.error, out.error_kind)
        if "abort" in reasons:
            raise APIError(503, "the request was aborted because the server is shutting down",
                           code="service_unavailable")
    return finals


# A rendered prompt: its text (None when the client sent token ids) and its token ids.
RenderedPrompt = tuple[str | None, list[int]]


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """OpenAI's ``usage`` (token counts) for the prompts and the output tokens of every choice."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


class OpenAIServing(ABC):
    """One OpenAI generation request, from its parsed body to the response: the pipeline that
    POST /v1/completions and POST /v1/chat/completions share (as vLLM's ``OpenAIServing`` base
    class, but one instance per HTTP request). ``serve()`` runs it:

    1. warn about unknown fields; resolve ``model`` (404 for one not served);
    2. ``check()``: the route's refusals and limits, before any tokenizing (400);
    3. ``render()`` in the tokenizer threads (``off_loop``): the prompt(s) as token ids;
    4. ``params(prompts)``: the SamplingParams of every prompt's engine request; a structured
       output constraint is compiled now, in the tokenizer threads (400 if invalid);
    5. one engine request per prompt, its ``n`` choices the sequences of that request
       (``add_to_engine``: 400 if the engine rejects it, 503 while shutting down);
    6. ``stream: true``: SSE chunks, one choice each (``opening_choices()`` first, then
       ``stream_choice()`` per delta), the usage chunk if ``stream_options.include_usage``,
       then ``[DONE]``; the engine requests are aborted however the stream ends. Otherwise one
       JSON body of ``final_choice()`` per choice (prompt order, then choice index) with usage.
       An engine failure is a 500 (an error event in a stream), a shutdown abort a 503.

    A route subclass supplies steps 2-4 and the shapes: ``response_id_prefix`` (the response
    ``id`` is ``<prefix>-<X-Request-Id>``), ``chunk_type`` (OpenAI's chunk object) and
    ``response_type`` (the non-streaming body).
    """

    response_id_prefix: ClassVar[str]
    chunk_type: ClassVar[type[BaseModel]]
    response_type: ClassVar[type[BaseModel]]

    def __init__(self, req: SamplingRequest, request: Request, state: ServerState) -> None:
        self.req = req
        self.request = request
        self.state = state
        self.tokenizer = state.engine.tokenizer
        self.model = state.model_name  # the name to answer with (set from ``req.model`` by serve())
        self.response_id = ""  # set by serve() once the request id is known
        self.tokens_streamed = False  # a chunk with output tokens has been sent

    # ---- what a route supplies --------------------------------------------------------------
    @abstractmethod
    def check(self) -> None:
        """Refuse what the route does not support and check limits, before tokenizing (APIError 400)."""

    @abstractmethod
    def render(self) -> list[RenderedPrompt]:
        """The prompt(s), one engine request each; runs in a tokenizer thread (APIError 400 if unrenderable)."""

    @abstractmethod
    def params(self, prompts: list[RenderedPrompt]) -> SamplingParams:
        """The engine requests' SamplingParams (``prompts`` as ``render`` made them; APIError 400)."""

    def opening_choices(self) -> list[BaseModel]:
        """Choices sent each in its own chunk before any output (chat: the role); none by default."""
        return []

    @abstractmethod
    def stream_choice(self, d: ChoiceDelta) -> BaseModel:
        """The choice object of the chunk for one choice's delta."""

    @abstractmethod
    def final_choice(self, prompt_index: int, c: CompletionOutput, out: RequestOutput | None = None) -> BaseModel:
        """The choice object of the non-streaming response for choice ``c`` of prompt ``prompt_index``
        (``out``: that prompt's final RequestOutput)."""

    def response_extras(self, finals: list[RequestOutput]) -> dict:
        """Extra top-level fields of the non-streaming response (chat: ``prompt_logprobs``)."""
        return {}

    def chunk(self, choices: list[BaseModel], usage: UsageInfo | None = None) -> dict:
        """One SSE chunk's JSON: ``chunk_type`` with ``choices``; ``usage`` only in the usage chunk."""
        body = self.chunk_type(id=self.response_id, model=self.model, choices=choices, usage=usage)
        return body.model_dump(mode="json", exclude=None if usage is not None else {"usage"})

    # ---- the pipeline -----------------------------------------------------------------------
    async def serve(self) -> Response:
        """Validate, queue and answer the request (a JSON body or an SSE stream).

        Raises:
            APIError: 400 for invalid parameters or a prompt the engine rejects, 404 for an
                unknown model, 500 if the engine failed the request, 503 while shutting down.
        """
        warn_ignored_fields(self.req)
        self.model = served_model(self.state, self.req.model)
        if self.req.stream_options is not None and not self.req.stream:  # as vLLM's server refuses it
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        self.check()
        prompts = await off_loop(self.state, self.render)
        params = self.params(prompts)
        if params.structured_outputs is not None:  # a bad schema / regex / grammar is a 400 now
            await compile_constraint(self.state, self.req, params.structured_outputs)
        info = RequestInfo.from_request(self.request)
        group = await add_to_engine(self.state, [
            EngineRequest(text, params, info.origin(info.engine_request_id(p, len(prompts))), ids)
            for p, (text, ids) in enumerate(prompts)])
        self.response_id = f"{self.response_id_prefix}-{info.request_id}"
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        if self.req.stream:
            return AbortOnCloseStreamingResponse(self._stream(group, prompt_tokens), group, self._client_left)
        finals = await collect_final(group)
        choices = [self.final_choice(p, c, out) for p, out in enumerate(finals)
                   for c in sorted(out.outputs, key=lambda c: c.index)]
        completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
        body = self.response_type(id=self.response_id, model=self.model, choices=choices,
                                  usage=usage_info(prompt_tokens, completion_tokens), **self.response_extras(finals))
        return JSONResponse(body.model_dump(mode="json"))

    def _client_left(self) -> None:
        """The streaming client left before the end: count it by when (vlite:client_disconnects)."""
        count_disconnect(self.request, "mid-stream" if self.tokens_streamed else "before first token")

    async def _stream(self, group: RequestStreamGroup, prompt_tokens: int) -> AsyncIterator[str]:
        """SSE chunks, one choice per chunk; a choice's last chunk carries its finish_reason.
        Beam search choices arrive whole in one chunk at the end."""
        for choice in self.opening_choices():
            yield sse(self.chunk([choice]))
        deltas = GroupStreamer(group, self.req.n)
        try:
            async for d in deltas:
                if d.error is not None:
                    yield engine_error(d.error, d.error_kind).sse()
                    continue
                yield sse(self.chunk([self.stream_choice(d)]))
                self.tokens_streamed = self.tokens_streamed or d.end_token > d.first_token
        except RuntimeError as exc:  # the engine loop failed this request
            yield APIError(500, str(exc)).sse()
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse(self.chunk([], usage_info(prompt_tokens, deltas.completion_tokens)))
        yield SSE_DONE


def count_disconnect(request: Request, when: str) -> None:
    """Count a client that left ``request``'s route early in the server's metrics, if they exist yet."""
    state = getattr(request.app.state, "server", None)
    if state is not None and state.metrics is not None:
        state.metrics.client_disconnected(request.url.path, when)


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
            body = kwargs.get("req")
            count_disconnect(request, "before first token" if getattr(body, "stream", False) else "non-streaming")
            try:
                await work
            except (asyncio.CancelledError, Exception):  # nobody is left to answer
                logger.debug("cancelled handler ended", exc_info=True)
            return None
        return work.result()

    return wrapper
