"""Black-box leak check end to end: a real `vlite serve` (tiny model, no debug endpoints) read only
through /metrics and process memory, and fake servers for the bad inputs (no answer, HTML
/metrics, 401, a server that never drains). 127.0.0.1 only, bounded waits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fake_http import QuietHandler, ServerPool
from report_words import assert_no_none, blackbox_text
from serve_harness import ServerProcess, free_port, running

from vlite.diagnostics.targets.blackbox import run_blackbox, split_waves
from vlite.diagnostics.targets.connection import connect
from vlite.diagnostics.workload.actions import ClientAction
from vlite.diagnostics.workload.sources import jsonl_workload, synthetic_workload, with_action

FIX = Path(__file__).parent / "fixtures"
VLITE = str(Path(sys.executable).with_name("vlite"))


def _waves():
    """Six waves of 3: complete and disconnect-after-2-chunks in mixes that differ per wave."""
    # 40+ tokens: a stream cut after 2 chunks is still generating when the server sees the cut,
    # also on a loaded machine (with 10-12 tokens a fast step could finish it first)
    specs = synthetic_workload(18, input_len=(20, 40), output_len=(40, 48), seed=7, prefix="bb")
    plan = [0, 1, 3, 0, 2, 1]  # disconnects per wave
    out = []
    for w, k in enumerate(plan):
        wave = specs[3 * w:3 * w + 3]
        out.append([with_action(s, ClientAction("disconnect-stream", after_tokens=2)) if i < k else s
                    for i, s in enumerate(wave)])
    return out


@pytest.fixture
def faulty(tiny_model_dir, tmp_path):
    srv = ServerProcess(tiny_model_dir, tmp_path / "faulty.log", "--num-blocks", "128",
                        "--inject-fault", "skip-free-on-abort")
    yield from running(srv)


@pytest.fixture
def clean_with_key(tiny_model_dir, tmp_path):
    srv = ServerProcess(tiny_model_dir, tmp_path / "clean.log", "--num-blocks", "128", api_key="s3cret")
    yield from running(srv)


def test_blackbox_finds_the_disconnect_leak_and_its_reproducer_leaks_again(faulty, tmp_path):
    conn = connect(faulty.base_url)
    assert conn.adapter.kind == "vlite"
    waves = _waves()
    disconnects = {s.request_id for w in waves for s in w if s.action.is_abort}
    res = run_blackbox(conn, waves, max_concurrency=4, drain_timeout_s=30, bisect_budget_s=60,
                       sample_interval_s=0.1)
    assert res.verdict == "LEAK" and res.exit_code == 1, res.summary
    assert [s["client_action"] for s in res.suspects] == ["disconnect-stream"], res.fit
    sus = res.suspects[0]
    assert sus["blocks_per_request"] > 0.5 and sus["request_ids"] and set(sus["request_ids"]) <= disconnects
    assert len(sus["request_ids"]) == 1  # bisection halves down to one leaking request
    fit = {r["client_action"]: r["per_request"] for r in res.fit}
    assert fit["complete"] < 0.25
    assert len(res.probes) >= 7 and res.info["server_pid"] == faulty.proc.pid
    assert res.samples["rss_bytes"].notna().all()  # the server's process tree was found and sampled
    assert_no_none(blackbox_text(res))

    from vlite.diagnostics.report.blackbox_report import write_blackbox_report

    out = write_blackbox_report(res, tmp_path / "report")
    rep = json.loads((out / "report.json").read_text())
    assert rep["server_kind"] == "vlite" and rep["blackbox"]["suspects"][0]["client_action"] == "disconnect-stream"
    assert "curl -sN" in (out / "report.md").read_text()
    replay = jsonl_workload(out / "reproducer.jsonl")
    again = run_blackbox(connect(faulty.base_url), split_waves(replay, 1), max_concurrency=2, drain_timeout_s=30,
                         bisect_budget_s=0)
    assert again.verdict == "LEAK" and again.residual > 0, again.summary


def test_blackbox_clean_server_with_api_key_and_cli_bad_key(clean_with_key, tmp_path):
    # The CLI against the same server: without the key a one-line error (exit 2), with it CLEAN (exit 0).
    base = [VLITE, "leak-check", "--url", clean_with_key.base_url]
    no_key = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert no_key.returncode == 2 and "401" in no_key.stderr and "--api-key" in no_key.stderr
    assert "Traceback" not in no_key.stderr + no_key.stdout
    ok = subprocess.run(base + ["--api-key", "s3cret", "--num-requests", "12", "--abort-rate", "0.5",
                                "--input-len", "8:24", "--output-len", "6:10", "--report", str(tmp_path / "r")],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "CLEAN" in ok.stdout and "black-box" in ok.stdout
    assert ok.stdout.strip().splitlines()[-1].startswith("verdict: CLEAN")  # the verdict again, last
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["verdict"] == "CLEAN" and rep["drain"]["residual"] == 0 and (tmp_path / "r" / "report.html").is_file()


class _Fake(QuietHandler):
    metrics = ""
    content_type = "text/plain"

    def do_GET(self):  # noqa: N802 - http.server's spelling
        if self.path == "/metrics":
            self.reply(200, self.metrics, self.content_type)
        else:
            self.reply(200, b"ok" if self.path == "/health" else b"{}")

    def do_POST(self):  # noqa: N802
        self.reply(200, json.dumps({"choices": [{"text": "x", "finish_reason": "length"}], "usage": {}}),
                   "application/json")


@pytest.fixture
def fake_server():
    pool = ServerPool()
    yield lambda metrics, content_type="text/plain": pool.start(
        type("H", (_Fake,), {"metrics": metrics, "content_type": content_type}))
    pool.close()


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([VLITE, "leak-check", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_bad_input_is_one_line_never_a_traceback(fake_server, tmp_path):
    nobody = _cli("--url", f"http://127.0.0.1:{free_port()}")
    html = _cli("--url", fake_server((FIX / "not-prometheus.html").read_text(), "text/html"))
    unknown = _cli("--url", fake_server("process_resident_memory_bytes 1.0\n"))
    empty_log = tmp_path / "empty.log"
    empty_log.write_text("INFO nothing to see\n")
    no_stats = _cli("--from-log", str(empty_log))
    for res, words in ((nobody, "is not ready"), (html, "not a Prometheus page"), (unknown, "matches no known server"),
                       (no_stats, "no stats line")):
        assert res.returncode == 2, res.stdout + res.stderr
        assert words in res.stderr and "Traceback" not in res.stderr + res.stdout
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_never_draining_server_is_inconclusive_not_clean(fake_server, tmp_path):
    url = fake_server((FIX / "vllm-0.32.0-cpu-busy.prom").read_text())  # 8 running, forever
    res = _cli("--url", url, "--num-requests", "2", "--drain-timeout", "1", "--report", str(tmp_path / "r"))
    assert res.returncode == 3, res.stdout + res.stderr
    assert "INCONCLUSIVE" in res.stdout and "did not drain" in res.stdout and "CLEAN" not in res.stdout
    assert res.stdout.strip().splitlines()[-1].startswith("verdict: INCONCLUSIVE")
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["verdict"] == "INCONCLUSIVE" and rep["server_kind"] == "vllm" and rep["run"]["block_size"] == 128


def _vllm_page(used_blocks: int, running: int = 0) -> str:
    return ('vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="101"} 1.0\n'
            f'vllm:num_requests_running{{engine="0"}} {running}.0\nvllm:num_requests_waiting{{engine="0"}} 0.0\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} {used_blocks / 100}\n')


@pytest.fixture
def stepping_server():
    """A fake vLLM whose gauges change only when the engine steps (a completion request arrives):
    after a workload request they freeze 3 blocks above what is really held, with 0 running; a
    1-token probe makes it step and the gauges read what is held. Each workload request leaves
    ``leak_per_request`` blocks held."""
    pool = ServerPool()

    def start(leak_per_request: int) -> str:
        state = {"shown": 0, "held": 0}

        class H(_Fake):
            def do_GET(self):  # noqa: N802
                type(self).metrics = _vllm_page(state["shown"])
                super().do_GET()

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if body.get("max_tokens") == 1 and body.get("prompt") == "probe":
                    state["shown"] = state["held"]
                else:
                    state["held"] += leak_per_request
                    state["shown"] = state["held"] + 3
                super().do_POST()

        return pool.start(H)

    yield start
    pool.close()


def test_probe_unfreezes_stale_gauges_and_a_real_residual_stays(stepping_server):
    specs = synthetic_workload(4, input_len=(8, 8), output_len=(4, 4), seed=1)
    stale = connect(stepping_server(leak_per_request=0))
    assert stale.adapter.kind == "vllm"
    res = run_blackbox(stale, split_waves(specs, 2), drain_timeout_s=5, bisect_budget_s=0, server_pid=None)
    # Without the probes every idle point would read the frozen 3 blocks: a false LEAK.
    assert res.verdict == "CLEAN", res.summary
    assert [p["kv_used_before"] for p in res.probes] == [0, 3, 3] and all(p["kv_used_after"] == 0 for p in res.probes)
    assert_no_none(blackbox_text(res))  # a vLLM page: no block size, no process found
    held = connect(stepping_server(leak_per_request=1))
    res = run_blackbox(held, split_waves(specs, 2), drain_timeout_s=5, bisect_budget_s=0, server_pid=None)
    assert res.verdict == "LEAK" and res.residual == 4.0 and res.unit == "blocks", res.summary
    assert len(res.probes) >= 5  # two more probes confirmed the residual
    assert [(s["client_action"], s["blocks_per_request"]) for s in res.suspects] == [("complete", 1.0)]
    assert_no_none(blackbox_text(res))
