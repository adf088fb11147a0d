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
    import json

    from vlite.engine import RequestRejectedError, SamplingParams

    texts = list(prompts or [])
    if prompts_file is not None:
        texts += [line for line in prompts_file.read_text().splitlines() if line.strip()]
    if not texts:
        texts = DEFAULT_PROMPTS
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, ignore_eos=ignore_eos, n=n, beam_width=beam_width)
    except ValueError as exc:
        common.fail(str(exc))
    config = common.create_engine_config(engine_args)  # --seed above is per request; the engine's stays 0
    engine = common.load_engine(config)
    shown = list(texts)  # the table shows what the user typed, not the templated prompt
    if chat:
        texts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                      add_generation_prompt=True) for t in texts]
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
