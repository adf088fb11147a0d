"""Ctrl-C that keeps what was measured: the first SIGINT asks a long run to stop and report, the
second exits at once, also after the measured block while the command winds down.

``graceful_interrupt()`` is a context manager for the part of a command that measures (a
leak-check replay, a benchmark's timed loop). Inside it the first SIGINT does not raise: it
sets ``stop`` (a ``threading.Event`` the run polls), and the command drains, writes its report
of what it measured so far, and says where it is. A second SIGINT exits at once with code 130
(128 + SIGINT, the shell's convention), without waiting for anything. Outside the block Ctrl-C
behaves as usual (``KeyboardInterrupt``): before the run starts there is nothing to keep.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EXIT_INTERRUPTED = 130  # 128 + SIGINT


@contextmanager
def graceful_interrupt(what: str | Callable[[], str] = "the run") -> Iterator[threading.Event]:
    """Within the block, the first SIGINT sets the yielded event (the run stops, drains and
    reports); a second one exits at once with code 130, also while the report is written (keep
    the report writing inside the block). Only the main thread can install a
    signal handler; elsewhere (a test runner's worker thread) the block runs with Ctrl-C as is.

    Args:
        what: the words for the run in the message printed at the first Ctrl-C, or a function
            that returns them for the phase the run is in ("the calibration", "the replay").
    """
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_sigint(signum, frame) -> None:
        if stop.is_set():
            _exit_now(signum, frame)
        stop.set()
        words = what() if callable(what) else what
        sys.stderr.write(f"\ninterrupted: stopping {words}, draining for a few seconds and writing the report of "
                         "what was measured (Ctrl-C again to exit now)\n")
        sys.stderr.flush()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stop
    finally:
        # once interrupted, the command is on its way out (atexit joins threads): a further
        # Ctrl-C exits quietly instead of raising KeyboardInterrupt into an atexit callback
        signal.signal(signal.SIGINT, _exit_now if stop.is_set() else previous)


def _exit_now(signum, frame) -> None:
    """A second Ctrl-C: exit 130 at once (no thread joins, no drain). Reports are replaced whole
    (``report/atomic.py``), so the last complete one stays."""
    sys.stderr.write("\ninterrupted again: exiting now, nothing more is written\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)
