"""The one interface every leak-check target implements.

A target is where a leak check runs and what it reads: an engine in this process
(``inprocess.InProcessTarget``), a running ``vlite serve`` over HTTP (``http.HttpTarget``), any
OpenAI-compatible server as a black box (``blackbox.BlackboxTarget``), a server watched without
sending a request (``watch.WatchTarget``), a range a Prometheus server holds
(``prometheus_range.PrometheusTarget``), or a server's stats log after the fact
(``from_log.LogTarget``). ``vlite leak-check`` builds one from its options and calls only this
interface: ``target.run(plan, stop=...)`` returns a ``TargetRun``, whose report the CLI prints and
writes the same way for every target (``report/target_report.py``); a fleet of replicas behind a
router (``fleet.FleetTarget``) is one more target.

Each target class wraps its module's entry function (``run_in_process``, ``run_http``,
``run_blackbox``, ``watch``, ``judge_range``, ``analyze_log``), which keeps its own signature.
``TargetRun.result`` holds the mode's detail, a ``RunDetail``: whatever the mode, the reports ask
it only for its sections, its report.json fields, its plots and its extra files.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

# Exit codes by verdict (``checks/verdict.py``); 2 is a usage error.
# exit_code and EXIT_HEADLINE_NOT_EXERCISED are imported from here by the CLI and tests.
from vlite.diagnostics.checks.verdict import EXIT_HEADLINE_NOT_EXERCISED, exit_code, run_exit_code  # noqa: F401

if TYPE_CHECKING:  # types only: importing the checks loads torch, and the CLI imports this module early
    import pandas as pd

    from vlite.diagnostics.checks.result import RunResult
    from vlite.diagnostics.workload.replay import ReplayResult
    from vlite.diagnostics.workload.sources import RequestSpec

class TargetError(RuntimeError):
    """The target cannot be reached or read (the message is one line: what was wrong)."""


def default_wave(num_specs: int, idle_every: int | None) -> int:
    """Requests per wave (between two idle points): ``idle_every`` when given, else a fifth of the
    run but at least 16 (or all): enough troughs for the trend, few enough drains to keep batches full."""
    if idle_every is not None:
        return idle_every
    return max(1, num_specs // 5, min(num_specs, 16))


@dataclass
class Section:
    """A titled piece of a human report (terminal and report.md), as data: the reporters in
    ``report/target_report.py`` format it, the mode's section builders only fill it in.

    Attributes:
        title: "## title" in report.md; the title of the table on the terminal (None: untitled).
        text: a paragraph, as written (Markdown; printed as is on the terminal).
        lines: bullet points in report.md, one line each on the terminal; an item may be a
            ``(text, style)`` pair, style a Rich style for the terminal ("yellow").
        rows, cols: a table (``rows`` of dicts over the column names ``cols``); None: no table.
            An empty table reads "_none_" in report.md and is left off the terminal.
        limit: the most rows report.md shows (the rest are in report.json); ``terminal_limit``
            the most the terminal shows.
        terminal, markdown: where the section appears.
        bullets: report.md writes ``lines`` as "- " bullets (False: as plain lines).
    """

    title: str | None = None
    text: str | None = None
    lines: list = field(default_factory=list)
    rows: list[dict] | None = None
    cols: tuple[str, ...] = ()
    limit: int = 30
    terminal_limit: int = 20
    terminal: bool = True
    markdown: bool = True
    bullets: bool = True


@runtime_checkable
class RunDetail(Protocol):
    """What a mode adds to the common header of a ``TargetRun``; the reporters read it through
    this interface only, whatever the mode.

    Attributes:
        title: report.md's heading ("vlite leak-check report (blackbox: vllm)").
        headline_first: the terminal report opens with the verdict line (False for a watch,
            whose idle points and alerts were printed as they came).
        timing_first: the terminal report puts the timing line (requests, seconds, samples)
            before the verdict line, not after the findings (a black box: what was sent, then
            what it left).
    """

    title: str
    headline_first: bool
    timing_first: bool

    def sections(self) -> list[Section]:
        """The mode's sections of the human reports, in order (between "Run" and "Notes")."""
        ...

    def to_json(self) -> dict:
        """The mode's fields of report.json (JSON-serialisable, ``default=str`` aside)."""
        ...

    def plots(self, out_dir) -> list[str]:
        """Write the mode's PNG plots into ``out_dir``; returns their file names (none: [])."""
        ...

    def extra_files(self) -> dict[str, str]:
        """Files besides the common ones to write into the report directory: name -> text."""
        ...


def _silent(line: str) -> None:
    pass


