"""vlite leak-check in process: each planted fault is found and attributed to the request and
client action that caused it; the same workloads without the fault report CLEAN."""

from __future__ import annotations

import pytest
from conftest import make_engine

from vlite.diagnostics.targets.inprocess import run_in_process
from vlite.diagnostics.workload.actions import ClientAction
from vlite.diagnostics.workload.sources import RequestSpec, synthetic_prompt, synthetic_workload


def _mixed():
    # 14 requests, half aborted in every way a client can abort.
    return synthetic_workload(14, input_len=(8, 40), output_len=(6, 16), abort_rate=0.5, abort_mode="mix", seed=3)


def _preempting():
    # Three long requests on a 12-block cache: recompute preemption is certain.
    import random

    return [RequestSpec(f"pre-{i}", 0.0, synthetic_prompt(random.Random(i), 40), 40, 100) for i in range(3)]


def _run(ckpt, specs, faults=(), num_blocks=128):
    engine = make_engine(ckpt, num_blocks=num_blocks, faults=faults)
    return run_in_process(engine, specs, max_concurrency=16, idle_every=5, sample_interval_s=0.05)


def _plan(specs):
    return {s.request_id: s.action for s in specs}


@pytest.mark.parametrize("workload,num_blocks", [(_mixed, 128), (_preempting, 12)])
def test_workloads_without_faults_are_clean(tiny_checkpoint, workload, num_blocks):
    specs = workload()
    run = _run(tiny_checkpoint, specs, num_blocks=num_blocks)
    f = run.findings
    assert not f.leak, f.summary()
    assert f.drain.sign == "balanced" and f.drain.mismatch_blocks == 0
    assert f.leaked_blocks == [] and f.cpu_state["num_leftover_entries"] == 0
    assert f.summary().startswith("CLEAN")
    outcomes = {r.request_id: r.outcome for r in run.replay.requests}
    for rid, action in _plan(specs).items():
        assert outcomes[rid] in (("finished",) if not action.is_abort else ("aborted", "finished")), rid
    if workload is _preempting:
        assert run.info["num_preemptions_total"] > 0
    # a clean engine's troughs return to the baseline
    assert {p.num_used_blocks for p in run.replay.idle_points} == {0}
    if workload is _mixed:  # 14 requests in waves of 5: enough troughs for a fit
        assert f.trends[0].n >= 3 and f.trends[0].slope == 0.0 and not f.trends[0].rising


def test_skip_free_on_abort_is_attributed_to_the_aborting_requests(tiny_checkpoint):
    specs = _mixed()
    plan = _plan(specs)
    run = _run(tiny_checkpoint, specs, faults=("skip-free-on-abort",))
    f = run.findings
    assert f.leak and f.drain.sign == "deficit"
    raised = {r.request_id for r in run.replay.requests if r.outcome == "abort-raised"}
    assert raised and all(plan[rid].is_abort for rid in raised)
    owners = {b["request_id"] for b in f.leaked_blocks}
    assert owners and owners <= raised  # only aborted requests hold blocks ...
    assert owners >= {rid for rid in raised if plan[rid].kind != "abort-waiting"}  # ... every one that had blocks
    assert f.drain.deficit_blocks == len({b["block_id"] for b in f.leaked_blocks})
    for b in f.leaked_blocks:
        assert b["client_action"] == plan[b["request_id"]].label
        assert b["action_kind"] == plan[b["request_id"]].kind
        assert b["finish_reason"] == "abort" and b["suspected_path"].startswith("sequence finished by abort in ")
        assert "its release raised before the blocks were freed (PlantedFault" in b["suspected_path"]
    assert {g["action_kind"] for g in f.by_action} == {plan[r].kind for r in owners}
    assert sum(g["blocks"] for g in f.by_action) == f.drain.deficit_blocks
    assert {r["request_id"] for r in f.cpu_state["leftover_requests"]} == raised
    assert f.trends[0].slope > 0 and f.trends[0].rising


def test_leak_on_preempt_is_attributed_to_the_preempted_requests(tiny_checkpoint):
    specs = _preempting()
    run = _run(tiny_checkpoint, specs, faults=("leak-on-preempt",), num_blocks=12)
    f = run.findings
    assert f.leak and f.drain.deficit_blocks > 0
    assert f.leaked_blocks and all(b["num_preemptions"] > 0 for b in f.leaked_blocks)
    assert all("preemption" in b["suspected_path"] for b in f.leaked_blocks)
    assert all(b["client_action"] == "complete" for b in f.leaked_blocks)
    assert {b["request_id"] for b in f.leaked_blocks} <= {s.request_id for s in specs}


def test_orphan_block_table_is_found_on_the_cpu_side(tiny_checkpoint):
    specs = _mixed()
    plan = _plan(specs)
    run = _run(tiny_checkpoint, specs, faults=("orphan-block-table",))
    f = run.findings
    assert f.leak and f.drain.sign == "balanced"  # the blocks were freed: only the tables leak
    orphans = f.cpu_state["orphan_block_tables"]
    had_blocks = {r.request_id for r in run.replay.requests if r.outcome != "rejected"
                  and plan[r.request_id].kind != "abort-waiting"}
    assert {o["request_id"] for o in orphans} == had_blocks
    for o in orphans:
        assert o["client_action"] == plan[o["request_id"]].label and o["num_blocks"] > 0
    assert "orphan block tables" in f.summary()


