"""Write W1's requests (token ids and output lengths) as JSON, for engines outside vlite's venv.

    .venv/bin/python benchmarks/vs_vllm/w1_prompts.py OUT.json [--num-prompts 64] [--seed 0]

The requests are vlite's own W1 (``vlite.bench.datasets.random_requests``, the generator
``vlite bench throughput --input-len-range 32:256 --output-len-range 16:256`` uses), so a run
of ``benchmarks/vs_vllm/vllm_w1.py`` on this file and ``vlite bench throughput`` see the same prompts.
The file also names the default model's Hugging Face directory (``model_dir``).
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len-range", default="32:256")
    ap.add_argument("--output-len-range", default="16:256")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from vlite.bench.datasets import random_requests
    from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model

    model_dir = str(resolve_model(DEFAULT_MODEL).path)
    tok = AutoTokenizer.from_pretrained(model_dir)
    in_r = tuple(int(x) for x in args.input_len_range.split(":"))
    out_r = tuple(int(x) for x in args.output_len_range.split(":"))
    reqs = random_requests(tok, args.num_prompts, in_r, out_r, args.seed)
    json.dump({"model_dir": model_dir, "seed": args.seed, "input_len_range": in_r, "output_len_range": out_r,
               "requests": [{"prompt_token_ids": list(map(int, r.prompt_token_ids)), "output_len": r.expected_output_len}
                            for r in reqs]}, open(args.out, "w"))
    print(f"{len(reqs)} W1 requests ({sum(len(r.prompt_token_ids) for r in reqs)} prompt tokens, "
          f"{sum(r.expected_output_len for r in reqs)} output tokens) -> {args.out}")


if __name__ == "__main__":
    main()
