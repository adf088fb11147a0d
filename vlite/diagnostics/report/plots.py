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
    """KV blocks over time: free blocks against the total (top) and, zoomed, the blocks held
    by sequences and the cached ones (bottom), with request arrivals and aborts marked. A leak
    is a bottom line that does not come back to 0 when the engine is idle."""
    import textwrap

    df = run.samples
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=[1, 1.3])
    if not df.empty:
        top.plot(df["t_s"], df["num_free_blocks"], label="free blocks", color="tab:green")
        top.axhline(df["num_total_blocks"].iloc[0], color="black", lw=0.8, ls=":", label="total blocks")
        bottom.plot(df["t_s"], df["num_used_blocks"], label="used blocks (held by sequences)", color="tab:blue")
        if df["num_cached_blocks"].any():
            bottom.plot(df["t_s"], df["num_cached_blocks"], label="cached blocks (evictable, not leaked)",
                        color="tab:gray", ls="--")
    arrivals, aborts = _events(run)
    bottom.set_ylim(bottom=0)
    ymax = max(bottom.get_ylim()[1], 1.0)
    bottom.plot(arrivals, [ymax * 0.03] * len(arrivals), "|", color="tab:purple", ms=8, label="request arrival")
    bottom.plot(aborts, [ymax * 0.09] * len(aborts), "x", color="tab:red", ms=5, label="client abort")
    top.set_ylabel("KV blocks")
    bottom.set_ylabel("KV blocks (zoomed)")
    bottom.set_xlabel("time (s)")
    verdict = run.findings.summary().split(";")[0]
    top.set_title("\n".join(textwrap.wrap(f"KV blocks over time. {verdict}", 110)), fontsize=9)
    for ax in (top, bottom):
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(run, path: Path) -> None:
    """Process RSS and GPU memory (MiB) over time."""
    df = run.samples
    fig, ax = plt.subplots(figsize=(10, 4))
    cols = [("rss_bytes", "process RSS"), ("gpu_used_bytes", "GPU memory used (device)"),
            ("gpu_process_bytes", "GPU memory (this process)"), ("torch_allocated_bytes", "torch.cuda allocated"),
            ("torch_reserved_bytes", "torch.cuda reserved")]
    for col, label in cols:
        if col in df.columns and df[col].notna().any():
            ax.plot(df["t_s"], pd.to_numeric(df[col], errors="coerce") / MIB, label=label)
    if not any(col in df.columns for col, _ in cols[1:]):
        ax.text(0.01, 0.95, "no GPU: process RSS only", transform=ax.transAxes, fontsize=8, va="top")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("MiB")
    ax.set_title("Memory over time. Weights are loaded once; RSS also grows with allocator warm-up and caches,\n"
                 "so only growth at every idle point, per request, points at leaked per-request state", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(run, out_dir: Path) -> list[str]:
    """Write every plot into ``out_dir``; returns the file names."""
    names = {"blocks.png": plot_blocks, "memory.png": plot_memory, "leaks_by_action.png": plot_leaks_by_action,
             "troughs.png": plot_troughs}
    for name, fn in names.items():
        fn(run, out_dir / name)
    return list(names)
