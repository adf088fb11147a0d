"""The words of a leak-check report, for tests that read them: the console report and report.md of
an in-process / vlite-serve run (``RunResult``) or a black-box one (``BlackboxResult``), and the
text written into memory.png; ``assert_no_none`` fails on a Python ``None`` that leaked into them."""

from __future__ import annotations

import re

from rich.console import Console

_NONE = re.compile(r"\bNone\b")


def assert_no_none(text: str) -> None:
    """Fail with the offending lines when ``text`` prints the word None."""
    hits = [line for line in text.splitlines() if _NONE.search(line)]
    assert not hits, "the report prints None:\n" + "\n".join(hits)


def _console() -> Console:
    return Console(record=True, width=250, force_terminal=False, color_system=None)


def run_result_text(run) -> str:
    """Console report + report.md + memory.png's text box of a ``RunResult``."""
    from vlite.diagnostics.report import plots
    from vlite.diagnostics.report.report import print_report, report_markdown

    console = _console()
    print_report(run, console)
    return "\n".join([console.export_text(), report_markdown(run, []), plots._growth_text(run)])


def blackbox_text(res) -> str:
    """Console report + report.md of a ``BlackboxResult``."""
    from vlite.diagnostics.report.blackbox_report import print_blackbox, report_markdown

    console = _console()
    print_blackbox(res, console)
    return "\n".join([console.export_text(), report_markdown(res, [])])
