"""The in-process target: replay a workload on an ``LLMEngine`` in this process while sampling,
drain, snapshot, detect (``run_in_process``; ``InProcessTarget`` is its ``LeakCheckTarget``).

``InProcessClient`` drives the engine and injects each request's client action. The client
owns the step loop (as the async engine would), admits requests at their arrival offsets up to
``max_concurrency``, and after every ``idle_every`` admissions waits until the engine is idle:
those idle points are the troughs the trend regression needs.

An exception from the engine on any path the client drives (add, the rollback of a refused
multi-prompt request, abort, step, the idle-point census) is a finding
(``checks/engine_errors.py``), never a crash: an abort that raises (as the planted
``skip-free-on-abort`` does) is recorded and the replay goes on, the way a server logs an
exception in a disconnect handler and carries on; a step that raises is retried up to
``MAX_STEP_FAILURES`` times in a row, then the replay stops and what is there is judged.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import generate_latest

from vlite.diagnostics.checks import snapshot
from vlite.diagnostics.checks.cache_probe import REPEAT_ROUNDS, apply_probe, levelled
from vlite.diagnostics.checks.cardinality import FamilyCounts, cardinality_check, series_counts
from vlite.diagnostics.checks.detect import detect
from vlite.diagnostics.checks.engine_errors import engine_error
from vlite.diagnostics.checks.host_memory import anon_swap_bytes, host_memory_check
from vlite.diagnostics.checks.kind_growth import request_kind, served_by_point
from vlite.diagnostics.checks.result import RunResult
from vlite.diagnostics.readers.alloc_trace import AllocationTrace
from vlite.diagnostics.readers.gpu_alloc_trace import GpuAllocationTrace, TorchRecorder
from vlite.diagnostics.readers.samplers import MemoryProbe, Sampler, view_block_stats
from vlite.diagnostics.targets.base import TargetPlan, TargetRun
from vlite.diagnostics.targets.census_view import census_findings
from vlite.diagnostics.workload.all_paths import is_extra_probe
from vlite.diagnostics.workload.replay import IdlePoint, ReplayResult, RequestResult, render_prompt
from vlite.diagnostics.workload.sources import RequestSpec, engine_request_ids, expand_prompts
from vlite.engine import EngineClient, EngineView, RequestOrigin, SamplingParams
from vlite.entrypoints.metrics import ServerMetrics

ROUTE = "leak-check"
CACHE_PROBE_MIN_REQUESTS = 128  # distinct requests the cache probe may send at least (a cap it must reach)
MAX_STEP_FAILURES = 3  # steps in a row that raise before the client stops the replay (the engine is dead)


def sampling_params_for(spec: RequestSpec) -> SamplingParams:
    return spec.sampling_params()


class InProcessClient:
    """Replays a workload against an ``LLMEngine`` in this process.

    Args:
        engine: the engine (stepped only by this client during ``replay``).
        probe: returns (num_used_blocks, rss_bytes or None) for an idle point, optionally
            followed by a dict of host-memory readings (``IdlePoint.host``).
        stall_steps: steps without a new token or a finished request after which the client
            gives up on everything in flight (a leak can exhaust the cache so that the
            scheduler preempts forever); those requests end with outcome "stalled".
        on_output: called with every output a step returns (the server's metrics, as ``vlite
            serve`` feeds them), or None.
    """

    def __init__(self, engine: EngineClient, probe: Callable[[], tuple[int, int | None]], stall_steps: int = 300,
                 view: EngineView | None = None, on_output: Callable[[object], None] | None = None) -> None:
        self.engine = engine
        self.on_output = on_output
        self.view = view or EngineView(engine)
        self.probe = probe
        self.stall_steps = stall_steps
        self._quiet_steps = 0
        self._orphan_steps = 0  # steps in a row with engine work but no request in flight
        self._finished_ids: set[str] = set()  # requests seen finishing (a stuck one may re-emit its end)
        self._stuck = False  # the engine kept work no client waits for, through stall_steps steps
        self.errors: list[dict] = []  # exceptions the engine raised (checks/engine_errors.py)
        self._step_failures = 0  # steps in a row that raised

    def replay(self, specs: list[RequestSpec], max_concurrency: int = 32, idle_every: int = 0,
               stop: threading.Event | None = None, interrupt_drain_s: float = 5.0) -> ReplayResult:
        """Run ``specs`` to the end (every request finished, aborted or rejected) and drain.

        ``idle_every`` > 0: after that many admissions, admit no more until the engine is idle.
        ``stop`` (set by a first Ctrl-C, ``vlite.cli.interrupt``): send no more requests, abort
        those in flight, drain for at most ``interrupt_drain_s`` seconds, and return what was
        measured with ``interrupted`` set; the requests never sent keep outcome "not-sent".
        """
        engine = self.engine
        queue = deque(sorted(specs, key=lambda s: s.arrival_s))
        results = {s.request_id: RequestResult(s.request_id, s.action.kind, s.action.label, 0.0) for s in specs}
        inflight: dict[str, tuple[RequestSpec, float]] = {}
        out = ReplayResult([results[s.request_id] for s in specs], start_time=time.time())
        t0, in_wave, completed = out.start_time, 0, 0
        first_error = len(self.errors)  # a client replays more than once (the cache probe's rounds)
        self._idle_point(out, 0)  # the baseline

        def done(rid: str) -> None:
            nonlocal completed
            inflight.pop(rid, None)
            completed += 1

        while queue or inflight:
            if stop is not None and stop.is_set():
                self._interrupt(out, queue, inflight, results, done, interrupt_drain_s)
                break
            if self.engine_dead:
                self._stop_dead(out, queue, inflight, results, done)
                break
            now = time.time()
            wave_full = idle_every > 0 and in_wave >= idle_every
            while queue and not wave_full and len(inflight) < max_concurrency and queue[0].arrival_s <= now - t0:
                spec = queue.popleft()
                in_wave += 0 if is_extra_probe(spec) else 1
                wave_full = idle_every > 0 and in_wave >= idle_every
                admitted = self._admit(spec, results[spec.request_id], results)
                for rid in admitted:
                    inflight[rid] = (spec, time.time())
                    if spec.action.kind == "abort-waiting":
                        self._abort(rid, results[rid], "aborted while waiting")
                        done(rid)
                if not admitted:
                    done(spec.request_id)
            if wave_full and not inflight and (not engine.has_unfinished_requests() or self._stuck):
                self._idle_point(out, completed)
                in_wave, self._stuck = 0, False
                continue
            self._check_timeouts(inflight, results, done)
            if engine.has_unfinished_requests():
                self._step(inflight, results, done)
                # with no client waiting, sequences that keep making tokens (zombies) also end the wave
                self._orphan_steps = 0 if inflight else self._orphan_steps + 1
                if self._quiet_steps >= self.stall_steps or self._orphan_steps >= self.stall_steps:
                    self._give_up(out, inflight, results, done)
            elif inflight:  # the engine dropped requests the client still waits for
                for rid in list(inflight):
                    results[rid].outcome, results[rid].detail = "lost", "engine has no unfinished request"
                    results[rid].end_time = time.time()
                    done(rid)
            elif queue:
                time.sleep(min(0.05, max(0.0, queue[0].arrival_s - (time.time() - t0))))
        if out.interrupted is None and not self.engine_dead:
            self._drain(out)
        self._idle_point(out, completed)
        out.end_time = time.time()
        out.engine_errors.extend(self.errors[first_error:])
        return out

    @property
    def engine_dead(self) -> bool:
        """The last ``MAX_STEP_FAILURES`` steps all raised: the client stops stepping the engine."""
        return self._step_failures >= MAX_STEP_FAILURES

    def _stop_dead(self, out: ReplayResult, queue, inflight, results, done) -> None:
        """The engine's step keeps raising: send nothing more, abort those in flight (as clients
        that got an error; an abort may raise too) and judge what is there, undrained."""
        for spec in queue:
            res = results[spec.request_id]
            res.outcome, res.detail = "not-sent", "not sent: the engine's step kept raising"
        queue.clear()
        for rid in list(inflight):
            self._abort(rid, results[rid], "the engine's step kept raising: the client got an error")
            done(rid)
        out.notes.append(f"the replay stopped: the engine's step raised {MAX_STEP_FAILURES} times in a row "
                         f"({self.errors[-1]['exception']}); the state it left is judged as it is")

    def _interrupt(self, out: ReplayResult, queue, inflight, results, done, drain_s: float) -> None:
        """Stop early: the queued requests are not sent, those in flight are aborted (as clients
        that left), and the engine is drained for at most ``drain_s`` seconds."""
        not_sent = len(queue)
        for spec in queue:
            res = results[spec.request_id]
            res.outcome, res.detail = "not-sent", "the run was interrupted before it was sent"
        queue.clear()
        aborted = len(inflight)
        for rid in list(inflight):
            self._abort(rid, results[rid], "the run was interrupted (Ctrl-C): the client left")
            done(rid)
        self._drain(out, deadline=time.time() + drain_s)
        ended = sum(1 for r in out.requests if r.outcome not in ("not-sent", "pending"))
        out.interrupted = (f"interrupted (Ctrl-C) after {ended - aborted} of {len(out.requests)} requests had ended; "
                           f"{aborted} in flight aborted, {not_sent} never sent")

    def _drain(self, out: ReplayResult, deadline: float | None = None) -> None:
        """Step until the engine has nothing left, as a server keeps stepping after its clients
        left (bounded by ``stall_steps`` and, if given, the ``deadline`` in ``time.time()``
        seconds): a request that outlived its client runs out here."""
        steps = 0
        while self.engine.has_unfinished_requests() and steps < self.stall_steps and not self.engine_dead \
                and (deadline is None or time.time() < deadline):
            self._guarded_step()
            steps += 1
        if steps:
            out.notes.append(f"the engine still had work after every client had left: {steps} more steps "
                             + ("until it drained" if not self.engine.has_unfinished_requests()
                                else "and it did not drain"))

    def _give_up(self, out: ReplayResult, inflight, results, done) -> None:
        s = self.view.stats()
        if not inflight:  # sequences no client waits for never end: count the wave as over
            out.notes.append(f"the engine never went idle: {s.num_running} running, {s.num_waiting} waiting "
                             f"after {max(self._quiet_steps, self._orphan_steps)} steps with no request in flight"
                             + ("" if self._quiet_steps >= self.stall_steps else " (still making tokens)"))
            self._stuck, self._quiet_steps, self._orphan_steps = True, 0, 0
            return
        out.notes.append(f"the engine stalled: no token and no finished request in {self._quiet_steps} steps "
                         f"({s.num_running} running, {s.num_waiting} waiting, {s.num_free_blocks} free of "
                         f"{s.num_total_blocks} blocks); the client aborted its {len(inflight)} requests in flight")
        for rid in list(inflight):
            self._abort(rid, results[rid], "stalled engine: client gave up")
            results[rid].outcome = "stalled" if results[rid].outcome == "aborted" else results[rid].outcome
            done(rid)
        self._quiet_steps = 0

    def _idle_point(self, out: ReplayResult, completed: int) -> None:
        if out.idle_points and out.idle_points[-1].requests_completed == completed:
            return
        try:
            used, rss, *host = self.probe()  # the in-process probe adds host readings (the census walk)
        except Exception as exc:  # noqa: BLE001 - the engine's state could not be read: a finding, no idle point
            self.errors.append(engine_error("idle-point census", None, exc))
            return
        out.idle_points.append(IdlePoint(time.time(), completed, used, rss, host[0] if host else None))

    def _admit(self, spec: RequestSpec, res: RequestResult, results: dict | None = None) -> list[str]:
        """Add ``spec``'s engine requests (all or none for a multi-prompt request); their ids,
        or [] when the engine refused it (``res`` then says why)."""
        from vlite.engine import RequestRejectedError

        res.arrival_time = time.time()
        if spec.extra_prompts:
            return self._admit_group(spec, res, results)
        origin = RequestOrigin(spec.request_id, res.arrival_time, ROUTE, spec.client_tag, spec.action.label)
        try:
            self.engine.add_request(render_prompt(self.engine.tokenizer, spec), sampling_params_for(spec),
                                    request_id=spec.request_id, origin=origin)
        except (RequestRejectedError, ValueError) as exc:
            res.outcome, res.detail, res.end_time = "rejected", str(exc), time.time()
            return []
        except Exception as exc:  # noqa: BLE001 - the engine raised in its add path: a finding
            self._engine_raised("add_request", spec.request_id, exc, res)
            return []
        return [spec.request_id]

    def _engine_raised(self, path: str, rid: str, exc: BaseException, res: RequestResult) -> None:
        """Record ``exc`` from ``path`` as a finding; the client's request ended in an error."""
        err = engine_error(path, rid, exc)
        self.errors.append(err)
        res.outcome, res.detail, res.end_time = "engine-error", f"{path} raised {err['exception']}", time.time()

    def _admit_group(self, spec: RequestSpec, res: RequestResult, results: dict | None) -> list[str]:
        """A multi-prompt request as the API server adds one: an engine request per prompt
        (``<id>-<p>``), all or none (``add_requests``). On a refusal the client has its answer:
        from then on (``abort_time``) none of them may run (the zombie check holds them to it)."""
        from vlite.engine import EngineRequest, RequestRejectedError

        ids = engine_request_ids(spec)
        params = sampling_params_for(spec)
        reqs = [EngineRequest(text, params, RequestOrigin(rid, res.arrival_time, ROUTE, spec.client_tag,
                                                          spec.action.label))
                for rid, text in zip(ids, expand_prompts(spec, self.view.info().max_model_len))]
        res.engine_request_ids = ids
        refusal = (RequestRejectedError, ValueError)
        try:
            self.engine.add_requests(reqs)
        except Exception as exc:  # noqa: BLE001 - a refusal, or the engine raised in its add path or rollback
            refused = exc if isinstance(exc, refusal) else exc.__context__
            if not isinstance(refused, refusal):
                self._engine_raised("add_requests", spec.request_id, exc, res)
                return []
            res.outcome, res.detail = "rejected", f"one prompt of {len(ids)} refused: {refused}"
            res.end_time = res.abort_time = time.time()
            res.abort_step, res.tokens_at_abort = self.view.step, 0
            if exc is not refused:  # aborting the siblings admitted before the refusal raised
                self.errors.append(engine_error("add_requests rollback", spec.request_id, exc))
                res.detail += f"; the rollback of its admitted prompts raised {self.errors[-1]['exception']}"
            return []
        if results is not None:
            for rid in ids:  # each engine request reports into the one client result
                results[rid] = res
        return ids

    def _abort(self, rid: str, res: RequestResult, detail: str) -> None:
        res.abort_step, res.tokens_at_abort = self.view.step, self.view.request_tokens(rid)
        res.abort_time = res.end_time = time.time()
        try:
            self.engine.abort(rid)
        except Exception as exc:  # noqa: BLE001 - a failing disconnect handler must not stop the server (or us)
            self.errors.append(engine_error("abort", rid, exc))
            res.outcome, res.detail = "abort-raised", f"{detail}; abort raised {type(exc).__name__}: {exc}"
            return
        res.outcome, res.finish_reason, res.detail = "aborted", "abort", detail

    def _check_timeouts(self, inflight, results, done) -> None:
        now = time.time()
        for rid, (spec, t_admit) in list(inflight.items()):
            if spec.action.kind == "client-timeout" and now - t_admit >= spec.action.timeout_s:
                self._abort(rid, results[rid], f"client timed out after {now - t_admit:.2f} s")
                done(rid)

    def _guarded_step(self) -> list | None:
        """One engine step; its outputs, or None when it raised (recorded; ``engine_dead`` after
        ``MAX_STEP_FAILURES`` in a row)."""
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a raising step is a finding; the client retries a few times
            self.errors.append(engine_error("step", None, exc))
            self._step_failures += 1
            return None
        self._step_failures = 0
        return outputs

    def _step(self, inflight, results, done) -> None:
        before = self.view.stats().generation_tokens_total
        outputs = self._guarded_step()
        if outputs is None:
            self._quiet_steps += 1
            return
        if self.on_output is not None:
            for ro in outputs:
                self.on_output(ro)
        # Progress is a new token or a finished request (not just an output: a leak can make the
        # scheduler preempt and recompute the same sequences forever, each step re-emitting them).
        # A request's end counts once: a stuck request can emit its finished output at every step.
        ended = {o.request_id for o in outputs if o.finished} - self._finished_ids
        self._finished_ids |= ended
        progressed = bool(ended) or self.view.stats().generation_tokens_total > before
        self._quiet_steps = 0 if progressed else self._quiet_steps + 1
        for ro in outputs:
            res = results.get(ro.request_id)
            if res is None or ro.request_id not in inflight:
                continue
            spec = inflight[ro.request_id][0]
            res.num_output_tokens = max((len(c.token_ids) for c in ro.outputs), default=0)
            if ro.finished:
                res.finish_reason = ro.outputs[0].finish_reason
                res.outcome = "error" if res.finish_reason == "error" else "finished"
                res.detail, res.end_time = ro.error or "", time.time()
                done(ro.request_id)
            elif spec.action.kind in ("abort-after-tokens", "disconnect-stream") \
                    and res.num_output_tokens >= spec.action.after_tokens:
                what = "tokens" if spec.action.kind == "abort-after-tokens" else "chunks"
                self._abort(ro.request_id, res, f"aborted after {res.num_output_tokens} {what}")
                done(ro.request_id)
            elif spec.action.kind == "abort-prefill":
                self._abort(ro.request_id, res, "prefill ran in one step; aborted at its first token")
                done(ro.request_id)
        for rid, (spec, _) in list(inflight.items()):
            beam_after_tokens = spec.beam_width > 1 and spec.action.kind == "abort-after-tokens"
            if spec.action.kind not in ("abort-prefill", "abort-preempted", "abort-resumed") and not beam_after_tokens:
                continue
            p = self.view.request_progress(rid)
            if p and beam_after_tokens and p["num_output_tokens"] >= spec.action.after_tokens:
                # a beam search returns its beams only at the end: its progress says it is decoding
                self._abort(rid, results[rid], f"aborted during beam search decode, {p['num_output_tokens']} "
                                               "tokens into its beams")
                done(rid)
            elif p and spec.action.kind == "abort-preempted" and p["num_preemptions"] > 0:
                self._abort(rid, results[rid], f"aborted after {p['num_preemptions']} preemption(s), "
                                               f"status {p['status']}")
                done(rid)
            elif p and spec.action.kind == "abort-resumed" and p["num_preemptions"] > 0 \
                    and p["status"] == "running" and p["num_computed_tokens"] > 0:
                self._abort(rid, results[rid], f"aborted after {p['num_preemptions']} preemption(s) and a "
                                               f"resumption ({p['num_computed_tokens']} tokens recomputed)")
                done(rid)
            elif p and spec.action.kind == "abort-prefill" and p["num_computed_tokens"] > 0 \
                    and p["num_output_tokens"] == 0:
                self._abort(rid, results[rid], f"aborted during prefill, {p['num_computed_tokens']}/"
                                               f"{p['num_prompt_tokens']} prompt tokens cached")
                done(rid)


