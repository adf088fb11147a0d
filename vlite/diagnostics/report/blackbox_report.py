"""Reports of a black-box check or a ``--from-log`` post-mortem: the terminal verdict (Rich) and
the report directory: report.json, samples.csv, report.md (with the reproducer as curl
commands), report.html (one file, plots embedded), reproducer.jsonl and PNG plots.
The schema of report.json is documented in docs/leak-check.md.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
from rich.console import Console
from rich.markup import escape

from vlite.diagnostics.checks import engine_errors
from vlite.diagnostics.checks.storm import lines as storm_lines
from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.report.plots import save_figure
from vlite.diagnostics.report.writer import REPORT_VERSION, md_table, trend_line, write_report_dir
from vlite.diagnostics.targets.blackbox import BlackboxResult, action_text
from vlite.diagnostics.targets.zombie_blackbox import lines as zombie_lines

MIB = 1 << 20


def _v(value) -> str:
    """A value for the report's words: "n/a" where it was not read."""
    return "n/a" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _fmt_trend(t) -> str:
    return trend_line(t).replace("num_used_blocks", "kv_used")


def print_blackbox_verdict(res: BlackboxResult, console: Console, prefix: str = "") -> None:
    """The one-line verdict (LEAK red, INCONCLUSIVE yellow, CLEAN green)."""
    color = {Verdict.CLEAN: "green", Verdict.LEAK: "red", Verdict.ZOMBIE: "red", Verdict.INCONCLUSIVE: "yellow",
             Verdict.WEDGED: "red", Verdict.EMPTY_OUTPUT: "red", Verdict.OUTPUT_DRIFT: "red",
             Verdict.ENGINE_ERROR: "red"}[res.verdict]
    console.print(f"[bold {color}]{escape(prefix + res.summary)}[/]", highlight=False)


def print_blackbox(res: BlackboxResult, console: Console | None = None) -> None:
    """The verdict line, the residual, the fit and suspects, the trends and the notes."""
    console = console or Console()
    print_blackbox_verdict(res, console)
    bs = f", block_size {res.block_size} tokens (read from the server)" if res.block_size else ""
    total = f" of {res.kv_total:g}" if res.kv_total else ""
    console.print(f"server: {res.server_kind}{bs}; KV used in {res.unit}{total}", highlight=False)
    console.print(kv_moments(res), highlight=False)
    if res.probes:
        last = res.probes[-1]
        console.print(f"probes: {len(res.probes)} 1-token requests, each after an idle point; the last one (after "
                      f"{last['after']}): KV used {_v(last['kv_used_before'])} -> {_v(last['kv_used_after'])} "
                      f"{res.unit}", highlight=False)
    for s in res.suspects:
        per = next(v for k, v in s.items() if k.endswith("per_request"))
        console.print(f"suspect: {s['client_action']}: {per:g} {res.unit}/request (95% CI {s['ci95'][0]:g} .. "
                      f"{s['ci95'][1]:g}); minimal set {s['request_ids'] or '(not reproduced)'}", highlight=False)
    for t in res.trends:
        console.print(_fmt_trend(t), highlight=False)
    for line in zombie_lines(res.zombies):
        console.print(f"zombie check: {line}", highlight=False)
    for line in storm_lines(res.storm):
        console.print(f"storm check: {line}", highlight=False)
    for line in engine_errors.lines(res.replay.engine_errors):  # one line each; report.json has the traceback
        console.print(line.replace("engine raised", "server failed", 1), highlight=False, markup=False, style="red")
    for n in res.notes:
        console.print(f"[yellow]note:[/] {n}", highlight=False)


def kv_moments(res: BlackboxResult) -> str:
    """KV used at each moment the report names, in the server's unit: the baseline, after the
    waves (what the verdict judged) and when the check ended (after bisection, zombie and storm
    requests, which may leak more)."""
    if res.source == "log":
        return (f"KV used at idle ({res.unit}): {_v(res.baseline)} in an empty cache -> {_v(res.final)}, the least "
                "in the log's last idle stretch")
    line = (f"KV used at idle ({res.unit}): baseline {_v(res.baseline)} -> {_v(res.final)} after the waves "
            f"(the verdict's reading, residual {_v(res.residual)})")
    if res.kv_at_end is not None and res.kv_at_end != res.final:
        line += (f"; {_v(res.kv_at_end)} {res.unit} when the check ended (bisection, zombie and storm requests ran "
                 "after the verdict's reading)")
    return line


