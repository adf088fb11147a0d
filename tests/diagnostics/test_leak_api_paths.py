"""Every API path in the leak check's checklist. A multi-prompt completion with
one prompt refused after the others were admitted (sglang#28380), a request refused after
admission, a constrained request aborted while waiting, and the chat and completions routes with
each client action (over HTTP only: in process the replay drives the engine, not the API server)."""

from __future__ import annotations

import pytest
from conftest import make_engine

from vlite.diagnostics.checks import coverage
from vlite.diagnostics.checks.zombie import zombie_check
from vlite.diagnostics.targets.inprocess import run_in_process
from vlite.diagnostics.workload.actions import ClientAction
from vlite.diagnostics.workload.all_paths import all_paths_workload, is_extra_probe, suggest_num_blocks
from vlite.diagnostics.workload.replay import RequestResult
from vlite.diagnostics.workload.sources import OVER_MAX_MODEL_LEN, RequestSpec, engine_request_ids, expand_prompts
from vlite.engine import EngineRequest, EngineView, RequestOrigin, RequestRejectedError, SamplingParams

MAX_MODEL_LEN = 128


@pytest.fixture()
def engine(tiny_checkpoint):
    return make_engine(tiny_checkpoint, num_blocks=64, max_model_len=MAX_MODEL_LEN)


def _req(rid: str, prompt: str, max_tokens: int = 16) -> EngineRequest:
    return EngineRequest(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), RequestOrigin(rid))


def test_add_requests_is_all_or_none_and_counts_the_refusal_by_stage(engine):
    ok = [_req("g-0", "the of and to in"), _req("g-1", "is for on that")]
    bad = [_req("h-0", "the of and to in"), _req("h-1", " ".join(["the"] * (MAX_MODEL_LEN + 4)))]
    assert engine.add_requests(ok) == ["g-0", "g-1"]
    with pytest.raises(RequestRejectedError, match="maximum context length"):
        engine.add_requests(bad)
    # h-0 was admitted, then aborted while waiting: it holds nothing and never runs
    assert set(engine.scheduler.requests) == {"g-0", "g-1"}
    while engine.has_unfinished_requests():
        engine.step()
    history = EngineView(engine).request_history()
    assert history["h-0"].finished and history["h-0"].num_output_tokens == 0
    assert dict(EngineView(engine).coverage().rejections) == {"at admission": 1, "sibling rejected": 1}


def test_a_request_refused_once_running_is_counted_after_scheduling(engine):
    from vlite.engine import StructuredOutputsParams

    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
                            allowed_token_ids=[0])
    (out,) = engine.generate(["the of and to in"], params)
    assert out.error_kind == "request" and out.outputs[0].finish_reason == "error"
    assert dict(EngineView(engine).coverage().rejections) == {"after scheduling": 1}


def test_the_default_workload_takes_the_new_paths_in_process_and_the_routes_over_http():
    inproc = all_paths_workload(60)
    by_tag = {}
    for s in inproc:
        by_tag.setdefault(s.client_tag, []).append(s)
    (multi,) = by_tag["probe:multi-prompt-rejected"]
    assert multi.extra_prompts == (OVER_MAX_MODEL_LEN,) and not multi.action.is_abort
    (refused,) = by_tag["probe:rejected-after-admission"]
    assert refused.extra_params["allowed_token_ids"] == [0] and "choice" in refused.extra_params["structured_outputs"]
    (waiting,) = by_tag["probe:structured"]
    assert waiting.action.kind == "abort-waiting" and "structured_outputs" in waiting.extra_params
    # extra requests at the head of the first wave, outside the pool sizing
    assert len(inproc) == 63 and [is_extra_probe(s) for s in inproc[:3]] == [True] * 3
    drawn = [s for s in inproc if not is_extra_probe(s)]
    assert len(drawn) == 60 and suggest_num_blocks(inproc, 12) == suggest_num_blocks(drawn, 12)
    from vlite.diagnostics.targets.http import waves_of

    assert [len(w) for w in waves_of(inproc, 12)] == [15, 12, 12, 12, 12]
    over_http = all_paths_workload(60, in_process=False)
    assert len(over_http) == 68
    chat_actions = {s.action.kind for s in over_http if s.chat}
    assert {"abort-prefill", "disconnect-stream", "client-timeout"} <= chat_actions
    completions_actions = {s.action.kind for s in over_http if not s.chat}
    assert {"abort-prefill", "abort-after-tokens", "client-timeout"} <= completions_actions


def test_expand_prompts_writes_out_a_prompt_longer_than_max_model_len():
    spec = RequestSpec("m", 0.0, "hello", 1, 4, extra_prompts=(OVER_MAX_MODEL_LEN,))
    first, over = expand_prompts(spec, 100)
    assert first == "hello" and len(over.split()) > 100
    assert engine_request_ids(spec) == ["m-0", "m-1"]
    assert engine_request_ids(RequestSpec("s", 0.0, "x", 1, 4)) == ["s"]


