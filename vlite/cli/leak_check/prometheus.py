"""``vlite leak-check prometheus --prometheus P --job J --since 6h``: judge a range a Prometheus
server stored, a verdict per replica of the job."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import typer

from vlite.cli import common
from vlite.cli.leak_check import options as o
from vlite.cli.leak_check.watch import STUCK

PROM = {
    "prometheus": (str | None, typer.Option(None, "--prometheus", rich_help_panel=o.PANEL_MODE,
                                            help="The Prometheus server's URL.")),
    "job": (str | None, typer.Option(None, "--job", rich_help_panel=o.PANEL_MODE,
                                     help="The scrape job of the inference server.")),
    "since": (str, typer.Option("6h", "--since", rich_help_panel=o.PANEL_MODE,
                                help="How far back, e.g. 90s, 30m, 6h, 2d.")),
    "instance": (str | None, typer.Option(None, "--instance", rich_help_panel=o.PANEL_MODE, help=(
        "Judge only this replica (default: every replica of the job, a verdict each, never an average)."))),
    "instance_label": (str, typer.Option("instance", "--instance-label", rich_help_panel=o.PANEL_MODE, help=(
        "The label that tells the job's replicas apart (instance, or e.g. pod on Kubernetes)."))),
    "interval": (float | None, typer.Option(None, "--interval", rich_help_panel=o.PANEL_MODE, min=0.01,
                                            help="The query step, seconds (default: the interval Prometheus stored the samples at, else 15).")),
    **STUCK,
    "server_kind": (str, typer.Option("auto", "--server-kind", rich_help_panel=o.PANEL_MODE, help=(
        "auto (from the series), vlite, vllm, sglang, llamacpp, tgi or trtllm."))),
}


@o.with_group("out", o.REPORT)
@o.with_group("p", PROM)
def prometheus(p: SimpleNamespace = None, out: SimpleNamespace = None) -> None:
    """Judge a range a Prometheus server stored: a verdict per replica of the job."""
    from vlite.cli.leak_check_target import run_target
    from vlite.diagnostics.targets.base import TargetPlan
    from vlite.diagnostics.targets.prometheus_range import PrometheusTarget

    if not p.prometheus:
        common.fail("prometheus needs --prometheus URL (the Prometheus server) and --job")
    o.check_writable(out.report)
    try:
        target = PrometheusTarget(p.prometheus, p.job, p.since, instance=p.instance, server_kind=p.server_kind,
                                  step_s=p.interval, stuck_after_s=p.stuck_after, label=p.instance_label)
    except ValueError as exc:
        common.fail(str(exc))
    sys.exit(run_target(target, TargetPlan(), common.make_console(), out.report))
