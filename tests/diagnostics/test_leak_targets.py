"""Black-box targets without a server: adapters on recorded /metrics pages, process-tree memory
(with fake NVML and nvidia-smi), the attribution fit, wave design, --from-log and report.html."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vlite.diagnostics.readers.adapters import UnknownServerError, detect_kind
from vlite.diagnostics.readers.metrics_text import MetricsFormatError, parse_page
from vlite.diagnostics.readers.process import GpuProcessMemory, ProcessTreeProbe
from vlite.diagnostics.targets.blackbox import design_waves, fit_leak_per_action
from vlite.diagnostics.workload.sources import synthetic_workload

FIX = Path(__file__).parent / "fixtures"


def _state(name: str, kind: str = "auto"):
    page = parse_page((FIX / name).read_text())
    adapter = detect_kind(page, kind)
    return adapter.kind, adapter.read(page)


def test_vllm_recorded_pages_map_to_blocks_with_the_servers_block_size():
    kind, busy = _state("vllm-0.32.0-cpu-busy.prom")
    assert kind == "vllm"
    # 8 running requests, one 128-token block each: usage 8/363 (364 blocks minus the null block).
    assert (busy.num_running, busy.num_waiting, busy.kv_used, busy.kv_total) == (8, 0, 8.0, 363.0)
    assert busy.block_size == 128 and busy.unit == "blocks"
    _, idle = _state("vllm-0.32.0-cpu-after-abort.prom")
    assert idle.idle and idle.kv_used == 0.0
    assert idle.prefix_cache_hits == 896.0 and idle.prefix_cache_queries == 1775.0


def test_vllm_block_size_and_engines_come_from_labels_never_assumed():
    text = "\n".join(
        f'vllm:cache_config_info{{block_size="32",engine="{e}",num_gpu_blocks="101"}} 1.0\n'
        f'vllm:num_requests_running{{engine="{e}"}} 1.0\nvllm:num_requests_waiting{{engine="{e}"}} {e}.0\n'
        f'vllm:kv_cache_usage_perc{{engine="{e}"}} {0.05 * (e + 1)}' for e in (0, 1))
    s = detect_kind(parse_page(text)).read(parse_page(text))
    assert s.block_size == 32 and s.kv_total == 200.0  # two pools of 100 usable blocks
    assert s.kv_used == 15.0 and (s.num_running, s.num_waiting) == (2, 1)


def test_other_servers_from_their_documented_series():
    kind, sg = _state("sglang-docs.prom")
    assert kind == "sglang" and (sg.num_running, sg.num_waiting, sg.kv_used, sg.unit) == (3, 1, 5120.0, "tokens")
    assert sg.kv_total == 131072.0 and sg.prefix_cache_hits == 1024.0
    kind, lc = _state("llamacpp-docs.prom")
    assert kind == "llamacpp" and (lc.num_running, lc.num_waiting) == (1, 0)
    assert lc.kv_used is None and lc.unit == "none"  # current llama.cpp exports no KV gauge
    kind, tgi = _state("tgi-docs.prom")
    assert kind == "tgi" and (tgi.num_running, tgi.num_waiting, tgi.kv_used) == (2, 3, 4096.0)
    kind, vl = _state("vlite-serve-idle.prom")
    assert kind == "vlite" and vl.kv_used == 0 and vl.kv_total == 96


def test_detection_errors_name_what_was_looked_for():
    with pytest.raises(MetricsFormatError, match="not Prometheus text"):
        parse_page((FIX / "not-prometheus.html").read_text())
    with pytest.raises(MetricsFormatError, match="no metric sample"):
        parse_page("# just a comment\n")
    page = parse_page("process_resident_memory_bytes 1.0\n")
    with pytest.raises(UnknownServerError, match="vllm: vllm:num_requests_running"):
        detect_kind(page)
    with pytest.raises(UnknownServerError, match="not a sglang page"):
        detect_kind(parse_page((FIX / "vllm-0.32.0-cpu-idle.prom").read_text()), "sglang")
    with pytest.raises(ValueError, match="unknown --server-kind"):
        detect_kind(page, "triton")


class _FakeNvml:
    """Two devices; pid P uses 100 MiB on each, another pid 1 GiB."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=self.pid, usedGpuMemory=100 << 20), SimpleNamespace(pid=1, usedGpuMemory=1 << 30)]


