"""Ctrl-C of `vlite serve` while the model loads stops the server: no "ready" after "Finished
server process", exit 0 within seconds. Real subprocesses, real signals.

The load is made to last 10 minutes: ``slow_load/sitecustomize.py`` on the server's PYTHONPATH
puts a sleep before every ``LLMEngine`` (in the API server's process or the engine core's)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from serve_harness import ServerProcess

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

SLOW_LOAD = Path(__file__).parent / "slow_load"


def _wait_for(server: ServerProcess, needle: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in server.log():
            return
        if server.proc.poll() is not None:
            raise AssertionError(f"the server exited first ({server.proc.returncode}):\n{server.log()}")
        time.sleep(0.1)
    raise AssertionError(f"never logged {needle!r}:\n{server.log()}")


@pytest.mark.parametrize("frontend", ["--frontend-multiprocessing", "--disable-frontend-multiprocessing"],
                         ids=["engine-core-process", "in-process"])
def test_sigint_during_the_model_load_stops_serve(tiny_model_dir, tmp_path, frontend):
    env = {"VLITE_TEST_SLOW_LOAD_S": "600",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SLOW_LOAD), os.environ.get("PYTHONPATH")]))}
    server = ServerProcess(tiny_model_dir, tmp_path / "serve.log", frontend, env=env)
    try:
        _wait_for(server, "Uvicorn running on")  # bound, the load under way in the background
        time.sleep(1.0)
        t0 = time.monotonic()
        server.send_signal(signal.SIGINT)
        code = server.wait_exit(timeout=30)
        elapsed = time.monotonic() - t0
        log = server.log()
        assert code == 0, log
        assert elapsed < 15, f"took {elapsed:.1f} s to stop:\n{log}"
        assert "stopped while loading the model" in log, log
        assert " ready" not in log.split("Finished server process")[-1], log  # nothing loads on after it
        assert "failed to load the model" not in log, log  # a stop, not a load failure
    finally:
        server.stop()
