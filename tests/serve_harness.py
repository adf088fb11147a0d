"""Run ``vlite serve`` in a subprocess on a free loopback port, and read its /metrics.

Every wait is bounded by a deadline; the server's log is printed when a test fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from vlite.diagnostics.readers.metrics_text import labelled_values

VLITE = [str(Path(sys.executable).parent / "vlite")]
STARTUP_TIMEOUT_S = 300.0  # imports + model load (+ the first C++ kernel build) on a busy 2-core machine
DRAIN_TIMEOUT_S = 15.0


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``vlite serve --model MODEL --host 127.0.0.1 --port <free> ARGS...`` in a subprocess."""

    def __init__(self, model: str | Path, log_path: Path, *args: str, api_key: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        cmd = [*VLITE, "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1") | (env or {})
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Poll /health until 200; fail with the log if the process dies or the deadline passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()




def running(srv: ServerProcess):
    """Fixture body: wait until ``srv`` is ready, yield it, always stop it (printing its log tail,
    which pytest shows when a test failed)."""
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        print(srv.log()[-4000:])


def read_metrics(server: ServerProcess) -> dict[str, float]:
    """/metrics as {name or name{finished_reason}: value} (the model_name label dropped)."""
    text = httpx.get(server.base_url + "/metrics", headers=server.headers, timeout=10).text
    return labelled_values(text)


def is_drained(m: dict[str, float]) -> bool:
    """No request in the engine and every block back: free (or free holding a cached prefix)."""
    return (m["vlite:num_requests_running"] == 0 and m["vlite:num_requests_waiting"] == 0
            and m["vlite:num_free_blocks"] + m["vlite:num_cached_blocks"] == m["vlite:num_total_blocks"]
            and m["vlite:kv_cache_usage_perc"] == 0)


def wait_drained(server: ServerProcess, timeout: float = DRAIN_TIMEOUT_S) -> dict[str, float]:
    """Poll /metrics until drained; returns the drained metrics or fails with the last ones."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(server)
        if is_drained(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not drained after {timeout} s: {m}")
        time.sleep(0.05)


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.02):
    """Poll ``predicate()`` until it returns a truthy value; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