@pytest.fixture
def process_tree():
    """A parent python process with one child, both sleeping."""
    code = "import subprocess,sys,time; c=subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); " \
           "print(c.pid, flush=True); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    yield parent.pid, child
    import psutil

    for p in (psutil.Process(parent.pid).children(recursive=True)):
        p.kill()
    parent.kill()
    parent.wait(timeout=10)


def test_process_tree_rss_and_nvml_per_pid_memory(process_tree):
    parent, child = process_tree
    from vlite.diagnostics.readers.process import process_roles

    assert process_roles(parent) == {"api_server": parent, "engine_core": child}  # one child: the engine core
    probe = ProcessTreeProbe(parent, GpuProcessMemory(nvml=_FakeNvml(child)))
    row = probe.read()
    assert row["num_processes"] == 2 and {r["pid"] for r in probe.last_tree} == {parent, child}
    assert row["rss_bytes"] == sum(r["rss_bytes"] for r in probe.last_tree) > 0
    assert row["gpu_process_bytes"] == 200 << 20  # the child's two devices; pid 1 is not in the tree
    assert probe.gpu_source == "nvml" and probe.note is None


def test_no_gpu_degrades_and_nvidia_smi_is_the_fallback(tmp_path, process_tree):
    parent, child = process_tree

    class Broken:
        def nvmlInit(self):
            raise OSError("NVML Shared Library Not Found")

    none = GpuProcessMemory(nvml=Broken(), smi=str(tmp_path / "missing"))
    probe = ProcessTreeProbe(parent, none)
    assert none.source is None and "no GPU" in probe.note and "gpu_process_bytes" not in probe.read()
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{child}, 300'\necho '{child}, 12'\necho '999999, 5000'\n")
    smi.chmod(0o755)
    fallback = GpuProcessMemory(nvml=Broken(), smi=str(smi))
    assert fallback.source == "nvidia-smi"
    assert ProcessTreeProbe(parent, fallback).read()["gpu_process_bytes"] == 312 << 20


def test_nnls_fit_recovers_blocks_per_request_by_action():
    rng = np.random.default_rng(0)
    kinds = ["complete", "abort-prefill", "disconnect-stream"]
    counts = rng.integers(0, 8, size=(10, 3))
    truth = np.array([0.0, 2.0, 1.0])
    fit = {r["client_action"]: r for r in fit_leak_per_action(counts, counts @ truth, kinds)}
    for k, t in zip(kinds, truth):
        assert fit[k]["per_request"] == pytest.approx(t, abs=1e-6)
        assert fit[k]["ci95"][0] <= t + 1e-6 <= fit[k]["ci95"][1] + 1e-6
    assert fit["complete"]["requests"] == counts[:, 0].sum()


def test_waves_have_differing_seeded_mixes():
    specs = synthetic_workload(60, input_len=(8, 16), output_len=(8, 12), seed=1)
    waves = design_waves(specs, 6, seed=3, abort_rate=0.5)
    again = design_waves(specs, 6, seed=3, abort_rate=0.5)
    assert [[s.action for s in w] for w in waves] == [[s.action for s in w] for w in again]
    assert sum(len(w) for w in waves) == 60 and len(waves) == 6
    mixes = {tuple(sorted(s.action.kind for s in w)) for w in waves}
    assert len(mixes) == 6  # every wave a different mix
    assert all(s.action.kind == "complete" for w in design_waves(specs, 3, 0, 0.0) for s in w)


def test_reproducer_rows_replay_as_a_trace(tmp_path):
    import json

    from vlite.diagnostics.report.blackbox_report import _trace_row, curl_command
    from vlite.diagnostics.workload.actions import ClientAction
    from vlite.diagnostics.workload.sources import jsonl_workload, with_action

    spec = with_action(synthetic_workload(1, seed=0)[0], ClientAction("disconnect-stream", after_tokens=3))
    path = tmp_path / "reproducer.jsonl"
    path.write_text(json.dumps(_trace_row(spec)) + "\n")
    (back,) = jsonl_workload(path)
    assert back.action == spec.action and back.max_tokens == spec.max_tokens
    assert back.prompt == f"repro-{spec.request_id} {spec.prompt}"  # misses the prefix cache on replay
    assert back.request_id == f"repro-{spec.request_id}"
    cmd = curl_command(spec, "http://127.0.0.1:8000")
    assert "| head -n 6" in cmd and "/v1/completions" in cmd


