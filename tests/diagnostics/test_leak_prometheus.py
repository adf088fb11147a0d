"""``vlite leak-check --prometheus URL --job NAME --since``: a range judged from Prometheus's HTTP
API. The fake API answers with JSON recorded from a REAL Prometheus (Debian's 2.42) scraping two
`vlite serve` every second (tests/interop/prometheus.sh): one clean, one under
--inject-fault skip-free-on-abort, both with six waves of complete and mid-stream-disconnect
requests. No real Prometheus in CI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from fake_http import QuietHandler, ServerPool

from vlite.diagnostics.targets.prometheus_range import PrometheusError, judge_range, pages_from_matrix, parse_since

FIX = Path(__file__).parent / "fixtures"
VLITE = str(Path(sys.executable).with_name("vlite"))


def _recorded(job: str) -> dict:
    return json.loads((FIX / f"prometheus-range-{job}.json").read_text())


def _transport(rec: dict, seen: list | None = None) -> httpx.MockTransport:
    def handler(req: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append((req.url.path, dict(req.url.params.multi_items())))
        for c in rec["calls"]:
            if c["path"] == req.url.path:
                return httpx.Response(200, json=c["body"])
        return httpx.Response(404, json={"status": "error", "errorType": "not_found", "error": "no such path"})
    return httpx.MockTransport(handler)


def _judge(job: str, seen=None, **kw):
    rec = _recorded(job)
    return judge_range("http://prom:9090", job, parse_since(rec["since"]), end=rec["end"], step_s=rec["step_s"],
                       client=httpx.Client(transport=_transport(rec, seen)), on_line=lambda line: None, **kw)


def test_recorded_clean_range_is_clean():
    seen = []
    res = _judge("vlite-clean", seen)
    assert res.verdict == "CLEAN" and res.exit_code == 0, res.summary
    assert len(res.idle_points) >= 6 and res.idle_points[-1].requests_served == 30  # 6 waves x 5 requests
    assert all(p.kv_used == 0 for p in res.idle_points)
    assert res.info["server_kind"] == "vlite" and res.info["mode"] == "prometheus"
    # the range query asks only for the series the vlite adapter reads, of this job and instance
    q = next(params for path, params in seen if path == "/api/v1/query_range")["query"]
    assert q.startswith('{job="vlite-clean",instance="127.0.0.1:') and "vlite:num_free_blocks" in q
    assert "vlite:time_to_first_token_seconds_bucket" not in q


def test_recorded_leaking_range_is_a_leak_at_the_first_idle_point_after_traffic():
    res = _judge("vlite-leak")
    assert res.verdict == "LEAK" and res.exit_code == 1, res.summary
    a = res.alerts[0]
    assert a.flag == "kv-held" and a.idle_point == 2
    held = [p.kv_used for p in res.idle_points]
    assert held[0] == 0 and held[-1] > held[1] > 0  # 2 disconnects per wave, each leaves blocks behind


def test_prometheus_errors_are_one_line():
    rec = _recorded("vlite-clean")
    empty = {"calls": [{"path": "/api/v1/label/instance/values", "body": {"status": "success", "data": []}}]}
    with pytest.raises(PrometheusError, match="holds no series of job 'nope'"):
        judge_range("http://prom", "nope", 60, client=httpx.Client(transport=_transport(empty)))
    # a job with several instances is judged per instance: test_prometheus_fleet.py
    bad = {"calls": [{"path": "/api/v1/label/instance/values",
                      "body": {"status": "error", "errorType": "bad_data", "error": "parse error"}}]}
    with pytest.raises(PrometheusError, match="bad_data parse error"):
        judge_range("http://prom", "j", 60, client=httpx.Client(transport=_transport(bad)))
    with pytest.raises(ValueError, match="90s, 30m, 6h"):
        parse_since("six hours")
    assert parse_since("6h") == 21600 and parse_since("90s") == 90 and parse_since("2d") == 172800
    assert rec["recorded_from"].startswith("Prometheus 2.42")


def test_pages_from_matrix_groups_by_step_and_drops_prometheus_labels():
    result = [{"metric": {"__name__": "vllm:num_requests_running", "job": "j", "instance": "i", "engine": "0"},
               "values": [[10, "1"], [11, "0"]]},
              {"metric": {"__name__": "vllm:num_requests_running", "job": "j", "instance": "i", "engine": "1"},
               "values": [[10, "2"], [11, "NaN"]]}]
    pages = pages_from_matrix(result)
    assert [t for t, _ in pages] == [10.0, 11.0]
    assert pages[0][1].total("vllm:num_requests_running") == 3 and pages[1][1].total("vllm:num_requests_running") == 0
    assert pages[0][1].series("vllm:num_requests_running")[0].labels == {"engine": "0"}


def test_cli_prometheus_against_a_fake_api_server(tmp_path):
    rec = _recorded("vlite-leak")

    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            path = urlparse(self.path).path
            body = next((c["body"] for c in rec["calls"] if c["path"] == path), {"status": "error"})
            self.reply(200 if body.get("status") == "success" else 404, json.dumps(body), "application/json")

    pool = ServerPool()
    url = pool.start(Handler)
    try:
        # the fake answers the recorded range whatever start and end the CLI asks for
        p = subprocess.run([VLITE, "leak-check", "--prometheus", url, "--job",
                            "vlite-leak", "--since", rec["since"], "--interval", "1", "--report", str(tmp_path / "r")],
                           capture_output=True, text=True, timeout=120)
    finally:
        pool.close()
    assert p.returncode == 1, p.stdout + p.stderr
    assert "ALERT kv-held" in p.stdout and "verdict: LEAK" in p.stdout
    assert (tmp_path / "r" / "report.md").read_text().count("**LEAK**") == 1
    bad = subprocess.run([VLITE, "leak-check", "--prometheus", "http://127.0.0.1:9", "--job", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Connection refused" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def _resampling_transport(rec: dict) -> httpx.MockTransport:
    """Answer as Prometheus would for the recorded 1 s samples: a range query at any step (the
    newest sample at or before each step, within the 5 min lookback), an instant
    ``count_over_time`` with the number of stored samples."""
    raw = next(c["body"] for c in rec["calls"] if c["path"] == "/api/v1/query_range")["data"]["result"]

    def at(values, t):
        older = [(ts, v) for ts, v in values if ts <= t + 1e-6]
        return older[-1] if older and t - older[-1][0] <= 300 else None

    def handler(req: httpx.Request) -> httpx.Response:
        q = dict(req.url.params.multi_items())
        if req.url.path == "/api/v1/query_range":
            start, end, step = float(q["start"]), float(q["end"]), float(q["step"])
            ts = [start + k * step for k in range(int((end - start) / step) + 1)]
            out = [{"metric": s["metric"], "values": [[t, p[1]] for t in ts if (p := at(s["values"], t))]}
                   for s in raw]
            return httpx.Response(200, json={"status": "success", "data": {"resultType": "matrix", "result": out}})
        if req.url.path == "/api/v1/query":
            name = q["query"].split('__name__="')[1].split('"')[0]
            n = max(len(s["values"]) for s in raw if s["metric"]["__name__"] == name)
            data = {"resultType": "vector", "result": [{"metric": {}, "value": [float(q["time"]), str(n)]}]}
            return httpx.Response(200, json={"status": "success", "data": data})
        body = next((c["body"] for c in rec["calls"] if c["path"] == req.url.path), None)
        return httpx.Response(200 if body else 404, json=body or {"status": "error", "error": "no such path"})
    return httpx.MockTransport(handler)


def test_default_step_is_the_stored_scrape_interval_so_short_idle_stretches_are_seen():
    rec = _recorded("vlite-leak")  # scraped every 1 s; its idle stretches last a few seconds
    client = httpx.Client(transport=_resampling_transport(rec))
    res = judge_range("http://prom:9090", "vlite-leak", parse_since(rec["since"]), end=rec["end"], client=client,
                      on_line=lambda line: None)
    assert res.verdict == "LEAK", res.summary
    assert res.info["step_s"] == pytest.approx(1.0, rel=0.1) and res.info["stored_interval_s"] == res.info["step_s"]


def test_a_step_too_coarse_for_the_idle_stretches_names_the_interval_to_try():
    rec = _recorded("vlite-leak")
    client = httpx.Client(transport=_resampling_transport(rec))
    res = judge_range("http://prom:9090", "vlite-leak", parse_since(rec["since"]), end=rec["end"], step_s=15,
                      client=client, on_line=lambda line: None)
    assert res.verdict == "INCONCLUSIVE"
    assert "a 15 s step" in res.summary and "try --interval 1" in res.summary, res.summary
