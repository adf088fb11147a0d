"""``vlite leak-check fleet --url ROUTER --replica A --replica B``: traffic through the router,
a verdict per replica and the router's, every early leaver reconciled hop by hop."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import typer

from vlite.cli import common
from vlite.cli.leak_check import options as o

FLEET = {
    "replica": (list[str], typer.Option(None, "--replica", rich_help_panel=o.PANEL_MODE, help=(
        "A replica behind the router (repeat per replica): each gets its own verdict."))),
    "router_metrics": (str | None, typer.Option(None, "--router-metrics", rich_help_panel=o.PANEL_MODE, help=(
        "The router's own Prometheus page (vllm-router: its --prometheus-port), for its per-worker counts."))),
    "probes_per_replica": (int, typer.Option(2, "--probes-per-replica", rich_help_panel=o.PANEL_MODE, min=1, help=(
        "Early-leaving clients each replica must serve through the router, one at a time."))),
}
TRAFFIC = {**o.TRAFFIC, "zombie_threshold_steps": o.WORKLOAD["zombie_threshold_steps"], **o.ZOMBIE_S}


def _check(url: str | None, replica: list[str]) -> None:
    if not replica:
        common.fail("fleet needs --replica URL (one per replica behind the router)")
    if not url:
        common.fail("--replica needs --url: the router in front of the replicas")
    if url.rstrip("/") in [r.rstrip("/") for r in replica]:
        common.fail(f"--url {url} is also a --replica: --url is the router in front of the replicas")


@o.with_group("out", o.REPORT)
@o.with_group("storm", o.STORM)
@o.with_group("bb", {k: o.BLACKBOX[k] for k in ("drain_timeout", "zombie_max_tokens")})
@o.with_group("f", FLEET)
@o.with_group("srv", o.server("The router in front of the replicas, http://host:port.", pid=False, kind=False))
@o.with_group("w", TRAFFIC)
def fleet(w: SimpleNamespace = None, srv: SimpleNamespace = None, f: SimpleNamespace = None,
          bb: SimpleNamespace = None, storm: SimpleNamespace = None, out: SimpleNamespace = None) -> None:
    """Check a fleet through its router: a verdict per replica and the router's."""
    from vlite.cli.leak_check.workload import load_workload
    from vlite.cli.leak_check_fleet import run_fleet
    from vlite.diagnostics.targets.fleet import FleetOptions

    _check(srv.url, f.replica)
    o.check_choices(w)
    o.check_writable(out.report)
    specs = load_workload(w, workload="synthetic", in_process=False)
    opts = FleetOptions(srv.url, list(f.replica), router_metrics=f.router_metrics, api_key=srv.api_key, specs=specs,
                        max_concurrency=w.max_concurrency, probes_per_replica=f.probes_per_replica,
                        max_tokens=bb.zombie_max_tokens or 128, drain_timeout_s=bb.drain_timeout,
                        threshold_s=w.zombie_threshold_s, threshold_steps=w.zombie_threshold_steps,
                        storm_requests=storm.storm_requests, wedge_timeout_s=storm.wedge_timeout_s)
    sys.exit(run_fleet(opts, common.make_console(), out.report))
