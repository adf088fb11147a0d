"""``vlite leak-check scenario NAME``: run a fixed scenario (``all``: every one) in process, each
planting its own faults and checking its own expectations."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import typer
from rich.console import Console

from vlite.cli import common
from vlite.cli.leak_check import options as o
from vlite.cli.leak_check.replay import IN_PROCESS, validate_engine_args
from vlite.engine import EngineArgs

# The fixed scenarios' names (vlite/diagnostics/scenarios.py SCENARIOS; a test keeps the two equal).
# Listed here so that --help shows them without importing the engine.
SCENARIO_NAMES = ("abort-waiting", "abort-chunked-prefill", "disconnect-mid-stream", "non-streaming-disconnect",
                  "abort-preempted", "preempted-in-prefill", "raise-in-step", "never-fits", "repeated-short",
                  "n-samples-abort", "beam-under-pressure", "shared-prefix-aborts", "stop-strings", "chat-eos",
                  "preempted-resumed-aborted")
RUN = {k: o.WORKLOAD[k] for k in ("seed", "sample_interval_ms", "zombie_threshold_steps", "zombie_threshold_s")}
RUN["max_num_batched_tokens"] = IN_PROCESS["max_num_batched_tokens"]


@common.engine_args_options(include_faults=True, panel=o.PANEL_ENGINE)
@o.with_group("out", o.REPORT)
@o.with_group("r", RUN)
def scenario(name: str = typer.Argument(..., metavar="NAME", help=f"all, or one of: {', '.join(SCENARIO_NAMES)}."),
             r: SimpleNamespace = None, out: SimpleNamespace = None, engine_args: EngineArgs = None) -> None:
    """Run a fixed scenario in process (all: every one); exit 1 when one fails."""
    engine_args.seed = r.seed
    validate_engine_args(engine_args, r.max_num_batched_tokens, all_paths=False)
    if name != "all" and name not in SCENARIO_NAMES:
        common.fail(f"unknown scenario {name!r}; choose 'all' or one of: {', '.join(SCENARIO_NAMES)}")
    o.check_writable(out.report)
    zombie = {"threshold_s": r.zombie_threshold_s, "threshold_steps": r.zombie_threshold_steps}
    sys.exit(run_scenarios(name, common.make_console(), out.report, engine_args, r.sample_interval_ms / 1000.0,
                           zombie))


def run_scenarios(name, console, report, engine_args: EngineArgs, interval_s, zombie_options=None) -> int:
    """Run the scenario ``name`` (or ``all``), print a table of results; 1 when one failed, else 0."""
    from rich.table import Table

    from vlite.cli.leak_check_target import finish
    from vlite.diagnostics.scenarios import SCENARIOS, run_scenario
    from vlite.diagnostics.targets.base import TargetRun

    chosen = list(SCENARIOS.values()) if name == "all" else [SCENARIOS[name]]
    # Each scenario plants the faults itself (run_scenario), so the config carries none.
    faults = engine_args.inject_faults
    config = common.create_engine_config(dataclasses.replace(engine_args, inject_faults=()))
    ckpt = _load(engine_args.model)
    table = Table(title="leak-check scenarios", title_justify="left")
    for col in ("scenario", "result", "verdict", "failed checks"):
        table.add_column(col, overflow="fold")
    failed = 0
    for sc in chosen:
        res = run_scenario(sc, ckpt, config, faults, interval_s, zombie_options)
        failed += not res.passed
        bad = "; ".join(f"{what}: {detail}" for what, ok, detail in res.checks if not ok)
        summary = res.run.findings.summary(caveat=False)
        table.add_row(sc.name, "[green]pass[/]" if res.passed else "[red]FAIL[/]", summary, bad)
        console.print(f"{sc.name}: {'pass' if res.passed else 'FAIL'} - {summary}", highlight=False)
        run = TargetRun.of_run_result("in-process", res.run)
        if not res.passed:
            console.rule(f"{sc.name}: {sc.description}")
            finish(run, console, report / sc.name if report else None)
        elif report:
            finish(run, Console(quiet=True), report / sc.name)
    console.print(table)
    console.print(f"{len(chosen) - failed}/{len(chosen)} scenarios passed", highlight=False)
    return 1 if failed else 0


def _load(model: str):
    from vlite.engine import ModelNotFoundError, load_checkpoint

    try:
        with common.err_console.status(f"Loading {model} ..."):
            return load_checkpoint(model)
    except (ModelNotFoundError, ValueError) as exc:
        common.fail(str(exc))
