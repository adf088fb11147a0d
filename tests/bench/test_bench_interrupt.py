"""Ctrl-C during `vlite bench throughput` / `latency`: the first SIGINT ends the run and prints (and
writes) what was measured, marked INTERRUPTED, exit 130. Real subprocesses, real signals."""

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

VLITE = str(Path(sys.executable).parent / "vlite")


def _interrupt_after(args: list[str], marker: str, wait_s: float = 2.0) -> tuple[int, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", COLUMNS="200")
    proc = subprocess.Popen([VLITE, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, deadline = [], time.time() + 300
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            break
    else:
        proc.kill()
    assert marker in "".join(lines), "".join(lines)
    time.sleep(wait_s)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + out


def test_bench_throughput_ctrl_c_reports_the_finished_requests(tiny_model_dir, tmp_path):
    out_json = tmp_path / "t.json"
    # 4,000 requests of 256 output tokens: far longer than the test waits
    code, out = _interrupt_after(["bench", "throughput", "--model", str(tiny_model_dir), "--num-prompts", "4000",
                                  "--input-len", "16", "--output-len", "256", "--no-progress", "--output-json",
                                  str(out_json)], "vlite: ", wait_s=4.0)
    assert code == 130, out
    assert "INTERRUPTED:" in out and "of 4000 finished" in out and "Throughput:" in out, out
    data = json.loads(out_json.read_text())
    assert data["interrupted"] is True and 0 <= data["num_requests"] < 4000


def test_bench_latency_ctrl_c_reports_the_iterations_measured(tiny_model_dir, tmp_path):
    out_json = tmp_path / "l.json"
    code, out = _interrupt_after(["bench", "latency", "--model", str(tiny_model_dir), "--batch-size", "2",
                                  "--input-len", "8", "--output-len", "16", "--num-iters-warmup", "1", "--num-iters",
                                  "100000", "--no-progress", "--output-json", str(out_json)], "timed iterations",
                                 wait_s=5.0)
    assert code == 130, out
    assert "INTERRUPTED:" in out and "of 100000 measured" in out and "Avg latency:" in out, out
    data = json.loads(out_json.read_text())
    assert data["interrupted"] is True and 0 < len(data["latencies"]) < 100000
