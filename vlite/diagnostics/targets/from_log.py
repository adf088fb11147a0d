"""``vlite leak-check --from-log FILE``: a post-mortem from a server's periodic stats lines.

Lines read (one every ``--log-stats`` interval, 10 s by default in vLLM):

* vLLM V1 (``vllm/v1/metrics/loggers.py``), e.g. ``Engine 000: Avg prompt throughput: 82.5 tokens/s,
  Avg generation throughput: 27.5 tokens/s, Running: 4 reqs, Waiting: 0 reqs, CPU KV cache usage:
  1.7%, Prefix cache hit rate: 0.0%`` (``GPU KV cache usage`` on GPUs); vLLM V0's spelling with
  ``Swapped:`` and ``Pending:`` is read too;
* vlite's ``--log-stats`` line, the same words plus ``Free blocks: F/T (+C cached)``, which gives
  the usage in blocks (T - F - C).

Idle stretches are runs of consecutive lines with 0 running and 0 waiting (per engine). A clean
server's usage is 0 in them (evictable prefix-cache blocks count as free in both servers). The
verdict: LEAK when the last idle stretch stays above 0 on two lines or more, or when the troughs
(the minimum of each stretch) rise; INCONCLUSIVE (exit 3) when the log has no idle stretch, or ends on
a single idle line above 0 that nothing confirms; CLEAN otherwise. Lines that look like stats lines
but do not parse are counted and reported, never fatal.

Every line is also matched against the servers' own messages about aborts, zombies and leaked
KV (``checks/log_signatures.py``: vLLM, SGLang, TensorRT-LLM, llama.cpp). They are listed in the
report; a log with no stats line is judged by them alone: LEAK for a leak signature, ZOMBIE for
a zombie one, else INCONCLUSIVE (evidence, no KV to judge).
"""

from __future__ import annotations

import re
import threading
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pandas as pd

from vlite.diagnostics.checks.detect import trough_trend
from vlite.diagnostics.checks.log_signatures import SignatureCounter, describe, symptom_verdict
from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.targets.base import TargetError, TargetPlan, TargetRun
from vlite.diagnostics.targets.blackbox import BlackboxResult
from vlite.diagnostics.workload.replay import IdlePoint, ReplayResult

_STATS = re.compile(r"Running: (?P<running>\d+) reqs?, (?:Swapped: \d+ reqs?, )?(?:Waiting|Pending): "
                    r"(?P<waiting>\d+) reqs?, (?:(?:GPU|CPU|XPU|TPU) )?KV cache usage: (?P<usage>[\d.]+)%")
