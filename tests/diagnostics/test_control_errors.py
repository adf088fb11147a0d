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


def test_a_blackbox_probe_that_gets_5xx_is_a_finding_and_the_verdict_says_so(pool, tmp_path):
    """A fake vLLM, idle and clean, whose 1-token probes (the control requests of the black box)
    answer 500: a CLEAN run becomes ENGINE-ERROR, and the report names each failed probe."""
    import json as _json

    from vlite.diagnostics.report.blackbox_report import report_json, report_markdown
    from vlite.diagnostics.targets.blackbox import run_blackbox, split_waves
    from vlite.diagnostics.targets.connection import connect
    from vlite.diagnostics.workload.sources import synthetic_workload

    page = ('vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="101"} 1.0\n'
            'vllm:num_requests_running{engine="0"} 0.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.0\n')

    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.reply(200, page if self.path == "/metrics" else "ok" if self.path == "/health" else "{}")

        def do_POST(self):  # noqa: N802
            body = _json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body.get("prompt") == "probe":
                self.reply(500, "Internal Server Error")
            else:
                self.reply(200, _json.dumps({"choices": [{"text": "x", "finish_reason": "length"}], "usage": {}}),
                           "application/json")

    conn = connect(pool.start(Handler))
    specs = synthetic_workload(4, input_len=(8, 8), output_len=(4, 4), seed=1)
    res = run_blackbox(conn, split_waves(specs, 2), drain_timeout_s=5, bisect_budget_s=0, server_pid=None)
    assert res.verdict == "ENGINE-ERROR" and res.exit_code == 1, res.summary
    errors = res.replay.engine_errors
    assert len(errors) == 3 and all(e["path"].startswith("POST /v1/completions (1-token probe vlite-probe-")
                                    for e in errors)
    assert "500 Internal Server Error" in errors[0]["exception"]
    assert [p["status"] for p in res.probes] == [500, 500, 500]
    assert report_json(res)["engine_errors"] == errors
    assert "## Control requests that failed" in report_markdown(res, []) and "Traceback" in report_markdown(res, [])
