"""W1 offline through vLLM's Python ``LLM`` API, prompts given as token ids (run it with vLLM's venv).

    .venv-vllm/bin/python benchmarks/vs_vllm/vllm_w1.py --prompts w1_prompts.json --model DIR --dtype float32 \
        --json out.json [--enforce-eager]

``--prompts`` is the file ``benchmarks/vs_vllm/w1_prompts.py`` writes from vlite's own W1 generator
(``vlite.bench.datasets.random_requests``), so both engines run the same token ids and output
lengths. Greedy, EOS ignored, one ``LLM.generate`` call timed from submission to the last
output (vLLM's ``bench throughput`` way); the load (and torch.compile) is not timed. Writes the
same keys as ``vlite bench throughput --output-json``.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="JSON from benchmarks/vs_vllm/w1_prompts.py")
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile (vLLM's eager mode)")
    ap.add_argument("--json", required=True, help="write the result here")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    work = json.load(open(args.prompts))
    t_load = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
              enforce_eager=args.enforce_eager)
    load_s = time.perf_counter() - t_load
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in work["requests"]]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True) for r in work["requests"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(r["prompt_token_ids"]) for r in work["requests"])
    result = {"elapsed_time": elapsed, "num_requests": len(outs), "total_num_tokens": n_in + n_out,
              "total_prompt_tokens": n_in, "total_output_tokens": n_out,
              "requests_per_second": len(outs) / elapsed, "tokens_per_second": (n_in + n_out) / elapsed,
              "output_tokens_per_second": n_out / elapsed, "backend": "vllm", "dtype": args.dtype,
              "enforce_eager": args.enforce_eager, "load_s": load_s,
              "output_token_ids": [list(o.outputs[0].token_ids) for o in outs]}
    json.dump(result, open(args.json, "w"), indent=1)
    print(f"vLLM W1 {args.dtype}: {n_out} output tokens in {elapsed:.2f} s: {n_out / elapsed:.1f} out tok/s "
          f"(load {load_s:.0f} s)")


if __name__ == "__main__":  # vLLM's engine core is a spawned process: it re-imports this module
    main()
