"""The probe inside a pretend vLLM (a separate process): off unless enabled, its series on the
server's own /metrics, and ``run_blackbox`` naming the Responses store that keeps every response,
CLEAN where the store is off."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serve_harness import free_port

from vlite.diagnostics.readers.probe_series import from_page
from vlite.diagnostics.targets.blackbox import run_blackbox, split_waves
from vlite.diagnostics.targets.connection import connect
from vlite.diagnostics.workload.sources import synthetic_workload

HERE = Path(__file__).parent
PROBE = HERE.parents[1] / "probe"
FAST = {"VLITE_PROBE_QUIET_S": "0.3", "VLITE_PROBE_INTERVAL_S": "0.3"}


def _start(tmp_path, **env) -> tuple[subprocess.Popen, str]:
    port = free_port()
    full = {**os.environ, "PYTHONPATH": f"{PROBE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "VLITE_PROBE_DIR": str(tmp_path / "probe"), **env}
    proc = subprocess.Popen([sys.executable, str(HERE / "pretend_vllm.py"), str(port)], env=full,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"))
    base = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(f"{base}/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    return proc, base


@pytest.fixture
def server(tmp_path):
    procs = []

    def start(**env):
        proc, base = _start(tmp_path, **env)
        procs.append(proc)
        return base

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _page_reading(base: str, passes: int = 1, timeout_s: float = 20.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        reading = from_page(httpx.get(f"{base}/metrics").text)
        if reading is not None and all(v["passes"] >= passes for v in reading.processes.values()):
            return reading
        time.sleep(0.2)
    return from_page(httpx.get(f"{base}/metrics").text)


def test_the_probe_is_off_unless_enabled(server, tmp_path):
    base = server(**FAST)  # VLITE_PROBE not set
    time.sleep(1.0)
    assert from_page(httpx.get(f"{base}/metrics").text) is None
    assert not (tmp_path / "probe").exists()


def _responses_waves(n_waves: int = 6, per_wave: int = 4):
    specs = synthetic_workload(n_waves * per_wave, input_len=(4, 8), output_len=(3, 3), seed=3, prefix="pr")
    from dataclasses import replace

    return split_waves([replace(s, api="responses", store=True) for s in specs], per_wave)


def test_a_responses_store_that_keeps_every_response_is_named(server):
    base = server(VLITE_PROBE="1", PRETEND_STORE="1", **FAST)
    reading = _page_reading(base)
    assert reading is not None and list(reading.processes) == [k for k in reading.processes if k.startswith("main")]
    res = run_blackbox(connect(base, "vllm"), _responses_waves(), max_concurrency=4, drain_timeout_s=10,
                       bisect_budget_s=0)
    assert res.verdict == "LEAK", res.summary
    grown = res.probe["growing"]
    assert [g["container"] for g in grown] == ["__main__.ResponsesServing.response_store"], res.probe
    assert grown[0]["last"] == 24 and grown[0]["entries_per_request"] == pytest.approx(1.0, abs=0.05)
    assert "ResponsesServing.response_store" in res.summary and "main (pid" in res.summary


def test_the_same_run_with_the_store_off_is_clean(server):
    base = server(VLITE_PROBE="1", PRETEND_STORE="0", **FAST)
    assert _page_reading(base) is not None  # the probe's first pass, before the run (as in a server up a while)
    res = run_blackbox(connect(base, "vllm"), _responses_waves(), max_concurrency=4, drain_timeout_s=10,
                       bisect_budget_s=0)
    assert res.verdict == "CLEAN", res.summary
    assert res.probe["verdict"] == "CLEAN" and res.probe["processes"]
    assert "probed processes kept request ids" in res.summary
