"""``vlite leak-check replay`` (also the bare ``vlite leak-check``): replay a workload with client
aborts on an engine in this process, drain, and name the origin of every KV block left."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import typer

from vlite.cli import common
from vlite.cli.leak_check import options as o
from vlite.engine import EngineArgs

IN_PROCESS = {
    "max_num_batched_tokens": (int | None, typer.Option(
        None, "--max-num-batched-tokens", rich_help_panel=o.PANEL_INPROC, min=1,
        help="Token budget of one step (default 128 for the all-paths workload, so long prompts are chunked; "
             "else 2048).")),
    "trace_allocations": (bool, typer.Option(
        False, "--trace-allocations", rich_help_panel=o.PANEL_INPROC,
        help="Trace Python allocations over the replay (tracemalloc) and name the sites that kept growing "
             "between the idle points (HOST-LEAK attribution; the replay takes about 10% longer).")),
    "trace_gpu_allocations": (bool, typer.Option(
        False, "--trace-gpu-allocations", rich_help_panel=o.PANEL_INPROC,
        help="On CUDA: record the allocator's history with Python stacks and name the allocation sites whose "
             "live GPU bytes grew between the idle points, per request. Without CUDA the report says so.")),
    "cache_probe_requests": (int | None, typer.Option(
        None, "--cache-probe-requests", rich_help_panel=o.PANEL_INPROC, min=0,
        help="When a container keeps growing: the cache-versus-leak probe sends the first wave again, repeated "
             "and then with distinct prompts, at most this many distinct requests (default: twice "
             "--num-requests, at least 128; 0: no probe). A container that levels off is a bounded cache.")),
}


def validate_engine_args(engine_args: EngineArgs, max_num_batched_tokens: int | None, all_paths: bool) -> None:
    """Set the step budget and check every engine option before anything heavy is imported: a bad
    one is one line (exit 2) naming its flag."""
    from vlite.diagnostics.workload.all_paths import DEFAULT_MAX_NUM_BATCHED_TOKENS

    if max_num_batched_tokens is None:
        max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS if all_paths else 2048
    engine_args.max_num_batched_tokens = max_num_batched_tokens
    common.create_engine_config(engine_args)


@common.engine_args_options(include_faults=True, panel=o.PANEL_ENGINE, help_extra=o.ENGINE_HELP)
@o.with_group("inproc", IN_PROCESS)
@o.with_group("out", o.REPORT)
@o.with_group("w", o.WORKLOAD)
def replay(w: SimpleNamespace = None, out: SimpleNamespace = None, inproc: SimpleNamespace = None,
           engine_args: EngineArgs = None) -> None:
    """Replay with client aborts in this process (the default); name every block left."""
    from vlite.cli.leak_check_target import run_target

    t_start = time.time()
    o.check_choices(w)
    engine_args.seed = w.seed
    validate_engine_args(engine_args, inproc.max_num_batched_tokens, w.workload == "all-paths")
    o.check_writable(out.report)
    plan = _plan(w, inproc)
    from vlite.diagnostics.targets.inprocess import InProcessTarget
    from vlite.diagnostics.workload.all_paths import suggest_num_blocks

    if w.workload == "all-paths" and engine_args.num_blocks is None and engine_args.kv_cache_memory_bytes is None:
        # small enough to preempt
        engine_args.num_blocks = suggest_num_blocks(plan.specs, plan.info["idle_every"], engine_args.block_size)
    target = InProcessTarget(common.load_engine(common.create_engine_config(engine_args)))
    sys.exit(run_target(target, plan, common.make_console(), out.report, t_start=t_start))


def _plan(w: SimpleNamespace, inproc: SimpleNamespace):
    """The in-process replay's plan."""
    from vlite.cli.leak_check.workload import build_plan

    return build_plan(w, in_process=True, trace_allocations=inproc.trace_allocations,
                      trace_gpu_allocations=inproc.trace_gpu_allocations,
                      cache_probe_requests=inproc.cache_probe_requests)
