"""Every leak-check target implements ``LeakCheckTarget`` (``targets/base.py``), and each one runs
through that interface on the cheapest input there is: the log target on a recorded log, the
Prometheus target on a recorded range, the watch and black-box targets on fake servers, the
in-process target on the tiny model, the vlite-serve target on a tiny `vlite serve`. The report of
every run is printed and written by the same three calls (``report/target_report.py``)."""

from __future__ import annotations

import inspect
import json
import threading
from pathlib import Path

import httpx
import pytest
from conftest import make_engine
from fake_http import ServerPool
from rich.console import Console
from serve_harness import ServerProcess, running
from test_leak_blackbox import _Fake, _vllm_page, stepping_server  # noqa: F401 (a fixture)
from test_leak_prometheus import _recorded, _transport

from vlite.diagnostics.report.target_report import print_run, print_run_verdict, write_run_report
from vlite.diagnostics.targets.base import LeakCheckTarget, TargetError, TargetPlan, TargetRun, exit_code
from vlite.diagnostics.targets.blackbox import BlackboxTarget
from vlite.diagnostics.targets.connection import connect
from vlite.diagnostics.targets.from_log import LogError, LogTarget
from vlite.diagnostics.targets.http import HttpTarget
from vlite.diagnostics.targets.inprocess import InProcessTarget
from vlite.diagnostics.targets.prometheus_range import PrometheusTarget
from vlite.diagnostics.targets.watch import WatchTarget
from vlite.diagnostics.workload.sources import synthetic_workload

FIX = Path(__file__).parent / "fixtures"
TARGETS = (InProcessTarget, HttpTarget, BlackboxTarget, WatchTarget, PrometheusTarget, LogTarget)


def _plan(**kw) -> tuple[TargetPlan, list[str]]:
    lines: list[str] = []
    return TargetPlan(on_line=lines.append, **kw), lines


def _told(run: TargetRun, tmp_path: Path) -> tuple[str, set[str]]:
    """The console report and the files of the report directory, through the one dispatcher."""
    console = Console(record=True, width=200)
    print_run(run, console, timing="TIMING LINE")
    print_run_verdict(run, console, prefix="verdict: ")
    files = write_run_report(run, tmp_path / "report")
    names = {p.name for p in (tmp_path / "report").iterdir()}
    assert {f for f in files.split(", ") if "*" not in f} <= names
    return console.export_text(), names


def _check_run(run: TargetRun, kind: str) -> None:
    assert isinstance(run, TargetRun) and run.kind == kind
    # a CLEAN run that walked no client abort exits 4, every other run by its verdict
    expected = 4 if run.verdict == "CLEAN" and run.headline_not_exercised else exit_code(run.verdict)
    assert run.summary.startswith(run.verdict) and run.exit_code == expected
    assert run.info is run.result.info and run.samples is run.result.samples


def test_every_target_class_has_the_interface():
    kinds = [cls.kind for cls in TARGETS]
    assert kinds == ["in-process", "vlite-serve", "blackbox", "watch", "prometheus", "log"]
    for cls in TARGETS:
        assert callable(cls.describe) and cls.interruptible in (None, "the replay", "the watch"), cls
        params = inspect.signature(cls.run).parameters
        assert list(params)[:2] == ["self", "plan"] and params["stop"].kind is inspect.Parameter.KEYWORD_ONLY, cls
    # the runtime check is not vacuous: an object without run() is not a target
    assert isinstance(LogTarget(Path("x.log")), LeakCheckTarget)
    assert isinstance(HttpTarget("http://127.0.0.1:1"), LeakCheckTarget)
    assert not isinstance(type("NoRun", (), {"kind": "x", "interruptible": None, "describe": lambda s: ""})(),
                          LeakCheckTarget)


def test_exit_codes_by_verdict():
    assert [exit_code(v) for v in ("CLEAN", "LEAK", "ZOMBIE", "HOST-LEAK", "INCONCLUSIVE", "INTERRUPTED")] == \
        [0, 1, 1, 1, 3, 130]