def report_dict(res: BlackboxResult) -> dict:
    """The machine-readable report (report.json)."""
    outcomes: dict[str, int] = {}
    for r in res.replay.requests:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    trends = []
    for t in res.trends:
        d = asdict(t)
        d["rising"] = t.rising
        if d["metric"] == "num_used_blocks":
            d["metric"] = f"kv_used ({res.unit})"
        trends.append(d)
    return {"version": REPORT_VERSION, "verdict": res.verdict, "summary": res.summary, "server_kind": res.server_kind,
            "source": res.source, "run": res.info,
            "drain": {"unit": res.unit, "block_size": res.block_size, "kv_total": res.kv_total,
                      "baseline": res.baseline, "final": res.final, "residual": res.residual,
                      "kv_at_end": res.kv_at_end,
                      "probes": res.probes},
            "trends": trends,
            "cardinality": res.cardinality,  # /metrics series per family (checks/cardinality.py)
            "blackbox": {"suspects": res.suspects, "fit": res.fit, "bisection": res.bisection,
                         "reproducer": [_trace_row(s) for s in res.reproducer]},
            "zombies": res.zombies, "storm": res.storm, "process_tree": res.process_tree, "notes": res.notes,
            "engine_errors": res.replay.engine_errors,
            "client": {"outcomes": outcomes, "requests": [asdict(r) for r in res.replay.requests]},
            "idle_points": [asdict(p) | {"kv_used": p.num_used_blocks} for p in res.replay.idle_points]}


def _trace_row(spec) -> dict:
    # The prompt starts with the request id: it misses the prefix cache, whose leaked blocks a plain
    # replay of the same prompt would reuse instead of leaking new ones.
    row = {"arrival_s": 0.0, "request_id": f"repro-{spec.request_id}", "prompt": f"repro-{spec.request_id} {spec.prompt}",
           "max_tokens": spec.max_tokens, "client_action": action_text(spec.action),
           "temperature": spec.temperature, "ignore_eos": spec.ignore_eos}
    if spec.n != 1:
        row["n"] = spec.n
    return row


def curl_command(spec, base_url: str) -> str:
    """A curl command that approximates the request's client action (see docs/leak-check.md)."""
    a = spec.action
    body = {"prompt": f"repro-{spec.request_id} {spec.prompt}", "max_tokens": spec.max_tokens,
            "temperature": spec.temperature, "ignore_eos": spec.ignore_eos, "stream": a.streams}
    head = (f"curl -sN {base_url}/v1/completions -H 'Content-Type: application/json' "
            f"-H 'X-Request-Id: repro-{spec.request_id}'")
    data = f"-d {shlex.quote(json.dumps(body))}"
    if a.kind == "abort-waiting":
        return f"{head} --max-time 0.01 {data}"
    if a.kind == "abort-prefill":
        return f"{head} --max-time 0.05 {data}  # closes before the first token"
    if a.kind in ("abort-after-tokens", "disconnect-stream"):
        return f"{head} {data} | head -n {2 * a.after_tokens}  # closes after {a.after_tokens} chunks"
    if a.kind == "client-timeout":
        return f"{head} --max-time {a.timeout_s} {data}"
    return f"{head} {data}"


