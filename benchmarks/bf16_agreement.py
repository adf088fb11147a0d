"""bfloat16 vs float32 greedy tokens on workload W1 (and each run's throughput).

Both engines run the same 64 W1 requests greedily with EOS ignored; the outputs are compared
position by position. Reported: the share of output positions with the same token, the mean
share of each output before its first difference (after a first difference the two runs
continue from different contexts, so later positions are no longer comparable one to one),
and the share of requests whose outputs are identical.

    .venv/bin/python benchmarks/bf16_agreement.py [--num-prompts 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from vlite.bench.datasets import random_requests
    from vlite.bench.runners import run_vlite, token_agreement
    from vlite.engine.config import EngineConfig
    from vlite.engine.llm_engine import LLMEngine
    from vlite.engine.loader import DEFAULT_MODEL, load_checkpoint

    ckpt = load_checkpoint(DEFAULT_MODEL)
    reqs = random_requests(ckpt.tokenizer, args.num_prompts, (32, 256), (16, 256), seed=0)
    runs, result = {}, {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(dtype=dtype), checkpoint=ckpt)
        runs[dtype] = run_vlite(engine, reqs, show_progress=False)
        result[f"{dtype}_output_tok_s"] = runs[dtype].summary(reqs)["output_tokens_per_second"]
        print(f"{dtype}: {result[f'{dtype}_output_tok_s']:.2f} output tok/s")
        del engine
    agree = token_agreement(runs["float32"].token_ids, runs["bfloat16"].token_ids)
    result.update(agreement=agree, num_requests=len(reqs),
                  num_output_tokens=sum(len(t) for t in runs["float32"].token_ids))
    print(f"bf16 vs fp32 greedy: {agree['positions'] * 100:.1f}% of output positions equal; "
          f"{agree['prefix'] * 100:.1f}% of each output (mean) before the first difference; "
          f"{agree['identical'] * 100:.1f}% of requests identical")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
