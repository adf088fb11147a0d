"""Incremental detokenization and stop strings.

The incremental rule is vLLM's (from Hugging Face TGI): decode a short window of earlier
tokens with and without the new ones and emit the difference, holding back text that ends
in an incomplete UTF-8 character (U+FFFD). Stop strings may span tokens; the output is cut
before the stop string, as the OpenAI API does.

Text is decoded only when someone needs it: after every token for a sequence with stop
strings (they must end it in the same step), otherwise when its output is built
(``OutputProcessor``), all pending tokens at once. A request whose output is only read when
it ends (``RequestOutputKind.FINAL_ONLY``) is decoded once.
"""

from __future__ import annotations

from vlite.engine.core.sequence import Sequence

# Tokens of context decoded before the new ones so that leading spaces come out right.
_CONTEXT_TOKENS = 5


def fast_decoder(tokenizer):
    """What to call ``decode(ids, skip_special_tokens=True)`` on: the Rust ``tokenizers.Tokenizer``
    behind a fast Hugging Face tokenizer when transformers would return its text unchanged (no
    ``clean_up_tokenization_spaces``), skipping transformers' per-call Python work (about 3/4 of
    a short decode); else ``tokenizer`` itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend
    return tokenizer


def init_detokenizer(seq: Sequence) -> None:
    """Start the window at the end of the prompt."""
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.read_offset - _CONTEXT_TOKENS, 0)


def detokenize_incrementally(tokenizer, seq: Sequence) -> str:
    """``tokenizer``: anything with ``decode(ids, skip_special_tokens=True)`` (``fast_decoder``). Append the text of ``seq``'s tokens not decoded yet (one or many) to ``seq.output_text``;
    return the new text ("" when they end inside a UTF-8 character, then held back).

    Two decodes (the window with and without the new tokens) per call, whatever the number of
    new tokens, so a sequence whose text nobody reads until it ends costs two decodes in all.
    Several pending tokens that end in an incomplete character give the text up to the last
    complete one (at most 3 tokens back: a UTF-8 character is at most 4 bytes), as decoding
    them one at a time would have.
    """
    total = seq.num_tokens
    if total <= seq.read_offset:
        return ""
    ids = seq.token_ids_slice(seq.prefix_offset, total)
    read = seq.read_offset - seq.prefix_offset
    prefix_text = tokenizer.decode(ids[:read], skip_special_tokens=True)
    for end in range(len(ids), max(read, len(ids) - 4), -1):
        full_text = tokenizer.decode(ids[:end] if end < len(ids) else ids, skip_special_tokens=True)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new_text = full_text[len(prefix_text):]
            seq.prefix_offset, seq.read_offset = seq.read_offset, seq.prefix_offset + end
            seq.output_text += new_text
            return new_text
        if len(full_text) <= len(prefix_text):
            break  # nothing new to show (e.g. special tokens only): shorter windows give less
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