def run_in_process(engine: EngineClient, specs: list[RequestSpec], *, max_concurrency: int = 32, idle_every: int = 0,
                   sample_interval_s: float = 0.1, info: dict | None = None,
                   zombie_options: dict | None = None, stop: threading.Event | None = None,
                   trace_allocations: bool = False, trace_gpu_allocations: bool = False,
                   gpu_snapshot: Callable[[], dict] | None = None, on_progress=None,
                   cache_probe_requests: int | None = None) -> RunResult:
    """Replay ``specs`` on ``engine`` with a background sampler, then detect leaks at quiescence.

    ``trace_allocations``: run ``tracemalloc`` over the replay and add the Python allocation
    sites that grew from the second idle point to the last to the host-memory findings
    (``alloc_trace.py``; it slows the replay). ``trace_gpu_allocations``: record this process's
    CUDA allocator with Python stacks and name the allocation sites whose live bytes grew between
    the same idle points (``findings.gpu_allocations``, ``gpu_alloc_trace.py``); without CUDA it
    says so in one line and the run goes on. ``gpu_snapshot``: a stand-in for
    ``torch.cuda.memory._snapshot`` (tests on the CPU).

    ``cache_probe_requests``: when the host-memory check finds containers that keep growing,
    the cache-versus-leak probe (``cache_probe``) sends the run's first wave again, repeated and
    then with distinct prompts, at most this many distinct requests (None: twice the run's
    requests, at least ``CACHE_PROBE_MIN_REQUESTS``; 0: no probe); a container that levels off
    is a bounded cache, not a HOST-LEAK (``checks/cache_probe.py``).

    The run drives ``engine`` only through ``EngineClient`` (add, step, abort, has-unfinished)
    and reads it only through ``EngineView``. Specs with ``stop_token_at`` / ``stop_string_at`` are calibrated first (calibrate.py);
    coverage counts are taken from after the calibration, which reports its progress to
    ``on_progress("calibration", done, total)``. ``stop`` (set by a first Ctrl-C) ends the
    calibration or the replay early: the run is drained for a few seconds and its findings say
    INTERRUPTED, with every sample taken so far.
    """
    from vlite.diagnostics.checks.registries import sizes_source
    from vlite.diagnostics.workload.calibrate import calibrate, engine_greedy, needs_calibration

    view = EngineView(engine)
    if needs_calibration(specs):
        specs = calibrate(specs, engine_greedy(engine), stop=stop,
                          on_progress=(lambda d, t: on_progress("calibration", d, t)) if on_progress else None)
    coverage_before = view.coverage().to_dict()
    facts = view.info()
    memory = MemoryProbe(in_process_cuda=facts.device == "cuda", worker_pids=facts.worker_pids)
    blocks, regs = view_block_stats(view), sizes_source(view)
    sampler = Sampler(lambda: blocks() | regs(), memory, sample_interval_s).start()

    pids = [os.getpid(), *facts.worker_pids]
    # per process (host_memory.py, kind_growth.py): the engine and, under -tp, each rank's worker
    processes = {"engine": os.getpid(), **{f"tp_rank{r}": pid for r, pid in enumerate(facts.worker_pids)}}
    spec_ids = [s.request_id for s in specs]
    worker_errors: list[str] = []

    tracer = AllocationTrace() if trace_allocations else None
    gpu_tracer = GpuAllocationTrace(TorchRecorder(gpu_snapshot)) if trace_gpu_allocations else None
    # the /metrics page `vlite serve` would show for this engine, fed with every output: its
    # series per family at each idle point (cardinality.py)
    metrics = ServerMetrics(facts.model_name, view.stats)
    series: list[FamilyCounts] = []

    def probe() -> tuple[int, int | None, dict]:
        # an idle point: the census walk for container sizes (host_memory.py), ms per call
        series.append(series_counts(generate_latest(metrics.registry).decode()))
        if tracer is not None:
            tracer.idle_point()
        if gpu_tracer is not None:
            gpu_tracer.idle_point()
        census = view.request_census(())
        host = {"anon_swap_bytes": anon_swap_bytes(pids), "containers": dict(census.container_sizes),
                "caps": dict(census.container_caps),
                "processes": {name: anon_swap_bytes([pid]) for name, pid in processes.items()}}
        if facts.tensor_parallel_size > 1:  # each rank walks its own process (worker.py's census)
            try:
                ranks = view.worker_census(spec_ids)
            except Exception as exc:  # noqa: BLE001 - a failed rank ends the engine's requests; the run says so
                ranks = []
                if not worker_errors:
                    worker_errors.append(f"census inside the tensor-parallel workers failed: {exc}")
            for w in ranks:
                host["containers"].update({f"tp_rank{w['rank']}:{path}": n for path, n in w["container_sizes"].items()})
        return view.stats().num_used_blocks, memory.read().get("rss_bytes"), host

    t0 = time.time()
    replay: ReplayResult | None = None
    if tracer is not None:
        tracer.start()
    if gpu_tracer is not None:
        gpu_tracer.start()
    try:
        replay = InProcessClient(engine, probe, view=view, on_output=metrics.observe).replay(
            specs, max_concurrency, idle_every, stop=stop)
    finally:
        sampler.stop()
        completed = [p.requests_completed for p in replay.idle_points] if replay is not None else []
        growth = tracer.stop(completed) if tracer is not None else None
        gpu_growth = gpu_tracer.stop(completed) if gpu_tracer is not None else None
    sampler.sample()  # the drained state, after the last step
    snap = snapshot.from_view(view)
    findings = detect(snap, replay.requests, replay.idle_points, coverage_before=coverage_before,
                      zombie_options=zombie_options)
    findings.engine_errors = list(replay.engine_errors)
    try:
        findings.census = census_findings(view, replay.requests,
                                          workers=facts.tensor_parallel_size > 1 and not replay.interrupted
                                          and not worker_errors)
    except Exception as exc:  # noqa: BLE001 - the engine's state could not be walked: a finding, no census
        findings.engine_errors.append(engine_error("census", None, exc))
    findings.notes.extend(worker_errors)
    kinds = {s.request_id: request_kind(s) for s in specs}
    served = served_by_point([p.time for p in replay.idle_points],
                             [(kinds[r.request_id], r.end_time) for r in replay.requests])
    findings.host_memory = host_memory_check(replay.idle_points, served)
    growing = [g["path"] for g in findings.host_memory["growing"]]
    budget = (max(CACHE_PROBE_MIN_REQUESTS, 2 * len(specs)) if cache_probe_requests is None
              else cache_probe_requests)
    if growing and budget > 0 and not replay.interrupted and not (stop is not None and stop.is_set()):
        wave = idle_every or len(specs)
        probe_series, rounds, anon = cache_probe(engine, view, specs, growing, round_size=wave, budget=budget,
                                                 max_concurrency=max_concurrency, stop=stop, pids=pids,
                                                 seed=(info or {}).get("seed", 0), errors=findings.engine_errors)
        if stop is not None and stop.is_set():  # a Ctrl-C cut the rounds short: no level can be trusted
            findings.notes.append(f"cache probe interrupted after {rounds} rounds; the host-memory verdict stands")
        else:
            apply_probe(findings.host_memory, probe_series, rounds=rounds, round_size=min(wave, len(specs)), budget=budget,
                        anon_bytes=anon)
    findings.cardinality = cardinality_check([(p.requests_completed, c) for p, c in zip(replay.idle_points, series)])
    if growth is not None:
        findings.host_memory["allocation_sites"] = growth
    if gpu_growth is not None:
        if facts.worker_pids and not gpu_growth["unavailable"]:
            gpu_growth["scope"] = "this process only: the tensor-parallel workers' allocations are not recorded"
        findings.gpu_allocations = gpu_growth
    findings.notes.extend(replay.notes)
    findings.interrupted = replay.interrupted
    if memory.note:
        findings.notes.append(memory.note)
    run_facts = {"target": "in-process", "model": facts.model_name, "device": facts.device,
                 "num_total_blocks": snap.num_total_blocks, "block_size": facts.block_size,
                 "bytes_per_block": facts.bytes_per_block, "num_requests": len(specs),
                 "num_preemptions_total": view.stats().num_preemptions_total, "gpu_source": memory.gpu_source,
                 "inject_faults": list(facts.inject_faults), "tensor_parallel_size": facts.tensor_parallel_size,
                 "worker_pids": list(facts.worker_pids), "processes": processes, "replay_s": round(time.time() - t0, 2),
                 "sampler_errors": sampler.errors, **(info or {})}
    if replay.interrupted:
        run_facts["interrupted"] = replay.interrupted
    return RunResult(findings, sampler.frame(), replay, run_facts)


