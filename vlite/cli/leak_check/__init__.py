"""``vlite leak-check``: find KV-cache and memory leaks, one subcommand per mode (``replay`` in
process, ``url`` and ``blackbox`` against a running server, ``watch``, ``prometheus``, ``log``,
``fleet``, ``scenario``); the bare command runs ``replay``.

Exit codes (``EPILOG``, the end of ``--help``): 0 CLEAN, 1 LEAK / ZOMBIE / HOST-LEAK / ENGINE-ERROR /
WEDGED / EMPTY-OUTPUT / OUTPUT-DRIFT (or a scenario failed), 2 usage error or a target that cannot be
reached, 3 INCONCLUSIVE, 4 CLEAN but no client abort was exercised, 130 INTERRUPTED.
"""

from __future__ import annotations

import typer

from vlite.cli.leak_check.group import LeakCheckGroup
from vlite.cli.leak_check.help import LeakCheckCommand
from vlite.cli.leak_check.options import DEFAULT_ABORT_RATE, DEFAULT_NUM_REQUESTS  # noqa: F401 (public)
from vlite.cli.leak_check.scenario import SCENARIO_NAMES  # noqa: F401 (public)

# Plain help (main.py): "\b" keeps click from re-wrapping a paragraph.
EPILOG = """\b
Verdicts and exit codes:
  0    CLEAN         blocks back on the free list, no per-request state left
  4    CLEAN, but no client abort (waiting, prefill or decode) was exercised
  1    LEAK          blocks or per-request state left after the drain
  1    ZOMBIE        requests outlived their clients
  1    HOST-LEAK     host memory keeps growing past warm-up
  1    ENGINE-ERROR  the engine raised on add/abort/step, or --url answered 5xx
  1    WEDGED        after an abort storm /health says 200, a plain request hangs
  1    EMPTY-OUTPUT  after an abort storm the greedy canary gets zero tokens
  1    OUTPUT-DRIFT  after an abort storm the greedy canary's text changed
  1    a scenario failed
  2    usage error, or a target that cannot be reached or read (one line)
  3    INCONCLUSIVE  never drained, no KV gauge, no idle stretch, or every
                     request ended in an engine error
  130  INTERRUPTED   Ctrl-C: the report of what was measured is written

\b
Examples, one per subcommand:
  vlite leak-check                                  # replay in process: 60 requests, 30% aborted
  vlite leak-check --report leak-report             # + report.json, report.md, PNGs
  vlite leak-check url --url http://127.0.0.1:8000 --num-requests 40 --abort-rate 0.4
  vlite leak-check blackbox --url http://127.0.0.1:8000   # /metrics only (vLLM, SGLang, ...)
  vlite leak-check watch --url http://127.0.0.1:8000 --duration 600
  vlite leak-check prometheus --prometheus http://prom:9090 --job vllm --since 6h
  vlite leak-check log server.log
  vlite leak-check fleet --url http://router:8100 --replica http://r1:8000 --replica http://r2:8000
  vlite leak-check scenario all                     # the fixed scenarios

The older spelling (--url U --blackbox, --from-log F, --scenario all, ...) still works.
docs/leak-check/README.md: which subcommand answers which question."""

app = typer.Typer(cls=LeakCheckGroup, rich_markup_mode=None, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"max_content_width": 100})


@app.callback(epilog=EPILOG)
def leak_check() -> None:
    """Find KV-cache leaks: replay a workload with client aborts, drain, and name the origin of every block left.

    Without a subcommand it runs replay. Exit 0 CLEAN, 1 a leak, 2 usage error, 3 INCONCLUSIVE, 4 CLEAN with
    no client abort exercised (every verdict and code below).
    """


def _register() -> None:
    from vlite.cli.leak_check import fleet, log, prometheus, replay, scenario, url, watch

    for name, func in (("replay", replay.replay), ("url", url.url), ("blackbox", url.blackbox),
                       ("watch", watch.watch), ("prometheus", prometheus.prometheus), ("log", log.log),
                       ("fleet", fleet.fleet), ("scenario", scenario.scenario)):
        app.command(name, cls=LeakCheckCommand)(func)


_register()
