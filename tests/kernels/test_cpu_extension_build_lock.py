"""The C++ extension's build lock: a ``lock`` file left by a killed build is cleared instead of
making every later start wait forever, and a build running in another process is waited for."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from vlite.kernels.cpu_extension import build_lock


def test_a_stale_torch_lock_left_by_a_killed_build_is_removed(tmp_path):
    (tmp_path / "lock").write_text("")  # what torch's FileBaton leaves when its build is killed
    with build_lock(tmp_path, wait_s=1.0):
        assert not (tmp_path / "lock").exists()


def _hold(path: str, ready, seconds: float) -> None:
    from pathlib import Path

    with build_lock(Path(path), wait_s=5.0):
        (Path(path) / "lock").write_text("")  # a live build's baton
        ready.set()
        time.sleep(seconds)
        (Path(path) / "lock").unlink()


def test_a_build_in_another_process_is_waited_for_and_its_baton_kept(tmp_path):
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold, args=(str(tmp_path), ready, 1.0))
    proc.start()
    try:
        assert ready.wait(10)
        with pytest.raises(TimeoutError, match="another process has been building"):
            with build_lock(tmp_path, wait_s=0.3):
                pass
        assert (tmp_path / "lock").exists()  # a live build's baton is not touched
        t0 = time.monotonic()
        with build_lock(tmp_path, wait_s=10.0):
            assert time.monotonic() - t0 > 0.3  # it waited for the other build to end
    finally:
        proc.join(10)
    assert proc.exitcode == 0


def test_a_killed_holder_releases_the_lock(tmp_path):
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold, args=(str(tmp_path), ready, 60.0))
    proc.start()
    assert ready.wait(10)
    proc.kill()
    proc.join(10)
    assert (tmp_path / "lock").exists()  # the killed build left torch's baton behind
    with build_lock(tmp_path, wait_s=2.0):
        assert not (tmp_path / "lock").exists()


def test_the_build_notice_says_where_its_range_comes_from_and_the_end_gives_the_measured_time(
        monkeypatch, tmp_path, caplog):
    # a busy 2-core EPYC takes about 4 minutes: the notice must not promise "30-150 s"
    import logging

    import torch.utils.cpp_extension

    from vlite.kernels import cpu_extension

    clock = iter([100.0, 100.0 + 183.4])
    monkeypatch.setattr(cpu_extension.time, "monotonic", lambda: next(clock, 300.0))
    monkeypatch.setattr(cpu_extension, "_already_built", lambda name: False)
    monkeypatch.setattr(cpu_extension, "_build_directory", lambda name: None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: "the module")
    with caplog.at_level(logging.WARNING, logger="vlite.kernels"):
        assert cpu_extension._build() == "the module"
    notice, done = [r.getMessage() for r in caplog.records]
    assert "once per machine and venv" in notice and "Intel" in notice and "2-core AMD EPYC" in notice
    assert "about 4 min" in notice and "30-150" not in notice
    assert "ready after 183 s on this machine" in done and "load average" in done
