"""The serving layer: one engine loop (``engine_loop.EngineLoop``) reached through two core
clients (a thread, or an engine core process), under one async client (``AsyncEngineClient``:
``AsyncLLMEngine`` and ``MPAsyncLLMEngine``). Code outside ``vlite/engine`` imports these names
from ``vlite.engine``.
"""

from vlite.engine.serving.async_engine import AsyncLLMEngine, MPAsyncLLMEngine
from vlite.engine.serving.protocol import (
    AsyncEngineClient,
    EngineCoreStartError,
    EngineNotRunningError,
    EngineRequest,
)
from vlite.engine.serving.streams import RequestStreamGroup

__all__ = ["AsyncEngineClient", "AsyncLLMEngine", "EngineCoreStartError", "EngineNotRunningError", "EngineRequest",
           "MPAsyncLLMEngine", "RequestStreamGroup"]
