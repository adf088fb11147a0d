"""Formatting pieces every leak-check report shares: the trough-trend line and the Markdown
table. The report directory itself is written by ``render.write_run_report``."""

from __future__ import annotations

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