def test_log_target_on_recorded_logs(tmp_path):
    clean = LogTarget(FIX / "vllm-0.32.0-cpu-clean-run.log")
    leaky = LogTarget(FIX / "vlite-serve-skip-free-on-abort.log")
    assert isinstance(clean, LeakCheckTarget) and "vllm-0.32.0-cpu-clean-run.log" in clean.describe()
    plan, lines = _plan()
    run = clean.run(plan)
    _check_run(run, "log")
    assert run.verdict == "CLEAN" and run.exit_code == 0 and run.info["target"] == "log"
    assert len(lines) == 1 and lines[0].startswith(f"leak-check log {clean.path}: ")
    run = leaky.run(_plan()[0])
    assert run.verdict == "LEAK" and run.exit_code == 1 and run.result.unit == "blocks"
    text, names = _told(run, tmp_path)
    assert text.index("TIMING LINE") < text.index("server: vlite") and text.splitlines()[-1].startswith("verdict: LEAK")
    assert {"report.json", "report.md", "report.html", "samples.csv"} <= names
    assert json.loads((tmp_path / "report" / "report.json").read_text())["verdict"] == "LEAK"
    with pytest.raises(TargetError, match="cannot read log"):  # the CLI's one-line error
        LogTarget(tmp_path / "missing.log").run(TargetPlan())
    assert issubclass(LogError, ValueError)  # as before


def test_prometheus_target_on_a_recorded_range(tmp_path):
    rec = _recorded("vlite-leak")
    target = PrometheusTarget("http://prom:9090", "vlite-leak", rec["since"], step_s=rec["step_s"], end=rec["end"],
                              client=httpx.Client(transport=_transport(rec)))
    assert isinstance(target, LeakCheckTarget) and target.describe().endswith(f"the last {rec['since']}")
    plan, lines = _plan()
    run = target.run(plan)
    _check_run(run, "prometheus")
    assert run.verdict == "LEAK" and run.replay is None and run.info["mode"] == "prometheus"
    assert lines[0] == f"leak-check prometheus: {target.describe()}" and any(ln.startswith("ALERT kv-held")
                                                                              for ln in lines)
    text, names = _told(run, tmp_path)
    assert "TIMING LINE" not in text and names == {"report.json", "report.md", "report.html", "samples.csv"}
    with pytest.raises(ValueError, match="--since must be"):
        PrometheusTarget("http://prom:9090", "job", "yesterday")
    with pytest.raises(ValueError, match="needs --job"):
        PrometheusTarget("http://prom:9090", None, "6h")


@pytest.fixture
def idle_vllm():
    pool = ServerPool()
    yield pool.start(type("H", (_Fake,), {"metrics": _vllm_page(0)}))
    pool.close()


def test_watch_target_on_a_fake_idle_server(idle_vllm, tmp_path):
    target = WatchTarget(connect(idle_vllm), interval_s=0.05, duration_s=0.6)
    assert isinstance(target, LeakCheckTarget) and target.describe() == f"vllm at {idle_vllm}"
    reports: list[TargetRun] = []
    plan, lines = _plan()
    plan.on_report = reports.append
    run = target.run(plan, stop=threading.Event())
    _check_run(run, "watch")
    # one natural idle point (the baseline) and no traffic: no verdict either way
    assert run.verdict == "INCONCLUSIVE" and run.exit_code == 3 and len(run.result.idle_points) == 1
    assert lines[0].startswith(f"leak-check --watch: vllm at {idle_vllm}, scraping every 0.05 s for 0.6 s")
    assert any(ln.startswith("idle point 1") for ln in lines)
    assert len(reports) == 2 and all(r.kind == "watch" for r in reports)  # at the idle point and at the end
    stopped = threading.Event()
    stopped.set()  # a first Ctrl-C before the first scrape
    run = WatchTarget(connect(idle_vllm), interval_s=0.05).run(TargetPlan(), stop=stopped)
    assert run.info["stopped_by"] == "Ctrl-C" and run.verdict == "INCONCLUSIVE"


