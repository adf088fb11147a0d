"""The end-to-end parts of ``benchmarks/gpu/gpu_check.sh`` that need Python: random-weight checkpoints
built with transformers, and teacher-forced greedy parity of vlite against transformers.

  build   write two random-weight checkpoints with the default model's tokenizer:
          ``smollm2-shape-f32`` (SmolLM2-135M's shape, float32: for parity) and
          ``llama-1b-shape-bf16`` (Llama-3.2-1B's shape with SmolLM2's 49,152-token vocabulary,
          1.07B parameters, bfloat16: for speed). ``--tiny`` shrinks both to 2 layers (the CPU
          dry run).
  parity  vlite generates greedy continuations of random prompts; transformers, on the same
          device, re-scores prompt + output in one forward (teacher forcing), and each output
          token is compared with transformers' argmax at its position. float32: every token
          must equal it. bfloat16 (or --tolerance): the logit transformers gives vlite's token
          must be within the tolerance of the best logit (default 2^-6 of its magnitude, or of 1
          when it is smaller: two bfloat16 rounding steps; vlite and transformers sum in
          different orders).

Exit status: 0 when the parity criterion holds, 1 when it does not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    # name: (LlamaConfig fields, dtype)
    "smollm2-shape-f32": (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3, rope_theta=100000.0, initializer_range=0.05), "float32"),
    "llama-1b-shape-bf16": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                 num_key_value_heads=8, rope_theta=500000.0, initializer_range=0.02), "bfloat16"),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(out: Path, tokenizer_dir: str, device: str, tiny: bool) -> None:
    """Save both checkpoints under ``out`` (see the module docstring)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for name, (fields, dtype) in SHAPES.items():
        fields = dict(fields)
        if tiny:
            fields.update(num_hidden_layers=2)
            if fields["hidden_size"] > 576:
                fields.update(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
        config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, rms_norm_eps=1e-5,
                             tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **fields)
        start = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(device):  # random init on the GPU: seconds, not a minute, for 1.07B weights
            model = LlamaForCausalLM(config).to(_DTYPES[dtype]).eval()
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(out / name, safe_serialization=True)
        tokenizer.save_pretrained(out / name)
        print(f"built {out / name}: {params / 1e9:.3f}B parameters, {dtype}, {time.perf_counter() - start:.1f} s")
        del model
        gc.collect()


def parity(model_dir: str, dtype: str, device: str, enforce_eager: bool, num_prompts: int, prompt_len: int,
           max_tokens: int, tolerance: float | None, seed: int) -> dict:
    """Greedy vlite tokens re-scored by transformers (see the module docstring). Returns the figures."""
    from vlite.bench.runners import load_hf_model
    from vlite.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from vlite.engine.llm_engine import LLMEngine
    from vlite.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    config = EngineConfig(model=model_dir, dtype=dtype, device=device, enforce_eager=enforce_eager,
                          cache=CacheConfig(block_size=16, num_blocks=1024),
                          scheduler=SchedulerConfig(max_num_seqs=max(num_prompts, 1), max_model_len=prompt_len + max_tokens + 16))
    engine = LLMEngine(config)
    vocab = engine.hf_config.vocab_size
    prompts = [torch.randint(100, vocab, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
    graphs = engine.model_runner.cuda_graphs is not None if engine.model_runner is not None else False
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    generated = [list(o.outputs[0].token_ids) for o in outs]
    del engine, outs
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    hf = load_hf_model(model_dir, dtype, device)
    equal = total = 0
    worst = 0.0
    within = True
    with torch.inference_mode():
        for prompt, out in zip(prompts, generated):
            full = torch.tensor([prompt + out], device=device)
            logits = hf(full).logits[0, prompt_len - 1:-1].float()  # the logits that chose each output token
            chosen = torch.tensor(out, device=device)
            best = logits.max(-1).values
            gap = best - logits.gather(1, chosen[:, None])[:, 0]
            equal += int((logits.argmax(-1) == chosen).sum())
            total += len(out)
            relative = gap / best.abs().clamp_min(1.0)  # logits near 0: measured against 1
            worst = max(worst, float(relative.max()))
            if tolerance is not None:
                within &= bool((relative <= tolerance).all())
    ok = equal == total if tolerance is None else within
    mode = "CUDA graphs" if graphs else "eager"
    rule = "every token equals transformers' argmax" if tolerance is None else \
        f"every token's logit within {tolerance:.2g} x |best logit| of the best"
    print(f"parity {Path(model_dir).name} {dtype} {device} {mode}: {equal}/{total} tokens equal transformers' "
          f"argmax (teacher-forced); largest gap {worst:.2e} of |best|; {rule}: {'PASS' if ok else 'FAIL'}")
    return {"model": Path(model_dir).name, "dtype": dtype, "device": device, "cuda_graphs": graphs,
            "tokens": total, "equal_to_argmax": equal, "largest_relative_gap": worst, "rule": rule, "pass": ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the random-weight checkpoints")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--tokenizer", required=True, help="directory with the default model's tokenizer files")
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--tiny", action="store_true", help="2-layer versions (the CPU dry run)")
    p = sub.add_parser("parity", help="teacher-forced greedy parity against transformers")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--tolerance", type=float, help="relative logit gap allowed (default: bfloat16 2^-6, float32 exact)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        build(args.out, args.tokenizer, args.device, args.tiny)
        return 0
    tolerance = args.tolerance if args.tolerance is not None else (2 ** -6 if args.dtype == "bfloat16" else None)
    result = parity(args.model, args.dtype, args.device, args.enforce_eager, args.num_prompts, args.prompt_len,
                    args.max_tokens, tolerance, args.seed)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
