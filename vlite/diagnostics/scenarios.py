"""Fixed scenarios for the known leak kinds; each checks the drain invariants after it runs.

Each scenario is a tiny workload on its own engine geometry (a few blocks, a small token
budget, ...) that steers the engine into one exit path; ``run_scenario`` replays it in
process, detects, and adds the scenario's own expectations (e.g. "the other requests still
finished"). A scenario passes when the run is CLEAN and every expectation holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vlite.diagnostics.checks.result import RunResult
from vlite.diagnostics.targets.inprocess import run_in_process
from vlite.diagnostics.workload.actions import ClientAction
from vlite.diagnostics.workload.sources import RequestSpec, synthetic_prompt


@dataclass(frozen=True)
class Scenario:
    """A named workload and engine geometry.

    engine: EngineConfig overrides: num_blocks (blocks), max_num_batched_tokens (tokens), max_num_seqs.
    faults: planted faults the scenario itself needs (raise-in-step).
    expect: checks on the run -> list of (what, ok, detail).
    """

    name: str
    description: str
    specs: Callable[[], list[RequestSpec]]
    engine: dict = field(default_factory=dict)
    faults: tuple[str, ...] = ()
    expect: Callable[[RunResult], list[tuple[str, bool, str]]] = lambda run: []
    idle_every: int = 0


@dataclass
class ScenarioResult:
    """One scenario's run and checks; ``passed`` is CLEAN and every check ok."""

    name: str
    description: str
    run: RunResult
    checks: list[tuple[str, bool, str]]

    @property
    def passed(self) -> bool:
        return not self.run.findings.leak and all(ok for _, ok, _ in self.checks)


def _spec(i: int, prompt_len: int, max_tokens: int, action: str = "complete", arrival_s: float = 0.0,
          tag: str | None = None, prefix: str = "sc") -> RequestSpec:
    import random

    return RequestSpec(f"{prefix}-{i:04d}", arrival_s, synthetic_prompt(random.Random(i), prompt_len), prompt_len,
                       max_tokens, ClientAction.parse(action), client_tag=tag)


def _outcomes(run: RunResult) -> dict[str, str]:
    return {r.request_id: r.outcome for r in run.replay.requests}


def _expect_outcomes(expected: dict[str, set[str]]) -> Callable[[RunResult], list[tuple[str, bool, str]]]:
    def check(run: RunResult) -> list[tuple[str, bool, str]]:
        got = _outcomes(run)
        return [(f"{rid} ends {'/'.join(sorted(want))}", got.get(rid) in want, f"outcome {got.get(rid)}")
                for rid, want in expected.items()]
    return check


def _expect_preempted_abort(run: RunResult) -> list[tuple[str, bool, str]]:
    res = {r.request_id: r for r in run.replay.requests}["sc-0001"]
    return [("the engine preempted at least once", run.info["num_preemptions_total"] > 0,
             f"{run.info['num_preemptions_total']} preemptions"),
            ("the preempted request was aborted", "preemption" in res.detail, res.detail or res.outcome)]


def _expect_flat(run: RunResult) -> list[tuple[str, bool, str]]:
    pts = run.replay.idle_points
    used = {p.num_used_blocks for p in pts}
    cpu = run.findings.cpu_state
    return [("used blocks return to the baseline at every idle point", used == {pts[0].num_used_blocks},
             f"{len(pts)} idle points, used blocks {sorted(used)}"),
            ("no block tables or request entries remain", cpu["num_block_tables"] == 0
             and not cpu["leftover_requests"], (f"{cpu['num_block_tables']} block tables, "
                                               f"{len(cpu['leftover_requests'])} request entries")),
            ("every request finished", all(o == "finished" for o in _outcomes(run).values()), "")]


def _cov(run: RunResult) -> dict:
    return run.findings.coverage or {"allocation_sites": {}, "finish_reasons": {}, "abort_states": {},
                                     "preemptions": 0, "resumptions": 0, "prefix_hit_tokens": 0, "forks": 0,
                                     "copy_on_write": 0, "beam_prunes": 0}


def _expect_cov(**wants: Callable[[dict], tuple[bool, str]]) -> Callable[[RunResult], list[tuple[str, bool, str]]]:
    """Checks on the run's coverage counts: name -> f(coverage) -> (ok, detail)."""
    def check(run: RunResult) -> list[tuple[str, bool, str]]:
        return [(what, *f(_cov(run))) for what, f in wants.items()]
    return check


def _both(*checks):
    return lambda run: [c for check in checks for c in check(run)]


def _at_least(path: tuple[str, ...], n: int = 1) -> Callable[[dict], tuple[bool, str]]:
    def f(cov: dict) -> tuple[bool, str]:
        value = cov
        for key in path:
            value = value.get(key, 0) if isinstance(value, dict) else 0
        return value >= n, f"{'.'.join(path)} = {value}"
    return f