def test_blackbox_target_on_a_fake_leaking_server(stepping_server, tmp_path):  # noqa: F811 (the fixture)
    url = stepping_server(leak_per_request=1)
    target = BlackboxTarget(connect(url), drain_timeout_s=5, bisect_budget_s=0)
    assert isinstance(target, LeakCheckTarget) and target.describe() == f"vllm at {url}"
    specs = synthetic_workload(4, input_len=(8, 8), output_len=(4, 4), seed=1)
    plan, lines = _plan(specs=specs, idle_every=2, trace=True, info={"workload": "x.jsonl"})
    run = target.run(plan)
    _check_run(run, "blackbox")
    assert run.verdict == "LEAK" and run.result.residual == 4.0 and len(run.replay.requests) == 4
    assert run.info["idle_every"] == 2 and run.info["workload"] == "x.jsonl" and run.info["num_waves"] == 2
    assert lines == [f"leak-check (black-box): 4 requests in 2 waves against vllm at {url}, "
                     "block_size 128 tokens, pool 100 blocks"]  # no zombie check asked for
    text, names = _told(run, tmp_path)
    assert text.index("TIMING LINE") < text.index("server: vllm")  # the black-box report's order
    assert "reproducer.jsonl" not in names  # bisection had no budget


def test_in_process_target_on_the_tiny_model(tiny_checkpoint, tmp_path):
    target = InProcessTarget(make_engine(tiny_checkpoint, num_blocks=64))
    assert isinstance(target, LeakCheckTarget) and target.describe().endswith("(cpu)")
    specs = synthetic_workload(6, input_len=(8, 16), output_len=(4, 8), abort_rate=0.5, abort_mode="mix", seed=2)
    plan, lines = _plan(specs=specs, idle_every=3, sample_interval_s=0.05, abort_rate=0.5, info={"seed": 2})
    run = target.run(plan, stop=threading.Event())
    _check_run(run, "in-process")
    assert run.verdict == "CLEAN" and run.exit_code == 0, run.summary
    assert run.info["target"] == "in-process" and run.info["seed"] == 2 and len(run.replay.requests) == 6
    assert len(run.replay.idle_points) == 3  # baseline + one per wave of 3
    assert lines == [f"leak-check: 6 requests on {target.describe()}, 64 KV blocks, abort rate 0.5 (mix); "
                     "Ctrl-C stops early and still writes the report"]
    text, names = _told(run, tmp_path)
    assert text.index("drain invariant") < text.index("TIMING LINE")  # the in-process report's order
    assert {"report.json", "report.md", "report.html", "samples.csv"} <= names


@pytest.fixture
def tiny_serve(tiny_model_dir, tmp_path):
    yield from running(ServerProcess(tiny_model_dir, tmp_path / "serve.log", "--num-blocks", "96",
                                     "--enable-debug-endpoints"))


def test_vlite_serve_target_on_a_tiny_server(tiny_serve, tmp_path):
    target = HttpTarget(tiny_serve.base_url + "/")
    assert isinstance(target, LeakCheckTarget) and target.describe() == f"vlite serve at {tiny_serve.base_url}"
    specs = synthetic_workload(4, input_len=(8, 16), output_len=(4, 8), seed=4, prefix="iface")
    plan, lines = _plan(specs=specs, idle_every=2, sample_interval_s=0.05)
    run = target.run(plan, stop=threading.Event())
    _check_run(run, "vlite-serve")
    assert run.verdict == "CLEAN" and run.info["target"] == "http" and run.info["debug_endpoints"], run.summary
    assert run.headline_not_exercised and run.exit_code == 4  # no client abort in this workload
    assert [r.outcome for r in run.replay.requests] == ["finished"] * 4 and lines == []
    with pytest.raises(TargetError, match="is not"):
        HttpTarget("ftp://127.0.0.1:1").run(TargetPlan(specs=specs))
