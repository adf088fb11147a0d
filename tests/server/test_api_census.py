"""The API server's own request-id census: `vlite serve` walks the API server process's
objects at its idle points too, exports them in /metrics as `api_server.<path>` and shows both
processes' censuses at /debug/census. Here the engine loop runs in a thread of the app's process,
so the two censuses share a process and must not walk, or count, a container twice."""

from __future__ import annotations

import asyncio
import gc

import httpx
from conftest import make_engine

import vlite.entrypoints.serving as serving
import vlite.entrypoints.serving_completion as serving_completion
from vlite.diagnostics.readers.metrics_text import labelled_values, parse_page
from vlite.entrypoints.api_server import create_app
from vlite.entrypoints.state import ServerSettings

PLANTED = "api_server.vlite.entrypoints.serving_completion._SEEN_REQUEST_IDS"


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 400))


async def _serve_requests(app, batches: list[list[str]], then=None) -> tuple[dict, str]:
    """Serve one completion per id (every other one streamed), batch after batch, waiting after
    each for both censuses to be current; return the last /debug/census and /metrics (after
    ``then(app)``, if given, still inside the app's lifespan)."""
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 300  # a first start builds the C++ kernels on a loaded machine
            while (await http.get("/health")).status_code != 200:
                assert loop.time() < deadline, "the model did not load"
                await asyncio.sleep(0.05)
            for ids in batches:
                for i, rid in enumerate(ids):
                    body = {"prompt": "hello there", "max_tokens": 3, "stream": i % 2 == 1}
                    r = await http.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
                    assert r.status_code == 200, r.text
                for _ in range(200):  # the censuses run at idle points, at most once a second
                    page = (await http.get("/metrics")).text
                    pending = labelled_values(page, "vlite:census_pending_requests")["vlite:census_pending_requests"]
                    if pending == 0:
                        break
                    await asyncio.sleep(0.1)
                assert pending == 0
            if then is not None:
                then(app)
            return (await http.get("/debug/census")).json(), page


def _held(page: str) -> dict[str, float]:
    """vlite:ended_requests_held by its container label."""
    return {s.labels["container"]: s.value for s in parse_page(page).samples if s.name == "vlite:ended_requests_held"}


def test_a_map_planted_in_the_api_server_is_named_with_its_request_ids(tiny_checkpoint, monkeypatch):
    seen: dict[str, float] = {}
    monkeypatch.setattr(serving_completion, "_SEEN_REQUEST_IDS", seen, raising=False)
    serve = serving.OpenAIServing.serve

    async def keep_ids(self):  # planted: each request's id kept in a module-level map, never emptied
        seen[self.request.state.request_id] = 1.0
        return await serve(self)

    monkeypatch.setattr(serving.OpenAIServing, "serve", keep_ids)
    app = create_app(ServerSettings(enable_debug_endpoints=True), lambda: make_engine(tiny_checkpoint, num_blocks=32))
    gc.collect()
    gc.freeze()  # as a server may after start-up: the map leaves gc.get_objects(), references still reach it
    try:
        assert not any(o is seen for o in gc.get_objects())
        # two idle points: the second census must not find the first one's own record of the ids
        doc, page = _run(_serve_requests(app, [["api-1", "api-2"], ["api-3"]]))
    finally:
        gc.unfreeze()

    api, engine = doc["api_server"], doc["engine"]
    assert [(h["path"], h["kind"], h["request_ids"]) for h in api["held"]] == [
        (PLANTED, "key", ["api-1", "api-2", "api-3"])]
    assert api["pending"] == 0 and api["taken_at"] is not None and api["elapsed_ms"] > 0
    print(f"API server census: {api['objects_visited']} objects, {api['elapsed_ms']} ms; "
          f"engine census: {engine['objects_visited']} objects, {engine['elapsed_ms']} ms")
    # the engine loop runs in this process: its census leaves the server's modules to this one
    assert engine["held"] == [] and engine["taken_at"] is not None and engine["pid"] == api["pid"]
    assert _held(page) == {PLANTED: 3.0}  # /metrics: one series, counted once


def test_a_clean_server_holds_no_ended_request_on_either_side(tiny_checkpoint):
    app = create_app(ServerSettings(enable_debug_endpoints=True), lambda: make_engine(tiny_checkpoint, num_blocks=32))

    def idle_points_need_no_http_request_in_flight(app) -> None:
        state, census = app.state.server, app.state.server.census
        taken = census.census.taken_at
        state.engine.ended.total += 1  # as if one more request had ended
        state.requests_in_flight = 1  # a request still being answered (a /metrics scrape does not count)
        assert census.pending == 1 and not census.idle() and not census.maybe_run() and census.census.taken_at == taken
        state.requests_in_flight = 0
        assert census.idle()
        census.census._last -= 10  # the interval has passed
        assert census.maybe_run() and census.pending == 0 and census.census.taken_at != taken

    doc, page = _run(_serve_requests(app, [["c-1", "c-2"]], then=idle_points_need_no_http_request_in_flight))
    for side in ("api_server", "engine"):
        assert doc[side]["held"] == [] and doc[side]["pending"] == 0 and doc[side]["taken_at"] is not None, doc
        assert doc[side]["objects_visited"] > 100  # it did walk something
    assert _held(page) == {}
