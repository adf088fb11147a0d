"""CPU threads: the OpenMP wait policy vlite sets (and the user's that it keeps), the start-up
line of ``vlite serve`` / ``vlite bench``, and the oversubscription warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from vlite.engine.worker import cpu_threads
from vlite.engine.worker.cpu_threads import LoadReading, ThreadReport, apply_openmp_defaults


def test_defaults_set_a_short_spin_when_the_user_set_nothing():
    env = {"PATH": "/bin"}
    assert apply_openmp_defaults(env) == {"GOMP_SPINCOUNT": "1000"}
    assert env["GOMP_SPINCOUNT"] == "1000" and env["VLITE_OMP_DEFAULTS_SET"] == "1"


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"),
                                        ("KMP_BLOCKTIME", "1")])
def test_a_users_setting_is_kept(name, value):
    env = {name: value}
    assert apply_openmp_defaults(env) == {}
    assert env == {name: value}


def test_the_vlite_command_runs_its_openmp_with_the_policy():
    """The variable is set before torch's libgomp loads: libgomp itself reports a spin count of 1000
    (``OMP_DISPLAY_ENV``), against its default 300,000, and a user's setting wins."""
    env = {k: v for k, v in os.environ.items() if k not in cpu_threads.WAIT_VARIABLES} | {"OMP_DISPLAY_ENV": "VERBOSE"}
    code = "import vlite.cli.main, torch; torch.ones(1 << 20).sum()"

    def spincount(extra: dict) -> str:
        out = subprocess.run([sys.executable, "-c", code], env=env | extra, capture_output=True, text=True, check=True)
        found = [line.split("=")[1].strip(" '") for line in out.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
        if not found:
            pytest.skip("this torch's OpenMP is not libgomp (no GOMP_SPINCOUNT in OMP_DISPLAY_ENV)")
        return found[0]

    assert spincount({}) == "1000"
    assert spincount({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}) == "300000"


def report(load_1m: float, others: int | None, threads: int = 2, cpus: int = 2) -> ThreadReport:
    return ThreadReport(threads, "GOMP_SPINCOUNT=1000 (set by vlite)", cpus, LoadReading(load_1m, others))


def test_no_warning_on_an_idle_machine_or_with_room_to_spare():
    assert report(0.2, 0).oversubscribed() is None
    assert report(0.4, 1).oversubscribed() is None  # the average says idle, a task flickered
    assert report(3.0, 3, threads=4, cpus=8).oversubscribed() is None  # 4 CPUs left for 3 tasks


def test_warning_when_other_work_takes_the_cpus_vlites_threads_need():
    warning = report(1.1, 1).oversubscribed()
    assert warning and "oversubscribed" in warning and "2 torch threads" in warning and "2 CPUs" in warning
    assert "OMP_NUM_THREADS" in warning
    assert report(5.6, 4, threads=8, cpus=8).oversubscribed()
    assert report(2.0, None).oversubscribed()  # no /proc: the load average alone


def test_read_load_leaves_out_this_process(monkeypatch):
    reading = cpu_threads.read_load()
    assert reading.load_1m >= 0
    if os.path.exists("/proc/loadavg"):
        assert reading.others_runnable is not None and reading.others_runnable >= 0


def _fake_load(monkeypatch, load_1m: float, others: int):
    monkeypatch.setattr(cpu_threads, "read_load", lambda: LoadReading(load_1m, others))
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 2)
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


def test_log_thread_report_logs_its_line_and_warns_only_when_oversubscribed(monkeypatch, caplog):
    log = logging.getLogger("vlite.test_threads")
    _fake_load(monkeypatch, 0.1, 0)
    with caplog.at_level(logging.INFO, logger=log.name):
        cpu_threads.log_thread_report(log)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(lines) == 1 and lines[0][0] == logging.INFO
    assert "torch 2 intra-op" in lines[0][1] and "wait policy" in lines[0][1] and "2 CPUs available" in lines[0][1]
    caplog.clear()
    _fake_load(monkeypatch, 6.5, 5)
    with caplog.at_level(logging.INFO, logger=log.name):
        cpu_threads.log_thread_report(log)
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.INFO, logging.WARNING]
    assert "load average 6.50" in caplog.records[1].getMessage()


def test_bench_prints_the_line_and_the_warning(monkeypatch, capsys):
    from vlite.cli import bench

    _fake_load(monkeypatch, 0.0, 0)
    bench._say_threads()
    quiet = capsys.readouterr().err
    assert "CPU threads: torch 2 intra-op" in quiet and "oversubscribed" not in quiet
    _fake_load(monkeypatch, 4.0, 3)
    bench._say_threads()
    assert "warning:" in capsys.readouterr().err


def test_vlite_serve_logs_its_threads_at_start(vlite_serve, tmp_path):
    vlite_serve()
    log = (tmp_path / "serve-0.log").read_text()
    line = next((x for x in log.splitlines() if "CPU threads:" in x), None)
    assert line is not None, log[-2000:]
    assert "intra-op" in line and "GOMP_SPINCOUNT=1000 (set by vlite)" in line and "CPUs available" in line
