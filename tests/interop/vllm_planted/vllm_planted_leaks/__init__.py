"""Planted leaks for a real vLLM (test only): with ``VLITE_PLANT_ABORT_LEAK=api_server`` vLLM's
``AsyncLLM.abort`` (API server process) keeps every aborted request id in a dict on the AsyncLLM;
with ``engine_core``, ``EngineCore.abort_requests`` (engine core process) does the same on the
EngineCore. Off when the variable is unset."""

import os
import time


def register() -> None:
    where = os.environ.get("VLITE_PLANT_ABORT_LEAK")
    if where == "api_server":
        from vllm.v1.engine.async_llm import AsyncLLM

        original = AsyncLLM.abort

        async def abort(self, request_id, internal=False):
            kept = self.__dict__.setdefault("aborted_requests", {})
            for rid in (request_id,) if isinstance(request_id, str) else list(request_id):
                kept[rid] = time.time()
            return await original(self, request_id, internal)

        AsyncLLM.abort = abort
    elif where == "engine_core":
        from vllm.v1.engine.core import EngineCore

        original_core = EngineCore.abort_requests

        def abort_requests(self, request_ids):
            kept = self.__dict__.setdefault("aborted_requests", {})
            for rid in request_ids:
                kept[rid] = time.time()
            return original_core(self, request_ids)

        EngineCore.abort_requests = abort_requests
