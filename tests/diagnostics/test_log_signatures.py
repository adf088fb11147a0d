"""The servers' own log messages about aborts, zombies and leaked KV: ``--from-log`` on log
fixtures in each server's format (fixtures/logs/README.md), and ``--watch --server-log`` on a
log written while the watch runs (a fake /metrics server)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlite.cli.main import app
from vlite.diagnostics.checks.log_signatures import SignatureCounter, match
from vlite.diagnostics.targets.from_log import analyze_log

LOGS = Path(__file__).parent / "fixtures" / "logs"


def _hits(name: str) -> dict:
    c = SignatureCounter()
    c.feed((LOGS / name).read_text().splitlines())
    return {h["signature"]: h for h in c.summary()}


def test_each_server_message_is_matched_and_counted():
    vllm = _hits("vllm-aborts.log")
    assert set(vllm) == {"vllm-aborted-request"}
    assert vllm["vllm-aborted-request"]["count"] == 3  # request ids: one line names two
    assert vllm["vllm-aborted-request"]["lines"] == 2
    sglang = _hits("sglang-state-deleted.log")
    assert set(sglang) == {"sglang-state-deleted"} and sglang["sglang-state-deleted"]["lines"] == 4
    trt = _hits("trtllm-kv-transfer-timeout.log")
    assert trt["trtllm-kv-transfer-timeout"]["lines"] == 3
    assert trt["trtllm-store-context-blocks"]["count"] == 2 and trt["trtllm-store-context-blocks"]["first_line"] == 4
    llama = _hits("llamacpp-prompt-cache-limit.log")
    assert llama["llamacpp-prompt-cache-limit"]["lines"] == 2  # size limit and token limit; not "cache state"
    # near misses stay unmatched
    assert not match("[2026-12-05 21:20:33] Abort request 9b1f not found in rid_to_state; likely already finished")
    assert not match("srv        update:  - cache state: 1 prompts, 535.030 MiB (limits: 703.155 MiB, 4096 tokens)")
    assert not match("(APIServer pid=1) INFO 12-05 21:15:04 [async_llm.py:361] Added request cmpl-1-0.")


@pytest.mark.parametrize(("name", "verdict", "exit_code"), [
    ("vllm-aborts.log", "CLEAN", 0),  # judged by its stats lines; the aborts are evidence
    ("sglang-state-deleted.log", "ZOMBIE", 1),
    ("trtllm-kv-transfer-timeout.log", "LEAK", 1),
    ("llamacpp-prompt-cache-limit.log", "INCONCLUSIVE", 3),  # a cache at its limit is no leak
])
def test_from_log_verdicts(name, verdict, exit_code):
    res = analyze_log(LOGS / name)
    assert res.verdict == verdict and res.exit_code == exit_code, res.summary
    assert res.info["log_signatures"] and any(n.startswith("log signature: ") for n in res.notes)


def test_from_log_cli_names_the_signature(tmp_path):
    res = CliRunner().invoke(app, ["leak-check", "--from-log", str(LOGS / "trtllm-kv-transfer-timeout.log"),
                                   "--report", str(tmp_path / "r")])
    assert res.exit_code == 1, res.output
    assert "LEAK: the server logged trtllm's 'trtllm-kv-transfer-timeout' 3 time(s)" in res.output
    assert (tmp_path / "r" / "report.json").exists()


def test_server_log_needs_watch():
    res = CliRunner().invoke(app, ["leak-check", "--from-log", str(LOGS / "vllm-aborts.log"),
                                   "--server-log", str(LOGS / "vllm-aborts.log")])
    assert res.exit_code == 2 and "--server-log" in res.output


def test_watch_follows_the_server_log_and_alerts_once_per_message(tmp_path):
    import httpx
    from fake_http import QuietHandler, ServerPool

    from vlite.diagnostics.readers.adapters import detect_kind
    from vlite.diagnostics.readers.metrics_text import parse_page
    from vlite.diagnostics.targets.connection import Connection
    from vlite.diagnostics.targets.watch import watch

    page = (Path(__file__).parent / "fixtures" / "vllm-0.32.0-cpu-idle.prom").read_text()
    log = tmp_path / "server.log"
    log.write_text((LOGS / "sglang-state-deleted.log").read_text())  # written before the watch: not read
    lines: list[str] = []

    class Metrics(QuietHandler):
        def do_GET(self):
            self.reply(200, page)

    pool = ServerPool()
    try:
        url = pool.start(Metrics)
        conn = Connection(url, detect_kind(parse_page(page), "auto"), {}, {}, httpx.Client(timeout=5))

        def write_later():
            time.sleep(0.3)
            with log.open("a") as f:
                f.write((LOGS / "trtllm-kv-transfer-timeout.log").read_text())
                f.write("[TensorRT-LLM][WARNING] Timed out waiting for context KV cache transfer after 10")  # no \n yet

        t = threading.Thread(target=write_later)
        t.start()
        res = watch(conn, interval_s=0.05, duration_s=1.0, on_line=lines.append, log_path=log)
        t.join()
    finally:
        pool.close()
    alerts = [a for a in res.alerts if a.flag == "log-signature"]
    # in the order the log shows them: the warm-up's storeContextBlocks line comes first
    assert [a.message.split("'")[1] for a in alerts] == ["trtllm-store-context-blocks", "trtllm-kv-transfer-timeout"]
    assert sum(line.startswith("ALERT log-signature") for line in lines) == 2
    hits = {h["signature"]: h for h in res.info["log_signatures"]}
    assert hits["trtllm-kv-transfer-timeout"]["lines"] == 3  # the unfinished last line is not read
    assert "sglang-state-deleted" not in hits
    assert res.verdict != "LEAK"  # an alert, not a verdict: the KV checks judge
