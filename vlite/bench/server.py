"""Start and stop a ``vlite serve`` subprocess on a free loopback port (for ``bench serve`` and tests)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, extra_args: list[str] | None = None, api_key: str | None = None,
                 timeout_s: float = 300.0, log_path: str | None = None) -> tuple[subprocess.Popen, str]:
    """Run ``vlite serve --model MODEL --host 127.0.0.1 --port P [extra_args]``; wait until /health is 200.

    Returns (process, base_url). The server's output goes to ``log_path`` (default: discarded).
    Raises:
        RuntimeError: the server exited, or was not healthy within ``timeout_s`` seconds
            (it is stopped first).
    """
    import httpx

    port = free_port()
    cmd = [sys.executable, "-c", "from vlite.cli.main import app; app()", "serve", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), *(extra_args or [])]
    if api_key:
        cmd += ["--api-key", api_key]
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vlite serve exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"vlite serve was not healthy within {timeout_s:.0f}s")


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if the server has not exited within ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
