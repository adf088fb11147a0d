"""Structured output: constrain a request's tokens to a JSON schema, any JSON object, a regular
expression, a list of choices or a grammar, with a per-sequence token bitmask (as vLLM's
structured outputs, through its "guidance" backend, the llguidance library).

The pieces, one concept each:

* ``StructuredOutputsParams``: what a request asks for (vLLM's ``StructuredOutputsParams``
  fields: ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``, and the options
  ``disable_any_whitespace``, ``disable_additional_properties``, ``whitespace_pattern``).
* ``StructuredOutputManager`` (one per engine, owned by the scheduler):
    - the grammar compiler cache: the llguidance tokenizer of the model (built once, on the
      first constrained request, ~0.2 s for a 49k vocabulary) and an LRU of compiled grammars
      (one template ``LLMatcher`` per distinct constraint); ``compile`` is thread-safe, so the
      server compiles (and refuses, 400) a constraint in its tokenizer threads before the
      request is queued;
    - the per-sequence matchers: each lives on its sequence only (``seq.grammar_matcher``, as
      vLLM keeps a request's grammar on the request); the manager's registry ``matchers`` is
      the set of sequence ids that hold one, so a matcher never freed stays visible to the leak
      check. ``add`` when a request is queued, ``fork`` for the n > 1
      samples (a deep copy: the children start where the parent is), ``accept`` for each
      token appended to the sequence, ``free`` from ``Scheduler.finish_sequence`` (every exit:
      stop, length, abort, error). The leak check reads the registry's size
      (``structured_output.matchers`` in ``vlite.engine.introspection.REGISTRIES``).
* ``apply_grammar_masks(logits, seqs)``: the one call in the batched sampler. For each row whose
  sequence has a matcher it computes the allowed-token bitmask and sets the other logits to
  -inf. A step with no constrained sequence in the whole process returns after one integer
  test.

Recompute preemption keeps a sequence's output tokens, and its matcher with them: the matcher
is advanced only when a token is appended, never when the prompt and outputs are recomputed.
When the matcher reaches its end state (nothing but EOS can follow) the scheduler finishes the
sequence with finish_reason "stop" (coverage kind ``stop:grammar``); EOS is allowed exactly when
the grammar accepts, so a model may also end with EOS. Beam search is refused
(``SamplingParams`` raises): the beams rank raw logits outside the sampler.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from vlite.engine.sampling_params import CONSTRAINT_FIELDS, StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from vlite.engine.core.sequence import Sequence

# Distinct compiled grammars kept (each a template matcher; a copy per sequence costs ~1 us).
GRAMMAR_CACHE_SIZE = 256


def _one_line(message: str) -> str:
    return " ".join(message.split())


class StructuredOutputManager:
    """The grammar compiler cache and the per-sequence matcher registry of one engine.

    Args:
        tokenizer: the model's Hugging Face (fast) tokenizer; None: every constraint is refused.
        vocab_size: the width of the model's logits (tokens); masks cover exactly this many.
        eos_token_ids: the ids that end a sequence; the mask allows them once the grammar accepts.
        cache_size: compiled grammars kept (LRU).

    ``compile`` may be called from any thread; everything else from the engine thread only.
    """

    # Live matchers across every manager of the process: the sampler's O(1) "nothing to do" test.
    live_total = 0

    def __init__(self, tokenizer=None, vocab_size: int | None = None, eos_token_ids=(),
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._ll_tokenizer: LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._cache_lock = threading.Lock()
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self.matchers: set[int] = set()  # ids of the sequences holding a matcher (the matcher is on the sequence)
        self.num_compiled = 0  # cache misses (grammars compiled)
        self.num_cache_hits = 0

    # ---- compiling (any thread) ---------------------------------------------------------------
    def ll_tokenizer(self) -> LLTokenizer:
        """The llguidance view of the model's tokenizer (built on first use).

        Raises:
            ValueError: there is no tokenizer, or it is not a fast (Rust ``tokenizers``) one.
        """
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                if self._hf_tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer; this engine has none")
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
                except ValueError as exc:
                    raise ValueError(f"structured outputs are not available for this tokenizer: {exc}") from None
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> LLMatcher:
        """The compiled template matcher of ``params`` (from the cache, or compiled and cached).
        Thread-safe; the compile itself runs outside the cache lock (llguidance releases the
        GIL while it builds a grammar).

        Raises:
            ValueError: an invalid schema, regex, choice list or grammar, in one line naming
                the constraint and llguidance's reason.
        """
        key = params.cache_key()
        with self._cache_lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return template
        import llguidance

        what = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
                "choice": "choice list", "grammar": "grammar"}[params.kind]
        try:
            grammar = params.to_llguidance()
        except (ValueError, TypeError) as exc:
            raise ValueError(f"invalid {what}: {_one_line(str(exc))}") from None
        template = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"invalid {what}: {_one_line(template.get_error())}")
        with self._cache_lock:
            self._cache[key] = template
            self.num_compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template

    # ---- per-sequence state (engine thread) ---------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Give ``seq`` a fresh matcher if its request is constrained (a no-op otherwise).

        Raises:
            ValueError: the constraint does not compile (see ``compile``).
        """
        params = seq.sampling_params.structured_outputs
        if params is None:
            return
        self._register(seq, self.compile(params).deep_copy())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (n > 1 sample) continues from ``parent``'s grammar state (a deep copy)."""
        if parent.grammar_matcher is not None:
            self._register(child, parent.grammar_matcher.deep_copy())

    def _register(self, seq: Sequence, matcher: LLMatcher) -> None:
        if seq.seq_id not in self.matchers:
            StructuredOutputManager.live_total += 1
            self.matchers.add(seq.seq_id)
        seq.grammar_matcher = matcher

    def accept(self, seq: Sequence, token: int) -> tuple[bool, str | None]:
        """Advance ``seq``'s matcher by one sampled token. Returns (the grammar has reached its
        end state, an error message if the matcher rejected the token)."""
        matcher = seq.grammar_matcher
        if not matcher.consume_token(token):
            return True, f"the grammar rejected token {token}: {_one_line(matcher.get_error())}"
        return matcher.is_stopped(), None

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s matcher (every finish path; idempotent)."""
        if seq.seq_id in self.matchers:
            self.matchers.discard(seq.seq_id)
            StructuredOutputManager.live_total -= 1
        seq.grammar_matcher = None


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Set to -inf the logits of every token the grammar of row i's sequence does not allow
    next (in place). logits: [len(seqs), vocab] float32 on CPU. Rows of unconstrained sequences
    are untouched; with no live matcher in the process this is one integer test.

    The bitmask is llguidance's: one bit per token, 32 tokens per int32 word; tokens past the
    tokenizer's vocabulary are never allowed.
    """
    if not StructuredOutputManager.live_total:
        return
    rows = [i for i, s in enumerate(seqs) if s.grammar_matcher is not None]
    if not rows:
        return
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    for j, i in enumerate(rows):
        seqs[i].grammar_matcher.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), words * 4)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(rows), words * 32)[:, :vocab].bool()
    for j, i in enumerate(rows):
        logits[i].masked_fill_(~allowed[j], float("-inf"))


__all__ = ["CONSTRAINT_FIELDS", "GRAMMAR_CACHE_SIZE", "StructuredOutputManager", "StructuredOutputsParams",
           "apply_grammar_masks"]
