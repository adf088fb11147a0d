"""Structured output's costs on SmolLM2 (docs/serve.md, "Structured output").

1. Requests without a constraint: a W1-like offline workload (random prompts, greedy, ignore_eos)
   run by one engine alternately *with* the shipped sampler and *without* structured output
   (``apply_grammar_masks`` replaced by a no-op in the sampler, and the matcher free in the
   finish path too), ``--repeats`` times each (with, without, with, without, ...), in one process,
   so the slow spells of a shared machine hit both sides. Reported: output tokens/s of each run,
   the medians and the throughput overhead; and, measured directly, the time spent inside
   ``apply_grammar_masks`` during the "with" runs as a share of their wall time.
2. Requests with a constraint: per output token, the microseconds to compute and apply the
   grammar mask to one [vocab] float32 logits row (``apply_grammar_masks``) and to advance the
   matcher (``StructuredOutputManager.accept``), replaying the tokens SmolLM2 itself generated
   under each constraint (JSON schema with any whitespace, JSON object, regex, choice); and the
   mask time per row when 8 constrained rows are masked together.

    .venv/bin/python benchmarks/serving/structured_output.py [--num-prompts 32] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def unconstrained_ab(engine, reqs, repeats: int) -> dict:
    import vlite.engine.worker.sampler as sampler_mod
    from vlite.bench.runners import run_vlite

    shipped_mask, shipped_free = sampler_mod.apply_grammar_masks, engine.structured_output.free
    inside: list[float] = []  # seconds of each apply_grammar_masks call of the current run

    def timed(mask):
        def call(logits, seqs):
            start = time.perf_counter()
            mask(logits, seqs)
            inside.append(time.perf_counter() - start)
        return call

    # The "without" side times a no-op the same way: the first Python call after a forward pass
    # runs on cold caches, and that cost is not structured output's.
    sides = {"with": (timed(shipped_mask), shipped_free),
             "without": (timed(lambda logits, seqs: None), lambda seq: None)}
    tps: dict[str, list[float]] = {"with": [], "without": []}
    share: dict[str, list[float]] = {"with": [], "without": []}
    per_call_us: dict[str, list[float]] = {"with": [], "without": []}
    try:
        for i in range(repeats):
            for side, (mask, free) in sides.items():
                sampler_mod.apply_grammar_masks, engine.structured_output.free = mask, free
                inside.clear()
                res = run_vlite(engine, reqs, show_progress=False, warmup=(i == 0))
                out_tps = res.summary(reqs)["output_tokens_per_second"]
                tps[side].append(out_tps)
                share[side].append(sum(inside) / res.elapsed_s)
                per_call_us[side].append(statistics.median(inside) * 1e6)
                line = (f"repeat {i}: {side:7s} {out_tps:7.2f} output tok/s, {len(inside)} sampler calls, median "
                        f"{per_call_us[side][-1]:.2f} us inside the mask call ({'apply_grammar_masks' if side == 'with' else 'a no-op'}"
                        f"; all calls: {share[side][-1] * 100:.4f}% of the run)")
                print(line, flush=True)
    finally:
        sampler_mod.apply_grammar_masks, engine.structured_output.free = shipped_mask, shipped_free
    w, wo = statistics.median(tps["with"]), statistics.median(tps["without"])
    print(f"median: with {w:.2f}, without {wo:.2f} output tok/s -> overhead {(1 - w / wo) * 100:+.2f}%")
    return {"with_tok_s": tps["with"], "without_tok_s": tps["without"], "median_with": w, "median_without": wo,
            "overhead": 1 - w / wo, "mask_time_share": share, "mask_call_us": per_call_us}


def constrained_costs(engine, repeats: int) -> dict:
    from vlite.engine.core.sequence import RequestOrigin, Sequence
    from vlite.engine.core.structured_output import StructuredOutputsParams, apply_grammar_masks
    from vlite.engine.sampling_params import SamplingParams

    tok = engine.tokenizer

    def chat(message: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                       add_generation_prompt=True)

    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "hobbies": {"type": "array", "items": {"type": "string"},
                                                           "maxItems": 3}},
              "required": ["name", "age", "hobbies"], "additionalProperties": False}
    cases = {
        "json schema (person, any whitespace)": ("Describe Ada Lovelace as JSON with name, age and hobbies.",
                                                 StructuredOutputsParams(json=person)),
        "json_object": ("Give me a JSON object describing a cat.", StructuredOutputsParams(json_object=True)),
        "regex [a-z ]{20,60}\\.": ("Write a short sentence.", StructuredOutputsParams(regex=r"[a-z ]{20,60}\.")),
        "choice (3 options)": ("Is the sky blue?", StructuredOutputsParams(choice=["yes", "no", "it depends"])),
    }
    manager = engine.structured_output
    vocab = engine.hf_config.vocab_size
    results = {}
    for name, (prompt, params) in cases.items():
        out = engine.generate([chat(prompt)], SamplingParams(max_tokens=120, temperature=0.0,
                                                             structured_outputs=params))[0].outputs[0]
        tokens = list(out.token_ids)
        mask_us, accept_us, first_us, rest_us = [], [], [], []
        for _ in range(repeats):
            seq = Sequence("bench", None, [1], SamplingParams(structured_outputs=params), RequestOrigin("bench"))
            manager.add(seq)
            logits = torch.randn(1, vocab)
            t_mask, t_accept = [], []
            for token in tokens:
                start = time.perf_counter()
                apply_grammar_masks(logits, [seq])
                mid = time.perf_counter()
                manager.accept(seq, token)
                t_accept.append(time.perf_counter() - mid)
                t_mask.append(mid - start)
            manager.free(seq)
            mask_us.append(sum(t_mask) / len(tokens) * 1e6)
            accept_us.append(sum(t_accept) / len(tokens) * 1e6)
            first_us.append(t_mask[0] * 1e6)
            if len(tokens) > 1:
                rest_us.append(statistics.median(t_mask[1:]) * 1e6)
        results[name] = {"tokens": len(tokens), "finish_reason": out.finish_reason, "text": out.text,
                         "mask_us": statistics.median(mask_us), "accept_us": statistics.median(accept_us),
                         "first_mask_us": statistics.median(first_us),
                         "later_mask_us_median": statistics.median(rest_us) if rest_us else None}
        r = results[name]
        later = f", first token {r['first_mask_us']:.0f} us, later tokens median " + (
            f"{r['later_mask_us_median']:.0f} us" if rest_us else "-")
        print(f"{name}: {len(tokens)} tokens ({out.finish_reason}); mean mask {r['mask_us']:.1f} us + "
              f"advance {r['accept_us']:.1f} us per token{later}", flush=True)
    # 8 constrained rows masked in one call (the JSON-object case at its first token)
    params = cases["json_object"][1]
    seqs = [Sequence(f"b{i}", None, [1], SamplingParams(structured_outputs=params), RequestOrigin(f"b{i}"))
            for i in range(8)]
    for s in seqs:
        manager.add(s)
    logits = torch.randn(8, vocab)
    times = []
    for _ in range(max(repeats, 5) * 10):
        start = time.perf_counter()
        apply_grammar_masks(logits, seqs)
        times.append(time.perf_counter() - start)
    for s in seqs:
        manager.free(s)
    results["batch of 8 rows: mask us per row"] = statistics.median(times) / 8 * 1e6
    print(f"8 constrained rows in one call: {results['batch of 8 rows: mask us per row']:.1f} us per row")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len-range", default="32:256")
    ap.add_argument("--output-len-range", default="16:128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-ab", action="store_true", help="only the constrained per-token costs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from vlite.bench.datasets import random_requests
    from vlite.engine.config import EngineConfig
    from vlite.engine.llm_engine import LLMEngine
    from vlite.engine.worker.loader import DEFAULT_MODEL, load_checkpoint

    ckpt = load_checkpoint(DEFAULT_MODEL)
    engine = LLMEngine(EngineConfig(), checkpoint=ckpt)
    result = {"workload": vars(args), "torch_threads": torch.get_num_threads()}
    if not args.skip_ab:
        in_r = tuple(int(x) for x in args.input_len_range.split(":"))
        out_r = tuple(int(x) for x in args.output_len_range.split(":"))
        reqs = random_requests(ckpt.tokenizer, args.num_prompts, in_r, out_r, seed=0)
        result["unconstrained"] = unconstrained_ab(engine, reqs, args.repeats)
    result["constrained"] = constrained_costs(engine, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
