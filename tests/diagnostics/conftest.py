"""The diagnostics tests' `vlite serve` subprocesses."""

from __future__ import annotations

import pytest
from serve_harness import ServerProcess

SERVE_STARTUP_TIMEOUT_S = 300.0  # imports, model load and (first run) the CPU kernels' build on a loaded 2-core machine


@pytest.fixture
def vlite_serve(tiny_model_dir, tmp_path):
    """``start(*args, env=None) -> base URL``: ``vlite serve --model <tiny> --num-blocks 96 ARGS`` on a free
    loopback port, ready (/health 200) when returned; ``env`` adds to the environment. Every server
    started is stopped after the test, and its log tail printed (pytest shows it when the test failed)."""
    servers: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> str:
        srv = ServerProcess(tiny_model_dir, tmp_path / f"serve-{len(servers)}.log", "--num-blocks", "96", *args,
                            env=env)
        servers.append(srv)
        srv.wait_ready(timeout=SERVE_STARTUP_TIMEOUT_S)
        return srv.base_url

    yield start
    for srv in servers:
        srv.stop()
        print(srv.log()[-4000:])