def report_markdown(res: BlackboxResult, plots: list[str]) -> str:
    base = res.info.get("url", "http://127.0.0.1:8000")
    unit_key = f"{res.unit}_per_request" if res.unit in ("blocks", "tokens") else "per_request"
    suspects = [s | {"ci95": f"{s['ci95'][0]:g} .. {s['ci95'][1]:g}", "request_ids": ", ".join(s["request_ids"])}
                for s in res.suspects]
    fit = [r | {"ci95": f"{r['ci95'][0]:.3g} .. {r['ci95'][1]:.3g}", "per_request": f"{r['per_request']:.3g}"}
           for r in res.fit]
    out = [f"# vlite leak-check report ({res.source}: {res.server_kind})\n", f"**{res.verdict}**: "
           f"{res.summary.split(': ', 1)[-1]}\n", "## Run\n",
           md_table([{"key": k, "value": v} for k, v in res.info.items()], ("key", "value"), 100),
           "## Drain (KV used at idle, after a 1-token probe)\n",
           f"unit: {res.unit}; block_size: {_v(res.block_size)}"
           f"{' (read from the server)' if res.block_size else ' (the server does not say)'}; pool: {_v(res.kv_total)}; "
           f"{kv_moments(res)}\n",
           md_table(res.probes, ("after", "request_id", "status", "kv_used_before", "kv_used_after"), 50),
           "## Trend (troughs at idle points)\n", "\n".join(f"- {_fmt_trend(t)}" for t in res.trends) + "\n",
           "## Suspects (black-box attribution)\n",
           md_table(suspects, ("client_action", unit_key, "ci95", "requests_sent", "request_ids")),
           "\nFit of the residual increments per wave on the per-wave action counts (non-negative least squares, "
           "95% bootstrap interval over waves):\n\n",
           md_table(fit, ("client_action", "per_request", "ci95", "requests")),
           "\n## Bisection\n", md_table(res.bisection, ("suspect", "tested", "leaked", "delta"), 50)]
    if res.reproducer:
        out += ["\n## Reproducer\n", "`reproducer.jsonl` in this directory replays the minimal set:\n\n",
                f"```\nvlite leak-check --url {base} --workload reproducer.jsonl --blackbox\n```\n\n",
                "The same requests with curl (client actions approximated by curl's timeouts and `head`):\n\n```\n",
                "\n".join(curl_command(s, base) for s in res.reproducer), "\n```\n"]
    if res.zombies:
        z = res.zombies
        out += ["\n## Zombie requests (the server after each early-leaving client left)\n",
                f"One request at a time on an idle server, max_tokens {z['max_tokens']}.\n\n",
                md_table(z["actions"], ("client_action", "requests", "zombies", "tokens_after_leaving",
                                        "generating_s", "running_s", "aborts_counted", "request_id")),
                "\n" + "\n".join(f"- {line}" for line in zombie_lines(z)) + "\n"]
        for a in z["zombies"]:
            out += [f"\nReproducer ({a['client_action']}):\n\n```\n{a['reproducer']}\n```\n"]
    if res.storm:
        out += ["\n## After the abort storm (wedge probe, output canary)\n",
                "\n".join(f"- {line}" for line in storm_lines(res.storm)) + "\n"]
    if res.process_tree:
        out += ["\n## Server process tree (last sample)\n",
                md_table(res.process_tree, ("pid", "name", "rss_bytes", "gpu_bytes"))]
    if res.replay.engine_errors:
        out += ["\n## Control requests that failed (5xx, dropped connection)\n",
                engine_errors.markdown(res.replay.engine_errors)]
    out += ["\n## Notes\n", "\n".join(f"- {n}" for n in res.notes) or "_none_", "\n\n## Plots\n",
            "\n".join(f"![{p}]({p})" for p in plots), ""]
    return "\n".join(out)


def plot_usage(res: BlackboxResult, path: Path) -> None:
    """KV used over time (the server's unit) with running and waiting requests, idle points marked."""
    df = res.samples
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    if not df.empty and "kv_used" in df.columns:
        top.plot(df["t_s"], pd.to_numeric(df["kv_used"], errors="coerce"), color="tab:blue",
                 label=f"KV used ({res.unit})")
        t0 = df["time"].iloc[0]
        pts = res.replay.idle_points
        top.plot([p.time - t0 for p in pts], [p.num_used_blocks for p in pts], "o", color="tab:orange",
                 label="idle point (after a probe)")
        for col, color in (("num_running", "tab:green"), ("num_waiting", "tab:red")):
            if col in df.columns:
                bottom.plot(df["t_s"], df[col], color=color, label=col)
    if res.baseline is not None:
        top.axhline(res.baseline, color="black", lw=0.8, ls=":", label="baseline")
    top.set_ylabel(f"KV used ({res.unit})")
    bottom.set_ylabel("requests")
    bottom.set_xlabel("time (s)")
    top.set_title(f"{res.server_kind}: {res.summary[:110]}", fontsize=9)
    for ax in (top, bottom):
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=100)


