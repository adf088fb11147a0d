"""The leak check walks every engine path, says which it walked, inspects every
per-request registry, catches zombie requests, and explains blocks from evidence."""

from __future__ import annotations

import json

import pytest
from conftest import make_engine
from report_words import assert_no_none, run_result_text

from vlite.diagnostics.targets.inprocess import run_in_process
from vlite.diagnostics.workload.actions import ClientAction
from vlite.diagnostics.workload.all_paths import all_paths_workload, suggest_num_blocks
from vlite.diagnostics.workload.sources import RequestSpec, WorkloadError, jsonl_workload, synthetic_prompt


def _eos_engine(ckpt, num_blocks):
    """An engine whose EOS id is a token the random model really generates for a chat prompt
    (so EOS finishes happen, as on an instruction-tuned model)."""
    from vlite.diagnostics.workload.all_paths import CHAT_MESSAGES
    from vlite.engine.sampling_params import SamplingParams

    engine = make_engine(ckpt, num_blocks=num_blocks, max_num_batched_tokens=256)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
               for m in CHAT_MESSAGES]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.eos_token_ids = frozenset(o.outputs[0].token_ids[3] for o in outs)  # each chat answer's 4th token
    return engine


def _assert_drained(run):
    f = run.findings
    assert not f.leak and f.verdict == "CLEAN", f.summary()
    assert f.drain.sign == "balanced" and f.drain.mismatch_blocks == 0 and f.drain.quiescent
    assert f.leaked_blocks == [] and f.cpu_state["num_leftover_entries"] == 0 and f.unattributed == []
    assert f.registries["leftover"] == [] and f.registries["over_bound"] == []
    assert {p.num_used_blocks for p in run.replay.idle_points} == {0}


def test_all_paths_workload_walks_every_path_and_drains(tiny_checkpoint):
    specs = all_paths_workload(80, input_len=(8, 40), output_len=(8, 20), abort_rate=0.5, seed=0)
    wave = 16
    engine = _eos_engine(tiny_checkpoint, suggest_num_blocks(specs, wave))
    run = run_in_process(engine, specs, max_concurrency=64, idle_every=wave, sample_interval_s=0.05)
    _assert_drained(run)
    cov = run.findings.coverage
    # 80 requests: three structured requests cannot walk all five forms, and this small pool may
    # admit the long n > 1 prefill probe only once its prefill fits one step; every engine path is walked
    # (and an abort after resumption needs a preempted request resumed before its client leaves,
    # which this small pool's timing does not always give)
    assert set(cov["not_exercised"]) <= {"abort during prefill (n > 1)", "structured output: grammar",
                                         "structured output: json_object", "abort after resumption"}, cov
    assert {"structured:json", "structured:regex", "logprobs", "prompt_logprobs", "logit_bias",
            "penalties"} <= set(cov["features"])
    assert cov["preemptions"] >= 2 and cov["resumptions"] >= 2 and cov["forks"] >= 2 and cov["copy_on_write"] >= 2
    assert cov["beam_prunes"] >= 2 and cov["prefix_hit_tokens"] >= 32
    for kind in ("stop:eos", "stop:stop_token", "stop:stop_string", "length", "abort"):
        assert cov["finish_reasons"].get(kind, 0) >= 1, kind
    assert set(cov["allocation_sites"]) == {"prefill", "decode append", "prefix cache hit", "fork", "copy-on-write"}
    # every registry was sampled over time, and is empty at the end
    assert {"reg:scheduler.requests", "reg:scheduler.live_sequences", "reg:ledger.held"} <= set(run.samples.columns)
    assert run.samples["reg:scheduler.requests"].max() > 0 and run.samples["reg:scheduler.requests"].iloc[-1] == 0
    # no zombie: every aborted request's blocks went back in the step it was aborted
    z = run.findings.zombies
    assert z["distribution"]["n"] >= 5 and z["zombies"] == [] and z["distribution"]["max_steps"] == 0


