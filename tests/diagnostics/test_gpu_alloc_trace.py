"""GPU memory named by allocation site: the snapshot diff over PyTorch's
allocator snapshot format, the tracer's idle-point path with a CPU stand-in for the allocator,
and what the option says where there is no CUDA."""

from __future__ import annotations

import os
import types

import httpx
import pytest
import torch
from conftest import make_engine

from vlite.diagnostics.readers.gpu_alloc_trace import (
    GpuAllocationTrace,
    HttpRecorder,
    TorchRecorder,
    lines,
    site_growth,
    snapshot_growth,
)
from vlite.diagnostics.report.report import extra_lines
from vlite.diagnostics.targets.inprocess import run_in_process
from vlite.diagnostics.workload.sources import synthetic_workload
from vlite.engine import cuda_alloc_sites

TORCH_DIR = os.path.dirname(torch.__file__)
WORKER = os.path.dirname(cuda_alloc_sites.__file__)  # .../vlite/engine/worker
CHECKER = os.path.normpath(os.path.join(WORKER, "..", "..", "diagnostics", "targets", "inprocess.py"))
RUNNER = os.path.join(WORKER, "model_runner.py")


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


# innermost first, as the allocator records them: torch's own frames, then vlite's
KEPT = [_frame(f"{TORCH_DIR}/nn/modules/module.py", 1773, "_call_impl"),
        _frame(RUNNER, 412, "compute_logits"), _frame(RUNNER, 397, "execute_model"),
        _frame(os.path.join(os.path.dirname(RUNNER), "executor.py"), 88, "execute"),
        _frame("/usr/lib/python3.11/threading.py", 975, "run")]
STEP = [_frame(RUNNER, 405, "compute_logits"), _frame(RUNNER, 397, "execute_model")]
SEEN_BY_CHECKER = [_frame(f"{TORCH_DIR}/cuda/memory.py", 1160, "_snapshot"), _frame(CHECKER, 300, "probe")]


def _block(size, state="active_allocated", frames=()):
    return {"size": size, "requested_size": size - 8, "address": 0, "state": state, "frames": list(frames)}


def _snapshot(kept: int, step_blocks: int = 2) -> dict:
    """A ``torch.cuda.memory._snapshot()`` dict: weights from before recording, ``kept`` blocks kept
    per request, per-step blocks (in use, freed, or waiting for a stream), the checker's own."""
    blocks = [_block(2 << 20)] + [_block(512, frames=KEPT) for _ in range(kept)]
    blocks += [_block(1024, frames=STEP) for _ in range(step_blocks)]
    blocks += [_block(4096, "inactive", KEPT), _block(4096, "active_awaiting_free", KEPT),
               _block(512, frames=SEEN_BY_CHECKER)]
    return {"segments": [{"address": 0, "total_size": 20 << 20, "stream": 0, "segment_type": "large",
                          "segment_pool_id": (0, 0), "allocated_size": 0, "active_size": 0, "blocks": blocks}],
            "device_traces": [[]]}


def test_live_sites_sums_active_allocated_blocks_by_their_frames_outside_torch_and_the_checker():
    sites = cuda_alloc_sites.live_sites(_snapshot(kept=3))
    kept = ("vlite/engine/worker/model_runner.py:412 in compute_logits <- vlite/engine/worker/model_runner.py:397 in "
            "execute_model <- vlite/engine/worker/executor.py:88 in execute")
    assert sites[kept] == {"bytes": 3 * 512, "count": 3}  # inactive and awaiting-free blocks are not live
    assert sites[cuda_alloc_sites.BEFORE_RECORDING] == {"bytes": 2 << 20, "count": 1}
    assert sites["vlite/engine/worker/model_runner.py:405 in compute_logits <- "
                 "vlite/engine/worker/model_runner.py:397 in execute_model"] == {"bytes": 2048, "count": 2}
    # a stack that is all torch and checker frames falls back to its innermost frames
    assert any(s.startswith("torch/cuda/memory.py:1160 in _snapshot") for s in sites)
    assert sum(s["count"] for s in sites.values()) == 7
    assert cuda_alloc_sites.site_of(KEPT, depth=1) == "vlite/engine/worker/model_runner.py:412 in compute_logits"


def test_snapshot_growth_names_the_site_that_grew_per_request_and_nothing_that_did_not():
    grown = snapshot_growth(_snapshot(kept=2, step_blocks=2), _snapshot(kept=14, step_blocks=1), served=12)
    assert len(grown) == 1
    g = grown[0]
    assert g["site"].startswith("vlite/engine/worker/model_runner.py:412 in compute_logits")
    assert (g["bytes_diff"], g["count_diff"], g["bytes_per_request"]) == (12 * 512, 12, 512.0)
    assert snapshot_growth(_snapshot(5), _snapshot(5), served=10) == []
    # a site new at the later idle point counts from zero; the largest growth comes first
    rows = site_growth({"a": {"bytes": 100, "count": 1}}, {"a": {"bytes": 300, "count": 2},
                                                           "b": {"bytes": 1000, "count": 4}}, served=0)
    assert [r["site"] for r in rows] == ["b", "a"] and rows[0]["bytes_per_request"] == 1000.0


