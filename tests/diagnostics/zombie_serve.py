"""``vlite serve`` with planted zombies (test only). ``VLITE_TEST_PLANT_ZOMBIE`` lists them, comma
separated (default ``first-token``; ``0`` plants none):

- ``first-token``: a streaming client that disconnects before the first token never triggers the
  abort, so its request decodes on to ``max_tokens``;
- ``admission``: a streaming request's admission takes ``ADMISSION_DELAY_S`` (a slow tokenizer
  or a busy queue) and a client that leaves meanwhile cancels nothing: the requests are still
  added, and the response that would abort them on close is never sent;
- ``refused``: a multi-prompt request refused for one prompt keeps the prompts admitted before it
  (the rollback of ``LLMEngine.add_requests`` skipped): they run on after the client got its 400.

For ``first-token``:

Run as ``python zombie_serve.py serve --model ...`` (the arguments of ``vlite serve``). The
patch wraps ``AbortOnCloseStreamingResponse``: it counts the chunks the stream produced and, when
the stream ends with the request unfinished and fewer than two chunks produced (the client saw no
token; the first may have been in flight when the cut was noticed), skips ``group.abort()``.
Mid-stream disconnects and non-streaming timeouts are aborted as usual. The first chunk is held
``FIRST_CHUNK_DELAY_S`` (as a long prefill would), so that on a loaded machine the client's cut
still lands before any token was produced for the stream.

Each engine step is also slowed to ``STEP_DELAY_S`` (``VLITE_TEST_STEP_DELAY_S`` overrides it: a
healthy engine on a loaded machine, whose steps outlast the zombie check's old 1 s bound;
``VLITE_TEST_PLANT_ZOMBIE=0`` leaves the abort alone): on the tiny test model a 400-token request
otherwise ends inside the first chunk's hold, and a mid-stream disconnect would then come after the
request finished (nothing left to abort). The patch is at module level, so the engine core process
(multiprocessing "spawn" runs this file again as ``__mp_main__``) gets it too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from starlette.responses import StreamingResponse

from vlite.engine.llm_engine import LLMEngine
from vlite.entrypoints import serving

logger = logging.getLogger("vlite.server")
_init = serving.AbortOnCloseStreamingResponse.__init__
FIRST_CHUNK_DELAY_S = 0.3
STEP_DELAY_S = float(os.environ.get("VLITE_TEST_STEP_DELAY_S", "0.004"))  # 400 steps: >= 1.6 s, past the hold
PLANTS = {p for p in os.environ.get("VLITE_TEST_PLANT_ZOMBIE", "first-token").split(",") if p not in ("", "0")}
PLANT = "first-token" in PLANTS
ADMISSION_DELAY_S = 0.3


def _patched_init(self, content, group, on_client_left=None):
    counts = {"chunks": 0}

    async def counted():
        first = True
        async for chunk in content:
            if first:  # a slow first token (a long prefill): the client's cut always lands before it
                first = False
                await asyncio.sleep(FIRST_CHUNK_DELAY_S)
            counts["chunks"] += 1
            yield chunk

    _init(self, counted(), group, on_client_left)
    self._planted_counts = counts


async def _patched_call(self, scope, receive, send):
    try:
        await StreamingResponse.__call__(self, scope, receive, send)
    finally:
        if PLANT and not self.group.all_finished and self._planted_counts["chunks"] < 2:
            logger.warning("planted zombie: client of %s left before the first token; NOT aborting %s",
                           scope.get("path"), self.group.request_ids)
        else:
            self.group.abort()


_step = LLMEngine.step


def _slow_step(self):
    time.sleep(STEP_DELAY_S)
    return _step(self)


_serve = serving.OpenAIServing.serve


async def _admission_that_ignores_a_cancel(self):
    if not self.req.stream:
        return await _serve(self)

    async def admit():
        await asyncio.sleep(ADMISSION_DELAY_S)
        return await _serve(self)

    # the handler's cancellation (its client left) stops the wait, not the admission; the
    # streaming response it builds, which aborts its requests when it closes, is never sent
    return await asyncio.shield(asyncio.ensure_future(admit()))


def _add_requests_keeping_siblings(self, requests):
    # the first refusal raises; the prompts admitted before it stay queued
    return [self.add_request(r.prompt, r.sampling_params, prompt_token_ids=r.prompt_token_ids,
                             request_id=r.origin.request_id, origin=r.origin) for r in requests]


LLMEngine.step = _slow_step
if "admission" in PLANTS:
    serving.OpenAIServing.serve = _admission_that_ignores_a_cancel
if "refused" in PLANTS:
    LLMEngine.add_requests = _add_requests_keeping_siblings
serving.AbortOnCloseStreamingResponse.__init__ = _patched_init
serving.AbortOnCloseStreamingResponse.__call__ = _patched_call

if __name__ == "__main__":
    from vlite.cli.main import app

    sys.argv[0] = "vlite"
    app()
