"""memory.png and blocks.png show growth honestly: an axis from 0 or a marked scale, the
fitted growth per request and the verdict written in, on a GPU what moves, "zoomed" only when it is."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from vlite.diagnostics.checks.detect import Trend
from vlite.diagnostics.report import plots
from vlite.diagnostics.workload.replay import IdlePoint, ReplayResult

MIB = 1 << 20


def _run(samples: pd.DataFrame, *, rss_troughs=(1293.6, 1296.0, 1296.5, 1297.0, 1297.4), verdict="CLEAN",
         slope=4 * 1024.0):
    points = [IdlePoint(float(i), 20 * i, 0, int(r * MIB)) for i, r in enumerate(rss_troughs)]
    rss = (Trend("rss_bytes", len(points) - 2, slope, points[2].rss_bytes - slope * 40, (slope / 2, slope * 2),
                 0.9, points[2].rss_bytes, points[-1].rss_bytes, threshold=MIB) if slope is not None
           else Trend("rss_bytes", max(0, len(points) - 2), threshold=MIB))
    trends = [Trend("num_used_blocks", len(points), 0.0, 0.0, (0.0, 0.0), 1.0, 0, 0), rss]
    findings = SimpleNamespace(trends=trends, verdict=verdict, summary=lambda: f"{verdict}: drain invariant holds")
    return SimpleNamespace(samples=samples, findings=findings, info={"bytes_per_block": 720 * 1024},
                           replay=ReplayResult([], points, start_time=0.0))


def _samples(n: int = 50, **extra) -> pd.DataFrame:
    t = np.linspace(0, 10, n)
    used = (np.sin(t) > 0) * 20
    df = pd.DataFrame({"t_s": t, "time": t, "num_total_blocks": 27, "num_free_blocks": 27 - used, "num_used_blocks": used,
                       "num_cached_blocks": 0, "rss_bytes": (1293.6 + 3.8 * t / 10) * MIB})
    for col, values in extra.items():
        df[col] = values
    return df


def _texts(fig) -> str:
    return "\n".join([t.get_text() for ax in fig.axes for t in ax.texts]
                     + [ax.get_title(loc=w) for ax in fig.axes for w in ("left", "center")])


def test_memory_axis_starts_at_0_and_the_fitted_growth_and_verdict_are_written_in():
    fig = plots.memory_figure(_run(_samples()))
    top, mid, low = fig.axes[:3]
    assert top.get_ylim()[0] == 0  # 1,295 MiB of RSS drawn from 0: a 4 MiB drift looks like one
    assert "Zoomed" in mid.get_title(loc="left") and "MiB" in mid.get_title(loc="left")  # the zoomed panel says so
    text = _texts(fig)
    assert "+4.0 KiB/request" in text and "not rising beyond 1 MiB/request" in text and "verdict: CLEAN" in text
    # the troughs' panel spans at least the growth a leak at the threshold would show after warm-up
    assert low.get_ylim()[1] >= 40
    plots.plt.close(fig)


def _threshold_line(low):
    return next(line for line in low.get_lines() if line.get_label().startswith("growth at the threshold"))


def test_memory_threshold_line_starts_at_the_warm_up_level_not_the_origin():
    # the 1 MiB/request line drawn from (0, 0) left every point above it while the text
    # said "not rising"; it starts where the fit starts (the first idle point after warm-up)
    run = _run(_samples())
    fig = plots.memory_figure(run)
    low = fig.axes[2]
    xs, ys = _threshold_line(low).get_data()
    trend = run.findings.trends[1]
    base = run.replay.idle_points[0].rss_bytes
    assert xs[0] == 40 and xs[-1] == 80  # idle points at 0, 20, 40, 60, 80 requests; fit from 40
    assert ys[0] == pytest.approx((trend.intercept + trend.slope * 40 - base) / MIB)
    assert ys[0] > 2.0  # the warm-up level (about 2.9 MiB above the first point), not 0
    assert ys[-1] - ys[0] == pytest.approx(40.0)  # 1 MiB/request over 40 requests
    # the points after warm-up sit below the line (not rising), so the picture agrees with the words
    fit_ys = [(p.rss_bytes - base) / MIB for p in run.replay.idle_points[2:]]
    assert all(y <= ys[0] + (x - 40) + 0.5 for x, y in zip((40, 60, 80), fit_ys))
    plots.plt.close(fig)
    # no fit (too few points): from the RSS at the first point after warm-up
    short = _run(_samples(), rss_troughs=(1293.6, 1296.0, 1296.5), slope=None)
    fig = plots.memory_figure(short)
    xs, ys = _threshold_line(fig.axes[2]).get_data()
    assert xs[0] == 40 and ys[0] == pytest.approx(1296.5 - 1293.6)
    plots.plt.close(fig)


def test_memory_text_names_the_host_memory_check_only_where_it_ran():
    run = _run(_samples())
    assert "host-memory check" not in plots._growth_text(run)  # --url: it did not run
    run.findings.host_memory = {"verdict": "below threshold"}
    assert "host-memory check" in plots._growth_text(run)


def test_memory_on_a_gpu_plots_what_moves_not_the_preallocated_total():
    n = 50
    fig = plots.memory_figure(_run(_samples(
        n, gpu_used_bytes=[128e9] * n, torch_allocated_bytes=np.linspace(100e9, 100.1e9, n),
        torch_reserved_bytes=[101e9] * n, gpu_process_bytes=[102e9] * n)))
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert {"torch.cuda allocated", "torch.cuda reserved", "GPU memory of the process"} <= set(labels)
    assert any(label.startswith("KV blocks in use") for label in labels)
    assert not any("whole device" in label for label in labels)
    plots.plt.close(fig)


def test_memory_without_a_fit_says_why():
    fig = plots.memory_figure(_run(_samples(), rss_troughs=(1293.6, 1294.0), slope=None))
    assert "not fitted" in _texts(fig) and "verdict: CLEAN" in _texts(fig)
    plots.plt.close(fig)


@pytest.mark.parametrize("peak, zoomed", [(26, False), (6, True)])
def test_blocks_lower_panel_says_zoomed_only_when_it_is(peak, zoomed):
    df = _samples()
    df["num_used_blocks"] = (df["num_used_blocks"] > 0) * peak
    fig = plots.blocks_figure(_run(df))
    top, bottom = fig.axes[:2]
    assert top.get_ylim() == (0, pytest.approx(27 * 1.05))
    label = bottom.get_ylabel()
    assert ("zoomed" in label) == zoomed, label
    assert bottom.get_ylim()[1] <= 27 * 1.05
    if zoomed:
        assert bottom.get_ylim()[1] < 0.8 * 27 and "of 27" in label
    plots.plt.close(fig)
