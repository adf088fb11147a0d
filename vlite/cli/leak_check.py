"""``vlite leak-check``: replay a workload with injected client aborts, sample memory and the
free list, drain, and report leaked KV blocks (and per-request state) by origin.

Exit codes (``EPILOG``, the end of ``--help``): 0 CLEAN, 1 LEAK / ZOMBIE / HOST-LEAK / WEDGED /
EMPTY-OUTPUT / OUTPUT-DRIFT (or a scenario failed), 2 usage error or a target that cannot be reached, 3 INCONCLUSIVE, 4 CLEAN but no client
abort was exercised (while waiting, in prefill or in decode; e.g. ``--abort-rate 0``), 130 INTERRUPTED.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import typer
from rich.console import Console

from vlite.cli import common
from vlite.engine import EngineArgs

_MIX_HELP = "Abort kind: abort-waiting, abort-prefill, abort-after-tokens, disconnect-stream, client-timeout, or mix."
# The fixed scenarios' names (vlite/diagnostics/scenarios.py SCENARIOS; a test keeps the two equal).
# Listed here so that --help shows them without importing the engine.
SCENARIO_NAMES = ("abort-waiting", "abort-chunked-prefill", "disconnect-mid-stream", "non-streaming-disconnect",
                  "abort-preempted", "preempted-in-prefill", "raise-in-step", "never-fits", "repeated-short", "n-samples-abort",
                  "beam-under-pressure", "shared-prefix-aborts", "stop-strings", "chat-eos",
                  "preempted-resumed-aborted")
# The default run is the one the docs state and `make run` makes (with 120 requests): client
# aborts are what the tool exists to test, so a bare `vlite leak-check` sends them.
DEFAULT_NUM_REQUESTS = 60
DEFAULT_ABORT_RATE = 0.3
# --help groups the options by mode (Typer's rich_help_panel, shown by common.PanelledCommand in the plain help).
PANEL_WORKLOAD = "Workload and client aborts (in process and --url)"
PANEL_INPROC = "In-process replay (the default target)"
PANEL_ENGINE = "Engine (in-process replay and --scenario)"
PANEL_URL = "A running server (--url; --blackbox for /metrics only)"
PANEL_WATCH = "--watch: scrape a live server, send no request"
PANEL_PROM = "--prometheus: judge a range Prometheus stored"
PANEL_LOG = "--from-log: post-mortem of a server's stats log"
PANEL_FLEET = "A fleet: --url ROUTER --replica URL ..."
PANEL_REPORT = "Report and output"
# Plain help (main.py): "\b" keeps click from re-wrapping a paragraph.
EPILOG = """\b
Verdicts and exit codes:
  0    CLEAN         blocks back on the free list, no per-request state left
  4    CLEAN, but no client abort (while waiting, in prefill or in decode) was
                     exercised: the paths leak-check exists for went untested
                     (e.g. --abort-rate 0); the verdict line names what was missed
  1    LEAK          blocks or per-request state left after the drain
  1    ZOMBIE        requests outlived their clients
  1    HOST-LEAK     host memory keeps growing past warm-up
  1    ENGINE-ERROR  the engine raised on add/abort/step, or --url answered 5xx
  1    WEDGED        after an abort storm /health says 200 but a plain request
                     does not complete (--url: --storm-requests)
  1    EMPTY-OUTPUT  after an abort storm the greedy canary gets HTTP 200 with
                     zero tokens
  1    OUTPUT-DRIFT  after an abort storm the greedy canary's text changed
  1    a --scenario failed
  2    usage error, or a target that cannot be reached or read (one line)
  3    INCONCLUSIVE  the server never drained, no KV gauge, no idle stretch,
                     or every request ended in an engine error
  130  INTERRUPTED   Ctrl-C: the report of what was measured is written

\b
Examples, one per mode:
  vlite leak-check                                  # in process: 60 requests, 30% aborted
  vlite leak-check --scenario all                   # the fixed scenarios
  vlite leak-check --url http://127.0.0.1:8000 --num-requests 40 --abort-rate 0.4
  vlite leak-check --url http://127.0.0.1:8000 --blackbox   # /metrics only (vLLM, SGLang, ...)
  vlite leak-check --url http://127.0.0.1:8000 --watch --duration 600
  vlite leak-check --url http://router:8100 --replica http://r1:8000 --replica http://r2:8000
  vlite leak-check --prometheus http://prom:9090 --job vllm --since 6h
  vlite leak-check --from-log server.log
  vlite leak-check --report leak-report             # + report.json, report.md, PNGs

