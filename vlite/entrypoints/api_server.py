"""The FastAPI app: OpenAI routes, /tokenize, /detokenize, /health, /version, /metrics, /debug.

Two request-id censuses run at idle points (docs/architecture.md, "The leak check"): the engine loop's and this
process's own (``vlite.entrypoints.census``, a task on the event loop); /metrics exports both
(``vlite:ended_requests_held{container}``), /debug/census shows both with their request ids.

The model loads in the background after the socket is bound, so /health answers 503 until
the engine is ready (and again once shutdown begins). HTTP handlers never touch the engine:
they go through AsyncLLMEngine (adds, aborts, read-only snapshots on the engine thread) or,
with the engine core in its own process, MPAsyncLLMEngine (the same methods, over pipes).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vlite import __version__
from vlite.engine import (
    INT64_MAX,
    INT64_MIN,
    AsyncLLMEngine,
    EngineConfig,
    EngineCoreStartError,
    LLMEngine,
    MPAsyncLLMEngine,
)
from vlite.entrypoints.census import ApiServerCensus
from vlite.entrypoints.errors import APIError, install_error_handlers
from vlite.entrypoints.metrics import ServerMetrics
from vlite.entrypoints.middleware import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    InFlightMiddleware,
    ReadinessMiddleware,
    RequestIdMiddleware,
)
from vlite.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from vlite.entrypoints.serving import check_prompt_chars, off_loop, served_model, with_cancellation
from vlite.entrypoints.serving_chat import OpenAIServingChat, chat_plain_messages, check_chat_chars, render_chat
from vlite.entrypoints.serving_completion import OpenAIServingCompletion
from vlite.entrypoints.serving_responses import OpenAIServingResponses, stored_response
from vlite.entrypoints.state import ServerSettings, ServerState

logger = logging.getLogger("vlite.server")

# What each route can answer besides its 200, for the OpenAPI document (docs/serve.md, "Errors").
# Every route: 400 (an X-Request-Id over 256 characters), 401 (with --api-key), 413 (a body over
# --max-request-body-bytes, whatever the route) and 503 (loading, shutting down); body routes
# add 400 for invalid bodies and 404 for an unknown model; the generation routes add 500 (the
# engine failed that request). Validation errors are 400, never FastAPI's 422.
_ERROR_TEXT = {400: "invalid request (the message and `param` say what and where)",
               401: "missing or wrong API key (only with --api-key)", 404: "unknown model",
               413: "request body over --max-request-body-bytes",
               500: "the engine failed this request (the server goes on)",
               503: "the model is loading or the server is shutting down"}


def _errors(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": _ERROR_TEXT[s]} for s in statuses}


_COMMON_ERRORS = (400, 401, 413, 503)
# With "stream": true. Before OpenAPI 3.2 the schema of an event stream describes one event.
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "one JSON chunk (or an error object), or [DONE] last"}}}}}


def _exact_integer_bounds(node) -> None:
    """FastAPI's OpenAPI models hold ``minimum``/``maximum`` as floats, which turns the seed bound
    2**63 - 1 into 2**63; put integer schemas' bounds back as exact integers (int64 at most)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum"):
                if isinstance(node.get(key), float):
                    node[key] = max(INT64_MIN, min(INT64_MAX, int(node[key])))
        for value in node.values():
            _exact_integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _exact_integer_bounds(value)


def _runtime_bounds(doc: dict, state: ServerState) -> None:
    """Write the bounds known once the model is loaded into the request schemas: ``n`` and
    ``best_of`` <= --max-n, ``max_tokens`` <= max_model_len, token ids < the vocabulary size."""
    schemas = doc.get("components", {}).get("schemas", {})
    vocab = state.engine.hf_config.vocab_size

    def bound(node, maximum: int) -> None:  # the integer member of a field's schema (or its anyOf)
        for member in [node, *node.get("anyOf", []), *node.get("oneOf", [])]:
            if member.get("type") == "integer":
                member["maximum"] = maximum
            elif member.get("type") == "array":
                bound(member["items"], maximum)

    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas.get(name, {}).get("properties", {})
        for field, maximum in (("n", state.settings.max_n), ("best_of", state.settings.max_n),
                               ("max_tokens", state.max_model_len), ("max_completion_tokens", state.max_model_len),
                               ("stop_token_ids", vocab - 1), ("prompt", vocab - 1)):
            if field in props:
                bound(props[field], maximum)
    if "tokens" in schemas.get("DetokenizeRequest", {}).get("properties", {}):
        bound(schemas["DetokenizeRequest"]["properties"]["tokens"], vocab - 1)


