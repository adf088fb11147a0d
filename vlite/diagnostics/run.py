"""One leak-check run: replay a workload while sampling, drain, snapshot, detect.

``run_in_process`` drives an LLMEngine in this process; ``vlite.diagnostics.targets.http``
does the same against a running ``vlite serve``.
"""

from __future__ import annotations

import os
import threading
import time

from vlite.diagnostics.checks import snapshot
from vlite.diagnostics.checks.detect import detect
from vlite.diagnostics.checks.host_memory import anon_swap_bytes, host_memory_check
from vlite.diagnostics.checks.result import RunResult
from vlite.diagnostics.targets.inprocess import InProcessClient
from vlite.diagnostics.targets.samplers import MemoryProbe, Sampler, view_block_stats
from vlite.diagnostics.workload.sources import RequestSpec
from vlite.engine import EngineClient


def run_in_process(engine: EngineClient, specs: list[RequestSpec], *, max_concurrency: int = 32, idle_every: int = 0,
                   sample_interval_s: float = 0.1, info: dict | None = None,
                   zombie_options: dict | None = None, stop: threading.Event | None = None) -> RunResult:
    """Replay ``specs`` on ``engine`` with a background sampler, then detect leaks at quiescence.

    The run drives ``engine`` only through ``EngineClient`` (add, step, abort, has-unfinished)
    and reads it only through ``EngineView``. Specs with ``stop_token_at`` / ``stop_string_at`` are calibrated first (calibrate.py);
    coverage counts are taken from after the calibration. ``stop`` (set by a first Ctrl-C)
    ends the replay early: the run is drained for a few seconds and its findings say
    INTERRUPTED, with every sample taken so far.
    """
    from vlite.diagnostics.checks.registries import sizes_source
    from vlite.diagnostics.workload.calibrate import calibrate, engine_greedy, needs_calibration
    from vlite.engine import EngineView

    view = EngineView(engine)
    if needs_calibration(specs):
        specs = calibrate(specs, engine_greedy(engine))
    coverage_before = view.coverage().to_dict()
    facts = view.info()
    memory = MemoryProbe(in_process_cuda=facts.device == "cuda", worker_pids=facts.worker_pids)
    blocks, regs = view_block_stats(view), sizes_source(view)
    sampler = Sampler(lambda: blocks() | regs(), memory, sample_interval_s).start()

    pids = [os.getpid(), *facts.worker_pids]

    def probe() -> tuple[int, int | None, dict]:
        # an idle point: the census walk for container sizes (host_memory.py), ms per call
        host = {"anon_swap_bytes": anon_swap_bytes(pids),
                "containers": dict(view.request_census(()).container_sizes)}
        return view.stats().num_used_blocks, memory.read().get("rss_bytes"), host

    t0 = time.time()
    try:
        replay = InProcessClient(engine, probe, view=view).replay(specs, max_concurrency, idle_every, stop=stop)
    finally:
        sampler.stop()
    sampler.sample()  # the drained state, after the last step
    snap = snapshot.from_view(view)
    findings = detect(snap, replay.requests, replay.idle_points, coverage_before=coverage_before,
                      zombie_options=zombie_options)
    findings.census = census_findings(view, replay.requests)
    findings.host_memory = host_memory_check(replay.idle_points)
    findings.notes.extend(replay.notes)
    findings.interrupted = replay.interrupted
    if memory.note:
        findings.notes.append(memory.note)
    run_facts = {"target": "in-process", "model": facts.model_name, "device": facts.device,
                 "num_total_blocks": snap.num_total_blocks, "block_size": facts.block_size,
                 "bytes_per_block": facts.bytes_per_block, "num_requests": len(specs),
                 "num_preemptions_total": view.stats().num_preemptions_total, "gpu_source": memory.gpu_source,
                 "inject_faults": list(facts.inject_faults), "tensor_parallel_size": facts.tensor_parallel_size,
                 "worker_pids": list(facts.worker_pids), "replay_s": round(time.time() - t0, 2),
                 "sampler_errors": sampler.errors, **(info or {})}
    if replay.interrupted:
        run_facts["interrupted"] = replay.interrupted
    return RunResult(findings, sampler.frame(), replay, run_facts)


def census_findings(view, requests) -> dict:
    """The request-id census at the drained idle point (``EngineView.request_census``), each
    container's requests joined with what their clients did; ``elapsed_ms`` is its cost."""
    actions = {r.request_id: r.action_label for r in requests}
    t0 = time.perf_counter()
    result = view.request_census(set(actions))
    out = result.to_dict()
    out["elapsed_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    for h in out["held"]:
        h["client_actions"] = sorted({actions.get(rid, "?") for rid in h["request_ids"]})
    return out
