"""Report files are replaced whole: a Ctrl-C during a watch's rewrite leaves the last complete
report.json, and a second Ctrl-C while the command winds down exits 130 without a traceback."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from vlite.diagnostics.report.render import write_run_report
from vlite.diagnostics.targets.base import TargetRun


class _Detail:
    title, headline_first, timing_first = "a run", True, False

    def sections(self):
        return []

    def to_json(self) -> dict:
        return {}

    def plots(self, out_dir) -> list[str]:
        return []

    def extra_files(self) -> dict[str, str]:
        return {}


def _write(out, verdict: str) -> None:
    run = TargetRun("watch", verdict, verdict, None, pd.DataFrame({"t": [1.0]}), {}, [])
    write_run_report(run, _Detail(), out)


class _Interrupted(io.StringIO):
    """A file whose first write raises KeyboardInterrupt, as a Ctrl-C in the middle of a write."""

    def write(self, s):
        raise KeyboardInterrupt


def test_an_interrupted_rewrite_keeps_the_last_complete_report(tmp_path, monkeypatch):
    out = tmp_path / "rep"
    _write(out, "CLEAN")
    real_open = io.open

    def open_then_interrupt(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode:  # opened for writing (and truncated): the Ctrl-C comes before any byte
            f.close()
            return _Interrupted()
        return f

    monkeypatch.setattr(io, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        _write(out, "LEAK")
    monkeypatch.undo()
    assert json.loads((out / "report.json").read_text())["verdict"] == "CLEAN"
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.json", "report.md", "samples.csv"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_second_ctrl_c_while_the_command_winds_down_exits_quietly():
    # after the guarded block the interrupted command waits on a worker thread at exit, as
    # interpreter shutdown does: a second Ctrl-C there must not raise into the shutdown
    code = ("import threading, time\n"
            "from vlite.cli.interrupt import graceful_interrupt\n"
            "with graceful_interrupt('the test') as stop:\n"
            "    print('ready', flush=True)\n"
            "    while not stop.is_set():\n"
            "        time.sleep(0.01)\n"
            "threading.Thread(target=time.sleep, args=(30,)).start()\n"
            "print('winding down', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "winding down"
    time.sleep(0.3)  # in the interpreter's shutdown, joining the thread
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=10)
    err = proc.stderr.read()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "interrupted again: exiting now" in err
