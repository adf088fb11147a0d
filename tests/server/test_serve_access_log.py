"""`vlite serve` leaves /health and /metrics out of its access log by default, as vLLM's
``--disable-access-log-for-endpoints /health,/metrics`` would (a leak check's 100 ms
scrapes were 4,093 of a serve log's 4,431 lines); other routes still log a line each."""

from __future__ import annotations

import logging

import httpx
import pytest
from serve_harness import ServerProcess

from vlite.entrypoints.access_log import ExcludePathsFilter, parse_paths


def _access_record(path: str) -> logging.LogRecord:
    # the shape uvicorn's access logger gives: (client_addr, method, full_path, http_version, status_code)
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", "GET", path, "1.1", 200), None)


def test_filter_matches_the_path_without_its_query():
    f = ExcludePathsFilter(parse_paths("/health, /metrics"))
    assert not f.filter(_access_record("/metrics")) and not f.filter(_access_record("/metrics?name[]=x"))
    assert not f.filter(_access_record("/health"))
    assert f.filter(_access_record("/v1/completions")) and f.filter(_access_record("/metricsx"))
    assert parse_paths("") == () and parse_paths(" , ") == ()
    with pytest.raises(ValueError, match="is not a path"):
        parse_paths("metrics")


def test_a_bad_path_is_a_one_line_error(tiny_model_dir):
    from typer.testing import CliRunner

    from vlite.cli.main import app

    res = CliRunner().invoke(app, ["serve", "--model", str(tiny_model_dir), "--disable-access-log-for-endpoints",
                                   "metrics"])
    assert res.exit_code == 2 and "is not a path" in res.output


def test_serve_log_has_no_metrics_lines_but_a_completion_line(tiny_model_dir, tmp_path):
    server = ServerProcess(tiny_model_dir, tmp_path / "serve.log", "--num-blocks", "64", "--served-model-name",
                           "tiny")
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            for _ in range(20):
                assert client.get("/metrics").status_code == 200
            assert client.get("/health").status_code == 200
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello",
                                                     "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        server.stop()
    log = server.log()
    access = [line for line in log.splitlines() if '" 200' in line and "HTTP/1.1" in line]
    assert not [line for line in access if "GET /metrics" in line or "GET /health" in line], log
    assert sum("POST /v1/completions" in line for line in access) == 1, log