docs/leak-check.md has the whole story."""
# leak-check's Typer command settings (main.py registers it with them)
COMMAND_OPTIONS = {"cls": common.panelled((PANEL_WORKLOAD, PANEL_INPROC, PANEL_ENGINE, PANEL_URL, PANEL_FLEET,
                                            PANEL_WATCH, PANEL_PROM, PANEL_LOG, PANEL_REPORT)), "epilog": EPILOG}
_SMALL_POOL = ("the all-paths workload (the default) instead sizes a deliberately small KV pool, a quarter of what a wave of "
               "requests asks for (25 blocks at --num-requests 60, 39 at 120, 71 at 200), so that preemption happens")


def _range(text: str, name: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        return int(lo), int(hi or lo)
    except ValueError:
        common.fail(f"{name} must be MIN:MAX tokens (e.g. 16:64), got {text!r}")


@common.engine_args_options(include_faults=True, panel=PANEL_ENGINE, help_extra={
    "kv_cache_memory_bytes": f"Without it or --num-blocks, {_SMALL_POOL}.",
    "num_blocks": f"Without it or --kv-cache-memory-bytes, {_SMALL_POOL}.",
})
def leak_check(
    workload: str = typer.Option("all-paths", "--workload", "-w", rich_help_panel=PANEL_WORKLOAD,
                                 help="all-paths (every engine path: prefix hits, preemption, n > 1, beam search, "
                                      "EOS/stop finishes; on a deliberately small KV pool sized from "
                                      "--num-requests to force preemption, unless --num-blocks or "
                                      "--kv-cache-memory-bytes is given), synthetic (plain requests), kind-waves (waves "
                                      "of one request kind each, for host-memory growth per kind), a JSONL trace (.jsonl; schema in "
                                      "docs/leak-check.md), or a ShareGPT file (.json)."),
    num_requests: int = typer.Option(DEFAULT_NUM_REQUESTS, "--num-requests", rich_help_panel=PANEL_WORKLOAD, min=1,
                                     help="Requests to run: the size of the all-paths (default) and synthetic "
                                          "workloads, and the most read from a ShareGPT file (a JSONL trace runs "
                                          "whole). It also sizes the waves (a fifth of the run) and the all-paths KV pool."),
    input_len: str = typer.Option("16:64", "--input-len", rich_help_panel=PANEL_WORKLOAD, help="Synthetic prompt length range MIN:MAX, tokens."),
    prompt_source: str = typer.Option("distinct", "--prompt-source", rich_help_panel=PANEL_WORKLOAD,
                                      help="Prompt text of the all-paths and synthetic workloads: distinct "
                                           "(made-up words no request repeats, so outputs differ too and a cache "
                                           "keyed by content keeps growing) or word-list (a 90-word list: every "
                                           "token is one of about 90)."),
    output_len: str = typer.Option("8:32", "--output-len", rich_help_panel=PANEL_WORKLOAD, help="Synthetic output length range MIN:MAX, tokens."),
    request_rate: float = typer.Option(float("inf"), "--request-rate", rich_help_panel=PANEL_WORKLOAD,
                                       help="Poisson arrival rate, requests/s (inf = all at once)."),
    max_concurrency: int = typer.Option(64, "--max-concurrency", rich_help_panel=PANEL_WORKLOAD, min=1, help="Most requests in flight."),
    idle_every: int | None = typer.Option(None, "--idle-every", rich_help_panel=PANEL_WORKLOAD, min=0,
                                          help="Wait for the engine to go idle after every N requests, giving the "
                                               "trend its troughs (default: num_requests/5; 0 = never)."),
    abort_rate: float = typer.Option(DEFAULT_ABORT_RATE, "--abort-rate", rich_help_panel=PANEL_WORKLOAD, min=0.0, max=1.0,
                                      help="Fraction of requests the client aborts (--abort-mode); 0 tests no abort "
                                           "path, and a CLEAN verdict then exits 4 instead of 0. A JSONL trace's lines that "
                                           "name a client_action keep it; --scenario sets its own."),
    abort_mode: str = typer.Option("mix", "--abort-mode", rich_help_panel=PANEL_WORKLOAD, help=_MIX_HELP),
    url: str | None = typer.Option(None, "--url", rich_help_panel=PANEL_URL, help="Target a running server (http://host:port): vlite serve, vLLM, SGLang, llama.cpp, TGI or TensorRT-LLM."),
    sample_interval_ms: float = typer.Option(100.0, "--sample-interval-ms", rich_help_panel=PANEL_WORKLOAD, min=1.0, help="Sampling period, ms."),
    report: Path | None = typer.Option(None, "--report", rich_help_panel=PANEL_REPORT,  # noqa: B008 (Typer's option style)
                                       help="Write report.json, samples.csv, report.md, PNGs here."),
    scenario: str | None = typer.Option(None, "--scenario", rich_help_panel=PANEL_INPROC,
                                        help=f"Run a fixed scenario by name, or all: {', '.join(SCENARIO_NAMES)}."),
    seed: int = typer.Option(0, "--seed", rich_help_panel=PANEL_WORKLOAD, help="Seed of the workload and the client actions."),
    n: int = typer.Option(1, "--n", rich_help_panel=PANEL_WORKLOAD, min=1, help="Samples per synthetic request (n > 1 forks shared blocks)."),
    max_num_batched_tokens: int | None = typer.Option(
        None, "--max-num-batched-tokens", rich_help_panel=PANEL_INPROC, min=1,
        help="Token budget of one step (default 128 for the all-paths workload, so long prompts are chunked; "
             "else 2048)."),
    engine_args: EngineArgs = None,
    server_kind: str = typer.Option("auto", "--server-kind", rich_help_panel=PANEL_URL,
                                    help="With --url: auto (from /metrics), vlite, vllm, sglang, llamacpp, tgi or trtllm."),
    blackbox: bool = typer.Option(False, "--blackbox", rich_help_panel=PANEL_URL,
                                  help="With --url: use only /metrics and process memory (automatic for servers "
                                       "other than vlite)."),
    api_key: str | None = typer.Option(None, "--api-key", rich_help_panel=PANEL_URL, help="Bearer key of the server (--url)."),
    server_pid: int | None = typer.Option(None, "--server-pid", rich_help_panel=PANEL_URL, min=1,
                                          help="The server's root process (default: the one listening on the port)."),
    drain_timeout: float = typer.Option(60.0, "--drain-timeout", rich_help_panel=PANEL_URL, min=0.1,
                                        help="Black-box: seconds to wait for the server to go idle (else "
                                             "INCONCLUSIVE, exit 3)."),
    bisect_budget: float = typer.Option(60.0, "--bisect-budget", rich_help_panel=PANEL_URL, min=0.0,
                                        help="Black-box: seconds for bisecting the leaking requests."),
    from_log: Path | None = typer.Option(None, "--from-log", rich_help_panel=PANEL_LOG,  # noqa: B008 (Typer's option style)
                                         help="Post-mortem: read vLLM's or vlite's periodic stats lines from a log, and the "
                                              "servers' own abort, zombie and leak messages (vLLM, SGLang, "
                                              "TensorRT-LLM, llama.cpp)."),
    zombie_threshold_s: float = typer.Option(1.0, "--zombie-threshold-s", rich_help_panel=PANEL_URL, min=0.0,
                                             help="Where no engine step is known: a request outliving its client "
                                                  "by more than max(this, 3 x the run's p99 inter-token latency) "
                                                  "seconds is a ZOMBIE."),
    zombie_threshold_steps: int = typer.Option(2, "--zombie-threshold-steps", rich_help_panel=PANEL_WORKLOAD, min=0,
                                               help="A request outliving its client by more than this many engine "
                                                    "steps is a ZOMBIE (in process, and over --url from the server's "
                                                    "step counter)."),
    watch: bool = typer.Option(False, "--watch", rich_help_panel=PANEL_WATCH,
                               help="With --url: send NO request; scrape /metrics (and the server's memory on this "
                                    "host) until Ctrl-C or --duration, judging at its natural idle points."),
    duration: float | None = typer.Option(None, "--duration", rich_help_panel=PANEL_WATCH, min=0.1, help="--watch: stop after this many seconds."),
    interval: float | None = typer.Option(None, "--interval", rich_help_panel=PANEL_WATCH, min=0.01,
                                          help="--watch: seconds between scrapes (default 1); --prometheus: the query "
                                               "step (default 15)."),
    stuck_after: float = typer.Option(300.0, "--stuck-after", rich_help_panel=PANEL_WATCH, min=0.1,
                                      help="--watch/--prometheus: a running gauge above 0 this long with no request "
                                           "finished or aborted is flagged (seconds)."),
    server_log: Path | None = typer.Option(None, "--server-log", rich_help_panel=PANEL_WATCH,  # noqa: B008
                                           help="--watch: follow the server's log file (from its end) and alert on "
                                                "the servers' own messages about aborts, zombies and leaked KV "
                                                "(vLLM, SGLang, TensorRT-LLM, llama.cpp; docs/leak-check.md)."),
    prometheus: str | None = typer.Option(None, "--prometheus", rich_help_panel=PANEL_PROM,
                                          help="Judge a range a Prometheus server holds (its URL); with --job, --since."),
    job: str | None = typer.Option(None, "--job", rich_help_panel=PANEL_PROM, help="--prometheus: the scrape job of the inference server."),
    since: str = typer.Option("6h", "--since", rich_help_panel=PANEL_PROM, help="--prometheus: how far back, e.g. 90s, 30m, 6h, 2d."),
    instance: str | None = typer.Option(None, "--instance", rich_help_panel=PANEL_PROM,
                                        help="--prometheus: judge only this replica (default: every replica of the "
                                             "job, a verdict each, never an average)."),
    instance_label: str = typer.Option("instance", "--instance-label", rich_help_panel=PANEL_PROM,
                                       help="--prometheus: the label that tells the job's replicas apart (instance, "
                                            "or e.g. pod on Kubernetes)."),
    trace_allocations: bool = typer.Option(False, "--trace-allocations", rich_help_panel=PANEL_INPROC,
                                           help="In process: trace Python allocations over the replay (tracemalloc) "
                                                "and name the sites that kept growing between the idle points "
                                                "(HOST-LEAK attribution; the replay takes about 10% longer)."),
    trace_gpu_allocations: bool = typer.Option(False, "--trace-gpu-allocations", rich_help_panel=PANEL_INPROC,
                                               help="On CUDA: record the allocator's history with Python stacks and "
                                                    "name the allocation sites whose live GPU bytes grew between "
                                                    "the idle points, per request (in process; with --url, a vlite "
                                                    "serve started with --enable-debug-endpoints). Without CUDA the "
                                                    "report says so and the run goes on."),
    cache_probe_requests: int | None = typer.Option(
        None, "--cache-probe-requests", rich_help_panel=PANEL_INPROC, min=0,
        help="In process, when a container keeps growing: the cache-versus-leak probe sends the first wave again, "
             "repeated and then with distinct prompts, at most this many distinct requests (default: twice "
             "--num-requests, at least 128; 0: no probe). A container that levels off is a bounded cache, reported "
             "with its entries, not a HOST-LEAK."),
    zombie_max_tokens: int = typer.Option(512, "--zombie-max-tokens", rich_help_panel=PANEL_URL, min=0,
                                          help="Black-box: max_tokens of the zombie check's early leavers, one "
                                               "request per client action after the waves (0 = no zombie check)."),
    replica: list[str] = typer.Option(None, "--replica", rich_help_panel=PANEL_FLEET,
                                      help="A replica behind the router given by --url (repeat per replica): "
                                           "traffic goes through the router, each replica gets its own verdict "
                                           "and every early leaver is reconciled hop by hop (docs/leak-check.md)."),
    router_metrics: str | None = typer.Option(None, "--router-metrics", rich_help_panel=PANEL_FLEET,
                                              help="With --replica: the router's own Prometheus page (vllm-router: "
                                                   "its --prometheus-port), for its per-worker routed and in-flight counts."),
    probes_per_replica: int = typer.Option(2, "--probes-per-replica", rich_help_panel=PANEL_FLEET, min=1,
                                           help="With --replica: early-leaving clients each replica must serve "
                                                "through the router, one at a time."),
    storm_requests: int = typer.Option(32, "--storm-requests", rich_help_panel=PANEL_URL, min=0,
                                       help="With --url: streamed requests of the abort storm after the replay, all "
                                            "cut at once; then the wedge probe (WEDGED) and the greedy output "
                                            "canary run before any abort (EMPTY-OUTPUT, OUTPUT-DRIFT). 0 = none."),
    wedge_timeout_s: float | None = typer.Option(None, "--wedge-timeout-s", rich_help_panel=PANEL_URL, min=0.1,
                                                 help="With --url: seconds a plain request may take after the abort "
                                                      "storm before the server is WEDGED (default: max(5, 10 x its "
                                                      "slowest run before any abort))."),
) -> None:
    """Find KV-cache leaks: replay a workload with client aborts, drain, and name the origin of every block left.

    Exit 0 CLEAN, 1 LEAK / ZOMBIE / HOST-LEAK / WEDGED / EMPTY-OUTPUT / OUTPUT-DRIFT, 4 CLEAN with no client abort exercised; every verdict,
    exit code and an example per mode are at the end of this help.
    """
    from vlite.cli.leak_check_target import connect_or_fail, run_target
    from vlite.diagnostics.targets.base import TargetPlan, default_wave
    from vlite.diagnostics.workload.actions import ABORT_MODES
    from vlite.engine import FAULTS

    console = common.make_console()
    inject_fault = engine_args.inject_faults
    from vlite.diagnostics.workload.sources import PROMPT_SOURCES

    if prompt_source not in PROMPT_SOURCES:
        common.fail(f"unknown --prompt-source {prompt_source!r}; choose one of: {', '.join(PROMPT_SOURCES)}")
    if abort_mode not in ABORT_MODES:
        common.fail(f"unknown --abort-mode {abort_mode!r}; choose one of: {', '.join(ABORT_MODES)}")
    for f in inject_fault:
        if f not in FAULTS:
            common.fail(f"unknown --inject-fault {f!r}; known faults: {', '.join(FAULTS)}")
    if not url and not prometheus and (blackbox or api_key or server_pid or server_kind != "auto"):
        common.fail("--blackbox, --api-key, --server-pid and --server-kind apply to a server: add --url")
    if not url and (storm_requests != 32 or wedge_timeout_s is not None):
        common.fail("--storm-requests and --wedge-timeout-s apply to a server's replay: add --url")
    if url and scenario:
        common.fail("--scenario runs in process; it cannot be combined with --url")
    if trace_allocations and (url or watch or prometheus or from_log is not None or scenario):
        common.fail("--trace-allocations traces this process's allocations: it applies to the in-process replay "
                    "only (not --url, --watch, --prometheus, --from-log or --scenario)")
    if trace_gpu_allocations and (watch or prometheus or from_log is not None or scenario or blackbox or api_key):
        common.fail("--trace-gpu-allocations reads the CUDA allocator of this process or of a vlite serve's engine "
                    "(--url to it, with --enable-debug-endpoints): not --watch, --prometheus, --from-log, --scenario, "
                    "--blackbox or --api-key")
    if cache_probe_requests is not None and (url or watch or prometheus or from_log is not None or scenario):
        common.fail("--cache-probe-requests applies to the in-process replay only (not --url, --watch, --prometheus, "
                    "--from-log or --scenario)")
    if url and inject_fault:
        common.fail("--inject-fault plants a fault in this process's engine; pass it to `vlite serve` instead")
    if replica or router_metrics:
        _fleet_or_fail(url, replica, router_metrics, blackbox or watch or prometheus or from_log is not None or scenario)
    interval_s = sample_interval_ms / 1000.0
    t_start = time.time()
    if report is not None:
        _check_writable(report)
    if server_log is not None and not watch:
        common.fail("--server-log follows a live server's log during --watch; add --watch (or read a log "
                    "after the fact with --from-log)")
    if not (watch or prometheus):  # their options alone would start a full replay instead
        given = [flag for flag, value, default in (("--duration", duration, None), ("--interval", interval, None),
                                                   ("--stuck-after", stuck_after, 300.0), ("--job", job, None),
                                                   ("--since", since, "6h"), ("--instance", instance, None),
                                                   ("--instance-label", instance_label, "instance"))
                 if value != default]
        if given:
            common.fail(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --watch or --prometheus; add one of them (or drop "
                        f"{'it' if len(given) == 1 else 'them'})")
    if prometheus and url:
        common.fail("--prometheus reads a range Prometheus stored; --url is for a live server: pick one")
    if (watch or prometheus) and from_log is not None:
        common.fail("--from-log reads a server's log; it cannot be combined with --watch or --prometheus")
    if watch or prometheus:
        if watch and prometheus:
            common.fail("--watch scrapes a live server (--url), --prometheus reads a stored range: pick one")
        if watch and not url:
            common.fail("--watch needs --url (the server to watch)")
        if server_log is not None and not server_log.is_file():
            common.fail(f"--server-log {server_log}: no such file (give the log file the server writes)")
        if prometheus:
            from vlite.diagnostics.targets.prometheus_range import PrometheusTarget

            try:
                target = PrometheusTarget(prometheus, job, since, instance=instance, server_kind=server_kind,
                                          step_s=interval, stuck_after_s=stuck_after, label=instance_label)
            except ValueError as exc:
                common.fail(str(exc))
        else:
            from vlite.diagnostics.targets.watch import WatchTarget

            target = WatchTarget(connect_or_fail(url, server_kind, api_key), interval_s=interval or 1.0,
                                 duration_s=duration, stuck_after_s=stuck_after, server_pid=server_pid,
                                 server_log=server_log)
        sys.exit(run_target(target, TargetPlan(), console, report))
    if from_log is not None:
        from vlite.diagnostics.targets.from_log import LogTarget

        sys.exit(run_target(LogTarget(from_log), TargetPlan(), console, report))
    from vlite.diagnostics.workload.all_paths import DEFAULT_MAX_NUM_BATCHED_TOKENS

    if max_num_batched_tokens is None:
        max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS if workload == "all-paths" and not scenario else 2048
    engine_args.max_num_batched_tokens, engine_args.seed = max_num_batched_tokens, seed
    zombie_options = {"threshold_s": zombie_threshold_s, "threshold_steps": zombie_threshold_steps}

    if scenario:
        sys.exit(_run_scenarios(scenario, console, report, engine_args, interval_s, zombie_options))

    # Five waves: enough troughs for the fit, and few enough drains to keep batches full; at
    # least 16 requests a wave (or all of a small trace), so that a wave can preempt.
    n_specs = num_requests if workload in ("synthetic", "all-paths") else None
    if workload == "kind-waves" and idle_every is None:  # one idle point after each one-kind wave
        from vlite.diagnostics.workload.kind_waves import kind_wave_size

        idle_every = kind_wave_size(num_requests)
    specs = _load_workload(workload, num_requests, _range(input_len, "--input-len"),
                           _range(output_len, "--output-len"), request_rate, abort_rate, abort_mode, seed,
                           count_tokens=None, n=n, in_process=url is None,
                           wave_size=default_wave(n_specs, idle_every) if n_specs else None, prompt_source=prompt_source)
    every = default_wave(len(specs), idle_every)
    if url:
        from vlite.diagnostics.workload.actions import IN_PROCESS_ONLY

        bad = next((s for s in specs if s.action.kind in IN_PROCESS_ONLY), None)
        if bad is not None:
            common.fail(f"request {bad.request_id}: client action {bad.action.kind!r} needs the in-process target "
                        "(a client cannot see a preemption over HTTP); drop --url or change the action")
    info = {"workload": workload, "prompt_source": prompt_source, "abort_rate": abort_rate, "abort_mode": abort_mode, "seed": seed,
            "max_concurrency": max_concurrency, "idle_every": every, "sample_interval_ms": sample_interval_ms}
    plan = TargetPlan(specs=specs, max_concurrency=max_concurrency, idle_every=idle_every, sample_interval_s=interval_s,
                      seed=seed, abort_rate=abort_rate, abort_mode=abort_mode, trace=workload.endswith(".jsonl"),
                      zombie_options=zombie_options, info=info, trace_allocations=trace_allocations,
                      trace_gpu_allocations=trace_gpu_allocations,
                      cache_probe_requests=cache_probe_requests)
    if replica:
        from vlite.cli.leak_check_fleet import run_fleet
        from vlite.diagnostics.targets.fleet import FleetOptions

        specs = _load_workload("synthetic", num_requests, _range(input_len, "--input-len"),
                               _range(output_len, "--output-len"), request_rate, abort_rate, abort_mode, seed,
                               count_tokens=None, in_process=False)
        opts = FleetOptions(url, list(replica), router_metrics=router_metrics, api_key=api_key, specs=specs,
                            max_concurrency=max_concurrency, probes_per_replica=probes_per_replica,
                            max_tokens=zombie_max_tokens or 128, drain_timeout_s=drain_timeout,
                            threshold_s=zombie_threshold_s, threshold_steps=zombie_threshold_steps,
                            storm_requests=storm_requests, wedge_timeout_s=wedge_timeout_s)
        sys.exit(run_fleet(opts, console, report))
    if url:
        conn = connect_or_fail(url, server_kind, api_key)
        if blackbox or conn.adapter.kind != "vlite" or api_key:
            if trace_gpu_allocations:
                common.fail(f"--trace-gpu-allocations needs a vlite serve (its /debug/gpu_allocations); {url} looks "
                            f"like {conn.adapter.kind}")
            from vlite.diagnostics.targets.blackbox import BlackboxTarget

            target = BlackboxTarget(conn, url=url, drain_timeout_s=drain_timeout, bisect_budget_s=bisect_budget,
                                    server_pid=server_pid, zombie_max_tokens=zombie_max_tokens,
                                    storm_requests=storm_requests, wedge_timeout_s=wedge_timeout_s)
        else:
            from vlite.diagnostics.targets.http import HttpTarget

            target = HttpTarget(url, storm_requests=storm_requests, wedge_timeout_s=wedge_timeout_s)
    else:
        from vlite.diagnostics.targets.inprocess import InProcessTarget
        from vlite.diagnostics.workload.all_paths import suggest_num_blocks

        if workload == "all-paths" and engine_args.num_blocks is None and engine_args.kv_cache_memory_bytes is None:
            # small enough to preempt
            engine_args.num_blocks = suggest_num_blocks(specs, every, engine_args.block_size)
        target = InProcessTarget(common.load_engine(common.create_engine_config(engine_args)))
    sys.exit(run_target(target, plan, console, report, t_start=t_start))


def _fleet_or_fail(url, replica, router_metrics, other_mode) -> None:
    """The fleet mode's option checks: --replica needs --url (the router), and no other mode."""
    if not replica:
        common.fail("--router-metrics applies to a fleet: add --replica URL (one per replica)")
    if not url:
        common.fail("--replica needs --url: the router in front of the replicas")
    if other_mode:
        common.fail("--replica runs the fleet check; it cannot be combined with --blackbox, --watch, --prometheus, "
                    "--from-log or --scenario")
    if url.rstrip("/") in [r.rstrip("/") for r in replica]:
        common.fail(f"--url {url} is also a --replica: --url is the router in front of the replicas")