def _n_samples_abort() -> list[RequestSpec]:
    from dataclasses import replace

    actions = ["abort-waiting", "abort-prefill", "abort-after-tokens:1", "abort-after-tokens:4", "complete",
               "disconnect-stream:2", "complete"]
    return [replace(_spec(i, 120 if a == "abort-prefill" else 24, 12, a, prefix="ns"), n=3, temperature=1.0, seed=i)
            for i, a in enumerate(actions)]


def _beam_pressure() -> list[RequestSpec]:
    from dataclasses import replace

    beams = [replace(_spec(i, 30, 12, "abort-after-tokens:3" if i == 2 else "complete", prefix="bp"), n=2,
                     beam_width=4, temperature=0.0) for i in range(3)]
    return beams + [_spec(10 + i, 40, 40, prefix="bp") for i in range(3)]


def _shared_prefix_aborts() -> list[RequestSpec]:
    from dataclasses import replace

    from vlite.diagnostics.workload.sources import shared_prefix

    pre = shared_prefix("scenario", 48)
    actions = ["complete", "abort-waiting", "abort-prefill", "abort-after-tokens:2", "disconnect-stream:3",
               "complete", "abort-after-tokens:1", "complete"]
    out = []
    for i, a in enumerate(actions):
        sp = _spec(i, 20, 10, a, prefix="sp")
        out.append(replace(sp, prompt=pre + " " + sp.prompt, prompt_len=68))
    return out


def _stop_strings() -> list[RequestSpec]:
    from dataclasses import replace

    return [replace(_spec(i, 24, 16, "disconnect-stream:6" if i == 3 else "complete", prefix="ss"),
                    stop_string_at=2 + i % 4) for i in range(6)] + \
        [replace(_spec(10 + i, 24, 16, prefix="ss"), stop_token_at=3 + i) for i in range(2)]


def _chat_eos() -> list[RequestSpec]:
    from dataclasses import replace

    from vlite.diagnostics.workload.all_paths import CHAT_MESSAGES

    actions = ["complete", "abort-after-tokens:2", "complete", "disconnect-stream:1", "complete", "complete"]
    return [replace(_spec(i, 8, 48, a, prefix="eos"), prompt=CHAT_MESSAGES[i], chat=True, ignore_eos=False)
            for i, a in enumerate(actions)]


