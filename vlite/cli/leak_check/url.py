"""``vlite leak-check url --url U`` and ``vlite leak-check blackbox --url U``: replay a workload with
client aborts against a running server, then the abort storm (wedge probe, output canary).

``url`` reads a vlite serve's own ledger and uses /metrics and process memory only (black box)
for any other server or with ``--api-key``; ``blackbox`` always does."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import typer

from vlite.cli import common
from vlite.cli.leak_check import options as o

GPU_TRACE = {
    "trace_gpu_allocations": (bool, typer.Option(
        False, "--trace-gpu-allocations", rich_help_panel=o.PANEL_SERVER,
        help="A vlite serve started with --enable-debug-endpoints: name the CUDA allocation sites whose live "
             "GPU bytes grew between the idle points.")),
}


def _server_replay(w, srv, storm, bb, out, *, blackbox: bool, trace_gpu: bool = False) -> None:
    from vlite.cli.leak_check.workload import build_plan
    from vlite.cli.leak_check_target import connect_or_fail, run_target
    from vlite.diagnostics.workload.actions import IN_PROCESS_ONLY

    t_start = time.time()
    if not srv.url:
        common.fail("this mode needs --url: the server to check (http://host:port)")
    o.check_choices(w)
    o.check_writable(out.report)
    plan = build_plan(w, in_process=False, trace_gpu_allocations=trace_gpu)
    bad = next((s for s in plan.specs if s.action.kind in IN_PROCESS_ONLY), None)
    if bad is not None:
        common.fail(f"request {bad.request_id}: client action {bad.action.kind!r} needs the in-process target "
                    "(a client cannot see a preemption over HTTP); use `vlite leak-check replay` or change the action")
    conn = connect_or_fail(srv.url, srv.server_kind, srv.api_key)
    if blackbox or conn.adapter.kind != "vlite" or srv.api_key:
        if trace_gpu:
            common.fail(f"--trace-gpu-allocations needs a vlite serve (its /debug/gpu_allocations); {srv.url} looks "
                        f"like {conn.adapter.kind}")
        from vlite.diagnostics.targets.blackbox import BlackboxTarget

        target = BlackboxTarget(conn, url=srv.url, drain_timeout_s=bb.drain_timeout, bisect_budget_s=bb.bisect_budget,
                                server_pid=srv.server_pid, zombie_max_tokens=bb.zombie_max_tokens,
                                storm_requests=storm.storm_requests, wedge_timeout_s=storm.wedge_timeout_s)
    else:
        from vlite.diagnostics.targets.http import HttpTarget

        target = HttpTarget(srv.url, storm_requests=storm.storm_requests, wedge_timeout_s=storm.wedge_timeout_s)
    sys.exit(run_target(target, plan, common.make_console(), out.report, t_start=t_start))


@o.with_group("out", o.REPORT)
@o.with_group("gpu", GPU_TRACE)
@o.with_group("bb", o.BLACKBOX)
@o.with_group("storm", o.STORM)
@o.with_group("srv", o.server(o.URL_HELP))
@o.with_group("w", o.WORKLOAD)
def url(w: SimpleNamespace = None, srv: SimpleNamespace = None, storm: SimpleNamespace = None,
        bb: SimpleNamespace = None, gpu: SimpleNamespace = None, out: SimpleNamespace = None) -> None:
    """Replay with client aborts against a running server, then the abort storm."""
    _server_replay(w, srv, storm, bb, out, blackbox=False, trace_gpu=gpu.trace_gpu_allocations)


@o.with_group("out", o.REPORT)
@o.with_group("bb", o.BLACKBOX)
@o.with_group("storm", o.STORM)
@o.with_group("srv", o.server(o.URL_HELP))
@o.with_group("w", o.WORKLOAD)
def blackbox(w: SimpleNamespace = None, srv: SimpleNamespace = None, storm: SimpleNamespace = None,
             bb: SimpleNamespace = None, out: SimpleNamespace = None) -> None:
    """Like url, reading only /metrics and the server's memory (vLLM, SGLang, ...)."""
    _server_replay(w, srv, storm, bb, out, blackbox=True)
