"""Ctrl-C during `vlite leak-check`: the first SIGINT stops the replay and still writes the report
of what was measured (verdict INTERRUPTED); a second exits at once. Real subprocesses, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _start(tiny_model_dir: Path, report: Path) -> subprocess.Popen:
    # 400 requests arriving at 4 requests/s: the replay lasts about 100 s, so it is surely still
    # running when the test interrupts it, whatever the machine's speed.
    cmd = [str(Path(sys.executable).parent / "vlite"), "leak-check", "--model", str(tiny_model_dir), "--workload",
           "synthetic", "--num-requests", "400", "--request-rate", "4", "--input-len", "8:16", "--output-len", "4:8",
           "--num-blocks", "64", "--sample-interval-ms", "50", "--report", str(report)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float = 300) -> list[str]:
    lines, deadline = [], time.time() + timeout_s
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    proc.kill()
    raise AssertionError(f"never printed {needle!r}:\n{''.join(lines)}")


def test_first_ctrl_c_writes_an_interrupted_report(tiny_model_dir, tmp_path):
    report = tmp_path / "rep"
    proc = _start(tiny_model_dir, report)
    head = _wait_for_line(proc, "Ctrl-C stops early")
    time.sleep(3.0)  # some requests run, some samples are taken
    t_sigint = time.time()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    elapsed = time.time() - t_sigint
    out = "".join(head) + out
    assert proc.returncode == 130, out
    assert "interrupted: stopping the replay" in out and f"report written to {report}" in out, out
    assert out.strip().splitlines()[-1].startswith("verdict: INTERRUPTED"), out
    rep = json.loads((report / "report.json").read_text())
    assert rep["verdict"] == "INTERRUPTED" and rep["summary"].startswith("INTERRUPTED: interrupted (Ctrl-C) after")
    assert "interrupted" in rep["run"]
    outcomes = rep["client"]["outcomes"]
    assert outcomes.get("not-sent", 0) > 0 and sum(outcomes.values()) == 400  # every request accounted for
    assert rep["drain"]["quiescent"] and rep["drain"]["sign"] == "balanced"  # the in-flight ones were drained
    samples = (report / "samples.csv").read_text().splitlines()
    assert len(samples) > 10  # the samples taken before Ctrl-C are kept
    assert {"blocks.png", "memory.png", "report.md"} <= {p.name for p in report.iterdir()}
    assert "**INTERRUPTED**" in (report / "report.md").read_text()
    assert elapsed < 60, f"the interrupted run took {elapsed:.0f} s to report"


def test_second_ctrl_c_exits_at_once(tiny_model_dir, tmp_path):
    from vlite.cli import interrupt

    # The handler itself, in a child that waits in the guarded block: SIGINT twice -> exit 130 at once.
    code = ("import sys, time\n"
            "from vlite.cli.interrupt import graceful_interrupt\n"
            "with graceful_interrupt('the test') as stop:\n"
            "    print('ready', flush=True)\n"
            "    while not stop.is_set():\n"
            "        time.sleep(0.01)\n"
            "    print('stopping', flush=True)\n"
            "    time.sleep(60)  # a slow report: the second Ctrl-C must not wait for it\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "stopping"
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=10)
    assert proc.returncode == interrupt.EXIT_INTERRUPTED and time.time() - t0 < 5
    assert "Ctrl-C again to exit now" in proc.stderr.read()


def test_ctrl_c_during_calibration_stops_it_within_seconds(tiny_model_dir, tmp_path):
    # calibration (greedy runs that find stop tokens, before the replay) ignored Ctrl-C.
    # 300 requests whose stop token is the 400th greedy token, on a 64-block pool that runs two
    # at a time: calibration alone would take minutes, so it is surely under way at the SIGINT.
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt_len": 8, "max_tokens": 8, "stop_token_at": 400,
                                         "client_action": "complete"}) + "\n" for _ in range(300)))
    report = tmp_path / "rep"
    cmd = [str(Path(sys.executable).parent / "vlite"), "leak-check", "--model", str(tiny_model_dir), "--workload",
           str(trace), "--num-blocks", "64", "--report", str(report)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", COLUMNS="200")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    head = _wait_for_line(proc, "Ctrl-C stops early")
    time.sleep(3.0)  # calibration under way
    t_sigint = time.time()
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("leak-check was still calibrating 60 s after Ctrl-C") from None
    elapsed = time.time() - t_sigint
    out = "".join(head) + out
    assert proc.returncode == 130, out
    assert "interrupted: stopping the calibration" in out and "stopping the replay" not in out, out
    assert "calibration: greedy runs" in out, out  # its progress line
    assert out.strip().splitlines()[-1].startswith("verdict: INTERRUPTED"), out
    rep = json.loads((report / "report.json").read_text())
    assert rep["verdict"] == "INTERRUPTED" and rep["client"]["outcomes"].get("not-sent") == 300
    assert rep["drain"]["sign"] == "balanced"  # the calibration's requests were aborted and freed
    assert elapsed < 20, f"took {elapsed:.0f} s to stop after Ctrl-C"