def _check_writable(report: Path) -> None:
    """Fail (exit 2) before the run if the report directory cannot be created or written."""
    import tempfile

    try:
        report.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=report, prefix=".write-check-"):
            pass
    except OSError as exc:
        common.fail(f"cannot write the report to {report}: {exc}")


def _load_workload(workload, num_requests, input_len, output_len, request_rate, abort_rate, abort_mode, seed,
                   count_tokens, n=1, in_process=True, wave_size=None, prompt_source="word-list"):
    from vlite.diagnostics.workload import sources as wl

    if n != 1 and workload != "synthetic":
        common.fail(f"--n applies to --workload synthetic; {workload} sets each request's n itself "
                    "(all-paths and kind-waves send n > 1 requests of their own, a trace its rows' n)")
    try:
        if workload == "all-paths":
            from vlite.diagnostics.workload.all_paths import all_paths_workload

            return all_paths_workload(num_requests, input_len=input_len, output_len=output_len,
                                      request_rate=request_rate, abort_rate=abort_rate, abort_mode=abort_mode,
                                      seed=seed, in_process=in_process, wave_size=wave_size,
                                      prompt_source=prompt_source)
        if workload == "kind-waves":  # waves of one request kind each (checks/kind_growth.py)
            from vlite.diagnostics.workload.kind_waves import kind_waves_workload

            specs = kind_waves_workload(num_requests, input_len=input_len, output_len=output_len, seed=seed)
            if len(specs) != num_requests:  # whole rounds of one wave per kind, at least MIN_ROUNDS
                from vlite.diagnostics.workload.kind_waves import KINDS, MIN_ROUNDS

                typer.echo(f"--workload kind-waves: {len(specs)} requests, not {num_requests}: whole rounds of one wave "
                           f"per kind ({len(KINDS)} kinds), at least {MIN_ROUNDS} rounds", err=True)
            return specs
        if workload == "synthetic":
            return wl.synthetic_workload(num_requests, input_len=input_len, output_len=output_len,
                                         request_rate=request_rate, abort_rate=abort_rate, abort_mode=abort_mode,
                                         seed=seed, n=n, prompt_source=prompt_source)
        path = Path(workload)
        if path.is_dir():
            common.fail(f"--workload {workload} is a directory; give all-paths, synthetic, kind-waves, a JSONL trace (.jsonl) "
                        "or a ShareGPT file (.json)")
        if not path.is_file():
            common.fail(f"--workload {workload}: not all-paths, synthetic or kind-waves, and no such file")
        if path.suffix == ".jsonl":
            return wl.jsonl_workload(path, abort_rate=abort_rate, abort_mode=abort_mode, seed=seed,
                                     warn=common.warn)
        return wl.sharegpt_workload(path, num_requests, count_tokens=count_tokens, max_output_len=output_len[1],
                                    request_rate=request_rate, abort_rate=abort_rate, abort_mode=abort_mode,
                                    seed=seed)
    except ValueError as exc:
        common.fail(str(exc))