def test_trace_carries_every_client_option_and_rejects_unknown_keys(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"prompt": "hello there", "stop": ["x y"], "stop_token_ids": [5], "min_tokens": 1, "logprobs": 2,
             "seed": 3, "temperature": 0.5, "ignore_eos": False, "n": 2},
            {"prompt_len": 8, "beam_width": 3, "n": 2, "prefix_id": "sys", "prefix_len": 32, "chat": False},
            {"prompt": "hi", "chat": True, "stop_token_at": 2, "stop_string_at": 1, "client_action": "abort-resumed"}]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    a, b, c = jsonl_workload(trace)
    assert a.stop == ("x y",) and a.stop_token_ids == (5,) and a.logprobs == 2 and not a.ignore_eos and a.n == 2
    p = a.sampling_params()
    assert p.stop == ["x y"] and p.stop_token_ids == [5] and p.min_tokens == 1 and p.seed == 3
    assert b.beam_width == 3 and b.sampling_params().beam_width == 3 and b.prompt_len == 40
    assert c.chat and c.stop_token_at == 2 and c.stop_string_at == 1 and c.action.kind == "abort-resumed"
    # two requests naming the same prefix share its text
    trace.write_text(json.dumps({"prompt": "a", "prefix_id": "p"}) + "\n" + json.dumps({"prompt": "b", "prefix_id": "p"}))
    x, y = jsonl_workload(trace)
    assert x.prompt[:-1] == y.prompt[:-1] and len(x.prompt) > 40
    trace.write_text(json.dumps({"prompt": "a", "stop_sequences": ["x"]}))
    warned = []
    (spec,) = jsonl_workload(trace, warn=warned.append)
    assert spec.stop == () and len(warned) == 1  # ignored, and said so
    assert "ignored unknown key stop_sequences (line 1)" in warned[0] and "known keys: arrival_s" in warned[0]
    trace.write_text(json.dumps({"prompt": "a", "beam_width": 2, "temperature": 1.0}))
    with pytest.raises(WorkloadError, match="beam search"):
        jsonl_workload(trace)


def test_unknown_trace_keys_are_a_warning_listing_them(tmp_path):
    from typer.testing import CliRunner

    from vlite.cli.main import app

    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"prompt": "a", "max_token": 3}) + "\n" + json.dumps({"prompt": "b", "colour": 1}))
    # the model does not exist: the warning comes from reading the trace, before the model load fails
    res = CliRunner().invoke(app, ["leak-check", "--workload", str(trace), "--model", "/no/such/model"],
                             env={"COLUMNS": "300"})
    warning = next(ln for ln in res.output.splitlines() if ln.startswith("warning:"))
    assert "ignored unknown keys max_token (line 1: did you mean max_tokens?); colour (line 2)" in warning
    assert "known keys: arrival_s, prompt" in warning
    assert res.exit_code == 2 and "not found" in res.output  # the run went on to the model


@pytest.mark.parametrize("line, message", [
    ('{"prompt": 5}', "line 1: field prompt must be a non-empty string, got 5"),
    ('{"prompt": ""}', "line 1: field prompt must be a non-empty string, got \"\""),
    ('{"prompt_len": "64"}', 'line 1: field prompt_len must be an integer >= 1 (tokens), got "64"'),
    ('{"prompt": "a", "max_tokens": 0}', "line 1: field max_tokens must be an integer >= 1, got 0"),
    ('{"prompt": "a", "chat": "yes"}', 'line 1: field chat must be true or false, got "yes"'),
    ('{"prompt": "a", "stop": [1]}', "line 1: field stop must be a non-empty string, a list of them, or null, got [1]"),
    ('{"prompt": "a", "client_action": "explode"}',
     'line 1: field client_action must be one of complete, abort-waiting'),
    ('{"max_tokens": 3}', "line 1: no prompt: give field prompt (a non-empty string) or prompt_len"),
    ('{"prompt": "a", max_tokens: 3}', "line 1: not valid JSON (Expecting property name enclosed in double quotes "
                                       "at column 17); each line must be one JSON object, e.g. {"),
    ('["a"]', "line 1: a JSON list where a JSON object is needed"),
])
def test_trace_rows_are_checked_against_the_schema(tmp_path, line, message):
    from typer.testing import CliRunner

    from vlite.cli.main import app

    trace = tmp_path / "t.jsonl"
    trace.write_text(line)
    with pytest.raises(WorkloadError) as err:
        jsonl_workload(trace)
    assert message in str(err.value) and "'" not in str(err.value).split("line 1:")[1].replace("'s", "")
    res = CliRunner().invoke(app, ["leak-check", "--workload", str(trace), "--model", "/no/such/model"],
                             env={"COLUMNS": "400"})
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output


def test_trace_errors_name_the_right_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + json.dumps({"prompt": 5}))
    with pytest.raises(WorkloadError, match=r"t.jsonl, line 3: field prompt"):
        jsonl_workload(trace)


