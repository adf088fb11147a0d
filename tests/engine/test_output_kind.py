"""Outputs only for requests with a consumer this step (``SamplingParams.output_kind``): a
FINAL_ONLY request gets one output, when it ends, equal to the last output the same request
gets when it is CUMULATIVE; stop strings, n > 1 and ``generate`` keep their results."""

from __future__ import annotations

import dataclasses

from conftest import make_engine

from vlite.engine.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "The quick brown fox"


def _run(engine, params_list):
    """Add one request per params (same prompt), step to the end; every output by request id."""
    ids = [engine.add_request(PROMPT, p) for p in params_list]
    seen = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return [seen[rid] for rid in ids]


def _final(out):
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]


def test_final_only_gets_one_output_equal_to_the_cumulative_last(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    base = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    final = dataclasses.replace(base, output_kind=RequestOutputKind.FINAL_ONLY)
    cumulative, final_only = _run(engine, [base, final])
    assert len(cumulative) == 12 and not any(o.finished for o in cumulative[:-1])
    assert len(final_only) == 1 and final_only[0].finished
    assert _final(final_only[0]) == _final(cumulative[-1])
    text = engine.tokenizer.decode(final_only[0].outputs[0].token_ids, skip_special_tokens=True)
    assert final_only[0].outputs[0].text == text


def test_stop_string_and_n_samples_end_the_same_way(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    probe = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    text = probe.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    base = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3)
    for params in (base, sampled):
        final = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        cumulative, final_only = _run(engine, [params, final])
        assert len(final_only) == 1
        assert _final(final_only[0]) == _final(cumulative[-1])
    stopped = _run(engine, [dataclasses.replace(base, output_kind=RequestOutputKind.FINAL_ONLY)])[0][0]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    assert stopped.outputs[0].text == text[:text.index(stop)]


def test_generate_asks_for_final_outputs_only(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    built = []
    make_output = engine.output_processor.make_output
    engine.output_processor.make_output = lambda req: built.append(req.request_id) or make_output(req)
    outs = engine.generate([PROMPT, PROMPT + " jumps"], SamplingParams(max_tokens=8, temperature=0.0,
                                                                       ignore_eos=True))
    assert sorted(built) == sorted(o.request_id for o in outs)  # one output each, at its end
    for out in outs:
        assert out.outputs[0].text == engine.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
