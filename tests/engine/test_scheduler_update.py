"""Scheduler.update_from_output without a model: a fake runner output (StepResult) books a
step. Covers what the engine used to do itself: computed tokens, token append and stops,
finishing through the one free path (blocks back, record kept), n-sample forks sharing blocks,
and the SchedulerOutput carrying block tables and keep_logits to the runner."""

from __future__ import annotations

from utils import fake_result, make_scheduler

from vlite.engine.core.request import Request
from vlite.engine.core.sequence import RequestOrigin, Sequence
from vlite.engine.sampling_params import SamplingParams


def test_update_appends_tokens_and_finishes_at_max_tokens_through_the_free_path():
    sched = make_scheduler(max_model_len=128)
    seq = Sequence("a", None, list(range(6)), SamplingParams(max_tokens=2, ignore_eos=True), RequestOrigin("a"))
    sched.add_sequence(seq)
    out = sched.schedule()
    assert out.block_tables == {seq.seq_id: sched.kv_cache_manager.get_block_table(seq.seq_id)}
    assert len(out.block_tables[seq.seq_id]) == 2 and out.blocks_to_copy == [] and not out.keep_logits
    (req,) = sched.update_from_output(out, fake_result(out, 3))
    assert seq.num_computed_tokens == 6 and seq.output_token_ids == [3] and not req.is_finished
    assert sched.stats.prompt_tokens_total == 6 and sched.stats.generation_tokens_total == 1
    out = sched.schedule()
    (req,) = sched.update_from_output(out, fake_result(out, 5))
    assert seq.output_token_ids == [3, 5] and req.is_finished and seq.finish_reason.value == "length"
    assert sched.requests == {} and sched.kv_cache_manager.num_used_blocks == 0
    rec = sched.request_record(seq.seq_id)
    assert rec.finish_reason == "length" and rec.num_output_tokens == 2 and sched.stats.finish_counts["length"] == 1


def test_stop_token_ends_the_sequence_in_the_step_it_is_sampled():
    sched = make_scheduler(max_model_len=128)
    seq = Sequence("s", None, [1, 2, 3], SamplingParams(max_tokens=8, stop_token_ids=[9]), RequestOrigin("s"))
    sched.add_sequence(seq)
    out = sched.schedule()
    sched.update_from_output(out, fake_result(out, 9))
    assert seq.finish_reason.value == "stop" and seq.stop_reason == 9 and sched.stats.finish_counts["stop:stop_token"] == 1
    assert not sched.has_unfinished() and sched.kv_cache_manager.num_used_blocks == 0


def test_n_samples_fork_after_the_prompt_and_share_its_blocks():
    sched = make_scheduler(max_model_len=128)
    params = SamplingParams(n=3, max_tokens=4, ignore_eos=True, temperature=0)
    parent = Sequence("n", None, list(range(8)), params, RequestOrigin("n"))
    sched.add_request(Request.of(parent))
    out = sched.schedule()
    assert out.keep_logits  # the runner must hand back logits to fork from
    (req,) = sched.update_from_output(out, fake_result(out, 4, logits=True))
    assert [s.index for s in req.seqs] == [0, 1, 2] and len(req) == 3
    assert all(s.output_token_ids == [4] for s in req.seqs)  # greedy children sample the same token
    tables = [sched.kv_cache_manager.get_block_table(s.seq_id) for s in req.seqs]
    assert tables[0] == tables[1] == tables[2] and sched.kv_cache_manager.num_used_blocks == 2  # shared
    sched.abort("n")
    assert sched.requests == {} and sched.kv_cache_manager.num_used_blocks == 0
    assert sched.stats.abort_states["decode"] == 3 and all(sched.request_record(s.seq_id).finish_reason == "abort"
                                                     for s in req.seqs)
