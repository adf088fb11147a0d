"""``vlite generate``: offline batch generation on the paged engine."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from vlite.cli import common
from vlite.engine import EngineArgs

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged memory.",
    "Explain what a KV cache is in one sentence.",
    "def fibonacci(n):",
]


@common.engine_args_options()
def generate(
    prompts: list[str] = typer.Argument(None, help="Prompts (default: a few built-in ones)."),
    prompts_file: Path | None = typer.Option(None, "--prompts-file", "-f", exists=True, dir_okay=False,
                                             help="File with one prompt per line."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most output tokens per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, (0, 1]."),
    top_k: int = typer.Option(-1, "--top-k", help="Keep the k most likely tokens (-1 = all)."),
    seed: int | None = typer.Option(None, "--seed", help="Per-request sampling seed."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt in the model's chat template."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate past EOS up to --max-tokens."),
    n: int = typer.Option(1, "--n", help="Samples per prompt; they share the prompt's KV blocks."),
    beam_width: int = typer.Option(1, "--beam-width", help="Beam search with this many beams (> 1)."),
    engine_args: EngineArgs = None,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object per prompt instead of a table."),
) -> None:
    """Generate text for PROMPTs (or --prompts-file) with continuous batching."""
    texts = list(prompts or [])
    for i, text in enumerate(texts, 1):  # checked here, not after a model load
        if not text.strip():
            common.fail(f"PROMPT {i} of {len(texts)} is empty: give some text, or no PROMPT for the built-in prompts")
    if prompts_file is not None:
        texts += [line for line in prompts_file.read_text().splitlines() if line.strip()]
        if not texts:
            common.fail(f"--prompts-file {prompts_file} has no non-blank line")
    if not texts:
        texts = DEFAULT_PROMPTS
    import json

    from vlite.engine import RequestRejectedError, SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, ignore_eos=ignore_eos, n=n, beam_width=beam_width)
    except ValueError as exc:
        common.fail(str(exc))
    config = common.create_engine_config(engine_args)  # --seed above is per request; the engine's stays 0
    meta = common.check_before_load(config)  # config and tokenizer: checks in seconds, before the weights load
    shown = list(texts)  # the table shows what the user typed, not the templated prompt
    if chat:
        texts = [meta.tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                    add_generation_prompt=True) for t in texts]
    _check_lengths(texts, shown, max_tokens, meta, config)
    engine = common.load_engine(config, checked=True)
    try:
        outputs = engine.generate(texts, params, show_progress=not json_out)
    except RequestRejectedError as exc:
        common.fail(str(exc))
    if json_out:
        for out in outputs:
            for c in out.outputs:
                print(json.dumps({"request_id": out.request_id, "index": c.index, "prompt": out.prompt,
                                  "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
        return
    table = Table(show_lines=True)
    table.add_column("prompt", overflow="fold")
    table.add_column("output", overflow="fold")
    table.add_column("tokens", justify="right")
    table.add_column("finish", justify="center")
    for prompt, out in zip(shown, outputs):
        for c in out.outputs:
            table.add_row(prompt if c.index == 0 else f"  [{c.index}]", c.text, str(len(c.token_ids)),
                          c.finish_reason)
    common.make_console().print(table)
    s = engine.stats()
    common.make_console(stderr=True).print(
        f"{len(outputs)} request{'s' if len(outputs) != 1 else ''}, {s.prompt_tokens_total} prompt + {s.generation_tokens_total} generated tokens in "
        f"{s.step} steps; preemptions: {s.num_preemptions_total}; free blocks {s.num_free_blocks}/{s.num_total_blocks}"
        f" (+{s.num_cached_blocks} cached); prefix cache hits {s.blocks.prefix_cache_hits}/"
        f"{s.blocks.prefix_cache_queries} tokens")


def _check_lengths(texts: list[str], shown: list[str], max_tokens: int, meta, config) -> None:
    """Exit 2 before the model loads if a prompt plus ``--max-tokens`` exceeds the model length
    (``--max-model-len``, else the model's limit), naming the prompt and the largest values that fit."""
    from vlite.engine import derive_max_model_len

    max_len = derive_max_model_len(meta.config, config.scheduler.max_model_len)
    for i, (text, typed) in enumerate(zip(texts, shown), 1):
        num_tokens = len(meta.tokenizer(text).input_ids)
        if num_tokens + max_tokens > max_len:
            short = typed if len(typed) <= 40 else typed[:37] + "..."
            room, explicit = max_len - num_tokens, config.scheduler.max_model_len is not None
            fix = f"lower --max-tokens to {room} or less" if room >= 1 else "shorten the prompt"
            fix += " or raise --max-model-len" if explicit else ""
            common.fail(f"prompt {i} ({short!r}, {common.plural(num_tokens, 'token')}) + --max-tokens {max_tokens} = "
                        f"{num_tokens + max_tokens} tokens exceeds the model length of {max_len} tokens"
                        f"{' (--max-model-len)' if explicit else ''}; {fix}")