def _refused(rid: str, t: float, step: int) -> RequestResult:
    r = RequestResult(rid, "complete", "complete", 0.0, outcome="rejected", abort_time=t)
    r.abort_step, r.tokens_at_abort, r.engine_request_ids = step, 0, [f"{rid}-0", f"{rid}-1"]
    return r


def test_the_admitted_prompts_of_a_refused_multi_prompt_request_are_zombies_when_they_run_on():
    rolled_back = {"m-0": {"finished": True, "finished_time": 10.0, "released_time": None, "finished_step": 4,
                           "num_output_tokens": 0}}
    z = zombie_check([_refused("m", 10.0, 4)], rolled_back)  # m-1, never admitted, has no history
    assert z["zombies"] == [] and z["client_left"] == 1 and z["unmeasured"] == 0
    ran_on = {"m-0": {"finished": True, "finished_time": 12.0, "released_time": 12.0, "released_step": 20,
                      "num_output_tokens": 16}}
    (row,) = zombie_check([_refused("m", 10.0, 4)], ran_on)["zombies"]
    assert row["request_id"] == "m-0" and row["outlived_steps"] == 16 and row["tokens_after_leaving"] == 16
    assert "multi-prompt" in row["client_action"]
    # a plain refused request (nothing admitted) is not a client that left
    plain = RequestResult("p", "complete", "complete", 0.0, outcome="rejected")
    assert zombie_check([plain], {})["client_left"] == 0


class _NoRollback:
    """The planted defect of mutant multi-prompt-rejection-keeps-admitted: add_requests that
    leaves the prompts admitted before a refusal in the engine."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_requests(self, requests):
        for r in requests:
            self._engine.add_request(r.prompt, r.sampling_params, request_id=r.origin.request_id, origin=r.origin)


def _multi(rid: str) -> RequestSpec:
    return RequestSpec(rid, 0.0, "the of and to in is for", 8, 24, extra_prompts=(OVER_MAX_MODEL_LEN,),
                       client_tag="path:multi-prompt-rejected")


def test_in_process_a_refused_multi_prompt_request_is_clean_and_covered(engine):
    specs = [_multi("multi-x7"), RequestSpec("wait-x7", 0.0, "on that with as", 4, 8, ClientAction("abort-waiting"))]
    run = run_in_process(engine, specs)
    f = run.findings
    assert f.verdict == "CLEAN", f.summary()
    assert run.replay.requests[0].outcome == "rejected" and run.replay.requests[0].engine_request_ids == ["multi-x7-0",
                                                                                                           "multi-x7-1"]
    assert f.coverage["rejections"] == {"at admission": 1, "sibling rejected": 1}
    assert "multi-prompt request with one prompt rejected" not in f.not_exercised
    assert set(coverage.API_PATHS) == set(f.coverage["not_applicable"])
    assert not set(coverage.API_PATHS) & set(f.not_exercised)


def test_in_process_admitted_prompts_left_running_after_the_refusal_are_zombies(engine):
    run = run_in_process(_NoRollback(engine), [_multi("multi-x7")])
    f = run.findings
    assert f.verdict == "ZOMBIE", f.summary()
    (row,) = f.zombies["zombies"]
    assert row["request_id"] == "multi-x7-0" and row["tokens_after_leaving"] == 24
    assert "multi-prompt request with one prompt rejected" in f.not_exercised


def test_api_paths_are_judged_only_where_the_api_server_counts_disconnects():
    every_engine_path = {"rejections": {"sibling rejected": 1}}
    in_process = coverage.section(every_engine_path)
    assert in_process["not_applicable"] == list(coverage.API_PATHS)
    assert not set(coverage.API_PATHS) & set(in_process["not_exercised"])
    assert any("API-server paths not applicable" in line for line in coverage.lines(in_process))
    text = ('# TYPE vlite:client_disconnects counter\n'
            'vlite:client_disconnects_total{model_name="m",route="/v1/chat/completions",when="mid-stream"} 2.0\n'
            'vlite:client_disconnects_total{model_name="m",route="/v1/completions",when="non-streaming"} 0.0\n'
            '# TYPE vlite:forks counter\nvlite:forks_total{model_name="m"} 0.0\n'
            '# TYPE vlite:request_rejected counter\n'
            'vlite:request_rejected_total{model_name="m",stage="sibling rejected"} 3.0\n')
    after = coverage.from_metrics_text(text)
    assert after["rejections"] == {"sibling rejected": 3}
    over_http = coverage.section(after)
    assert over_http["not_applicable"] == []
    assert "chat: disconnect mid-stream" not in over_http["not_exercised"]
    assert "completions: client timeout" in over_http["not_exercised"]
    assert "multi-prompt request with one prompt rejected" not in over_http["not_exercised"]
