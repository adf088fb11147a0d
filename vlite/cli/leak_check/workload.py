"""The workload of a replay (in process or over HTTP): read the workload options, build the
request specs and the ``TargetPlan`` the target runs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import typer

from vlite.cli import common


def token_range(text: str, name: str) -> tuple[int, int]:
    """``MIN:MAX`` (or ``N``) tokens as ``(min, max)``; one line (exit 2) when it is not that."""
    try:
        lo, _, hi = text.partition(":")
        return int(lo), int(hi or lo)
    except ValueError:
        common.fail(f"{name} must be MIN:MAX tokens (e.g. 16:64), got {text!r}")


def load_workload(w: SimpleNamespace, *, workload: str | None = None, in_process: bool = True,
                  wave_size: int | None = None) -> list:
    """The request specs of the workload options ``w`` (``workload`` overrides ``w.workload``);
    one line (exit 2) for a bad workload name, file or option."""
    from vlite.diagnostics.workload import sources as wl

    workload = workload or w.workload
    n = getattr(w, "n", 1)
    prompt_source = getattr(w, "prompt_source", "word-list")
    if n != 1 and workload != "synthetic":
        common.fail(f"--n applies to --workload synthetic; {workload} sets each request's n itself "
                    "(all-paths and kind-waves send n > 1 requests of their own, a trace its rows' n)")
    lens = {"input_len": token_range(w.input_len, "--input-len"), "output_len": token_range(w.output_len, "--output-len")}
    aborts = {"abort_rate": w.abort_rate, "abort_mode": w.abort_mode, "seed": w.seed}
    try:
        if workload == "all-paths":
            from vlite.diagnostics.workload.all_paths import all_paths_workload

            return all_paths_workload(w.num_requests, **lens, request_rate=w.request_rate, **aborts,
                                      in_process=in_process, wave_size=wave_size, prompt_source=prompt_source)
        if workload == "kind-waves":
            return _kind_waves(w.num_requests, lens, w.seed)
        if workload == "responses":
            if in_process:
                common.fail("--workload responses sends the Responses API (/v1/responses): it needs --url; "
                            "the in-process engine has no HTTP routes")
            from dataclasses import replace

            return [replace(s, api="responses", store=True) for s in wl.synthetic_workload(
                w.num_requests, **lens, request_rate=w.request_rate, **aborts, prompt_source=prompt_source)]
        if workload == "synthetic":
            return wl.synthetic_workload(w.num_requests, **lens, request_rate=w.request_rate, **aborts, n=n,
                                         prompt_source=prompt_source)
        path = Path(workload)
        if path.is_dir():
            common.fail(f"--workload {workload} is a directory; give all-paths, synthetic, kind-waves, responses, a "
                        "JSONL trace (.jsonl) or a ShareGPT file (.json)")
        if not path.is_file():
            common.fail(f"--workload {workload}: not all-paths, synthetic, kind-waves or responses, and no such file")
        if path.suffix == ".jsonl":
            return wl.jsonl_workload(path, **aborts, warn=common.warn)
        return wl.sharegpt_workload(path, w.num_requests, count_tokens=None, max_output_len=lens["output_len"][1],
                                    request_rate=w.request_rate, **aborts)
    except ValueError as exc:
        common.fail(str(exc))


def _kind_waves(num_requests: int, lens: dict, seed: int) -> list:
    # waves of one request kind each (checks/kind_growth.py)
    from vlite.diagnostics.workload.kind_waves import KINDS, MIN_ROUNDS, kind_waves_workload

    specs = kind_waves_workload(num_requests, **lens, seed=seed)
    if len(specs) != num_requests:  # whole rounds of one wave per kind, at least MIN_ROUNDS
        typer.echo(f"--workload kind-waves: {len(specs)} requests, not {num_requests}: whole rounds of one wave "
                   f"per kind ({len(KINDS)} kinds), at least {MIN_ROUNDS} rounds", err=True)
    return specs


def build_plan(w: SimpleNamespace, *, in_process: bool, **extra):
    """The ``TargetPlan`` of a replay of the workload options ``w``; ``extra`` goes to the plan
    (``trace_allocations``, ...). Five waves: enough troughs for the fit, and few enough drains to
    keep batches full; at least 16 requests a wave (or all of a small trace), so that a wave can
    preempt."""
    from vlite.diagnostics.targets.base import TargetPlan, default_wave

    idle_every = w.idle_every
    n_specs = w.num_requests if w.workload in ("synthetic", "all-paths", "responses") else None
    if w.workload == "kind-waves" and idle_every is None:  # one idle point after each one-kind wave
        from vlite.diagnostics.workload.kind_waves import kind_wave_size

        idle_every = kind_wave_size(w.num_requests)
    specs = load_workload(w, in_process=in_process,
                          wave_size=default_wave(n_specs, idle_every) if n_specs else None)
    every = default_wave(len(specs), idle_every)
    info = {"workload": w.workload, "prompt_source": w.prompt_source, "abort_rate": w.abort_rate,
            "abort_mode": w.abort_mode, "seed": w.seed, "max_concurrency": w.max_concurrency, "idle_every": every,
            "sample_interval_ms": w.sample_interval_ms}
    zombie_options = {"threshold_s": w.zombie_threshold_s, "threshold_steps": w.zombie_threshold_steps}
    return TargetPlan(specs=specs, max_concurrency=w.max_concurrency, idle_every=idle_every,
                      sample_interval_s=w.sample_interval_ms / 1000.0, seed=w.seed, abort_rate=w.abort_rate,
                      abort_mode=w.abort_mode, trace=w.workload.endswith(".jsonl"), zombie_options=zombie_options,
                      info=info, **extra)
