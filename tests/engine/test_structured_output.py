"""Structured output in the engine: grammar masks in the sampler, matcher state through fork,
preemption, finish and abort (vlite.engine.core.structured_output)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import make_engine

from vlite.engine.core.sequence import RequestOrigin, Sequence
from vlite.engine.core.structured_output import StructuredOutputManager, StructuredOutputsParams, apply_grammar_masks
from vlite.engine.introspection import EngineView
from vlite.engine.llm_engine import RequestRejectedError
from vlite.engine.sampling_params import SamplingParams


def INT(lo, hi):  # noqa: N802 - reads like a schema constructor
    return {"type": "integer", "minimum": lo, "maximum": hi}


# Bounded schemas (every string, array and integer has a limit), so that even a random model's
# output closes well within max_tokens: the grammar, not the model, makes them finish.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": INT(0, 120)},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    INT(-50, 50),
    {"type": "string", "maxLength": 5},
    {"type": "string", "pattern": "^[a-f0-9]{6}$"},
    {"type": "array", "items": INT(0, 9), "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": INT(0, 99), "y": INT(0, 99)},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "null"},
    {"const": "fixed"},
    {"anyOf": [INT(0, 5), {"type": "string", "maxLength": 3}]},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "maxItems": 2}}, "required": ["tags"], "additionalProperties": False},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "array", "prefixItems": [INT(0, 3), {"type": "boolean"}], "items": False},
    {"type": "object", "properties": {"kind": {"const": "circle"}, "r": INT(1, 9)}, "required": ["kind", "r"],
     "additionalProperties": False},
    {"$defs": {"digit": INT(0, 9)}, "type": "object",
     "properties": {"a": {"$ref": "#/$defs/digit"}, "b": {"$ref": "#/$defs/digit"}}, "required": ["a", "b"],
     "additionalProperties": False},
    {"oneOf": [{"type": "object", "properties": {"cat": {"type": "boolean"}}, "required": ["cat"],
                "additionalProperties": False},
               {"type": "object", "properties": {"dog": INT(0, 3)}, "required": ["dog"], "additionalProperties": False}]},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}, "additionalProperties": False},
    {"enum": ["été", "naïve", "日本"]},
    {"type": "string", "minLength": 2, "maxLength": 4, "pattern": "^[A-Z]+$"},
]
PERSON = SCHEMAS[0]


def validate(schema: dict, text: str) -> None:
    """Raise unless ``text`` is JSON valid against ``schema`` (draft 2020-12, formats checked)."""
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(json.loads(text))


def constrained(max_tokens=64, temperature=0.0, seed=None, n=1, **structured) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, n=n,
                          structured_outputs=StructuredOutputsParams(**structured))


def matchers(engine) -> int:
    return EngineView(engine).registries()["structured_output.matchers"]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return make_engine(tiny_checkpoint, num_blocks=256)


def test_json_schemas_validate_greedy_and_sampled(engine):
    assert len(SCHEMAS) >= 20
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for temperature in (0.0, 1.0):
            prompts.append(f"Schema {i}: answer in JSON")
            params.append(constrained(temperature=temperature, seed=i, json=schema, disable_any_whitespace=True))
    outs = engine.generate(prompts, params)
    for k, out in enumerate(outs):
        schema, c = SCHEMAS[k // 2], out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        validate(schema, c.text)
    assert matchers(engine) == 0
    assert EngineView(engine).coverage().finish_reasons.get("stop:grammar", 0) >= len(SCHEMAS)


def test_a_json_string_schema_and_whitespace_options(engine):
    params = constrained(json=json.dumps(PERSON), whitespace_pattern=r"[ ]?")
    c = engine.generate(["person"], params)[0].outputs[0]
    assert c.finish_reason == "stop"
    validate(PERSON, c.text)
    assert "\n" not in c.text and "  " not in c.text  # only single spaces between JSON tokens


def test_disable_additional_properties_closes_objects():
    open_schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "null"}}}}}
    params = StructuredOutputsParams(json=open_schema, disable_additional_properties=True)
    grammar = json.loads(params.to_llguidance())
    closed = grammar["grammars"][0]["json_schema"]
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in open_schema  # the request's schema is not modified


def test_regex_choice_and_grammar(engine):
    cases = [
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"choice": ["alpha", "beta gamma", "δ"]}, lambda t: t in ("alpha", "beta gamma", "δ")),
        ({"grammar": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[1-9]/'}, lambda t: re.fullmatch(r"yes|no|maybe [1-9]", t)),
        ({"grammar": 'root ::= "x" [a-c] "y"'}, lambda t: re.fullmatch(r"x[a-c]y", t)),  # GBNF
    ]
    for temperature in (0.0, 1.0):
        outs = engine.generate([f"case {i}" for i in range(len(cases))],
                               [constrained(temperature=temperature, seed=i, **kw) for i, (kw, _) in enumerate(cases)])
        for (kw, ok), out in zip(cases, outs):
            c = out.outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (kw, c.text)
    assert matchers(engine) == 0


def test_grammar_end_stops_even_with_ignore_eos(engine):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["done"]))
    c = engine.generate(["x"], params)[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("done", "stop", None)


def test_n_samples_each_follow_the_schema_from_forked_matchers(engine):
    rid = "n3"
    engine.add_request("three people", constrained(temperature=1.0, seed=7, n=3, json=PERSON,
                                                   disable_any_whitespace=True), request_id=rid)
    engine.step()  # the prompt: the parent samples, then 2 children fork its matcher
    live = list(engine.scheduler.requests[rid])
    assert len(live) == 3 and matchers(engine) == 3
    assert len({id(s.grammar_matcher) for s in live}) == 3  # one matcher per sequence, not shared
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    assert len(final.outputs) == 3
    for c in final.outputs:
        assert c.finish_reason == "stop"
        validate(PERSON, c.text)
    assert len({c.text for c in final.outputs}) > 1  # sampled independently after the fork
    assert matchers(engine) == 0


def test_abort_mid_generation_leaves_no_matcher(engine):
    # Flexible whitespace: a random model keeps emitting whitespace, so these run until aborted.
    live_before = StructuredOutputManager.live_total  # matchers of every engine in this process
    for i in range(3):
        engine.add_request(f"json {i}", constrained(max_tokens=200, temperature=1.0, seed=i, n=2 if i == 2 else 1,
                                                    json_object=True), request_id=f"abort-{i}")
    finished = set()
    for _ in range(4):
        finished |= {out.request_id for out in engine.step() if out.finished}
    # one matcher per live sample (1 + 1 + 2 unless a random draw already closed an object)
    live = EngineView(engine).registries()["block_tables"]
    assert live >= 2 and matchers(engine) == live
    for i in range(3):
        assert engine.abort(f"abort-{i}") == (f"abort-{i}" not in finished)
    registries = EngineView(engine).registries()
    assert registries["structured_output.matchers"] == 0 and registries["block_tables"] == 0
    assert not engine.scheduler.requests and not engine.structured_output.matchers
    assert StructuredOutputManager.live_total == live_before


def test_preemption_keeps_the_grammar_state(tiny_checkpoint):
    """A tight KV cache preempts (recompute) constrained requests mid-output; their outputs equal
    those of a cache with room for all: the matcher was neither reset nor advanced twice."""
    prompts = [list(range(100 + 10 * i, 108 + 10 * i)) for i in range(4)]
    params = [constrained(max_tokens=40, regex=r"[a-z]{30}\.") for _ in prompts]
    roomy = make_engine(tiny_checkpoint, num_blocks=128, block_size=4).generate(prompts, params)
    alone = [o.outputs[0].text for o in roomy]
    tight = make_engine(tiny_checkpoint, num_blocks=14, block_size=4, max_num_batched_tokens=32)
    outs = tight.generate(prompts, params)
    assert tight.scheduler.stats.num_preemptions_total > 0
    assert [o.outputs[0].text for o in outs] == alone
    assert all(re.fullmatch(r"[a-z]{30}\.", t) for t in alone)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert matchers(tight) == 0


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(engine):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["free one", "free two"]
    alone = [o.outputs[0].token_ids for o in engine.generate(prompts, free)]
    mixed = engine.generate([prompts[0], "json", prompts[1]],
                            [free, constrained(json=PERSON, disable_any_whitespace=True), free])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    validate(PERSON, mixed[1].outputs[0].text)


def test_mask_is_exactly_the_grammar_bitmask(engine):
    """apply_grammar_masks sets -inf exactly on the tokens llguidance's mask forbids, only on
    constrained rows, and leaves allowed logits as they were."""
    manager = engine.structured_output
    params = constrained(json=PERSON)
    seqs = [Sequence(f"m{i}", None, [1, 2], p, RequestOrigin(f"m{i}"))
            for i, p in enumerate([params, SamplingParams(), params])]
    manager.add(seqs[0])
    manager.add(seqs[2])
    prefix = engine.tokenizer('{"name": "Al', add_special_tokens=False).input_ids
    assert seqs[2].grammar_matcher.consume_tokens(prefix)
    vocab = engine.hf_config.vocab_size
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_grammar_masks(logits, seqs)
    assert torch.equal(logits[1], before[1])
    for row in (0, 2):
        allowed = torch.frombuffer(bytearray(seqs[row].grammar_matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed = allowed[:vocab] > 0
        assert 0 < int(allowed.sum()) < vocab
        assert torch.equal(torch.isinf(logits[row]), ~allowed)
        assert torch.equal(logits[row][allowed], before[row][allowed])
    first = engine.tokenizer.decode([int(logits[0].argmax())])
    assert first.lstrip().startswith("{")  # the schema is an object
    for s in seqs:
        manager.free(s)
    assert not manager.matchers and all(s.grammar_matcher is None for s in seqs)


def test_compile_cache_and_invalid_constraints(engine):
    manager = engine.structured_output
    schema = {"type": "object", "properties": {"cache": {"type": "boolean"}}}
    compiled = manager.num_compiled
    first = manager.compile(StructuredOutputsParams(json=schema))
    assert manager.compile(StructuredOutputsParams(json=json.dumps(schema))) is first  # same key, one compile
    assert manager.num_compiled == compiled + 1
    bad = [({"json": {"type": "foo"}}, "invalid JSON schema"),
           ({"regex": "[a-"}, "invalid regex"),
           ({"grammar": "start: undefined_rule"}, "invalid grammar")]
    for kw, message in bad:
        with pytest.raises(ValueError, match=message) as info:
            manager.compile(StructuredOutputsParams(**kw))
        assert "\n" not in str(info.value)
        with pytest.raises(RequestRejectedError, match=message):
            engine.add_request("x", constrained(**kw))
    assert not engine.scheduler.requests and matchers(engine) == 0


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "must be a JSON Schema object"),
    ({"json_object": False}, "exactly one of"),
])
def test_params_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_beam_search_and_unknown_keys_are_refused():
    with pytest.raises(ValueError, match="beam search does not support structured outputs"):
        SamplingParams(temperature=0.0, beam_width=2, structured_outputs={"regex": "a+"})
    with pytest.raises(ValueError, match="unexpected keyword argument 'guided_json'"):
        SamplingParams(structured_outputs={"guided_json": {}})


@pytest.mark.slow
def test_smollm2_follows_json_mode_schema_and_choice_with_default_whitespace(smollm2_checkpoint):
    """A real instruct model, vLLM's defaults (any JSON whitespace): chat prompts asking for
    JSON finish by themselves with valid output."""
    engine = make_engine(smollm2_checkpoint, num_blocks=64)
    tok = engine.tokenizer

    def chat(message: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                       add_generation_prompt=True)

    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    outs = engine.generate(
        [chat("Give me a JSON object describing a cat with its name and color."),
         chat("Describe Ada Lovelace as JSON with name and age."), chat("Is the sky blue? Answer yes or no.")],
        [constrained(max_tokens=80, json_object=True), constrained(max_tokens=80, json=person),
         constrained(max_tokens=10, choice=["yes", "no"])])
    cat, ada, answer = (o.outputs[0] for o in outs)
    assert all(c.finish_reason == "stop" for c in (cat, ada, answer))
    assert isinstance(json.loads(cat.text), dict)
    validate(person, ada.text)
    assert answer.text in ("yes", "no")
    assert matchers(engine) == 0
