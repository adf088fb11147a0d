"""The sections of a passive watch (``--watch``) or a Prometheus range (``--prometheus``): pure
functions from the watch's facts to ``Section``s and report.json fields. The report directory is
rewritten at each idle point (``report/target_report.write_run_report``), so it is current while
the watch runs; a watch has no plots."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from vlite.diagnostics.targets.base import Section

_GREEN = ("CLEAN",)
_YELLOW = ("INCONCLUSIVE",)  # every other verdict red


def _memory_line(m: dict) -> str:
    source = f" ({m['source']})" if m.get("source") else ""
    slope = ("not fitted" if m.get("late_slope") is None else
             f"{m['late_slope'] / 1024:.1f} KiB/request (95% CI {m['late_ci95'][0] / 1024:.1f} .. "
             f"{m['late_ci95'][1] / 1024:.1f})")
    state = ("keeps growing" if m["keeps_growing"] else
             "inconclusive (the CI straddles the threshold)" if m.get("inconclusive") else
             "levelled off (warm-up)" if m["warm_up"] else "below the threshold")
    return f"Host memory{source}: plateau test over {m['n']} idle points: late-half slope {slope}: {state}\n"


def sections(res) -> list[Section]:
    """A fleet's verdict per replica (the terminal; the idle points and alerts were printed as
    they came), then report.md's replicas, alerts, idle points and host-memory plateau test."""
    replicas = [(f"replica {row['instance']}: {row['summary']}",
                 "green" if row["verdict"] in _GREEN else "yellow" if row["verdict"] in _YELLOW else "red")
                for row in res.instances or []]
    pts = [asdict(p) for p in res.idle_points]
    for p in pts:
        p["time"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p["time"]))
    alerts = [asdict(a) | {"time": time.strftime("%H:%M:%S", time.localtime(a.time))} for a in res.alerts]
    out = [Section(lines=replicas, markdown=False)]
    if res.instances:
        out.append(Section("Replicas (a verdict each)", rows=res.instances, limit=200, terminal=False,
                           cols=("instance", "verdict", "idle_points", "kv_total", "summary")))
    out += [Section("Alerts", text=None if alerts else "_none_\n", rows=alerts or None, terminal=False,
                    cols=("flag", "time", "idle_point", "message")),
            Section("Natural idle points (running == waiting == 0)", rows=pts, limit=200, terminal=False,
                    cols=("index", "time", "kv_used", "requests_served", "memory_bytes", "uncounted"))]
    if res.memory_test:
        out.append(Section(text=_memory_line(res.memory_test), terminal=False))
    return out


def report_json(res) -> dict:
    """The watch's fields of report.json."""
    return {"server_kind": res.server_kind, "unit": res.unit, "alerts": [asdict(a) for a in res.alerts],
            "idle_points": [asdict(p) for p in res.idle_points], "memory_test": res.memory_test,
            "instances": res.instances}


def write_watch_report(res, out_dir: Path) -> Path:
    """Write the report directory of a watch (``render.write_run_report``); called at each
    idle point, so the report stays current. Returns ``out_dir``.

    Raises:
        OSError: the directory cannot be created or written.
    """
    from vlite.diagnostics.report.render import write_run_report

    write_run_report(res.as_target_run("watch"), WatchView(res), out_dir)
    return Path(out_dir)


class WatchView:
    """A watch or a Prometheus range as a ``RunDetail`` (no plots)."""

    headline_first = False  # the idle points and alerts were printed as they came
    timing_first = False

    def __init__(self, res) -> None:
        self.res = res
        self.title = f"vlite leak-check --watch report ({res.server_kind})"

    def sections(self) -> list[Section]:
        return sections(self.res)

    def to_json(self) -> dict:
        return report_json(self.res)

    def plots(self, out_dir) -> list[str]:
        return []

    def extra_files(self) -> dict[str, str]:
        return {}
