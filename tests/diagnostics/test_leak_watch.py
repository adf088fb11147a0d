"""``vlite leak-check --watch``: the passive judge sends no request. Against a real `vlite serve`
driven by the TEST's own traffic: CLEAN on a clean server; LEAK within three natural idle points
under ``--inject-fault skip-free-on-abort`` (the CLI, stopped with Ctrl-C). Then the judge alone
(``Watcher``) on synthetic readings: a stuck running gauge, uncounted requests, host memory that
keeps growing, a lagging gauge. 127.0.0.1 only, bounded waits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_harness import ServerProcess, read_metrics, running, wait_drained

from vlite.diagnostics.readers.adapters import MetricsReading
from vlite.diagnostics.report.watch_report import write_watch_report
from vlite.diagnostics.targets.connection import connect
from vlite.diagnostics.targets.watch import Watcher, watch

VLITE = str(Path(sys.executable).with_name("vlite"))


@pytest.fixture
def clean(tiny_model_dir, tmp_path):
    yield from running(ServerProcess(tiny_model_dir, tmp_path / "clean.log", "--num-blocks", "128"))


@pytest.fixture
def leaky(tiny_model_dir, tmp_path):
    yield from running(ServerProcess(tiny_model_dir, tmp_path / "leaky.log", "--num-blocks", "128",
                                     "--inject-fault", "skip-free-on-abort"))


def _complete(base: str, i: int) -> None:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": f"watch test {i} hello", "max_tokens": 12,
                                                   "temperature": 0.0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200


def _disconnect(base: str, i: int) -> None:
    """Stream 48 tokens and leave after 2 chunks: the server must abort the rest."""
    body = {"prompt": f"watch test {i} leave early", "max_tokens": 48, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                chunks += 1
                if chunks >= 2:
                    break


def _wave(server, i: int, aborts: int, completes: int = 2) -> None:
    for k in range(completes):
        _complete(server.base_url, 10 * i + k)
    for k in range(aborts):
        _disconnect(server.base_url, 10 * i + 5 + k)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the server is idle again (the leak keeps blocks, not requests)
        m = read_metrics(server)
        if m["vlite:num_requests_running"] == 0 and m["vlite:num_requests_waiting"] == 0:
            break
        time.sleep(0.05)
    time.sleep(1.0)  # let the watcher see the idle stretch (3 scrapes at 0.1 s)


def test_watch_stays_clean_on_a_clean_server_and_sends_no_request(clean, tmp_path):
    conn = connect(clean.base_url)
    before = read_metrics(clean)
    stop = threading.Event()
    lines: list[str] = []
    out: dict = {}

    def sleep(s: float) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        time.sleep(s)

    t = threading.Thread(target=lambda: out.setdefault("res", watch(
        conn, interval_s=0.1, on_report=lambda r: write_watch_report(r, tmp_path / "report"), on_line=lines.append,
        sleep=sleep)))
    t.start()
    time.sleep(1.0)  # the baseline idle point
    for i in range(3):
        _wave(clean, i, aborts=2)
    stop.set()
    t.join(timeout=30)
    res = out["res"]
    assert res.verdict == "CLEAN" and res.exit_code == 0, (res.summary, lines)
    assert len(res.idle_points) >= 4 and not res.alerts, lines
    assert all(p.kv_used == 0 for p in res.idle_points)
    assert sum(line.startswith("idle point") for line in lines) == len(res.idle_points)
    # every request the server finished was the test's own: 3 waves x (2 complete + 2 aborted)
    after = wait_drained(clean)
    served = sum(v for k, v in after.items() if k.startswith("vlite:request_success_total")) - \
        sum(v for k, v in before.items() if k.startswith("vlite:request_success_total"))
    assert served == 12 and res.idle_points[-1].requests_served == 12
    assert res.info["stopped_by"] == "Ctrl-C" and res.samples["memory_bytes"].notna().all()
    rep = tmp_path / "report"
    assert {"report.md", "report.html", "samples.csv", "report.json"} <= {p.name for p in rep.iterdir()}
    assert "**CLEAN**" in (rep / "report.md").read_text()


def test_watch_cli_flags_a_leaking_server_within_three_idle_points_and_ctrl_c_writes_the_report(leaky, tmp_path):
    rep = tmp_path / "watch"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([VLITE, "leak-check", "--watch", "--url", leaky.base_url, "--interval", "0.1",
                             "--report", str(rep)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while not (rep / "report.json").exists():  # the baseline idle point writes the first report
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        for i in range(2):
            _wave(leaky, i, aborts=2)
        report = json.loads((rep / "report.json").read_text())
        assert report["verdict"] == "LEAK", report
        alert = report["alerts"][0]
        assert alert["flag"] == "kv-held" and alert["idle_point"] <= 3, report
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out
    assert "ALERT kv-held" in out and "verdict: LEAK" in out, out
    assert "**LEAK**" in (rep / "report.md").read_text()
    assert json.loads((rep / "report.json").read_text())["run"]["stopped_by"] == "Ctrl-C"


def _r(running=0, waiting=0, kv=0.0, finished=0.0, aborted=0.0, gen=0.0, received=None) -> MetricsReading:
    return MetricsReading("vllm", running, waiting, kv, 100.0, kv / 100.0, "blocks", 16, None, None, gen, aborted,
                          finished, received)


def _idle_then(w: Watcher, t: float, reading: MetricsReading, n: int = 4, mem=None) -> float:
    for _ in range(n):
        w.feed(t, reading, mem)
        t += 1.0
    return t


def test_watcher_flags_a_running_gauge_that_never_returns_to_0():
    lines = []
    w = Watcher("sglang", "tokens", stuck_after_s=30, on_line=lines.append)
    t = _idle_then(w, 0.0, _r())
    for k in range(40):  # 3 requests running, nothing finishes, tokens still generated (a busy zombie)
        w.feed(t + k, _r(running=3, kv=40.0, gen=10.0 * k))
    assert w.verdict()[0] == "ZOMBIE" and w.alerts[0].flag == "running-stuck", lines
    assert "3 request(s) running for 30 s" in w.alerts[0].message
    # a busy but healthy server finishes requests: never flagged
    ok = Watcher("vllm", "blocks", stuck_after_s=30)
    for k in range(100):
        ok.feed(float(k), _r(running=2, finished=float(k // 5)))
    assert not ok.alerts


def test_watcher_flags_requests_the_engine_never_counted():
    w = Watcher("vllm", "blocks")
    t = _idle_then(w, 0.0, _r(received=0.0))
    w.feed(t, _r(running=2, received=0.0))
    t = _idle_then(w, t + 1, _r(finished=3.0, received=5.0, gen=30.0), n=4)
    assert w.alerts[0].flag == "uncounted" and w.alerts[0].idle_point == 2
    assert "2 requests answered over HTTP" in w.alerts[0].message
    # an alert, not a verdict: vLLM 0.32 counts no client abort at all
    verdict, summary = w.verdict()
    assert verdict == "CLEAN" and "2 requests never counted by the engine" in summary


def test_watcher_host_memory_plateau_test_late_half_only():
    def run(mem_of):
        w = Watcher("vlite", "blocks")
        t = 0.0
        for i in range(10):
            w.feed(t, _r(running=1, finished=float(10 * i)))
            t = _idle_then(w, t + 1, _r(finished=float(10 * (i + 1))), mem={"bytes": mem_of(i), "source": "rss"})
        return w
    growing = run(lambda i: 1e9 + i * 10 * 1e6)  # 1 MB per request, steady
    assert growing.verdict()[0] == "HOST-LEAK" and growing.memory_test["keeps_growing"]
    warm = run(lambda i: 1e9 + min(i, 3) * 50e6)  # grows, then levels off: warm-up
    assert warm.verdict()[0] == "CLEAN" and warm.memory_test["warm_up"], warm.memory_test


def test_watcher_waits_out_a_lagging_gauge_and_needs_two_idle_points():
    w = Watcher("sglang", "tokens", gauge_lag_s=10.0)
    t = _idle_then(w, 0.0, _r())
    w.feed(t, _r(running=1, kv=64.0, gen=5.0))
    t = _idle_then(w, t + 1, _r(kv=64.0, gen=9.0))  # idle point 2, gauge still up: pending
    assert len(w.idle_points) == 2 and not w.alerts
    t = _idle_then(w, t, _r(kv=0.0, gen=9.0))  # the lagging gauge came back: no leak
    assert not w.alerts and w.verdict()[0] == "CLEAN"
    w.feed(t, _r(running=1, kv=64.0, gen=12.0))
    t = _idle_then(w, t + 1, _r(kv=64.0, gen=15.0), n=12)  # stays up past the lag: LEAK
    assert w.alerts and w.alerts[0].flag == "kv-held"
    assert Watcher("vlite", "blocks").verdict()[0] == "INCONCLUSIVE"


def test_watcher_reads_a_one_time_step_as_no_host_leak():
    w = Watcher("vlite", "blocks")
    t = 0.0
    for i in range(14):  # +67 MB once, after 90 requests served, then flat for 5 idle points
        w.feed(t, _r(running=1, finished=float(10 * i)))
        mem = 1e9 + (i % 2) * 50e3 + (67e6 if i >= 9 else 0)
        t = _idle_then(w, t + 1, _r(finished=float(10 * (i + 1))), mem={"bytes": mem, "source": "rss"})
    assert w.verdict()[0] == "CLEAN" and w.memory_test["step_only"], w.memory_test
