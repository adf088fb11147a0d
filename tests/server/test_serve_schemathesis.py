"""A bounded schemathesis run over `vlite serve`'s /openapi.json: every check, no 5xx,
no response that disagrees with the document. The longer run is in docs/serve.md.

positive_data_acceptance also accepts 400 here: some rules span several fields and a JSON schema
cannot state them (top_logprobs needs logprobs: true; beam search needs best_of >= max(n, 2) and
temperature 0; the prompt's *tokens* plus max_tokens must fit max_model_len and the KV cache;
/tokenize takes exactly one of prompt and messages). Every other check runs with its defaults.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import build_tiny_model_dir
from serve_harness import ServerProcess, running, wait_drained

ST = str(Path(sys.executable).parent / "st")
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "404"]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model_dir(tmp_path_factory.mktemp("st-tiny"), max_position_embeddings=128)
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("st-log") / "server.log", "--num-blocks", "64",
                        "--max-n", "4", "--enable-debug-endpoints", "--uvicorn-log-level", "warning")
    yield from running(srv)


def test_schemathesis_finds_no_server_error_and_no_schema_mismatch(server, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    cmd = [ST, "--config-file", str(config), "run", server.base_url + "/openapi.json", "--checks", "all",
           "--exclude-path-regex", "^/debug", "--phases", "coverage,fuzzing", "--max-examples", "30", "--seed", "12",
           "--request-timeout", "20", "--generation-database", "none", "--no-color", "--workers", "1"]
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=170)
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    print(out[-6000:])
    assert res.returncode == 0, out[-6000:]
    assert "Selected: 10/15" in out  # every route but /debug/blocks, /debug/census and /debug/gpu_allocations (3)
    print(f"schemathesis took {took:.0f} s")  # bounded by the subprocess timeout; speed is no unit test's business
    log = server.log()
    assert "Exception in ASGI application" not in log and "unhandled error" not in log
    wait_drained(server)
