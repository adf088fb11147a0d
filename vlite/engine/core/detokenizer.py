"""Incremental detokenization and stop strings.

The incremental rule is vLLM's (from Hugging Face TGI): decode a short window of earlier
tokens with and without the new ones and emit the difference, holding back text that ends
in an incomplete UTF-8 character (U+FFFD). Stop strings may span tokens; the output is cut
before the stop string, as the OpenAI API does.
"""

from __future__ import annotations

from vlite.engine.core.sequence import Sequence

# Tokens of context decoded before the new ones so that leading spaces come out right.
_CONTEXT_TOKENS = 5


def init_detokenizer(seq: Sequence) -> None:
    """Start the window at the end of the prompt."""
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.read_offset - _CONTEXT_TOKENS, 0)


def detokenize_incrementally(tokenizer, seq: Sequence) -> str:
    """Append the text of ``seq``'s newest tokens to ``seq.output_text``; return the new text."""
    ids = seq.all_token_ids
    prefix_text = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=True)
    full_text = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=True)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        new_text = full_text[len(prefix_text):]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
        seq.output_text += new_text
        return new_text
    return ""


def find_stop_string(seq: Sequence, new_text_len: int) -> str | None:
    """If a stop string now appears in the output, cut the text before it and return it."""
    stops = seq.sampling_params.stop
    if not stops or not new_text_len:
        return None
    text = seq.output_text
    for stop in stops:
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1:
            seq.output_text = text[:idx]
            return stop
    return None


def stop_holdback(seq: Sequence) -> int:
    """Characters a stream must hold back: they could be the start of a stop string."""
    return max((len(s) for s in seq.sampling_params.stop), default=1) - 1
