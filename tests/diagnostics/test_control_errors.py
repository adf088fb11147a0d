"""Over --url, a control request (drain polling, /debug/blocks, the final census) that gets a 5xx
or loses its connection is a finding naming the endpoint and the error, not a traceback: the
run still ends with a verdict."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fake_http import QuietHandler, ServerPool

from vlite.diagnostics.targets.http import POLL_FAILURES, _wait_idle, run_http

METRICS = ("vlite:num_total_blocks 16\nvlite:num_free_blocks 16\nvlite:num_cached_blocks 0\n"
           "vlite:num_requests_running 0\nvlite:num_requests_waiting 0\n")


def _handler(state: dict):
    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/health":
                self.reply(200, "ok")
            elif self.path == "/metrics":
                self.reply(500, "Internal Server Error") if state["broken"] else self.reply(200, METRICS)
            elif self.path == "/debug/blocks":  # the connection drops without an answer
                state["broken"] = True
                self.close_connection = True
            else:
                self.reply(404, "not found")
    return Handler


@pytest.fixture
def pool():
    p = ServerPool()
    yield p
    p.close()


def test_drain_polling_that_gets_5xx_gives_up_with_findings(pool):
    base = pool.start(_handler({"broken": True}))
    errors: list[dict] = []

    async def wait() -> bool:
        async with httpx.AsyncClient(timeout=5.0) as client:
            return await _wait_idle(base, client, timeout_s=30, errors=errors)

    assert asyncio.run(wait()) is False
    assert len(errors) == POLL_FAILURES
    assert {e["path"] for e in errors} == {"GET /metrics (drain polling)"}
    assert "500 Internal Server Error" in errors[0]["exception"] and "Traceback" in errors[0]["traceback"]


def test_a_dropped_debug_request_and_a_5xx_census_are_findings_and_the_run_ends(pool):
    base = pool.start(_handler({"broken": False}))
    run = run_http(base, [], sample_interval_s=0.05)
    f = run.findings
    paths = {e["path"]: e["exception"] for e in f.engine_errors}
    assert set(paths) == {"GET /debug/blocks (final snapshot)", "GET /metrics (final census)"}
    assert paths["GET /debug/blocks (final snapshot)"].startswith("RemoteProtocolError")
    assert "500 Internal Server Error" in paths["GET /metrics (final census)"]
    assert f.drain.num_total_blocks == 16 and f.drain.ok  # judged from the last sample taken
    assert f.verdict == "ENGINE-ERROR" and "GET /debug/blocks (final snapshot)" in f.summary()
    assert run.info["debug_endpoints"] is False