def _openapi(app: FastAPI, state: ServerState) -> dict:
    """FastAPI's document, without the 422 it adds to body routes (this server answers 400), with
    exact integer bounds and, once the model is loaded, the bounds that depend on it."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _exact_integer_bounds(doc)
        if state.engine is not None:
            _runtime_bounds(doc, state)
        for operations in doc.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(name, None)
        if state.engine is None:  # not loaded yet: do not cache a document without the model's bounds
            return doc
        app.openapi_schema = doc
    return app.openapi_schema


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """``await fn()`` run in a daemon thread. Unlike ``asyncio.to_thread`` nothing waits for the
    thread when the event loop closes: a Ctrl-C during a model load ends the server at once
    instead of after the load (``asyncio.run`` joins its executor's threads)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        def settle() -> None:
            if not future.done():  # cancelled: the server stopped while loading
                setter(value)
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits for the result any more
            pass

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            deliver(future.set_exception, exc)
        else:
            deliver(future.set_result, result)

    threading.Thread(target=run, name="vlite-model-load", daemon=True).start()
    return await future


async def _load(state: ServerState, load_engine: Callable[[], LLMEngine] | None, on_fatal: Callable[[str], None],
                core_config: EngineConfig | None = None,
                cancel_load: list[Callable[[], None]] | None = None) -> None:
    """Load the model off the event loop (in this process, or in the engine core process when
    ``core_config`` is given), then start the engine loop and mark the server ready.
    ``cancel_load`` gets a function that stops a load under way (kills the engine core process)."""
    metrics_box: list[ServerMetrics] = []

    def observe(out) -> None:  # metrics exist once the model's name is known
        if metrics_box:
            metrics_box[0].observe(out)

    def on_death(message: str) -> None:  # the engine core process died: fail, exit non-zero
        state.status = "failed"
        state.load_error = message
        on_fatal(message)

    try:
        if core_config is not None:
            async_engine = MPAsyncLLMEngine(core_config, on_output=observe, on_death=on_death,
                                            log_stats=state.settings.log_stats,
                                            log_stats_interval=state.settings.log_stats_interval)
            if cancel_load is not None:
                cancel_load.append(async_engine.core.cancel_launch)
            await _in_daemon_thread(async_engine.launch)
        else:
            engine = await _in_daemon_thread(load_engine)
            async_engine = AsyncLLMEngine(engine, on_output=observe, log_stats=state.settings.log_stats,
                                          log_stats_interval=state.settings.log_stats_interval, on_fatal=on_death)
    except Exception as exc:  # noqa: BLE001 - any load failure ends the server with its message
        if state.status == "shutting_down":  # the load was stopped (Ctrl-C): not a failure
            return
        state.status = "failed"
        state.load_error = str(exc) if isinstance(exc, EngineCoreStartError) else f"{type(exc).__name__}: {exc}"
        logger.error("failed to load the model: %s", state.load_error)
        on_fatal(state.load_error)
        return
    if state.status != "loading":  # shutdown began while loading
        if core_config is not None:
            await async_engine.shutdown()
        return
    names = state.settings.served_model_names or (async_engine.model_name,)
    census = state.census
    metrics = ServerMetrics(names[0], lambda: async_engine.latest_stats,
                            api_census=(lambda: (census.held_counts(), census.pending, census.overdue))
                            if census else None)
    metrics_box.append(metrics)
    async_engine.start()
    state.model_names = tuple(names)
    state.model_root = async_engine.model_root
    state.max_model_len = async_engine.max_model_len
    state.metrics = metrics
    state.engine = async_engine
    state.status = "ready"
    s = async_engine.latest_stats
    where = f"engine core process {async_engine.pid}" if core_config is not None else "in-process engine loop"
    logger.info("model %s ready (%s): max_model_len %d, %d KV blocks of %d tokens", names[0], where,
                async_engine.max_model_len, s.num_total_blocks, async_engine.block_size)


def create_app(settings: ServerSettings, load_engine: Callable[[], LLMEngine] | None,
               on_fatal: Callable[[str], None] | None = None, core_config: EngineConfig | None = None) -> FastAPI:
    """Build the app; ``load_engine`` runs in a worker thread at startup.

    With ``core_config`` the engine runs in its own process instead (``MPAsyncLLMEngine``,
    ``vlite.engine.serving.engine_core``) and ``load_engine`` is not used.

    ``on_fatal(message)`` is called if the model fails to load or the engine dies later (the
    engine core process died, or a tensor-parallel rank failed); the CLI stops the server then
    and exits non-zero.
    ``app.state.server`` is the ServerState (for signal handling and tests).
    """
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        cancel_load: list[Callable[[], None]] = []
        loader = asyncio.create_task(_load(state, load_engine, on_fatal or (lambda msg: None), core_config,
                                           cancel_load))
        census = asyncio.create_task(state.census.serve())  # waits for idle points (none while loading)
        yield
        census.cancel()
        state.begin_shutdown()
        if not loader.done():  # stopped while loading: the load is abandoned, not waited for
            logger.info("stopped while loading the model: the load is abandoned")
            state.load_abandoned = True
            for cancel in cancel_load:
                cancel()
            loader.cancel()
        if state.engine is not None:
            await state.engine.shutdown()
        if state._tokenizer_pool is not None:
            state._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="vlite", version=__version__, lifespan=lifespan)
    app.openapi = lambda: _openapi(app, state)
    app.state.server = state
    state.census = ApiServerCensus(state, app)
    install_error_handlers(app)
    # Added innermost first: the request id wraps everything, so every response echoes it.
    app.add_middleware(InFlightMiddleware, state=state)
    app.add_middleware(ReadinessMiddleware, state=state)
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/health", response_class=Response, responses={
        200: {"description": "ready: the engine loop runs (empty body)", "content": {}},
        **_errors(400, 413, 503)})  # no API key needed
    async def health() -> Response:
        """200 with an empty body once the engine loop runs (503 before, from the middleware)."""
        if state.engine is None or not state.engine.is_running:
            raise APIError(503, "the engine loop is not running", code="service_unavailable")
        return Response(status_code=200)

    @app.get("/version", responses=_errors(400, 401, 413))  # answers while loading too
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/v1/models", responses=_errors(*_COMMON_ERRORS))
    async def models() -> ModelList:
        """OpenAI's model list: the served model names."""
        return ModelList(data=[ModelCard(id=name, root=state.model_root, max_model_len=state.max_model_len)
                               for name in state.model_names])

    @app.post("/v1/completions", response_class=JSONResponse, responses={
        200: {"model": CompletionResponse, "content": _SSE}, **_errors(*_COMMON_ERRORS, 404, 500)})
    @with_cancellation
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await OpenAIServingCompletion(req, request, state).serve()

    @app.post("/v1/chat/completions", response_class=JSONResponse, responses={
        200: {"model": ChatCompletionResponse, "content": _SSE}, **_errors(*_COMMON_ERRORS, 404, 500)})
    @with_cancellation
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await OpenAIServingChat(req, request, state).serve()

    @app.post("/v1/responses", response_class=JSONResponse, responses={
        200: {"content": _SSE}, **_errors(*_COMMON_ERRORS, 404, 500)})
    @with_cancellation
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        return await OpenAIServingResponses(req, request, state).serve()

    @app.get("/v1/responses/{response_id}", responses=_errors(*_COMMON_ERRORS, 404))
    async def get_response(response_id: str) -> JSONResponse:
        """A response stored by POST /v1/responses (store: true), while the store keeps it."""
        return JSONResponse(stored_response(state, response_id))

    @app.post("/tokenize", responses=_errors(*_COMMON_ERRORS, 404))
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: ``prompt`` or chat ``messages`` -> token ids (tokenized off the event loop)."""
        served_model(state, req.model)
        tokenizer = state.engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            plain = chat_plain_messages(req.messages)
            check_chat_chars(state, plain)
            _, ids = await off_loop(state, render_chat, tokenizer, plain, req.add_generation_prompt)
        else:
            check_prompt_chars(state, len(req.prompt), "prompt")
            ids = (await off_loop(state, lambda: tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)
                                  )).input_ids
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)

    @app.post("/detokenize", responses=_errors(*_COMMON_ERRORS, 404))
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize: token ids -> text (decoded off the event loop)."""
        served_model(state, req.model)
        tokenizer = state.engine.tokenizer
        vocab = len(tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=await off_loop(state, tokenizer.decode, req.tokens))

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text exposition format",
              "content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors(*_COMMON_ERRORS)})
    async def metrics() -> Response:
        """Prometheus text exposition of this server's registry."""
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if settings.enable_debug_endpoints:
        @app.get("/debug/blocks")
        async def debug_blocks() -> JSONResponse:
            """The block manager's state (vlite.engine.introspection.blocks_document); read-only."""
            doc = await state.engine.blocks_snapshot()
            if state.metrics is not None:  # server state: per-request latency bookkeeping
                doc["view"]["registries"]["server.metrics_last_token"] = len(state.metrics._last_token_time)
            return JSONResponse(doc)

        @app.get("/debug/census")
        async def debug_census() -> JSONResponse:
            """The last request-id census of each process, ``{"engine": ..., "api_server": ...}``
            (``EngineLoop.census_document``, ``ApiServerCensus.document``): when it was taken, its
            cost, the requests ended since, and every container still holding ended requests, by
            path, with their ids. In-process the two share a pid and walk disjoint objects."""
            engine_doc = await state.engine.query("census")
            return JSONResponse({"engine": engine_doc, "api_server": state.census.document()})

        @app.get("/debug/gpu_allocations")
        async def debug_gpu_allocations() -> JSONResponse:
            """The engine process's live CUDA allocations by allocation site
            (``vlite.engine.worker.cuda_alloc_sites.document``: ``{"pid", "recording", "unavailable",
            "sites": {site: {"bytes", "count"}}}``), once recording was started; read by
            ``leak-check --url --trace-gpu-allocations`` at its idle points."""
            return JSONResponse(await state.engine.query("gpu_allocations"))

        @app.post("/debug/gpu_allocations/start")
        async def debug_gpu_allocations_start() -> JSONResponse:
            """Start recording the engine process's CUDA allocations with their Python stacks
            (``torch.cuda.memory._record_memory_history``, bounded); without CUDA,
            ``recording`` is false and ``unavailable`` says why."""
            return JSONResponse(await state.engine.query("gpu_allocations_start"))

        @app.post("/debug/gpu_allocations/stop")
        async def debug_gpu_allocations_stop() -> JSONResponse:
            """Stop the recording ``/debug/gpu_allocations/start`` began."""
            return JSONResponse(await state.engine.query("gpu_allocations_stop"))

    return app