_FREE = re.compile(r"Free blocks: (?P<free>\d+)/(?P<total>\d+) \(\+(?P<cached>\d+) cached\)")
_ENGINE = re.compile(r"Engine (\d+):")
_MARKERS = ("Avg prompt throughput", "KV cache usage")
_TIMES = ((re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?"), None),
          (re.compile(r"\b\d{2}-\d{2} \d{2}:\d{2}:\d{2}\b"), "%m-%d %H:%M:%S"))


class LogError(TargetError, ValueError):
    """The log cannot be read or holds no stats line (the message says what was looked for)."""


def _time(line: str) -> float | None:
    for pat, fmt in _TIMES:
        m = pat.search(line)
        if not m:
            continue
        text = m.group(0).replace(",", ".")
        try:
            dt = datetime.fromisoformat(text) if fmt is None else datetime.strptime(text, fmt).replace(year=2000)
            return dt.timestamp()
        except ValueError:
            continue
    return None


def parse_log(text: str) -> tuple[pd.DataFrame, int, int]:
    """Stats rows of a log: (DataFrame with line, time, engine, server, num_running, num_waiting,
    kv_usage_perc, kv_used, kv_total, unit; unparsable stats-like lines; other lines)."""
    rows, bad, other = [], 0, 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not any(m in line for m in _MARKERS):
            other += bool(line.strip())
            continue
        m = _STATS.search(line)
        if not m:
            bad += 1
            continue
        usage = float(m.group("usage"))
        free = _FREE.search(line)
        eng = _ENGINE.search(line)
        row = {"line": lineno, "time": _time(line), "engine": eng.group(1) if eng else "0",
               "server": "vlite" if free else "vllm", "num_running": int(m.group("running")),
               "num_waiting": int(m.group("waiting")), "kv_usage_perc": usage}
        if free:
            total, f, c = int(free.group("total")), int(free.group("free")), int(free.group("cached"))
            row.update(kv_used=float(total - f - c), kv_total=float(total), unit="blocks")
        else:
            row.update(kv_used=usage, kv_total=100.0, unit="percent")
        rows.append(row)
    return pd.DataFrame(rows), bad, other


def idle_stretches(df: pd.DataFrame) -> list[dict]:
    """Runs of consecutive idle lines (0 running, 0 waiting) per engine: first/last line, lines,
    min and last usage (in the row's unit)."""
    out = []
    for engine, g in df.groupby("engine", sort=True):
        run: list = []
        for _, r in list(g.iterrows()) + [(None, None)]:
            if r is not None and r["num_running"] == 0 and r["num_waiting"] == 0:
                run.append(r)
                continue
            if run:
                used = [x["kv_used"] for x in run]
                out.append({"engine": engine, "first_line": int(run[0]["line"]), "last_line": int(run[-1]["line"]),
                            "lines": len(run), "min_used": min(used), "last_used": used[-1],
                            "time": run[0]["time"]})
                run = []
    return sorted(out, key=lambda s: s["first_line"])


def analyze_log(path: Path) -> BlackboxResult:
    """Read ``path`` and decide CLEAN / LEAK / INCONCLUSIVE.

    Raises:
        LogError: the file cannot be read, or no line in it is a stats line.
    """
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        raise LogError(f"cannot read log {path}: {exc}") from exc
    df, bad, other = parse_log(text)
    sigs = SignatureCounter()
    sigs.feed(text.splitlines())
    hits = sigs.summary()
    if df.empty and hits:
        return _signatures_only(path, hits, sigs.lines_read)
    if df.empty:
        raise LogError(f"{path}: no stats line among {len(text.splitlines())} lines ({bad} unparsable); expected "
                       "vLLM's 'Engine 000: Avg prompt throughput: ... Running: N reqs, Waiting: M reqs, "
                       "GPU KV cache usage: P%' (--log-stats) or vlite serve --log-stats lines")
    unit = "blocks" if (df["unit"] == "blocks").all() else "percent"
    if unit == "percent":
        df["kv_used"] = df["kv_usage_perc"]
    kinds = sorted(set(df["server"]))
    stretches = idle_stretches(df)
    t = pd.to_numeric(df["time"], errors="coerce")
    t0 = t.min() if t.notna().any() else None
    samples = pd.DataFrame({"t_s": (t - t0) if t0 is not None else df["line"].astype(float),
                            "time": t if t0 is not None else df["line"].astype(float),
                            "num_running": df["num_running"], "num_waiting": df["num_waiting"],
                            "kv_used": df["kv_used"], "kv_usage_perc": df["kv_usage_perc"], "engine": df["engine"],
                            "line": df["line"]})
    base_time = float(samples["time"].iloc[0])
    has_time = t0 is not None
    points = [IdlePoint(float(s["time"]) if has_time and s["time"] is not None and s["time"] == s["time"]
                        else float(s["first_line"]), i, s["min_used"], None) for i, s in enumerate(stretches)]
    # the troughs are fitted on the idle stretch's index: the log does not count requests
    trend = replace(trough_trend(points), y_unit=unit, x_unit="idle stretch")
    notes = []
    if bad:
        notes.append(f"{bad} stats-like lines could not be parsed (skipped)")
    if not stretches:
        verdict = Verdict.INCONCLUSIVE
        summary = (f"INCONCLUSIVE: no idle stretch (0 running, 0 waiting) in {len(df)} stats lines: "
                   "nothing to compare with an empty cache")
    else:
        last = stretches[-1]
        above = [s for s in stretches if s["min_used"] > 0]
        if last["min_used"] > 0 and last["lines"] >= 2:
            verdict = Verdict.LEAK
            summary = (f"LEAK: KV cache usage stays above 0 (min {last['min_used']:g}, last {last['last_used']:g} "
                       f"{unit}) through the last idle stretch "
                       f"(lines {last['first_line']}-{last['last_line']}, {last['lines']} stats lines with 0 running "
                       f"and 0 waiting); {len(above)} of {len(stretches)} idle stretches stay above 0")
        elif trend.rising:
            verdict = Verdict.LEAK
            summary = (f"LEAK: the idle troughs (the least KV used in each idle stretch) rise by "
                       f"{trend.slope:.3g} {unit} per idle stretch ({len(stretches)} stretches)")
        elif last["min_used"] > 0:
            verdict = Verdict.INCONCLUSIVE
            summary = (f"INCONCLUSIVE: the log ends on one idle line at {last['min_used']:g} {unit} (line "
                       f"{last['first_line']}); a lagging gauge or a leak, nothing later confirms either")
        else:
            verdict = Verdict.CLEAN
            summary = (f"CLEAN: KV cache usage returns to 0 in the last idle stretch ({len(stretches)} idle "
                       f"stretches, {len(above)} with usage above 0 throughout)")
    replay = ReplayResult([], points, start_time=base_time, end_time=float(samples["time"].iloc[-1]))
    info = {"target": "log", "log": str(path), "server_kind": "+".join(kinds), "unit": unit,
            "stats_lines": len(df), "unparsable_lines": bad, "other_lines": other,
            "engines": sorted(set(df["engine"])), "idle_stretches": stretches, "log_signatures": hits}
    notes += [f"log signature: {describe(h)}" for h in hits]
    total = float(df["kv_total"].iloc[-1]) if unit == "blocks" else 100.0
    return BlackboxResult(verdict, summary, "+".join(kinds), unit, None, total, 0.0,
                          stretches[-1]["min_used"] if stretches else None, [trend], samples, replay, info,
                          notes=notes, source="log")


def _signatures_only(path: Path, hits: list[dict], num_lines: int) -> BlackboxResult:
    """The verdict of a log with no stats line but known server messages (module docstring)."""
    verdict = symptom_verdict(hits)
    worst = next((h for h in hits if h["kind"] == {Verdict.LEAK: "leak", Verdict.ZOMBIE: "zombie"}.get(verdict)), None)
    if worst is not None:
        summary = (f"{verdict}: the server logged {worst['server']}'s '{worst['signature']}' {worst['lines']} "
                   f"time(s): {worst['means']}")
    else:
        verdict = Verdict.INCONCLUSIVE
        found = ", ".join(f"{h['count']} x {h['signature']}" for h in hits)
        summary = f"INCONCLUSIVE: no stats line to judge the KV cache by; the log holds {found}"
    servers = "+".join(sorted({h["server"] for h in hits}))
    info = {"target": "log", "log": str(path), "server_kind": servers, "unit": "lines", "stats_lines": 0, "unparsable_lines": 0,
            "other_lines": num_lines, "log_signatures": hits}
    notes = [f"log signature: {describe(h)}" for h in hits]
    samples = pd.DataFrame(columns=["t_s", "time", "num_running", "num_waiting", "kv_used"])
    return BlackboxResult(verdict, summary, servers, "lines", None, None, None, None, [], samples,
                          ReplayResult([], []), info, notes=notes, source="log")


class LogTarget:
    """A server's stats log, read after the fact: the ``LeakCheckTarget`` around ``analyze_log``
    (the plan's workload is not used: the log says what the server ran)."""

    kind = "log"
    interruptible = None

    def __init__(self, path: Path) -> None:
        self.path = path

    def describe(self) -> str:
        return f"the stats log {self.path}"

    def run(self, plan: TargetPlan, *, stop: threading.Event | None = None) -> TargetRun:
        """``analyze_log``, then one line with what was read.

        Raises:
            LogError: the file cannot be read, or no line in it is a stats line.
        """
        res = analyze_log(self.path)
        plan.on_line(f"leak-check log {self.path}: {res.info['stats_lines']} stats lines "
                     f"({res.info['unparsable_lines']} unparsable, {res.info['other_lines']} other lines)")
        return res.as_target_run(self.kind)
