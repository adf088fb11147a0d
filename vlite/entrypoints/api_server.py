"""The FastAPI app: OpenAI routes, /tokenize, /detokenize, /health, /version, /metrics, /debug.

The model loads in the background after the socket is bound, so /health answers 503 until
the engine is ready (and again once shutdown begins). HTTP handlers never touch the engine:
they go through AsyncLLMEngine (adds, aborts, read-only snapshots on the engine thread).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vlite import __version__
from vlite.engine.async_engine import AsyncLLMEngine
from vlite.engine.llm_engine import LLMEngine
from vlite.entrypoints.debug import blocks_snapshot
from vlite.entrypoints.errors import APIError, install_error_handlers
from vlite.entrypoints.metrics import ServerMetrics
from vlite.entrypoints.middleware import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    ReadinessMiddleware,
    RequestIdMiddleware,
)
from vlite.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from vlite.entrypoints.serving import served_model, with_cancellation
from vlite.entrypoints.serving_chat import create_chat_completion, render_chat
from vlite.entrypoints.serving_completion import create_completion
from vlite.entrypoints.state import ServerSettings, ServerState

logger = logging.getLogger("vlite.server")


async def _load(state: ServerState, load_engine: Callable[[], LLMEngine], on_fatal: Callable[[str], None]) -> None:
    """Load the model off the event loop, then start the engine loop and mark the server ready."""
    try:
        engine = await asyncio.to_thread(load_engine)
    except Exception as exc:  # noqa: BLE001 - any load failure ends the server with its message
        state.status = "failed"
        state.load_error = f"{type(exc).__name__}: {exc}"
        logger.error("failed to load the model: %s", state.load_error)
        on_fatal(state.load_error)
        return
    if state.status != "loading":  # shutdown began while loading
        return
    names = state.settings.served_model_names or (engine.model_name,)
    metrics = ServerMetrics(names[0], lambda: async_engine.latest_stats)
    async_engine = AsyncLLMEngine(engine, on_output=metrics.observe, log_stats=state.settings.log_stats,
                                  log_stats_interval=state.settings.log_stats_interval)
    async_engine.start()
    state.model_names = tuple(names)
    state.model_root = str(engine.config.model)
    state.max_model_len = engine.max_model_len
    state.metrics = metrics
    state.engine = async_engine
    state.status = "ready"
    s = async_engine.latest_stats
    logger.info("model %s ready: max_model_len %d, %d KV blocks of %d tokens", names[0], engine.max_model_len,
                s.num_total_blocks, engine.block_size)


def create_app(settings: ServerSettings, load_engine: Callable[[], LLMEngine],
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """Build the app; ``load_engine`` runs in a worker thread at startup.

    ``on_fatal(message)`` is called if the model fails to load (the CLI stops the server then).
    ``app.state.server`` is the ServerState (for signal handling and tests).
    """
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.create_task(_load(state, load_engine, on_fatal or (lambda msg: None)))
        yield
        state.begin_shutdown()
        if not loader.done():
            loader.cancel()
        if state.engine is not None:
            await state.engine.shutdown()

    app = FastAPI(title="vlite", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    # Added innermost first: the request id wraps everything, so every response echoes it.
    app.add_middleware(ReadinessMiddleware, state=state)
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/health")
    async def health() -> Response:
        """200 with an empty body once the engine loop runs (503 before, from the middleware)."""
        if state.engine is None or not state.engine.is_running:
            raise APIError(503, "the engine loop is not running", code="service_unavailable")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> ModelList:
        """OpenAI's model list: the served model names."""
        return ModelList(data=[ModelCard(id=name, root=state.model_root, max_model_len=state.max_model_len)
                               for name in state.model_names])

    @app.post("/v1/completions")
    @with_cancellation
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await create_completion(req, request, state)

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(req, request, state)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        """vLLM's /tokenize: ``prompt`` or chat ``messages`` -> token ids."""
        served_model(state, req.model)
        tokenizer = state.engine.engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            _, ids = render_chat(tokenizer, req.messages, req.add_generation_prompt)
        else:
            ids = tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: token ids -> text."""
        served_model(state, req.model)
        tokenizer = state.engine.engine.tokenizer
        vocab = len(tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition of this server's registry."""
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if settings.enable_debug_endpoints:
        @app.get("/debug/blocks")
        async def debug_blocks() -> JSONResponse:
            """The block manager's state (see vlite.entrypoints.debug); read-only."""
            doc = await state.engine.run_on_engine(lambda engine: blocks_snapshot(engine, state.engine))
            if state.metrics is not None:  # server state: per-request latency bookkeeping
                doc["view"]["registries"]["server.metrics_last_token"] = len(state.metrics._last_token_time)
            return JSONResponse(doc)

    return app