def test_the_tracer_compares_the_first_idle_point_after_warm_up_with_the_latest():
    calls = iter([3, 40, 2, 9])  # idle point 0 (before any request) is never read; 1 and 4 are compared
    trace = GpuAllocationTrace(TorchRecorder(lambda: _snapshot(kept=next(calls))))
    assert trace.start() is None
    for _ in range(5):
        trace.idle_point()
    g = trace.stop([0, 10, 20, 30, 40])
    assert (g["from_requests"], g["to_requests"], g["unavailable"]) == (10, 40, None)
    assert len(g["sites"]) == 1 and g["sites"][0]["count_diff"] == 6
    assert g["sites"][0]["bytes_per_request"] == round(6 * 512 / 30, 1)
    assert "compute_logits" in lines(g)[1] and "B/request" in lines(g)[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_without_cuda_the_option_says_what_it_cannot_do_in_one_line():
    trace = GpuAllocationTrace(TorchRecorder())
    assert "no CUDA device" in trace.start()
    trace.idle_point()
    trace.idle_point()
    g = trace.stop([0, 5])
    assert g["sites"] == [] and not g["errors"]
    out = lines(g)
    assert len(out) == 1 and out[0].startswith("GPU allocation sites: not recorded: no CUDA device")
    doc = cuda_alloc_sites.document()
    assert not doc["recording"] and doc["sites"] == {} and "no CUDA device" in doc["unavailable"]


def test_http_recorder_reads_the_debug_documents_and_says_when_the_server_has_none():
    snaps = iter([_snapshot(1), _snapshot(7)])  # idle point 0 is not read
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        if request.url.path == "/debug/gpu_allocations/start":
            return httpx.Response(200, json={"recording": True, "unavailable": None, "sites": {}})
        if request.url.path == "/debug/gpu_allocations":
            return httpx.Response(200, json={"recording": True, "sites": cuda_alloc_sites.live_sites(next(snaps))})
        return httpx.Response(200, json={"recording": False, "sites": {}})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    trace = GpuAllocationTrace(HttpRecorder("http://srv", client))
    assert trace.start() is None
    for _ in range(3):
        trace.idle_point()
    g = trace.stop([0, 4, 10])
    assert g["sites"][0]["count_diff"] == 6 and g["sites"][0]["bytes_per_request"] == 512.0
    assert seen == [("POST", "/debug/gpu_allocations/start"), ("GET", "/debug/gpu_allocations"),
                    ("GET", "/debug/gpu_allocations"), ("POST", "/debug/gpu_allocations/stop")]

    missing = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(404)))
    assert "--enable-debug-endpoints" in HttpRecorder("http://srv", missing).start()
    no_cuda = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(
        200, json={"recording": False, "unavailable": "no CUDA device in this process", "sites": {}})))
    assert HttpRecorder("http://srv", no_cuda).start() == "the server's engine: no CUDA device in this process"


