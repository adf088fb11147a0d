"""Benchmark workloads, following ``vllm bench``'s dataset names: random, sharegpt, prefix-repetition.

Every dataset yields :class:`SampleRequest` items: the prompt as token ids (what the offline
benchmarks feed the engine), the same prompt as text (what the serving benchmark sends), and
the number of output tokens to generate (the request runs with ``ignore_eos`` so it produces
exactly that many).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class SampleRequest:
    """One benchmark request.

    prompt: the prompt text (decoded from ``prompt_token_ids`` for synthetic datasets).
    prompt_token_ids: the prompt as token ids; ``prompt_len == len(prompt_token_ids)``.
    expected_output_len: output tokens to generate (>= 1).
    """

    prompt: str
    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random-dataset range: [floor(length * (1 - r)), ceil(length * (1 + r))], at least 1.

    Raises:
        ValueError: ``range_ratio`` outside [0, 1) or ``length`` < 1.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    lo = max(1, int(np.floor(length * (1 - range_ratio))))
    hi = int(np.ceil(length * (1 + range_ratio)))
    return lo, hi


def _usable_token_ids(tokenizer) -> np.ndarray:
    """Vocabulary ids that are not special tokens (random prompts avoid BOS/EOS/chat markers)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def random_requests(tokenizer, num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
                    seed: int = 0) -> list[SampleRequest]:
    """Prompts of random token ids; input and output lengths uniform (inclusive) in their ranges.

    The lengths are drawn first (inputs, then outputs), then the token ids, all from one
    ``numpy.random.default_rng(seed)``, so a workload is fixed by its seed alone.

    Raises:
        ValueError: an empty or non-positive range, or ``num_prompts`` < 1.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    for name, (lo, hi) in (("input", input_range), ("output", output_range)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} length range must satisfy 1 <= min <= max, got [{lo}, {hi}]")
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_range[0], input_range[1] + 1, size=num_prompts)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, size=num_prompts)
    vocab = _usable_token_ids(tokenizer)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = rng.choice(vocab, size=int(n_in)).tolist()
        out.append(SampleRequest(tokenizer.decode(ids), ids, int(n_out)))
    return out


def sharegpt_requests(path: str | Path, tokenizer, num_prompts: int, output_len: int | None = None,
                      seed: int = 0, min_len: int = 4, max_prompt_len: int = 1024,
                      max_total_len: int = 2048) -> list[SampleRequest]:
    """Conversations from a ShareGPT JSON file (a list of ``{"conversations": [{"from", "value"}, ...]}``).

    As in vLLM: the first turn is the prompt and the second turn's token count is the output
    length (unless ``output_len`` is given); conversations with fewer than two turns are skipped,
    as are pairs with prompt or output under ``min_len`` tokens, a prompt over ``max_prompt_len``,
    or prompt + output over ``max_total_len``. Conversations are shuffled with ``seed``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a JSON list, or fewer than ``num_prompts`` conversations qualify.
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")  # noqa: TRY004 - bad file content
    convs = [d.get("conversations") or d.get("conversation") or [] for d in data if isinstance(d, dict)]
    convs = [c for c in convs if len(c) >= 2]
    order = np.random.default_rng(seed).permutation(len(convs))
    out: list[SampleRequest] = []
    for i in order:
        prompt, completion = convs[i][0]["value"], convs[i][1]["value"]
        ids = tokenizer(prompt).input_ids
        n_out = output_len if output_len is not None else len(tokenizer(completion).input_ids)
        if output_len is None and (len(ids) < min_len or n_out < min_len):
            continue
        if len(ids) < 1 or len(ids) > max_prompt_len or len(ids) + n_out > max_total_len:
            continue
        out.append(SampleRequest(prompt, ids, n_out))
        if len(out) == num_prompts:
            return out
    raise ValueError(f"{path}: only {len(out)} usable conversations, {num_prompts} requested")


def prefix_repetition_requests(tokenizer, num_prompts: int, prefix_len: int, suffix_len: int,
                               num_prefixes: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """vLLM's prefix-repetition dataset: ``num_prefixes`` random shared prefixes of ``prefix_len``
    tokens, each followed by a fresh random suffix of ``suffix_len`` tokens; prompts are shuffled.

    Raises:
        ValueError: a non-positive length or count.
    """
    if min(num_prompts, prefix_len, num_prefixes, output_len) < 1 or suffix_len < 0:
        raise ValueError("num_prompts, prefix_len, num_prefixes and output_len must be >= 1, suffix_len >= 0")
    rng = np.random.default_rng(seed)
    vocab = _usable_token_ids(tokenizer)
    prefixes = [rng.choice(vocab, size=prefix_len).tolist() for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + rng.choice(vocab, size=suffix_len).tolist()
        out.append(SampleRequest(tokenizer.decode(ids), ids, output_len))
    return [out[i] for i in rng.permutation(num_prompts)]