def test_double_free_shows_as_an_excess(tiny_checkpoint):
    specs = _mixed()
    plan = _plan(specs)
    run = _run(tiny_checkpoint, specs, faults=("double-free",))
    f = run.findings
    assert f.leak and f.drain.excess_frees > 0 and "excess" in f.drain.sign
    assert f.anomalies and all(a["kind"] == "double free" for a in f.anomalies)
    for a in f.anomalies:
        assert a["client_action"] == plan[a["request_id"]].label
    assert "double free" in f.summary()


def test_raise_in_step_is_clean_and_only_the_raising_request_errors(tiny_checkpoint):
    import random

    specs = [RequestSpec(f"r-{i}", 0.0, synthetic_prompt(random.Random(i), 20), 20, 8, ClientAction(),
                         client_tag="raise-in-step" if i == 1 else None) for i in range(4)]
    run = _run(tiny_checkpoint, specs, faults=("raise-in-step",))
    outcomes = {r.request_id: (r.outcome, r.finish_reason) for r in run.replay.requests}
    assert outcomes.pop("r-1") == ("error", "error")
    assert set(outcomes.values()) == {("finished", "length")}
    assert not run.findings.leak, run.findings.summary()


def test_prefix_cached_blocks_are_free_and_fork_refcount_leak_names_the_forker(tiny_checkpoint):
    # Distinct prompts, n = 2 samples each (forks share the prompt's blocks), prefix caching on:
    # cached-evictable blocks remain at the end and must not be reported as a leak.
    specs = synthetic_workload(8, input_len=(20, 40), output_len=(4, 10), abort_rate=0.25, abort_mode="mix",
                               seed=5, n=2)
    clean = _run(tiny_checkpoint, specs)
    assert not clean.findings.leak, clean.findings.summary()
    drain = clean.findings.drain
    assert drain.num_cached_blocks > 0 and drain.sign == "balanced"  # cached blocks counted as free
    engine_specs = {s.request_id for s in specs}
    run = _run(tiny_checkpoint, specs, faults=("refcount-not-decremented-on-fork",))
    f = run.findings
    assert f.leak and f.drain.sign == "deficit"
    assert f.leaked_blocks and all(b["site"] == "fork" for b in f.leaked_blocks)
    assert {b["request_id"] for b in f.leaked_blocks} <= engine_specs
    assert all("fork" in b["suspected_path"] for b in f.leaked_blocks)


def test_a_model_that_fails_every_step_is_inconclusive_not_clean(tiny_checkpoint, monkeypatch):
    from vlite.engine.worker.models.llama import LlamaForCausalLM

    def broken_forward(self, *args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(LlamaForCausalLM, "forward", broken_forward)
    run = _run(tiny_checkpoint, synthetic_workload(6, input_len=(8, 20), output_len=(4, 8), seed=1))
    f = run.findings
    assert not f.leak and f.drain.mismatch_blocks == 0  # the error path freed everything
    assert f.verdict == "INCONCLUSIVE" and f.summary().startswith("INCONCLUSIVE: every request ended in an engine")
    assert f.to_dict()["verdict"] == "INCONCLUSIVE"


def test_preempted_in_prefill_scenario_finds_a_table_dropped_at_a_prefill_preemption(tiny_checkpoint, monkeypatch):
    # Preempting a sequence that has no output token yet drops its block table without a free:
    # only a preemption in the middle of a (chunked) prefill walks that branch, and the
    # preempted-in-prefill scenario forces one.
    from vlite.diagnostics.scenarios import SCENARIOS, run_scenario
    from vlite.engine.core import scheduler as scheduler_mod

    base = make_engine(tiny_checkpoint).config
    clean = run_scenario(SCENARIOS["preempted-in-prefill"], tiny_checkpoint, base)
    assert clean.passed, (clean.run.findings.summary(), clean.checks)
    assert clean.run.findings.coverage["preemptions_in_prefill"] >= 1

    preempt = scheduler_mod.Scheduler._preempt

    def drop_prefill_table(self, seq):
        if seq.num_output_tokens == 0:
            self.kv_cache_manager.block_tables.pop(seq.seq_id, None)  # planted: no free
            seq.status, seq.num_computed_tokens = scheduler_mod.SequenceStatus.PREEMPTED, 0
            self.waiting.appendleft(seq)
            return
        preempt(self, seq)

    monkeypatch.setattr(scheduler_mod.Scheduler, "_preempt", drop_prefill_table)
    leaky = run_scenario(SCENARIOS["preempted-in-prefill"], tiny_checkpoint, base)
    assert leaky.run.findings.leak and not leaky.passed, leaky.run.findings.summary()