def test_in_process_run_names_a_tensor_kept_per_request_through_the_stand_in(tiny_checkpoint):
    # The planted defect keeps one "device" block per finished request; the stand-in allocator
    # turns what is kept into a snapshot in torch's format, with the planting line as the
    # innermost frame. The run goes through start / idle_point / stop and the report.
    engine = make_engine(tiny_checkpoint, num_blocks=128)
    processor, kept = engine.output_processor, []
    make_output = processor.make_output
    here = _frame(__file__, 0, "keep")

    def keep(self, req):
        out = make_output(req)
        if out.finished:
            kept.append(_block(65536, frames=[dict(here, line=keep.__code__.co_firstlineno + 3)]))
        return out

    processor.make_output = types.MethodType(keep, processor)

    def stand_in() -> dict:
        return {"segments": [{"blocks": [_block(1 << 20), *kept]}], "device_traces": []}

    specs = synthetic_workload(36, input_len=(8, 24), output_len=(4, 8), abort_rate=0.25, abort_mode="mix", seed=3)
    run = run_in_process(engine, specs, max_concurrency=8, idle_every=6, sample_interval_s=0.05,
                         trace_gpu_allocations=True, gpu_snapshot=stand_in)
    g = run.findings.gpu_allocations
    assert g["unavailable"] is None and len(g["sites"]) == 1, g
    top = g["sites"][0]
    assert top["site"].endswith(f"test_gpu_alloc_trace.py:{keep.__code__.co_firstlineno + 3} in keep")
    served = g["to_requests"] - g["from_requests"]
    assert served > 0 and top["count_diff"] >= 0.5 * served and top["bytes_per_request"] >= 0.5 * 65536
    assert any("test_gpu_alloc_trace.py" in line for line in extra_lines(run.findings))
    assert run.findings.to_dict()["gpu_allocations"]["sites"][0]["site"] == top["site"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_in_process_run_without_cuda_reports_one_line_and_keeps_its_verdict(tiny_checkpoint):
    specs = synthetic_workload(12, input_len=(8, 16), output_len=(4, 6), seed=4)
    run = run_in_process(make_engine(tiny_checkpoint, num_blocks=64), specs, max_concurrency=4, idle_every=4,
                         sample_interval_s=0.05, trace_gpu_allocations=True)
    assert run.findings.verdict == "CLEAN", run.findings.summary()
    assert [x for x in extra_lines(run.findings) if x.startswith("GPU allocation sites")] == [
        f"GPU allocation sites: not recorded: {cuda_alloc_sites.unavailable_reason()}"]


def test_cli_refuses_the_option_where_no_allocator_can_be_read():
    from typer.testing import CliRunner

    from vlite.cli.main import app

    for extra in (["--url", "http://127.0.0.1:1", "--blackbox"], ["--url", "http://127.0.0.1:1", "--watch"],
                  ["--scenario", "all"]):
        res = CliRunner().invoke(app, ["leak-check", "--trace-gpu-allocations", *extra], env={"COLUMNS": "200"})
        assert res.exit_code == 2 and "--trace-gpu-allocations reads the CUDA allocator" in res.output, res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")
def test_vlite_serve_debug_endpoints_answer_without_cuda_and_leak_check_url_says_so(vlite_serve):
    from vlite.diagnostics.targets.http import run_http

    url = vlite_serve("--enable-debug-endpoints")
    start = httpx.post(f"{url}/debug/gpu_allocations/start", timeout=10).json()
    assert start["recording"] is False and "no CUDA device" in start["unavailable"]
    doc = httpx.get(f"{url}/debug/gpu_allocations", timeout=10).json()
    assert doc["sites"] == {} and doc["pid"] > 0 and "no CUDA device" in doc["unavailable"]
    specs = synthetic_workload(8, input_len=(8, 16), output_len=(4, 6), seed=2, prefix="gpu")
    run = run_http(url, specs, max_concurrency=4, idle_every=4, sample_interval_s=0.05, trace_gpu_allocations=True)
    assert not run.findings.leak, run.findings.summary()
    assert run.findings.gpu_allocations["unavailable"].startswith("the server's engine: no CUDA device")
    assert httpx.post(f"{url}/debug/gpu_allocations/stop", timeout=10).status_code == 200


def test_vlite_serve_records_and_folds_the_engine_process_allocator_through_its_debug_endpoints(
        tiny_checkpoint, monkeypatch):
    # The engine loop runs in a thread of this process (create_app); torch's allocator is
    # replaced by a stand-in whose live blocks grow by one per completion served, so the path
    # POST start -> engine loop query -> GET (folded sites) -> POST stop runs on the CPU.
    import asyncio

    from vlite.entrypoints.api_server import create_app
    from vlite.entrypoints.state import ServerSettings

    served, calls = [], []
    monkeypatch.setattr(cuda_alloc_sites, "unavailable_reason", lambda: None)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [{"blocks": [
        _block(1 << 20), *(_block(512, frames=KEPT) for _ in served)]}], "device_traces": []})
    app = create_app(ServerSettings(enable_debug_endpoints=True), lambda: make_engine(tiny_checkpoint, num_blocks=32))

    async def scenario():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 300
                while (await http.get("/health")).status_code != 200:
                    assert loop.time() < deadline, "the model did not load"
                    await asyncio.sleep(0.05)
                before = (await http.get("/debug/gpu_allocations")).json()
                start = (await http.post("/debug/gpu_allocations/start")).json()
                for i in range(3):
                    r = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
                    assert r.status_code == 200, r.text
                    served.append(i)
                doc = (await http.get("/debug/gpu_allocations")).json()
                stop = (await http.post("/debug/gpu_allocations/stop")).json()
                return before, start, doc, stop

    try:
        before, start, doc, stop = asyncio.run(asyncio.wait_for(scenario(), 400))
    finally:
        cuda_alloc_sites.stop_recording()
    assert not before["recording"] and before["sites"] == {} and "POST /debug/gpu_allocations/start" in before[
        "unavailable"]
    assert start["recording"] and start["unavailable"] is None
    assert calls[0] == (("all",), {"context": "alloc", "stacks": "python",
                                   "max_entries": cuda_alloc_sites.DEFAULT_MAX_ENTRIES})
    kept = next(s for s in doc["sites"] if s.startswith("vlite/engine/worker/model_runner.py:412 in compute_logits"))
    assert doc["sites"][kept] == {"bytes": 3 * 512, "count": 3} and doc["recording"]
    assert not stop["recording"] and calls[-1] == ((None,), {})