def plot_memory(res: BlackboxResult, path: Path) -> None:
    """RSS of the server's process tree (and its GPU memory) over time, MiB."""
    df = res.samples
    fig, ax = plt.subplots(figsize=(10, 3.5))
    drawn = False
    for col, label in (("rss_bytes", "RSS of the server's process tree"), ("gpu_process_bytes", "GPU memory of the tree")):
        if col in df.columns and df[col].notna().any():
            ax.plot(df["t_s"], pd.to_numeric(df[col], errors="coerce") / MIB, label=label)
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no process memory (remote server, or no process found)", ha="center", va="center")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("MiB")
    ax.set_title("Server memory: informational (allocator warm-up also grows it)", fontsize=9)
    if drawn:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=100)


def plot_fit(res: BlackboxResult, path: Path) -> None:
    """KV units left per request by client action (the fit), with the 95% intervals."""
    fig, ax = plt.subplots(figsize=(8, 3.5))
    rows = res.fit
    if rows:
        y = range(len(rows))
        vals = [r["per_request"] for r in rows]
        err = [[max(0.0, v - r["ci95"][0]) for v, r in zip(vals, rows)],
               [max(0.0, r["ci95"][1] - v) for v, r in zip(vals, rows)]]
        ax.barh(list(y), vals, xerr=err, color="tab:red", alpha=0.8)
        ax.set_yticks(list(y), [r["client_action"] for r in rows])
        ax.invert_yaxis()
        ax.set_xlabel(f"{res.unit} left per request")
    else:
        ax.text(0.5, 0.5, "no fit (nothing leaked, or no waves)", ha="center", va="center")
        ax.set_axis_off()
    ax.set_title("Black-box attribution: residual per request, by client action", fontsize=10)
    save_figure(fig, path, dpi=100)


def plot_troughs(res: BlackboxResult, path: Path) -> None:
    pts = res.replay.idle_points
    trend = res.trends[0] if res.trends else None
    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = [p.requests_completed for p in pts]
    ax.plot(xs, [p.num_used_blocks for p in pts], "o", label=f"KV used at idle points ({res.unit})")
    if trend is not None and trend.slope is not None:
        ax.plot(xs, [trend.intercept + trend.slope * x for x in xs], "-", color="tab:orange",
                label=f"fit: {trend.slope:.3g} {res.unit} per {trend.x_unit}")
    ax.set_xlabel("requests completed" if res.source == "blackbox" else "idle stretch (0 = the first)")
    ax.set_ylabel(res.unit)
    ax.set_title("Troughs: a clean server returns to its baseline at every idle point", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=100)


def write_blackbox_report(res: BlackboxResult, out_dir: Path) -> Path:
    """Write report.json, samples.csv, report.md, report.html, reproducer.jsonl (when there is one)
    and the PNG plots into ``out_dir`` (created).

    Raises:
        OSError: the directory cannot be created or written.
    """
    plots = {"usage.png": plot_usage, "memory.png": plot_memory, "troughs.png": plot_troughs, "attribution.png": plot_fit}
    if res.samples.empty:  # a log judged by its server messages alone: nothing over time to plot
        plots = {}

    def write_plots(d: Path) -> list[str]:
        for name, fn in plots.items():
            fn(res, d / name)
        return list(plots)

    extra = ({"reproducer.jsonl": "".join(json.dumps(_trace_row(s)) + "\n" for s in res.reproducer)}
             if res.reproducer else None)
    return write_report_dir(out_dir, report_dict(res), res.samples, write_plots,
                            lambda names: report_markdown(res, names), f"vlite leak-check: {res.verdict}", extra)