@dataclass
class TargetPlan:
    """What a run sends and how it samples; each target reads the fields it needs.

    Attributes:
        specs: the requests to replay (none for the passive targets: watch, Prometheus, log).
        max_concurrency: the most requests in flight.
        idle_every: requests per wave, each followed by an idle point (0: one wave; None: the
            target's default, ``default_wave`` for the in-process and vlite-serve targets).
        sample_interval_s: the sampler's period, seconds.
        seed, abort_rate, abort_mode: the workload's seed and client-action mix (the black-box
            target redraws the actions of its waves from them).
        trace: the specs come from a JSONL trace: the black-box target replays their actions as
            written.
        zombie_options: ``checks/zombie.py`` thresholds (``threshold_s``, ``threshold_steps``).
        info: run facts to add to the report's ``run`` table (workload options).
        on_line: called with each progress line (what the run does, watch idle points, alerts).
        on_report: called with the run so far at each checkpoint (a watch's idle points), so that
            a report directory stays current while the run goes on.
        trace_allocations: the in-process target traces Python allocations over the replay
            (``alloc_trace.py``).
        trace_gpu_allocations: the in-process and vlite-serve targets name the CUDA allocation
            sites that grew over the replay (``gpu_alloc_trace.py``).
        on_progress: called as ``on_progress(phase, done, total)`` during a phase before the
            replay ("calibration": greedy runs of ``workload/calibrate.py``), at its start (0)
            and after each step of it; the last call has ``done == total`` unless a Ctrl-C cut
            the phase short.
        cache_probe_requests: the in-process target's cache-versus-leak probe: at most this many
            distinct requests (None: its default; 0: no probe; ``inprocess.cache_probe``).
    """

    specs: list[RequestSpec] = field(default_factory=list)
    max_concurrency: int = 32
    idle_every: int | None = None
    sample_interval_s: float = 0.1
    seed: int = 0
    abort_rate: float = 0.0
    abort_mode: str = "mix"
    trace: bool = False
    zombie_options: dict | None = None
    info: dict = field(default_factory=dict)
    on_line: Callable[[str], None] = _silent
    on_report: Callable[[TargetRun], None] | None = None
    trace_allocations: bool = False
    trace_gpu_allocations: bool = False
    on_progress: Callable[[str, int, int], None] | None = None
    cache_probe_requests: int | None = None

    def wave_size(self) -> int:
        """Requests per wave for this plan's specs (``default_wave``)."""
        return default_wave(len(self.specs), self.idle_every)

    def replay_options(self) -> dict:
        """The keyword arguments of ``run_in_process`` and ``run_http`` besides the specs and ``stop``."""
        return {"max_concurrency": self.max_concurrency, "idle_every": self.wave_size(),
                "sample_interval_s": self.sample_interval_s, "info": self.info, "zombie_options": self.zombie_options,
                "on_progress": self.on_progress}


@dataclass
class TargetRun:
    """A finished (or stopped) run of any target, with what every target can give.

    Attributes:
        kind: the target's kind (``LeakCheckTarget.kind``).
        verdict: CLEAN, LEAK, ZOMBIE, HOST-LEAK, ENGINE-ERROR, WEDGED, EMPTY-OUTPUT, OUTPUT-DRIFT,
            INCONCLUSIVE or INTERRUPTED.
        summary: the one-line verdict ("LEAK: 12 blocks held by ...").
        result: the mode's detail (a ``RunDetail``): a ``RunResult`` (in-process, vlite serve), a
            ``blackbox.BlackboxResult`` (black box, log), a ``watch.WatchResult`` (watch,
            Prometheus) or a ``fleet.FleetResult`` (fleet).
        samples: the samples taken while it ran (one row per sample; possibly empty).
        info: run facts (the report's ``run`` table); the same dict as the result's.
        notes: lines the report adds under "notes"; the same list as the result's.
        replay: the client's requests and idle points; None where no client ran (watch, Prometheus).
        interrupted: what a first Ctrl-C stopped, in words; None for a run that went to its end.
        headline_not_exercised: CLEAN, but the run walked (or, as a black box, sent) no client
            abort: none of ``checks/coverage.py``'s HEADLINE paths. Exit 4, not 0.
    """

    kind: str
    verdict: str
    summary: str
    result: RunDetail
    samples: pd.DataFrame
    info: dict
    notes: list[str]
    replay: ReplayResult | None = None
    interrupted: str | None = None
    headline_not_exercised: bool = False

    @property
    def exit_code(self) -> int:
        """The command's exit code for this run's verdict (``exit_code``); 4 for a CLEAN run
        whose headline paths (client aborts) were not exercised."""
        return run_exit_code([self.verdict], headline_not_exercised=self.headline_not_exercised)

    @classmethod
    def of_run_result(cls, kind: str, run: RunResult) -> TargetRun:
        """The ``TargetRun`` of a ``RunResult`` (the in-process and vlite-serve targets)."""
        f = run.findings
        return cls(kind, f.verdict, f.summary(), run, run.samples, run.info, f.notes, run.replay, f.interrupted,
                   headline_not_exercised=f.headline_not_exercised)


@runtime_checkable
class LeakCheckTarget(Protocol):
    """Where a leak check runs and what it reads; ``vlite leak-check`` drives every target through this.

    Attributes:
        kind: "in-process", "vlite-serve", "blackbox", "watch", "prometheus", "log" or "fleet".
        interruptible: the words for what a first Ctrl-C stops ("the replay", "the watch") when
            ``run`` honours ``stop`` (it then ends early and still reports); None when it does not
            (a first Ctrl-C ends the command as usual).
    """

    kind: str
    interruptible: str | None

    def describe(self) -> str:
        """One line: what is checked, and where (e.g. "vllm at http://127.0.0.1:8000")."""
        ...

    def run(self, plan: TargetPlan, *, stop: threading.Event | None = None) -> TargetRun:
        """Run ``plan`` against the target and judge it. ``stop`` (set by a first Ctrl-C): end
        early, drain, and return what was measured.

        Raises:
            TargetError: the target cannot be reached or read.
        """
        ...