def test_a_directory_as_workload_says_so(tmp_path):
    from typer.testing import CliRunner

    from vlite.cli.main import app

    res = CliRunner().invoke(app, ["leak-check", "-w", str(tmp_path)], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and f"--workload {tmp_path} is a directory" in res.output
    assert "no such file" not in res.output
    with pytest.raises(WorkloadError, match="is a directory"):
        jsonl_workload(tmp_path)


def test_every_schema_key_is_documented():
    from pathlib import Path

    from vlite.diagnostics.workload.sources import TRACE_SCHEMA

    doc = (Path(__file__).parents[2] / "docs" / "reference.md").read_text()
    section = doc[doc.index("## JSONL trace schema"):]
    section = section[:section.index("\n## ", 5)]
    for key in TRACE_SCHEMA:
        assert f"`{key}`" in section, key


def test_unwritable_report_fails_before_the_run(tmp_path):
    from typer.testing import CliRunner

    from vlite.cli.main import app

    blocker = tmp_path / "file"
    blocker.write_text("")
    res = CliRunner().invoke(app, ["leak-check", "--model", "/nonexistent", "--report", str(blocker / "r")],
                             env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "cannot write the report" in res.output  # not "model not found": checked first


def test_default_wave_keeps_small_traces_in_one_wave():
    from vlite.diagnostics.targets.base import default_wave as _default_wave

    assert _default_wave(5, None) == 5 and _default_wave(60, None) == 16 and _default_wave(200, None) == 40
    assert _default_wave(200, 7) == 7


def _n_samples(k=4):
    import random

    return [RequestSpec(f"z-{i}", 0.0, synthetic_prompt(random.Random(i), 20), 20, 16,
                        ClientAction("abort-after-tokens", after_tokens=2) if i % 2 else ClientAction(),
                        temperature=1.0, seed=i, n=3) for i in range(k)]


def test_zombie_samples_that_outlive_their_client_make_the_verdict_zombie(tiny_checkpoint):
    from vlite.engine.core.sequence import FinishReason

    engine = make_engine(tiny_checkpoint, num_blocks=96)

    def abort_first_only(request_id):  # a defect: the other samples decode on after the client left
        seqs = list(engine.scheduler.requests.get(request_id, ()))
        if not seqs:
            return False
        engine.scheduler.finish_sequence(seqs[0], FinishReason.ABORT)
        return True

    engine.abort = abort_first_only
    run = run_in_process(engine, _n_samples(), max_concurrency=8, idle_every=0, sample_interval_s=0.05)
    f = run.findings
    assert f.verdict == "ZOMBIE" and not f.leak, f.summary()
    zombies = {z["request_id"] for z in f.zombies["zombies"]}
    assert zombies == {"z-1", "z-3"}
    assert all(z["outlived_steps"] > 2 and z["tokens_after_leaving"] > 2 for z in f.zombies["zombies"])
    assert f.summary().startswith("ZOMBIE") and "--zombie-threshold-steps" in f.summary()
    assert_no_none(run_result_text(run))
    clean = run_in_process(make_engine(tiny_checkpoint, num_blocks=96), _n_samples(), max_concurrency=8,
                           sample_interval_s=0.05)
    assert clean.findings.verdict == "CLEAN" and clean.findings.zombies["zombies"] == []
    assert_no_none(run_result_text(clean))


def test_a_registry_left_behind_is_a_leak_and_named(tiny_checkpoint, monkeypatch):
    from vlite.engine.core.kv_cache_manager import KVCacheManager

    free = KVCacheManager.free

    def free_keeping_hash_progress(self, seq):
        kept = self._num_hashed.get(seq.seq_id)
        n = free(self, seq)
        if kept is not None:
            self._num_hashed[seq.seq_id] = kept  # a defect: prefix-hash progress never dropped
        return n

    monkeypatch.setattr(KVCacheManager, "free", free_keeping_hash_progress)
    engine = make_engine(tiny_checkpoint, num_blocks=64)
    run = run_in_process(engine, _n_samples(2), max_concurrency=4, sample_interval_s=0.05)
    f = run.findings
    assert f.leak and f.drain.ok, f.summary()  # blocks all came back: only the registry shows it
    assert [r["registry"] for r in f.registries["leftover"]] == ["prefix_hash_progress"]
    assert "registries not empty at idle: prefix_hash_progress" in f.summary()


def test_unattributed_blocks_are_described_from_the_release_history(tiny_checkpoint, monkeypatch):
    from vlite.diagnostics.checks import snapshot
    from vlite.diagnostics.checks.detect import detect
    from vlite.engine.core.kv_cache_manager import KVCacheManager

    release = KVCacheManager._release

    def release_keeping_count(self, block_id, seq, path="free"):  # a defect: the ledger is cleared, the count not
        if path == "free" and seq.num_output_tokens >= 4 and not getattr(self, "_done", False):
            self._done = True
            self.blocks[block_id].ref_count += 1
        release(self, block_id, seq, path)

    monkeypatch.setattr(KVCacheManager, "_release", release_keeping_count)
    engine = make_engine(tiny_checkpoint, num_blocks=64)
    run = run_in_process(engine, _n_samples(2), max_concurrency=4, sample_interval_s=0.05)
    f = run.findings
    assert f.leak and f.leaked_blocks == [] and len(f.unattributed) == 1, f.summary()
    u = f.unattributed[0]
    assert u["ref_count"] == 1 and u["last_holders"] and u["last_holders"][-1]["released_by"].startswith("finish")
    assert "did not bring the count to 0" in u["evidence"] and "unattributed blocks" in f.summary()
    assert f.unattributed_blocks == 1
    # the same description from the JSON a served engine sends
    snap = snapshot.from_debug_blocks(__import__("vlite.engine", fromlist=["x"]).blocks_document(engine))
    assert detect(snap, run.replay.requests, run.replay.idle_points).unattributed[0]["block_id"] == u["block_id"]


def test_suspected_paths_come_from_evidence_and_say_unknown_when_thin():
    from vlite.diagnostics.checks.evidence import suspected_paths
    from vlite.diagnostics.checks.snapshot import Snapshot

    rel = {"block_id": 3, "seq_id": 1, "request_id": "r", "alloc_site": "fork", "alloc_step": 2, "path": "copy-on-write",
           "seq_status": "running", "finish_reason": None, "num_preemptions": 0, "ref_count_after": 1, "step": 5,
           "time": 0.0}
    snap = Snapshot(8, 6, 2, 0, block_tables={1: [9]}, released=[rel])
    rows = [{"block_id": 4, "seq_id": 1, "request_id": "r", "site": "fork", "step": 2, "status": "running",
             "finish_reason": None, "num_preemptions": 0},
            {"block_id": 9, "seq_id": 1, "request_id": "r", "site": "copy-on-write", "step": 5, "status": "running",
             "finish_reason": None, "num_preemptions": 0}]
    suspected_paths(snap, rows)
    assert rows[0]["suspected_path"].startswith("copy-on-write replaced this block-table entry")
    assert "copy-on-write block from step 5" in rows[0]["evidence"]
    thin = [{"block_id": 7, "seq_id": 2, "request_id": "q", "site": "prefill", "step": 1, "status": "waiting",
             "finish_reason": None, "num_preemptions": 0}]
    suspected_paths(Snapshot(8, 7, 1, 0, released=[rel]), thin)
    assert thin[0]["suspected_path"] == "unknown" and "no release of this sequence remembered" in thin[0]["evidence"]


def test_rss_trend_skips_warm_up_stays_informational_and_survives_rich_markup():
    from io import StringIO

    from rich.console import Console

    from vlite.diagnostics.checks.detect import RSS_THRESHOLD_BYTES_PER_REQUEST, rss_trend
    from vlite.diagnostics.report.writer import trend_line
    from vlite.diagnostics.workload.replay import IdlePoint

    warm = [IdlePoint(0, 0, 0, 100_000_000), IdlePoint(0, 10, 0, 180_000_000)] + \
        [IdlePoint(0, 10 * i, 0, 200_000_000 + 100 * i) for i in range(2, 7)]
    t = rss_trend(warm)
    assert t.n == 5 and t.baseline == 200_000_200 and not t.rising  # the warm-up jump is not a trend
    flat = trend_line(t)
    assert flat.endswith("[informational; the host-memory verdict fits the later half]") and "rising" not in flat
    assert "baseline 190.7 MiB -> last 190.7 MiB" in flat and "KiB/request" in flat  # not raw byte counts
    assert flat.startswith("process RSS (rss_bytes) at idle troughs") and "R^2" in flat
    from vlite.diagnostics.checks.detect import trough_trend

    no_blocks = trend_line(trough_trend([IdlePoint(0, 10 * i, 0, 0) for i in range(5)]))
    assert "flat at every idle point" in no_blocks and "R^2" not in no_blocks  # no variance: no fit claimed
    growing = [IdlePoint(0, 10 * i, 0, 10 * i * 4 * RSS_THRESHOLD_BYTES_PER_REQUEST) for i in range(6)]
    t = rss_trend(growing)
    assert t.rising
    out = StringIO()
    Console(file=out, width=300).print(trend_line(t), markup=False)
    assert "[rising; informational" in out.getvalue()


def test_cli_report_has_coverage_and_says_unattributed(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from vlite.cli.main import app

    out = tmp_path / "rep"
    res = CliRunner().invoke(app, ["leak-check", "--model", str(tiny_model_dir), "--num-requests", "24",
                                   "--abort-rate", "0.3", "--input-len", "8:24", "--output-len", "6:12",
                                   "--report", str(out), "--sample-interval-ms", "50"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "coverage: allocations by site" in res.output and "unattributed blocks: 0" in res.output
    rep = json.loads((out / "report.json").read_text())
    cov = rep["coverage"]
    assert {"allocation_sites", "finish_reasons", "preemptions", "prefix_hit_tokens", "forks", "copy_on_write",
            "beam_prunes", "not_exercised"} <= set(cov)
    assert cov["preemptions"] > 0 and cov["forks"] > 0 and "EOS finish" in cov["not_exercised"]
    assert rep["verdict"] == "CLEAN" and rep["zombies"]["zombies"] == [] and rep["registries"]["leftover"] == []
    md = (out / "report.md").read_text()
    assert "unattributed" in md and "not exercised: EOS finish" in md


def test_zombie_thresholds_steps_in_process_seconds_over_http_and_the_running_gauge():
    from vlite.diagnostics.checks.zombie import zombie_check
    from vlite.diagnostics.workload.replay import RequestResult

    def left(rid, t, step, tokens):
        r = RequestResult(rid, "abort-after-tokens", "abort after 2 tokens", 0.0, outcome="aborted", abort_time=t)
        r.abort_step, r.tokens_at_abort = step, tokens
        return r

    hist = {"a": {"finished": True, "finished_time": 10.0, "released_time": 10.0, "released_step": 5,
                  "num_output_tokens": 2},
            "b": {"finished": True, "finished_time": 10.5, "released_time": 10.5, "released_step": 9,
                  "num_output_tokens": 6},
            "c": {"finished": True, "finished_time": 12.5, "released_time": 12.5, "released_step": None,
                  "num_output_tokens": 2},
            "d": {"finished": False}}
    z = zombie_check([left("a", 10.0, 5, 2), left("b", 10.0, 5, 2), left("c", 11.0, None, None),
                      left("d", 10.0, 5, 2)], hist)
    assert [r["request_id"] for r in z["zombies"]] == ["b", "c"]  # 4 steps in process; 1.5 s when steps unknown
    assert z["not_released"] == ["d"] and z["distribution"]["n"] == 3 and z["distribution"]["max_steps"] == 4
    assert z["distribution"]["tokens_after_leaving_total"] == 4
    assert zombie_check([], {}, gauge_lag_s=2.5)["zombies"][0]["client_action"] == "(running-request gauge)"
    # in process, 0 steps after the abort is no zombie whatever a token count says (a step makes one token)
    same_step = {"e": {"finished": True, "finished_time": 10.0, "released_time": 10.0, "released_step": 5,
                       "num_output_tokens": 15}}
    assert zombie_check([left("e", 10.0, 5, 8)], same_step)["zombies"] == []
    assert zombie_check([], {}, gauge_lag_s=0.2)["zombies"] == []


def test_coverage_lines_say_all_paths_only_when_none_is_missing():
    from vlite.diagnostics.checks import coverage

    every = {"allocation_sites": {"prefill": 1, "decode append": 1}, "prefix_hit_tokens": 1, "forks": 1,
             "copy_on_write": 1, "preemptions": 1, "resumptions": 1, "beam_prunes": 1,
             "finish_reasons": {"stop:eos": 1, "stop:stop_token": 1, "stop:stop_string": 1, "length": 1},
             "abort_states": {"waiting": 1, "prefill": 1, "decode": 1, "resumed": 1},
             "features": {f: 1 for f in ("structured:json", "structured:regex", "structured:choice",
                                         "structured:grammar", "structured:json_object", "logprobs",
                                         "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words",
                                         "penalties", "top_k/top_p/min_p", "min_tokens", "seed")},
             "aborts_by_family": {"n > 1: prefill": 1, "n > 1: decode": 1, "beam search: decode": 1,
                                  "structured output: decode": 1, "structured output: waiting": 1},
             "rejections": {"sibling rejected": 1, "after scheduling": 1}}
    full = coverage.lines(coverage.section(every))
    # in process the API server's routes are not applicable (no API server): not counted as missing
    assert full[-1] == (f"coverage: all {len(coverage.PATHS) - len(coverage.API_PATHS)} engine paths of the "
                        "checklist exercised")
    assert not any(line.startswith("not exercised:") for line in full)
    partial = coverage.lines(coverage.section({**every, "forks": 0}))
    assert "not exercised: fork" in partial and not any("engine paths of the checklist" in line for line in partial)
