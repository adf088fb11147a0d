"""The one report-directory writer and the Markdown pieces both leak-check reports share.

A leak-check report directory holds report.json, samples.csv, the PNG plots, report.md and
report.html (the Markdown with the plots embedded); the in-process/HTTP report (``report``), the
black-box and from-log report (``blackbox_report``) and the watch and Prometheus report
(``watch_report``, no plots) all write it here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

from vlite.diagnostics.report.atomic import atomic_write_text
from vlite.diagnostics.report.html_report import write_html

REPORT_VERSION = 1


def trend_line(t) -> str:
    """One line for a trough trend ``t`` (``checks.detect.Trend``): slope with its 95% CI, fit, levels."""
    unit = "bytes" if t.metric == "rss_bytes" else (getattr(t, "y_unit", None) or "blocks")
    per = getattr(t, "x_unit", "request")
    if t.slope is None:
        return f"{t.metric}: {t.n} idle points (need 3 for a trend)"
    if unit != "bytes":
        tag = "  [RISING]" if t.rising else ""
    else:  # said whether it rises or not: a flat RSS does not clear a run any more than a rising one fails it
        tag = ("  [rising; informational: warm-up included; the host-memory verdict fits the later half]"
               if t.rising else "  [informational; the host-memory verdict fits the later half]")
    if unit != "bytes":
        slope = f"{t.slope:.4g} {unit}{'/' if per == 'request' else ' per '}{per} (95% CI {t.ci95[0]:.4g} .. {t.ci95[1]:.4g})"
        levels = f"baseline {t.baseline:.6g} -> last {t.last:.6g}"
    else:  # bytes read as KiB per request and MiB levels
        slope = f"{t.slope / 1024:.1f} KiB/request (95% CI {t.ci95[0] / 1024:.1f} .. {t.ci95[1] / 1024:.1f})"
        levels = f"baseline {t.baseline / 2**20:.1f} MiB -> last {t.last / 2**20:.1f} MiB"
    name = "process RSS" if unit == "bytes" else "KV used" if unit != "blocks" else "used blocks"
    flat = t.slope == 0 and t.ci95[0] == t.ci95[1] == 0  # no variance: R^2 says nothing
    fit = "flat at every idle point" if flat else f"R^2 {t.r2:.2f}"
    return f"{name} ({t.metric}) at idle troughs: slope {slope}, {fit}, {t.n} idle points, {levels}" + tag


def md_table(rows: list[dict], cols: tuple[str, ...], limit: int = 30) -> str:
    """A Markdown table of ``rows`` over ``cols`` (at most ``limit`` rows; "_none_" when empty)."""
    if not rows:
        return "_none_\n"
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows[:limit]:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)).replace("|", "/") for c in cols)
                     + " |")
    if len(rows) > limit:
        lines.append(f"\n{len(rows) - limit} more rows in report.json")
    return "\n".join(lines) + "\n"


def write_report_dir(out_dir: Path, doc: dict, samples, plots: Callable[[Path], Iterable[str]],
                     markdown: Callable[[list[str]], str], title: str | None = None,
                     extra_files: dict[str, str] | None = None) -> Path:
    """Write one report directory ``out_dir`` (created): report.json (``doc``), samples.csv
    (``samples``, a DataFrame), the plots (``plots(out_dir)`` writes them and returns their file
    names), ``extra_files`` (name -> text), report.md (``markdown(plot names)``) and report.html;
    each text file replaced whole (``atomic_write_text``).

    Raises:
        OSError: the directory cannot be created or written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # each file replaced whole: a Ctrl-C or kill mid-rewrite leaves the previous complete report
    atomic_write_text(out_dir / "report.json", json.dumps(doc, indent=2, default=str))
    atomic_write_text(out_dir / "samples.csv", samples.to_csv(index=False))
    names = list(plots(out_dir))
    for name, text in (extra_files or {}).items():
        atomic_write_text(out_dir / name, text)
    md = markdown(names)
    atomic_write_text(out_dir / "report.md", md)
    if title is None:
        write_html(out_dir, md)  # one file, plots embedded
    else:
        write_html(out_dir, md, title)
    return out_dir