def _run_scenarios(name, console, report, engine_args: EngineArgs, interval_s, zombie_options=None) -> int:
    from rich.table import Table

    from vlite.cli.leak_check_target import finish
    from vlite.diagnostics.scenarios import SCENARIOS, run_scenario
    from vlite.diagnostics.targets.base import TargetRun
    from vlite.engine import ModelNotFoundError, load_checkpoint

    if name != "all" and name not in SCENARIOS:
        common.fail(f"unknown --scenario {name!r}; choose 'all' or one of: {', '.join(SCENARIOS)}")
    chosen = list(SCENARIOS.values()) if name == "all" else [SCENARIOS[name]]
    # Each scenario plants the faults itself (run_scenario), so the config carries none.
    faults, model = engine_args.inject_faults, engine_args.model
    config = common.create_engine_config(dataclasses.replace(engine_args, inject_faults=()))
    try:
        with common.err_console.status(f"Loading {model} ..."):
            ckpt = load_checkpoint(model)
    except (ModelNotFoundError, ValueError) as exc:
        common.fail(str(exc))
    table = Table(title="leak-check scenarios", title_justify="left")
    for col in ("scenario", "result", "verdict", "failed checks"):
        table.add_column(col, overflow="fold")
    failed = 0
    for sc in chosen:
        res = run_scenario(sc, ckpt, config, faults, interval_s, zombie_options)
        failed += not res.passed
        bad = "; ".join(f"{what}: {detail}" for what, ok, detail in res.checks if not ok)
        table.add_row(sc.name, "[green]pass[/]" if res.passed else "[red]FAIL[/]", res.run.findings.summary(caveat=False), bad)
        console.print(f"{sc.name}: {'pass' if res.passed else 'FAIL'} - {res.run.findings.summary(caveat=False)}",
                      highlight=False)
        if not res.passed:
            console.rule(f"{sc.name}: {sc.description}")
            finish(TargetRun.of_run_result("in-process", res.run), console, report / sc.name if report else None)
        elif report:
            finish(TargetRun.of_run_result("in-process", res.run), Console(quiet=True), report / sc.name)
    console.print(table)
    console.print(f"{len(chosen) - failed}/{len(chosen)} scenarios passed", highlight=False)
    return 1 if failed else 0
