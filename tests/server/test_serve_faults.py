"""`vlite serve --inject-fault ...`: the server survives planted faults and /debug/blocks names the leak.

With ``skip-free-on-abort`` a disconnect's abort raises before the blocks are released: the
server must log it and keep serving, and the debug endpoint must show the held blocks with
their origin (this is what the leak checker reads).
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import build_tiny_model_dir
from serve_harness import ServerProcess, read_metrics, running, wait_until

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model_dir(tmp_path_factory.mktemp("faults-tiny"), max_position_embeddings=2048)
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("faults-log") / "server.log",
                        "--num-blocks", str(NUM_BLOCKS), "--enable-debug-endpoints",
                        "--inject-fault", "skip-free-on-abort", "--inject-fault", "raise-in-step",
                        "--log-stats", "--log-stats-interval", "0.5")
    yield from running(srv)


def test_leaked_abort_is_survived_and_attributed(server):
    body = {"prompt": "leak me", "max_tokens": 900, "ignore_eos": True, "stream": True}
    headers = {"X-Request-Id": "leaky-1", "X-Vlite-Client-Tag": "fault-test"}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            n = 0
            for line in resp.iter_lines():
                n += line.startswith("data: ")
                if n == 3:
                    break

        def leaked():
            snap = http.get("/debug/blocks").json()
            return snap if "leaky-1" in snap["live_state"]["finished_live_requests"] else None

        snap = wait_until(leaked)
        m = read_metrics(server)
        assert m["vlite:num_requests_running"] == 0 and m["vlite:num_requests_waiting"] == 0
        held = [e for e in snap["ledger"] if e["request_id"] == "leaky-1"]
        assert held, snap["ledger"]
        assert m["vlite:num_free_blocks"] + m["vlite:num_cached_blocks"] == NUM_BLOCKS - len(held)
        for e in held:
            assert (e["status"], e["finish_reason"]) == ("finished", "abort")
            assert e["origin"]["route"] == "/v1/completions" and e["origin"]["client_tag"] == "fault-test"
        seq = [s for s in snap["sequences"] if s["request_id"] == "leaky-1"]
        assert len(seq) == 1 and sorted(seq[0]["block_table"]) == sorted(e["block_id"] for e in held)

        # still serving, and the failure is in the log
        ok = http.post("/v1/completions", json={"prompt": "after the leak", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert http.get("/health").status_code == 200
    log = server.log()
    assert "abort of request 'leaky-1' failed" in log and "PlantedFault" in log


def test_error_in_step_is_500_and_server_keeps_serving(server):
    tag = {"X-Vlite-Client-Tag": "raise-in-step"}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        r = http.post("/v1/completions", json={"prompt": "boom", "max_tokens": 4}, headers=tag)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        assert r.headers["connection"] == "close"  # the client must not reuse this connection
        with http.stream("POST", "/v1/completions", json={"prompt": "boom", "max_tokens": 4, "stream": True},
                         headers=tag) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert http.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2}).status_code == 200
        assert read_metrics(server)["vlite:request_success_total{error}"] == 2


def test_log_stats_lines(server):
    line = wait_until(lambda: next((ln for ln in server.log().splitlines() if "Avg prompt throughput" in ln), None))
    for part in ("Avg generation throughput:", "Running:", "Waiting:", "KV cache usage:", f"/{NUM_BLOCKS}"):
        assert part in line, line
