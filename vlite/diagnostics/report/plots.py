"""PNG plots of a leak-check run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

MIB = 1 << 20


def _events(run) -> tuple[list[float], list[float]]:
    """Arrival and abort times (s since the sampler started)."""
    t0 = run.samples["time"].iloc[0] if not run.samples.empty else run.replay.start_time
    arrivals = [r.arrival_time - t0 for r in run.replay.requests if r.arrival_time]
    aborts = [r.abort_time - t0 for r in run.replay.requests if r.abort_time]
    return arrivals, aborts


def plot_blocks(run, path: Path) -> None:
    """Write ``blocks_figure(run)`` to ``path`` (PNG)."""
    save_figure(blocks_figure(run), path)


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out ``fig``, write it to ``path`` as a PNG at ``dpi`` and free it (every report figure ends here)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def blocks_figure(run):
    """KV blocks over time: free blocks against the total (top) and the blocks held by sequences
    and the cached ones (bottom; its y-axis fits those series and says so when it is zoomed
    below the total), with request arrivals and aborts marked. A leak is a bottom line that does
    not come back to 0 when the engine is idle."""
    import textwrap

    df = run.samples
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=[1, 1.3])
    total = int(df["num_total_blocks"].iloc[0]) if not df.empty else 0
    held_max = 0.0
    if not df.empty:
        top.plot(df["t_s"], df["num_free_blocks"], label="free blocks", color="tab:green")
        top.axhline(total, color="black", lw=0.8, ls=":", label="total blocks")
        bottom.plot(df["t_s"], df["num_used_blocks"], label="used blocks (held by sequences)", color="tab:blue")
        held_max = float(df["num_used_blocks"].max())
        if df["num_cached_blocks"].any():
            bottom.plot(df["t_s"], df["num_cached_blocks"], label="cached blocks (evictable, not leaked)",
                        color="tab:gray", ls="--")
            held_max = max(held_max, float(df["num_cached_blocks"].max()))
    top.set_ylim(0, max(total, 1) * 1.05)
    ymax = max(held_max * 1.15, 1.0)
    if total:
        ymax = min(ymax, total * 1.05)
    bottom.set_ylim(0, ymax)
    arrivals, aborts = _events(run)
    bottom.plot(arrivals, [ymax * 0.03] * len(arrivals), "|", color="tab:purple", ms=8, label="request arrival")
    bottom.plot(aborts, [ymax * 0.09] * len(aborts), "x", color="tab:red", ms=5, label="client abort")
    top.set_ylabel(f"KV blocks (0 to {total})")
    zoomed = total and ymax < 0.8 * total
    bottom.set_ylabel(f"KV blocks held ({'zoomed: ' if zoomed else ''}0 to {ymax:.0f}"
                      f"{f' of {total}' if zoomed else ''})")
    bottom.set_xlabel("time (s)")
    verdict = run.findings.summary().split(";")[0]
    top.set_title("\n".join(textwrap.wrap(f"KV blocks over time. {verdict}", 110)), fontsize=9)
    for ax in (top, bottom):
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
        ax.grid(alpha=0.3)
    return fig


def memory_series(df: pd.DataFrame, bytes_per_block: int | None) -> list[tuple[str, pd.Series]]:
    """The memory figures worth plotting (bytes per sample), each with its label: process RSS;
    on a GPU what moves (torch.cuda allocated and reserved, the process's GPU memory); and the KV
    blocks in use (used blocks x bytes per block). The whole device's GPU memory is plotted only
    where nothing finer was sampled: it holds the preallocated KV cache and other processes."""
    out = []
    cols = [("rss_bytes", "process RSS"), ("torch_allocated_bytes", "torch.cuda allocated"),
            ("torch_reserved_bytes", "torch.cuda reserved"), ("gpu_process_bytes", "GPU memory of the process")]
    for col, label in cols:
        if col in df.columns and df[col].notna().any():
            out.append((label, pd.to_numeric(df[col], errors="coerce")))
    gpu_fine = any(label.startswith(("torch", "GPU")) for label, _ in out)
    if not gpu_fine and "gpu_used_bytes" in df.columns and df["gpu_used_bytes"].notna().any():
        out.append(("GPU memory used (whole device)", pd.to_numeric(df["gpu_used_bytes"], errors="coerce")))
    if bytes_per_block and "num_used_blocks" in df.columns:
        out.append((f"KV blocks in use x {bytes_per_block / 1024:g} KiB",
                    pd.to_numeric(df["num_used_blocks"], errors="coerce") * bytes_per_block))
    return out


def _growth_text(run) -> str:
    """The fitted RSS growth per request at idle troughs and the verdict, for the plot."""
    trends = [t for t in run.findings.trends if t.metric == "rss_bytes"]
    # name the host-memory check only where it ran (in process, or over --url of a server on this host)
    rests = ("KV blocks, per-request state and the host-memory check" if getattr(run.findings, "host_memory", None)
             else "KV blocks and per-request state")
    verdict = f"verdict: {run.findings.verdict} (this RSS fit is informational: the verdict rests on\n{rests})"
    if not trends or trends[0].slope is None:
        n = trends[0].n if trends else 0
        return f"RSS growth per request: not fitted\n({n} idle points after warm-up, 3 needed)\n{verdict}"
    t = trends[0]
    lo, hi = t.ci95
    state = ("RISING beyond the threshold (informational)" if t.rising
             else f"not rising beyond {t.threshold / 2**20:g} MiB/request")
    return (f"RSS growth at idle troughs, after warm-up:\n{t.slope / 1024:+.1f} KiB/request "
            f"(95% CI {lo / 1024:+.1f} .. {hi / 1024:+.1f}; {t.n} idle points),\n{state}\n{verdict}")


def plot_memory(run, path: Path) -> None:
    """Write ``memory_figure(run)`` to ``path`` (PNG)."""
    save_figure(memory_figure(run), path)


def memory_figure(run):
    """Memory over time, honestly scaled: the top panel's y-axis starts at 0 (MiB); the middle
    panel shows each series' change since the first sample, with its scale written on it; the
    bottom panel is process RSS at the idle troughs against requests completed, with the fitted
    growth per request (the RSS trend of the report) and the verdict written in."""
    df = run.samples
    series = memory_series(df, run.info.get("bytes_per_block")) if not df.empty else []
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(11, 9), height_ratios=[1, 1, 1.1])
    span = 0.0
    for label, values in series:
        top.plot(df["t_s"], values / MIB, label=label)
        first = values.dropna()
        if not first.empty:
            delta = (values - first.iloc[0]) / MIB
            mid.plot(df["t_s"], delta, label=label)
            span = max(span, float(delta.max() - delta.min()))
    top.set_ylim(bottom=0)
    top.set_ylabel("MiB (axis from 0)")
    top.set_xlabel("time (s)")
    mid.axhline(0, color="black", lw=0.6)
    mid.set_ylabel("change since start, MiB")
    mid.set_xlabel("time (s)")
    mid.set_title(f"Zoomed: each series' change since the first sample (they move within {span:.2f} MiB)",
                  fontsize=8.5, loc="left")
    if not any(label.startswith(("torch", "GPU")) for label, _ in series):
        top.text(0.01, 0.95, "no GPU: process RSS and KV blocks in use", transform=top.transAxes, fontsize=8,
                 va="top")
    pts = [p for p in run.replay.idle_points if p.rss_bytes is not None]
    xs = [p.requests_completed for p in pts]
    trend = next((t for t in run.findings.trends if t.metric == "rss_bytes"), None)
    if pts:
        base = pts[0].rss_bytes
        low.plot(xs, [(p.rss_bytes - base) / MIB for p in pts], "o", label="process RSS at idle points (troughs)")
        fit_x = [x for x in xs if x >= min(xs[2:] or xs)]  # the first two idle points are warm-up
        fitted = trend is not None and trend.slope is not None
        if fitted:
            low.plot(fit_x, [(trend.intercept + trend.slope * x - base) / MIB for x in fit_x], "-",
                     color="tab:orange", label="fit (the first two idle points, warm-up, left out)")
        # The threshold line starts at the warm-up level (the fit at its first point, else the
        # first point after warm-up), not at the origin: growth is judged from there. The scale
        # is the growth a leak at the threshold would show from there on, so a flat series looks
        # flat and a rising one fills the panel.
        x0 = fit_x[0]
        y0 = ((trend.intercept + trend.slope * x0 - base) / MIB if fitted
              else (pts[xs.index(x0)].rss_bytes - base) / MIB)
        threshold = trend.threshold if trend is not None and trend.threshold else 2**20
        reach = threshold * max(1, max(xs) - x0) / MIB
        low.plot([x0, max(x0 + 1, max(xs))], [y0, y0 + reach], ":", color="tab:red",
                 label=f"growth at the threshold from the warm-up level, {threshold / 2**20:g} MiB/request")
        values = [(p.rss_bytes - base) / MIB for p in pts]
        low.set_ylim(min(0.0, min(values), y0) - 0.05 * reach, max(y0 + reach, max(values)) * 1.1)
    low.set_xlabel("requests completed")
    low.set_ylabel("RSS at idle minus the first, MiB")
    low.set_title("Process RSS at the idle troughs against requests completed (y-axis: up to the threshold's "
                  "growth over the run)", fontsize=8.5, loc="left")
    low.text(0.01, 0.96, _growth_text(run), transform=low.transAxes, fontsize=8.5, va="top", ha="left",
             bbox={"facecolor": "lightyellow", "alpha": 0.9, "lw": 0.5})
    top.set_title("Memory over time. Weights and the KV cache are allocated once, at start; only growth at every "
                  "idle point,\nper request, points at leaked per-request state (bottom panel)", fontsize=9)
    for ax in (top, mid, low):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
        ax.grid(alpha=0.3)
    return fig


def plot_leaks_by_action(run, path: Path) -> None:
    """Leaked blocks per client action (bars), or a note that none leaked."""
    rows = run.findings.by_action
    fig, ax = plt.subplots(figsize=(8, 4))
    if rows:
        ax.barh([r["action_kind"] for r in rows], [r["blocks"] for r in rows], color="tab:red")
        for i, r in enumerate(rows):
            ax.text(r["blocks"], i, f" {r['blocks']} blocks / {r['requests']} req", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("leaked blocks")
    else:
        ax.text(0.5, 0.5, "no blocks held at quiescence", ha="center", va="center", fontsize=12)
        ax.set_axis_off()
    ax.set_title("Blocks still held after drain, by client action", fontsize=10)
    save_figure(fig, path)


def plot_troughs(run, path: Path) -> None:
    """Used blocks at idle points against requests completed, with the fitted line."""
    pts = run.replay.idle_points
    trend = run.findings.trends[0]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = [p.requests_completed for p in pts]
    ax.plot(xs, [p.num_used_blocks for p in pts], "o", label="used blocks at idle points (troughs)")
    if trend.slope is not None:
        ax.plot(xs, [trend.intercept + trend.slope * x for x in xs], "-", color="tab:orange",
                label=f"fit: {trend.slope:.3f} blocks/request, R^2 {trend.r2:.2f}")
    ax.set_xlabel("requests completed")
    ax.set_ylabel("used blocks")
    ax.set_title("Troughs: a clean engine returns to its baseline after every wave", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def write_plots(run, out_dir: Path) -> list[str]:
    """Write every plot into ``out_dir``; returns the file names."""
    names = {"blocks.png": plot_blocks, "memory.png": plot_memory, "leaks_by_action.png": plot_leaks_by_action,
             "troughs.png": plot_troughs}
    for name, fn in names.items():
        fn(run, out_dir / name)
    return list(names)