VLLM_LINE = ("(APIServer pid=8896) INFO 11-30 22:59:{s:02d} [loggers.py:335] Engine 000: Avg prompt throughput: 3.2 "
             "tokens/s, Avg generation throughput: 0.1 tokens/s, Running: {r} reqs, Waiting: {w} reqs, "
             "CPU KV cache usage: {u}%, Prefix cache hit rate: 0.0%")
VLITE_LINE = ("2026-11-30 23:00:{s:02d},000 INFO vlite.engine.async_engine: Avg prompt throughput: 1.0 tokens/s, "
              "Avg generation throughput: 2.0 tokens/s, Running: {r} reqs, Waiting: 0 reqs, KV cache usage: {u}%, "
              "Prefix cache hit rate: 0.0%, Free blocks: {f}/96 (+{c} cached)")


def _write(tmp_path, lines):
    p = tmp_path / "server.log"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_from_log_clean_vllm_and_leaking_vlite(tmp_path):
    from vlite.diagnostics.targets.from_log import analyze_log

    clean = [VLLM_LINE.format(s=i * 10, r=r, w=0, u=u) for i, (r, u) in enumerate([(4, 1.7), (0, 0.0), (3, 2.0),
                                                                                  (0, 0.0), (0, 0.0)])]
    res = analyze_log(_write(tmp_path, ["INFO starting", *clean, "garbage"]))
    assert res.verdict == "CLEAN" and res.exit_code == 0 and res.server_kind == "vllm" and res.unit == "percent"
    assert res.info["stats_lines"] == 5 and res.info["other_lines"] == 2 and len(res.info["idle_stretches"]) == 2
    leak = [VLITE_LINE.format(s=i * 5, r=r, u=u, f=f, c=c) for i, (r, u, f, c) in
            enumerate([(3, 10.0, 80, 6), (0, 2.1, 90, 4), (0, 2.1, 90, 4), (2, 9.0, 70, 10), (0, 4.2, 82, 10),
                       (0, 4.2, 82, 10)])]
    res = analyze_log(_write(tmp_path, leak + [VLLM_LINE.format(s=1, r=0, w=0, u="x")]))
    assert res.verdict == "LEAK" and res.exit_code == 1 and res.unit == "blocks"
    assert res.final == 4.0 and res.info["unparsable_lines"] == 1  # 96 - 82 - 10 blocks held at idle
    assert "2 of 2 idle stretches" in res.summary


def test_from_log_bad_input(tmp_path):
    from vlite.diagnostics.targets.from_log import LogError, analyze_log

    with pytest.raises(LogError, match="no stats line"):
        analyze_log(_write(tmp_path, ["INFO hello", "nothing here"]))
    with pytest.raises(LogError, match="cannot read"):
        analyze_log(tmp_path / "missing.log")
    busy = analyze_log(_write(tmp_path, [VLLM_LINE.format(s=i, r=5, w=1, u=9.0) for i in range(3)]))
    assert busy.verdict == "INCONCLUSIVE" and busy.exit_code == 3
    lone = analyze_log(_write(tmp_path, [VLLM_LINE.format(s=0, r=5, w=0, u=9.0), VLLM_LINE.format(s=10, r=0, w=0, u=1.0)]))
    assert lone.verdict == "INCONCLUSIVE"


def test_from_log_report_is_written_with_a_single_file_html(tmp_path):
    from vlite.diagnostics.report.blackbox_report import write_blackbox_report
    from vlite.diagnostics.targets.from_log import analyze_log

    res = analyze_log(_write(tmp_path, [VLLM_LINE.format(s=i * 10, r=r, w=0, u=u)
                                        for i, (r, u) in enumerate([(4, 1.7), (0, 0.0), (0, 0.0)])]))
    out = write_blackbox_report(res, tmp_path / "rep")
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4 and 'src="usage.png"' not in html
    import json

    rep = json.loads((out / "report.json").read_text())
    assert rep["verdict"] == "CLEAN" and rep["server_kind"] == "vllm" and rep["blackbox"]["suspects"] == []


def test_listening_pid_finds_this_process():
    import socket

    from vlite.diagnostics.readers.process import is_local_url, listening_pid

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        time.sleep(0.05)
        assert listening_pid(f"http://127.0.0.1:{port}") == os.getpid()
    assert is_local_url("http://127.0.0.1:1") and is_local_url("http://localhost:8000")
    assert not is_local_url("http://192.0.2.7:8000")  # TEST-NET-1: a remote server gets metrics only


