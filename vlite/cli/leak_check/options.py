"""The option groups the ``vlite leak-check`` subcommands share, and the command class that
turns a bad value into one line.

An option group is a dict ``{parameter name: (annotation, typer.Option(...))}``; ``with_group``
puts a group's options into a command's signature and hands the command one ``SimpleNamespace``
of their values, so that each subcommand declares only the options of its own mode.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import typer

from vlite.cli import common

DEFAULT_NUM_REQUESTS = 60
DEFAULT_ABORT_RATE = 0.3
DEFAULT_STORM_REQUESTS = 32
# Help sections (Typer's rich_help_panel, shown by common.PanelledCommand in the plain help).
PANEL_WORKLOAD = "Workload and client aborts"
PANEL_INPROC = "In-process replay"
PANEL_ENGINE = "Engine"
PANEL_SERVER = "The server"
PANEL_MODE = "This mode"
_MIX_HELP = "Abort kind: abort-waiting, abort-prefill, abort-after-tokens, disconnect-stream, client-timeout, or mix."
SMALL_POOL = ("the all-paths workload (the default) instead sizes a deliberately small KV pool, a quarter of what a wave of "
              "requests asks for (25 blocks at --num-requests 60, 39 at 120, 71 at 200), so that preemption happens")
# help_extra of the engine options where the replay sizes the pool itself
ENGINE_HELP = {"kv_cache_memory_bytes": f"Without it or --num-blocks, {SMALL_POOL}.",
               "num_blocks": f"Without it or --kv-cache-memory-bytes, {SMALL_POOL}."}


def _opt(default, *flags, panel=PANEL_WORKLOAD, **kw):
    return typer.Option(default, *flags, rich_help_panel=panel, **kw)


ZOMBIE_S = {
    "zombie_threshold_s": (float, _opt(1.0, "--zombie-threshold-s", panel=PANEL_WORKLOAD, min=0.0, help=(
        "Where no engine step is known: a request outliving its client by more than max(this, 3 x the run's "
        "p99 inter-token latency) seconds is a ZOMBIE."))),
}
# What a replay sends (in process and over HTTP); the fleet takes the first eight.
TRAFFIC = {
    "num_requests": (int, _opt(DEFAULT_NUM_REQUESTS, "--num-requests", min=1, help=(
        "Requests to run: the size of the all-paths (default) and synthetic workloads, and the most read from a "
        "ShareGPT file (a JSONL trace runs whole). It also sizes the waves (a fifth of the run) and the "
        "all-paths KV pool."))),
    "input_len": (str, _opt("16:64", "--input-len", help="Synthetic prompt length range MIN:MAX, tokens.")),
    "output_len": (str, _opt("8:32", "--output-len", help="Synthetic output length range MIN:MAX, tokens.")),
    "request_rate": (float, _opt(float("inf"), "--request-rate",
                                 help="Poisson arrival rate, requests/s (inf = all at once).")),
    "max_concurrency": (int, _opt(64, "--max-concurrency", min=1, help="Most requests in flight.")),
    "abort_rate": (float, _opt(DEFAULT_ABORT_RATE, "--abort-rate", min=0.0, max=1.0, help=(
        "Fraction of requests the client aborts (--abort-mode); 0 tests no abort path, and a CLEAN verdict then "
        "exits 4 instead of 0. A JSONL trace's lines that name a client_action keep it."))),
    "abort_mode": (str, _opt("mix", "--abort-mode", help=_MIX_HELP)),
    "seed": (int, _opt(0, "--seed", help="Seed of the workload and the client actions.")),
}
WORKLOAD = {
    "workload": (str, _opt("all-paths", "--workload", "-w", help=(
        "all-paths (every engine path: prefix hits, preemption, n > 1, beam search, EOS/stop finishes; on a "
        "deliberately small KV pool sized from --num-requests to force preemption, unless --num-blocks or "
        "--kv-cache-memory-bytes is given), synthetic (plain requests), kind-waves (waves of one request kind "
        "each, for host-memory growth per kind), responses (synthetic requests to the Responses API with store on; "
        "--url only), a JSONL trace (.jsonl; schema in docs/reference.md), or a "
        "ShareGPT file (.json)."))),
    **TRAFFIC,
    "prompt_source": (str, _opt("distinct", "--prompt-source", help=(
        "Prompt text of the all-paths and synthetic workloads: distinct (made-up words no request repeats, so "
        "outputs differ too and a cache keyed by content keeps growing) or word-list (a 90-word list: every "
        "token is one of about 90)."))),
    "idle_every": (int | None, _opt(None, "--idle-every", min=0, help=(
        "Wait for the engine to go idle after every N requests, giving the trend its troughs (default: "
        "num_requests/5; 0 = never)."))),
    "n": (int, _opt(1, "--n", min=1, help="Samples per synthetic request (n > 1 forks shared blocks).")),
    "sample_interval_ms": (float, _opt(100.0, "--sample-interval-ms", min=1.0, help="Sampling period, ms.")),
    "zombie_threshold_steps": (int, _opt(2, "--zombie-threshold-steps", min=0, help=(
        "A request outliving its client by more than this many engine steps is a ZOMBIE (in process, and over "
        "HTTP from the server's step counter)."))),
    **ZOMBIE_S,
}


def _show_all(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        ctx.meta["help_all"] = True  # help.LeakCheckCommand then lists every option's whole help
        typer.echo(ctx.get_help())
        raise typer.Exit()


REPORT = {
    "report": (Path | None, _opt(None, "--report", panel=None,
                                           help="Write report.json, report.md, report.html, samples.csv and PNGs here.")),
    "help_all": (bool, typer.Option(False, "--help-all", is_eager=True, callback=_show_all,
                                    help="Every option's whole help, defaults and ranges.")),
}
STORM = {
    "storm_requests": (int, _opt(DEFAULT_STORM_REQUESTS, "--storm-requests", panel=PANEL_SERVER, min=0, help=(
        "Streamed requests of the abort storm after the replay, all cut at once; then the wedge probe (WEDGED) "
        "and the greedy output canary run before any abort (EMPTY-OUTPUT, OUTPUT-DRIFT). 0 = none."))),
    "wedge_timeout_s": (float | None, _opt(None, "--wedge-timeout-s", panel=PANEL_SERVER, min=0.1, help=(
        "Seconds a plain request may take after the abort storm before the server is WEDGED (default: "
        "max(5, 10 x its slowest run before any abort))."))),
}
BLACKBOX = {
    "drain_timeout": (float, _opt(60.0, "--drain-timeout", panel=PANEL_SERVER, min=0.1, help=(
        "Black-box: seconds to wait for the server to go idle (else INCONCLUSIVE, exit 3)."))),
    "bisect_budget": (float, _opt(60.0, "--bisect-budget", panel=PANEL_SERVER, min=0.0,
                                  help="Black-box: seconds for bisecting the leaking requests.")),
    "zombie_max_tokens": (int, _opt(512, "--zombie-max-tokens", panel=PANEL_SERVER, min=0, help=(
        "Black-box: max_tokens of the zombie check's early leavers, one request per client action after the "
        "waves (0 = no zombie check)."))),
}


def server(url_help: str, *, pid: bool = True, kind: bool = True) -> dict:
    """The options that name a server: ``--url`` (with ``url_help``), ``--api-key``, and unless
    turned off ``--server-kind`` and ``--server-pid``."""
    group = {
        "url": (str | None, _opt(None, "--url", panel=PANEL_SERVER, help=url_help)),
        "api_key": (str | None, _opt(None, "--api-key", panel=PANEL_SERVER, help="Bearer key of the server.")),
    }
    if kind:
        group["server_kind"] = (str, _opt("auto", "--server-kind", panel=PANEL_SERVER, help=(
            "auto (from /metrics), vlite, vllm, sglang, llamacpp, tgi or trtllm.")))
    if pid:
        group["server_pid"] = (int | None, _opt(None, "--server-pid", panel=PANEL_SERVER, min=1, help=(
            "The server's root process (default: the one listening on the port).")))
    return group


URL_HELP = "The running server, http://host:port: vlite serve, vLLM, SGLang, llama.cpp, TGI or TensorRT-LLM."


def with_group(param: str, group: dict) -> Callable[[Callable], Callable]:
    """Replace the parameter ``param`` of a Typer command by the options of ``group``; the command
    is called with ``param`` set to a ``SimpleNamespace`` of their values."""

    def decorate(func: Callable) -> Callable:
        sig = inspect.signature(func)
        hints = typing.get_type_hints(func)
        if param not in sig.parameters:
            raise TypeError(f"{func.__name__} must declare a {param!r} parameter")
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
                 for name, (annotation, option) in group.items()]
        params = []
        for p in sig.parameters.values():
            params += added if p.name == param else [
                p.replace(annotation=hints.get(p.name, p.annotation), kind=inspect.Parameter.KEYWORD_ONLY)]

        @functools.wraps(func)
        def command(**kwargs):
            values = SimpleNamespace(**{name: kwargs.pop(name) for name in group})
            return func(**{param: values}, **kwargs)

        del command.__wrapped__  # Typer must read the new signature
        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def check_choices(w: SimpleNamespace) -> None:
    """The workload options whose values are a fixed list: one line (exit 2) for an unknown one."""
    from vlite.diagnostics.workload.actions import ABORT_MODES
    from vlite.diagnostics.workload.sources import PROMPT_SOURCES

    if getattr(w, "prompt_source", "distinct") not in PROMPT_SOURCES:
        common.fail(f"unknown --prompt-source {w.prompt_source!r}; choose one of: {', '.join(PROMPT_SOURCES)}")
    if w.abort_mode not in ABORT_MODES:
        common.fail(f"unknown --abort-mode {w.abort_mode!r}; choose one of: {', '.join(ABORT_MODES)}")


def check_writable(report: Path | None) -> None:
    """Fail (exit 2) before the run if the report directory cannot be created or written."""
    import tempfile

    if report is None:
        return
    try:
        report.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=report, prefix=".write-check-"):
            pass
    except OSError as exc:
        common.fail(f"cannot write the report to {report}: {exc}")