NEW_SCENARIOS = [
    Scenario("n-samples-abort", "n = 3 samples aborted while only the parent exists (waiting, chunked prefill) and "
             "after the fork (1 and 4 tokens, mid-stream); others complete", _n_samples_abort,
             {"max_num_batched_tokens": 32},
             expect=_both(_expect_cov(**{"forks happened": _at_least(("forks",)),
                                         "copy-on-write happened": _at_least(("copy_on_write",)),
                                         "aborted while waiting": _at_least(("abort_states", "waiting")),
                                         "aborted in prefill": _at_least(("abort_states", "prefill")),
                                         "aborted in decode (after the fork)": _at_least(("abort_states", "decode"))}),
                          _expect_outcomes({"ns-0004": {"finished"}, "ns-0003": {"aborted"}}))),
    Scenario("beam-under-pressure", "beam search (width 4) with long requests on a 20-block cache: beams pruned, "
             "forked and preempted; one beam search aborted", _beam_pressure, {"num_blocks": 20},
             expect=_both(_expect_cov(**{"beams pruned": _at_least(("beam_prunes",)),
                                         "preempted": _at_least(("preemptions",)),
                                         "forks happened": _at_least(("forks",))}),
                          _expect_outcomes({"bp-0000": {"finished"}, "bp-0010": {"finished"}}))),
    Scenario("shared-prefix-aborts", "8 requests on one 48-token shared prefix, aborted in every state; the prefix "
             "stays cached and is hit again", _shared_prefix_aborts, {"max_num_seqs": 2},
             expect=_expect_cov(**{"prefix-cache hits": _at_least(("prefix_hit_tokens",), 16),
                                   "aborted in decode": _at_least(("abort_states", "decode"))})),
    Scenario("stop-strings", "greedy requests that stop on strings spanning two tokens and on stop token ids "
             "(found by a calibration run); one disconnects", _stop_strings,
             expect=_expect_cov(**{"stop-string finishes": _at_least(("finish_reasons", "stop:stop_string"), 3),
                                   "stop-token finishes": _at_least(("finish_reasons", "stop:stop_token"), 1)})),
    Scenario("chat-eos", "chat messages through the chat template with EOS on (an instruction-tuned model ends "
             "them with EOS; a random one by length); two clients leave early", _chat_eos,
             expect=_expect_outcomes({"eos-0000": {"finished"}, "eos-0001": {"aborted"}})),
    Scenario("preempted-resumed-aborted", "a request preempted, resumed (recomputed) and then aborted, on a "
             "12-block cache", lambda: [_spec(0, 40, 100), _spec(1, 40, 100, "abort-resumed"), _spec(2, 40, 100)],
             {"num_blocks": 12},
             expect=_expect_cov(**{"preempted": _at_least(("preemptions",)),
                                   "resumed": _at_least(("resumptions",)),
                                   "aborted after resumption": _at_least(("abort_states", "resumed"))})),
]


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("abort-waiting", "abort requests while they wait behind a running one (max_num_seqs=1)",
             lambda: [_spec(0, 24, 16)] + [_spec(i, 24, 16, "abort-waiting") for i in (1, 2, 3)],
             {"max_num_seqs": 1}, expect=_expect_outcomes({"sc-0000": {"finished"}, "sc-0002": {"aborted"}})),
    Scenario("abort-chunked-prefill", "abort during a chunked prefill (16-token budget, 96-token prompts)",
             lambda: [_spec(0, 96, 8, "abort-prefill"), _spec(1, 96, 8, "abort-prefill"), _spec(2, 24, 8)],
             {"max_num_batched_tokens": 16},
             expect=lambda run: [("aborted mid-prefill", "during prefill" in {r.request_id: r for r in
                                  run.replay.requests}["sc-0000"].detail, "")]),
    Scenario("disconnect-mid-stream", "clients disconnect after a few streamed chunks",
             lambda: [_spec(i, 32, 24, "disconnect-stream:3" if i % 2 else "complete") for i in range(6)],
             expect=_expect_outcomes({"sc-0001": {"aborted"}, "sc-0000": {"finished"}})),
    Scenario("non-streaming-disconnect", "non-streaming clients time out and close the connection",
             lambda: [_spec(0, 32, 64, "client-timeout:0.05"), _spec(1, 32, 64, "client-timeout:0.05"),
                      _spec(2, 32, 16)], expect=_expect_outcomes({"sc-0000": {"aborted", "finished"}})),
    Scenario("abort-preempted", "abort a request after recompute preemption (a 12-block cache)",
             lambda: [_spec(0, 40, 100), _spec(1, 40, 100, "abort-preempted"), _spec(2, 40, 100)],
             {"num_blocks": 12}, expect=_expect_preempted_abort),
    Scenario("preempted-in-prefill", "a 70-token prompt preempted in the middle of its chunked prefill (a 6-block "
             "cache, a 16-token budget: a decoding request takes the blocks it needs), then recomputed",
             lambda: [_spec(0, 30, 50), _spec(1, 70, 4)], {"num_blocks": 6, "max_num_batched_tokens": 16},
             expect=_both(_expect_cov(**{"preempted during prefill": _at_least(("preemptions_in_prefill",))}),
                          _expect_outcomes({"sc-0000": {"finished"}, "sc-0001": {"finished"}}))),
    Scenario("raise-in-step", "a request that raises in the model runner: only it ends (error), others finish",
             lambda: [_spec(0, 24, 12), _spec(1, 24, 12, tag="raise-in-step"), _spec(2, 24, 12),
                      _spec(3, 24, 8, arrival_s=0.2)], faults=("raise-in-step",),
             expect=_expect_outcomes({"sc-0001": {"error"}, "sc-0000": {"finished"}, "sc-0002": {"finished"},
                                      "sc-0003": {"finished"}})),
    Scenario("never-fits", "a request larger than the whole KV cache is rejected; the queue is not blocked",
             lambda: [_spec(0, 200, 16), _spec(1, 24, 8), _spec(2, 24, 8)], {"num_blocks": 8},
             expect=_expect_outcomes({"sc-0000": {"rejected"}, "sc-0001": {"finished"}, "sc-0002": {"finished"}})),
    Scenario("repeated-short", "1,000 short requests in waves of 100: per-request state stays flat",
             lambda: [_spec(i, 4 + i % 5, 1 + i % 2) for i in range(1000)], {"max_num_seqs": 64},
             expect=_expect_flat, idle_every=100),
    *NEW_SCENARIOS,
]}


def run_scenario(scenario: Scenario, checkpoint, base_config, faults: tuple[str, ...] = (),
                 sample_interval_s: float = 0.1, zombie_options: dict | None = None) -> ScenarioResult:
    """Run one scenario on a fresh engine built from ``base_config`` (an EngineConfig) and a loaded checkpoint."""
    from dataclasses import replace

    from vlite.engine import LLMEngine

    cache = replace(base_config.cache, num_blocks=scenario.engine.get("num_blocks", base_config.cache.num_blocks or 256))
    sched = replace(base_config.scheduler, **{k: v for k, v in scenario.engine.items() if k != "num_blocks"})
    config = replace(base_config, cache=cache, scheduler=sched,
                     inject_faults=tuple(dict.fromkeys((*faults, *scenario.faults))))
    engine = LLMEngine(config, checkpoint=checkpoint)
    specs = scenario.specs()
    run = run_in_process(engine, specs, max_concurrency=64, idle_every=scenario.idle_every,
                         sample_interval_s=sample_interval_s, info={"scenario": scenario.name},
                         zombie_options=zombie_options)
    return ScenarioResult(scenario.name, scenario.description, run, scenario.expect(run))