def test_from_log_on_real_server_logs():
    """A real vLLM 0.32 (CPU) log of a clean run, and a real `vlite serve --inject-fault
    skip-free-on-abort --log-stats` log whose idle lines stay above 0."""
    from vlite.diagnostics.targets.from_log import analyze_log

    clean = analyze_log(FIX / "vllm-0.32.0-cpu-clean-run.log")
    assert clean.verdict == "CLEAN" and clean.server_kind == "vllm" and clean.info["stats_lines"] == 4
    leak = analyze_log(FIX / "vlite-serve-skip-free-on-abort.log")
    assert leak.verdict == "LEAK" and leak.server_kind == "vlite" and leak.unit == "blocks"
    assert leak.info["idle_stretches"][-1]["last_used"] == 36.0  # 96 - 45 free - 15 cached


def test_prefix_cache_occupancy_is_not_used():
    """An idle vlite server with a warm prefix cache: cached blocks are free, used is 0."""
    page = parse_page('vlite:num_total_blocks 96\nvlite:num_free_blocks 40\nvlite:num_cached_blocks 56\n'
                      'vlite:num_requests_running 0\nvlite:num_requests_waiting 0\n')
    s = detect_kind(page).read(page)
    assert s.kv_used == 0 and s.idle and s.kv_usage == 0


def test_white_box_report_directory_gets_a_single_file_html(tiny_checkpoint, tmp_path):
    from conftest import make_engine

    from vlite.diagnostics.report.report import write_report
    from vlite.diagnostics.targets.inprocess import run_in_process

    engine = make_engine(tiny_checkpoint, num_blocks=32)
    run = run_in_process(engine, synthetic_workload(4, input_len=(8, 16), output_len=(4, 6), seed=0),
                         max_concurrency=4, idle_every=2, sample_interval_s=0.05)
    out = write_report(run, tmp_path / "wb")
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>") and html.count("data:image/png;base64,") == 4
    assert "CLEAN" in html and "<table>" in html


def test_readiness_wait_fails_at_once_on_what_waiting_cannot_fix():
    """A 404 health route or a URL without a scheme is an error at once; a 503 (model still
    loading) is waited for until 200."""
    import time

    import httpx

    from vlite.diagnostics.targets.base import TargetError
    from vlite.diagnostics.targets.openai_client import wait_ready

    def client(*statuses):
        answers = iter(statuses)
        return httpx.Client(transport=httpx.MockTransport(lambda req: httpx.Response(next(answers))))

    start = time.time()
    with pytest.raises(TargetError, match="not an LLM server's root URL: GET /health answered HTTP 404"):
        wait_ready("http://127.0.0.1:1", client(404), timeout_s=30)
    with pytest.raises(TargetError, match="is not a server URL"):
        wait_ready("not-a-url", httpx.Client(), timeout_s=30)
    assert time.time() - start < 5
    wait_ready("http://127.0.0.1:1", client(503, 503, 200), timeout_s=30)  # returns once ready
    with pytest.raises(TargetError, match="is not ready: HTTP 503"):
        wait_ready("http://127.0.0.1:1", client(*[503] * 100), timeout_s=0.5)


def test_process_roles_name_the_api_server_engine_core_and_ranks():
    """Over --url: each process of a server's tree by its role (sleeping stand-ins:
    an API server whose engine core spawned two workers)."""
    import psutil

    from vlite.diagnostics.readers.process import process_roles

    grandchild = "import time; time.sleep(60)"
    core = (f"import subprocess,sys,time; ws=[subprocess.Popen([sys.executable,'-c',{grandchild!r}]) for _ in range(2)]; "
            "print(' '.join(str(w.pid) for w in ws), flush=True); time.sleep(60)")
    api = (f"import subprocess,sys,time; c=subprocess.Popen([sys.executable,'-c',{core!r}], stdout=subprocess.PIPE, "
           "text=True); print(c.pid, c.stdout.readline().strip(), flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", api], stdout=subprocess.PIPE, text=True)
    try:
        core_pid, *workers = map(int, parent.stdout.readline().split())
        assert process_roles(parent.pid) == {"api_server": parent.pid, "engine_core": core_pid,
                                             "tp_rank0": min(workers), "tp_rank1": max(workers)}
        assert process_roles(None) == {}
        assert process_roles(core_pid) == {"api_server": core_pid, "tp_rank0": min(workers), "tp_rank1": max(workers)}
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait(timeout=10)
