"""Log-probabilities in the OpenAI server's formats: vLLM's ``prompt_logprobs`` and the legacy
completions ``logprobs`` (parallel lists), over output tokens, or over prompt + output tokens
with ``echo``.

Formats: OpenAI's Completions API reference (``logprobs``: ``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``), and vLLM's OpenAI server (``prompt_logprobs``: per prompt
token null for the first, else {token id: {"logprob", "rank", "decoded_token"}}; with ``echo``
the first prompt token's ``token_logprobs`` and ``top_logprobs`` entries are null).
"""

from __future__ import annotations

from collections.abc import Sequence

from vlite.entrypoints.protocol import CompletionLogprobs, PromptLogprob
from vlite.entrypoints.serving import clamp_logprob


class TokenTexts:
    """Memoised ``tokenizer.decode([token_id])`` (a prompt repeats tokens; top-k lists repeat more)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def prompt_logprobs_json(texts: TokenTexts, entries: list | None) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs`` from the engine's (``vlite.engine.core.prompt_logprobs.Logprob`` dicts)."""
    if entries is None:
        return None
    return [None if e is None else {tid: PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                                                       decoded_token=texts(tid)) for tid, lp in e.items()}
            for e in entries]


def prompt_entries_as_floats(entries: list | None) -> list[dict[int, float] | None]:
    """The engine's prompt logprobs as {token id: logprob} dicts (the output tokens' form)."""
    return [None if e is None else {tid: lp.logprob for tid, lp in e.items()} for e in entries or ()]


def legacy_logprobs(texts: TokenTexts, token_ids: Sequence[int], entries: Sequence[dict[int, float] | None],
                    num_top: int, text_offset: int, result: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """Legacy completions logprobs for ``token_ids``: each token's text, its logprob (null where
    its entry is None: the first prompt token) and the ``max(num_top, 1)`` most likely tokens;
    ``text_offset`` is the character offset of the first token, each next one advances by the
    previous token's text length. Appends to ``result`` when given."""
    result = result or CompletionLogprobs()
    offset = text_offset
    for token_id, entry in zip(token_ids, entries):
        token = texts(token_id)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(clamp_logprob(entry[token_id]))
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:max(num_top, 1)]
        result.top_logprobs.append({texts(t): clamp_logprob(lp) for t, lp in top})
    return result


__all__ = ["TokenTexts", "legacy_logprobs", "prompt_entries_as_floats",
           "prompt_logprobs_json"]