def cache_probe(engine: EngineClient, view: EngineView, specs: list[RequestSpec], paths: list[str], *,
                round_size: int, budget: int, max_concurrency: int = 32, stop: threading.Event | None = None,
                pids: list[int] | None = None, seed: int = 0,
                errors: list[dict] | None = None) -> tuple[dict, int, tuple[int, int] | None]:
    """The cache-versus-leak probe's rounds (``workload/probe.py``) on a drained engine: the first
    ``round_size`` specs ``REPEAT_ROUNDS`` times as they were, then with distinct prompts until
    every container of ``paths`` levels off or ``budget`` distinct requests were sent; the
    engine is idle after each round, and the containers' entries are read there (the census).

    Returns (path -> (repeated points, distinct points), rounds run, anonymous RSS + swap bytes
    of ``pids`` before and after, or None where unread); a point is (probe requests sent,
    entries). ``stop`` (Ctrl-C) ends it after the round in flight. ``errors`` gets the
    exceptions the engine raised in the rounds (``checks/engine_errors.py``).
    """
    from vlite.diagnostics.workload import probe

    base = probe.template(specs, round_size)

    def sizes() -> dict[str, int]:
        found = view.request_census(()).container_sizes
        return {p: found.get(p, 0) for p in paths}

    anon0 = anon_swap_bytes(pids or [os.getpid()])
    client = InProcessClient(engine, lambda: (view.stats().num_used_blocks, None), view=view)
    sent, rounds, points = 0, 0, [(0, sizes())]

    def run(batch: list[RequestSpec]) -> None:
        nonlocal sent, rounds
        done = client.replay(batch, max_concurrency, 0, stop=stop)
        if errors is not None:
            errors.extend(done.engine_errors)
        sent, rounds = sent + len(batch), rounds + 1
        points.append((sent, sizes()))

    for r in range(REPEAT_ROUNDS):
        run(probe.repeated_round(base, r))
    split = len(points) - 1  # the last repeated point starts the distinct series
    d = 0
    while sent - points[split][0] < budget and not (stop is not None and stop.is_set()):
        run(probe.distinct_round(base, d, seed))
        d += 1
        if all(levelled([(x, s[p]) for x, s in points[split:]]) for p in paths):
            break
    anon1 = anon_swap_bytes(pids or [os.getpid()])
    series = {p: ([(x, s[p]) for x, s in points[:split + 1]], [(x, s[p]) for x, s in points[split:]]) for p in paths}
    return series, rounds, (anon0, anon1) if anon0 is not None and anon1 is not None else None


class InProcessTarget:
    """An engine in this process, driven through ``EngineClient`` and read through ``EngineView``:
    the ``LeakCheckTarget`` around ``run_in_process``."""

    kind = "in-process"
    interruptible = "the replay"

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.view = EngineView(engine)

    def describe(self) -> str:
        facts = self.view.info()
        return f"{facts.model_name} ({facts.device})"

    def run(self, plan: TargetPlan, *, stop: threading.Event | None = None) -> TargetRun:
        """``run_in_process`` with the plan's workload, one idle point every ``plan.wave_size()`` requests."""
        n = len(plan.specs)
        plan.on_line(f"leak-check: {n} request{'s' if n != 1 else ''} on {self.describe()}, "
                     f"{self.view.stats().num_total_blocks} KV blocks, abort rate {plan.abort_rate} "
                     f"({plan.abort_mode}); Ctrl-C stops early and still writes the report")
        run = run_in_process(self.engine, plan.specs, stop=stop, trace_allocations=plan.trace_allocations,
                             trace_gpu_allocations=plan.trace_gpu_allocations,
                             cache_probe_requests=plan.cache_probe_requests, **plan.replay_options())
        return TargetRun.of_run_result(self.kind, run)
