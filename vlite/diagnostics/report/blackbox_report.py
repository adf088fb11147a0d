"""The sections of a black-box check or a ``--from-log`` post-mortem: pure functions from the
result's facts to ``Section``s and report.json fields, its PNG plots, and reproducer.jsonl (with
the reproducer as curl commands in report.md). ``report/target_report.py`` formats and writes
them; the schema of report.json is documented in docs/reference.md.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from vlite.diagnostics.checks import engine_errors, probe_census
from vlite.diagnostics.checks.storm import lines as storm_lines
from vlite.diagnostics.report.plots import save_figure
from vlite.diagnostics.report.writer import trend_line
from vlite.diagnostics.targets.base import Section
from vlite.diagnostics.targets.blackbox import action_text
from vlite.diagnostics.targets.zombie_blackbox import lines as zombie_lines

MIB = 1 << 20


def _v(value) -> str:
    """A value for the report's words: "n/a" where it was not read."""
    return "n/a" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _fmt_trend(t) -> str:
    return trend_line(t).replace("num_used_blocks", "kv_used")


def terminal_lines(res) -> list[str]:
    """The terminal's lines: the server and its residual, the probes, the suspects, the trends,
    the zombie and storm checks."""
    bs = f", block_size {res.block_size} tokens (read from the server)" if res.block_size else ""
    total = f" of {res.kv_total:g}" if res.kv_total else ""
    out = [f"server: {res.server_kind}{bs}; KV used in {res.unit}{total}", kv_moments(res)]
    if res.probes:
        last = res.probes[-1]
        out.append(f"probes: {len(res.probes)} 1-token requests, each after an idle point; the last one (after "
                   f"{last['after']}): KV used {_v(last['kv_used_before'])} -> {_v(last['kv_used_after'])} {res.unit}")
    for s in res.suspects:
        per = next(v for k, v in s.items() if k.endswith("per_request"))
        out.append(f"suspect: {s['client_action']}: {per:g} {res.unit}/request (95% CI {s['ci95'][0]:g} .. "
                   f"{s['ci95'][1]:g}); minimal set {s['request_ids'] or '(not reproduced)'}")
    out += [_fmt_trend(t) for t in res.trends]
    out += [f"zombie check: {line}" for line in zombie_lines(res.zombies)]
    out += [f"storm check: {line}" for line in storm_lines(res.storm)]
    out += probe_census.lines(res.probe)
    # one line each (report.json has the traceback); over HTTP the engine's failure is the server's
    out += [(line.replace("engine raised", "server failed", 1), "red") for line in engine_errors.lines(res.replay.engine_errors)]
    return out


def kv_moments(res) -> str:
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


