"""bfloat16 vs float32 greedy tokens on workload W1 (and each run's throughput).

Both engines run the same 64 W1 requests greedily with EOS ignored; the outputs are compared
position by position. Reported: the share of output positions with the same token, the mean
share of each output before its first difference (after a first difference the two runs
continue from different contexts, so later positions are no longer comparable one to one),
and the share of requests whose outputs are identical.

Also transformers' own bfloat16 (its continuous batching, no padding) on the same requests:
vlite bfloat16 against transformers bfloat16 says whether vlite's bf16 path adds error of its
own, and transformers bfloat16 against vlite float32 (which equals transformers float32 token
for token) is how far bfloat16 alone moves the greedy tokens.

    .venv/bin/python benchmarks/quality/bf16_agreement.py [--num-prompts 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' bfloat16 run")
    args = ap.parse_args()

    from vlite.bench.datasets import random_requests
    from vlite.bench.runners import load_hf_model, run_hf_continuous, run_vlite, token_agreement
    from vlite.engine.config import EngineConfig
    from vlite.engine.llm_engine import LLMEngine
    from vlite.engine.worker.loader import DEFAULT_MODEL, load_checkpoint

    ckpt = load_checkpoint(DEFAULT_MODEL)
    reqs = random_requests(ckpt.tokenizer, args.num_prompts, (32, 256), (16, 256), seed=0)
    runs, result = {}, {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(dtype=dtype), checkpoint=ckpt)
        runs[dtype] = run_vlite(engine, reqs, show_progress=False)
        result[f"{dtype}_output_tok_s"] = runs[dtype].summary(reqs)["output_tokens_per_second"]
        print(f"{dtype}: {result[f'{dtype}_output_tok_s']:.2f} output tok/s")
        del engine
    pairs = {"agreement": ("float32", "bfloat16")}
    if not args.no_hf:
        runs["hf-bfloat16"] = run_hf_continuous(load_hf_model(str(ckpt.path), "bfloat16"), reqs, show_progress=False)
        pairs.update(agreement_vs_hf_bf16=("hf-bfloat16", "bfloat16"), hf_bf16_vs_fp32=("float32", "hf-bfloat16"))
    result.update(num_requests=len(reqs), num_output_tokens=sum(len(t) for t in runs["float32"].token_ids))
    for key, (a, b) in pairs.items():
        agree = result[key] = token_agreement(runs[a].token_ids, runs[b].token_ids)
        print(f"{b} vs {a} greedy: {agree['positions'] * 100:.1f}% of output positions equal; "
              f"{agree['prefix'] * 100:.1f}% of each output (mean) before the first difference; "
              f"{agree['identical'] * 100:.1f}% of requests identical")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
