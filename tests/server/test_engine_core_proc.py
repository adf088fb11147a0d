"""The engine core in its own process (``vlite serve``'s default, ``--frontend-multiprocessing``) and the
in-process option.

Death of the core: requests in flight get an error, the server exits non-zero within seconds,
no process is left. Death of the API process: the core exits on its own. The in-process option
(``--disable-frontend-multiprocessing``) serves without a child process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import psutil
import pytest
from conftest import build_tiny_model_dir
from serve_harness import ServerProcess

MP = ()  # the engine core process is the default


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("core-tiny"), max_position_embeddings=2048)


def _core(srv: ServerProcess) -> psutil.Process:
    """The engine core process: the API process's child running ``multiprocessing.spawn``."""
    cores = [p for p in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(cores) == 1, [p.cmdline() for p in psutil.Process(srv.proc.pid).children()]
    return cores[0]


def _gone(proc: psutil.Process, timeout: float) -> bool:
    try:
        proc.wait(timeout)
        return True
    except psutil.TimeoutExpired:
        return False


def test_core_death_fails_requests_in_flight_and_the_server_exits_nonzero(model_dir, tmp_path):
    srv = ServerProcess(model_dir, tmp_path / "server.log", "--num-blocks", "160", *MP)
    try:
        srv.wait_ready()
        api = psutil.Process(srv.proc.pid)
        core = _core(srv)
        children = api.children(recursive=True)  # the core, and multiprocessing's resource tracker
        body = {"prompt": "keep going", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            killed_at = time.monotonic()
            os.kill(core.pid, signal.SIGKILL)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        error = json.loads(rest[-2])
        assert rest[-1] == "[DONE]" and "error" in error
        assert "engine core process exited unexpectedly" in error["error"]["message"]
        assert srv.wait_exit(timeout=20) == 1
        assert time.monotonic() - killed_at < 20
        assert all(_gone(p, 10) for p in children), [p for p in children if p.is_running()]
        assert "exit code -9" in srv.log()
    finally:
        srv.stop()


def test_api_process_death_ends_the_core(model_dir, tmp_path):
    srv = ServerProcess(model_dir, tmp_path / "server.log", "--num-blocks", "160", "--enable-debug-endpoints", *MP)
    try:
        srv.wait_ready()
        core = _core(srv)
        # the HTTP reads of engine state work across the pipe: /metrics, /debug/blocks
        r = httpx.post(srv.base_url + "/v1/completions", timeout=30,
                       json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "n": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        page = httpx.get(srv.base_url + "/metrics", timeout=10).text
        assert re.search(r'^vlite:generation_tokens_total\{[^}]*\} 16\.0$', page, re.M), page
        snap = httpx.get(srv.base_url + "/debug/blocks", timeout=10).json()
        assert snap["num_free_blocks"] + snap["num_cached_blocks"] == snap["num_total_blocks"] == 160
        assert snap["view"]["registries"]["async.live"] == 0 and snap["view"]["registries"]["core_client.streams"] == 0
        assert snap["view"]["coverage"]["forks"] >= 1
        # structured output (validated in the API process, compiled again in the core) and
        # prompt logprobs (computed in the core) cross the pipe
        r = httpx.post(srv.base_url + "/v1/completions", timeout=30, json={
            "prompt": "x", "max_tokens": 8, "temperature": 0, "prompt_logprobs": 1,
            "structured_outputs": {"choice": ["yes", "no"]}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] in ("yes", "no") and choice["finish_reason"] == "stop"
        assert choice["prompt_logprobs"][0] is None
        bad = httpx.post(srv.base_url + "/v1/completions", timeout=30, json={
            "prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": "[a-"}})
        assert bad.status_code == 400 and "invalid regex" in bad.json()["error"]["message"]
        srv.proc.kill()  # SIGKILL: no shutdown path runs in the API process
        srv.proc.wait(10)
        assert _gone(core, 15), "the engine core outlived the API process"
    finally:
        srv.stop()


def test_in_process_option_serves_without_a_child_process(model_dir, tmp_path):
    srv = ServerProcess(model_dir, tmp_path / "server.log", "--num-blocks", "160", "--enable-debug-endpoints",
                        "--disable-frontend-multiprocessing")
    try:
        srv.wait_ready()
        assert psutil.Process(srv.proc.pid).children() == []
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        registries = httpx.get(srv.base_url + "/debug/blocks", timeout=10).json()["view"]["registries"]
        assert registries["async.live"] == 0 and "core_client.streams" not in registries
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