def report_json(res) -> dict:
    """The result's fields of report.json."""
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
    return {"server_kind": res.server_kind, "source": res.source,
            "drain": {"unit": res.unit, "block_size": res.block_size, "kv_total": res.kv_total,
                      "baseline": res.baseline, "final": res.final, "residual": res.residual,
                      "kv_at_end": res.kv_at_end, "probes": res.probes},
            "trends": trends,
            "cardinality": res.cardinality,  # /metrics series per family (checks/cardinality.py)
            "probe_census": res.probe,  # the vlite probe inside the server (checks/probe_census.py)
            "blackbox": {"suspects": res.suspects, "fit": res.fit, "bisection": res.bisection,
                         "reproducer": [_trace_row(s) for s in res.reproducer]},
            "zombies": res.zombies, "storm": res.storm, "process_tree": res.process_tree,
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
    """A curl command that approximates the request's client action (see docs/reference.md)."""
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


def markdown_sections(res) -> list[Section]:
    """report.md's sections: the drain, the trend, the suspects and the fit, the bisection, the
    reproducer (as a command and as curl), the zombie and storm checks, the process tree."""
    base = res.info.get("url", "http://127.0.0.1:8000")
    unit_key = f"{res.unit}_per_request" if res.unit in ("blocks", "tokens") else "per_request"
    suspects = [s | {"ci95": f"{s['ci95'][0]:g} .. {s['ci95'][1]:g}", "request_ids": ", ".join(s["request_ids"])}
                for s in res.suspects]
    fit = [r | {"ci95": f"{r['ci95'][0]:.3g} .. {r['ci95'][1]:.3g}", "per_request": f"{r['per_request']:.3g}"}
           for r in res.fit]
    drain = (f"unit: {res.unit}; block_size: {_v(res.block_size)}"
             f"{' (read from the server)' if res.block_size else ' (the server does not say)'}; pool: "
             f"{_v(res.kv_total)}; {kv_moments(res)}\n")
    out = [Section("Drain (KV used at idle, after a 1-token probe)", text=drain, rows=res.probes, limit=50,
                   cols=("after", "request_id", "status", "kv_used_before", "kv_used_after")),
           Section("Trend (troughs at idle points)", lines=[_fmt_trend(t) for t in res.trends]),
           Section("Suspects (black-box attribution)", rows=suspects,
                   cols=("client_action", unit_key, "ci95", "requests_sent", "request_ids")),
           Section(text="Fit of the residual increments per wave on the per-wave action counts (non-negative least "
                        "squares, 95% bootstrap interval over waves):\n", rows=fit,
                   cols=("client_action", "per_request", "ci95", "requests")),
           Section("Bisection", rows=res.bisection, cols=("suspect", "tested", "leaked", "delta"), limit=50)]
    if res.reproducer:
        out.append(Section("Reproducer", text=(
            "`reproducer.jsonl` in this directory replays the minimal set:\n\n"
            f"```\nvlite leak-check --url {base} --workload reproducer.jsonl --blackbox\n```\n\n"
            "The same requests with curl (client actions approximated by curl's timeouts and `head`):\n\n```\n"
            + "\n".join(curl_command(s, base) for s in res.reproducer) + "\n```\n")))
    if res.zombies:
        z = res.zombies
        out += [Section("Zombie requests (the server after each early-leaving client left)",
                        text=f"One request at a time on an idle server, max_tokens {z['max_tokens']}.\n", rows=z["actions"],
                        cols=("client_action", "requests", "zombies", "tokens_after_leaving", "generating_s",
                              "running_s", "aborts_counted", "request_id")),
                Section(lines=zombie_lines(z))]
        out += [Section(text=f"Reproducer ({a['client_action']}):\n\n```\n{a['reproducer']}\n```\n")
                for a in z["zombies"]]
    if res.storm:
        out.append(Section("After the abort storm (wedge probe, output canary)", lines=storm_lines(res.storm)))
    if res.replay.engine_errors:
        out.append(Section("Control requests that failed (5xx, dropped connection)",
                           text=engine_errors.markdown(res.replay.engine_errors)))
    if res.process_tree:
        out.append(Section("Server process tree (last sample)", rows=res.process_tree,
                           cols=("pid", "name", "rss_bytes", "gpu_bytes")))
    return [dataclasses.replace(x, terminal=False) for x in out]


def sections(res) -> list[Section]:
    """Every section of a black-box or from-log result: the terminal's lines, then report.md's."""
    return [Section(lines=terminal_lines(res), markdown=False)] + markdown_sections(res)


def plot_usage(res, path: Path) -> None:
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


def plot_memory(res, path: Path) -> None:
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


def plot_fit(res, path: Path) -> None:
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


def plot_troughs(res, path: Path) -> None:
    pts = res.replay.idle_points
    trend = res.trends[0] if res.trends else None
    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = [p.requests_completed for p in pts]
    ax.plot(xs, [p.num_used_blocks for p in pts], "o", label=f"KV used at idle points ({res.unit})")
    if trend is not None and trend.slope is not None:
        ax.plot(xs, [trend.intercept + trend.slope * x for x in xs], "-", color="tab:orange",
                label=f"fit: {trend.slope:.3g} {res.unit}/request")
    ax.set_xlabel("requests completed" if res.source == "blackbox" else "stats line")
    ax.set_ylabel(res.unit)
    ax.set_title("Troughs: a clean server returns to its baseline at every idle point", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=100)


def write_plots(res, out_dir: Path) -> list[str]:
    """Write usage.png, memory.png, troughs.png and attribution.png into ``out_dir``; none for a
    log judged by its server messages alone (nothing over time to plot). Returns the file names."""
    if res.samples.empty:
        return []
    plots = {"usage.png": plot_usage, "memory.png": plot_memory, "troughs.png": plot_troughs, "attribution.png": plot_fit}
    for name, fn in plots.items():
        fn(res, Path(out_dir) / name)
    return list(plots)


def extra_files(res) -> dict[str, str]:
    """reproducer.jsonl, where a minimal set was reproduced."""
    if not res.reproducer:
        return {}
    return {"reproducer.jsonl": "".join(json.dumps(_trace_row(s)) + "\n" for s in res.reproducer)}


def _as_run(res):
    return res.as_target_run("blackbox" if res.source == "blackbox" else res.source)


def print_blackbox(res, console=None) -> None:
    """The terminal report of a black-box or from-log result (``render.print_run``)."""
    from rich.console import Console

    from vlite.diagnostics.report.render import print_run

    print_run(_as_run(res), BlackboxView(res), console or Console())


def report_markdown(res, plots: list[str]) -> str:
    """report.md of a black-box or from-log result (``render.run_markdown``)."""
    from vlite.diagnostics.report.render import run_markdown

    return run_markdown(_as_run(res), BlackboxView(res), plots)


def write_blackbox_report(res, out_dir: Path) -> Path:
    """Write the report directory of a black-box or from-log result (``render.write_run_report``);
    returns ``out_dir``.

    Raises:
        OSError: the directory cannot be created or written.
    """
    from vlite.diagnostics.report.render import write_run_report

    write_run_report(_as_run(res), BlackboxView(res), out_dir)
    return Path(out_dir)


class BlackboxView:
    """A black-box or from-log result as a ``RunDetail``."""

    headline_first = True
    timing_first = True  # what was sent, then what it left

    def __init__(self, res) -> None:
        self.res = res
        self.title = f"vlite leak-check report ({res.source}: {res.server_kind})"

    def sections(self) -> list[Section]:
        return sections(self.res)

    def to_json(self) -> dict:
        return report_json(self.res)

    def plots(self, out_dir) -> list[str]:
        return write_plots(self.res, out_dir)

    def extra_files(self) -> dict[str, str]:
        return extra_files(self.res)
