"""Requests as the scheduler sees them: Sequence, its status, origin and finish reason."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vlite.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class SequenceStatus(enum.Enum):
    """Where a sequence is. PREEMPTED sequences sit in the waiting queue to be recomputed."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a sequence ended; values are the OpenAI/vLLM ``finish_reason`` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class RequestOrigin:
    """Who sent a request and how, so a leaked block can be traced back to it.

    request_id: the client's or server's id (``X-Request-Id`` over HTTP).
    arrival_time: ``time.time()`` when the engine received it, seconds.
    route: the entry point ("generate", "/v1/completions", "leak-check", ...).
    client_tag: free-form label given by the caller.
    client_action: what the client did, for the leak report ("complete",
        "disconnect after 3 chunks", ...); None when unknown.
    """

    request_id: str
    arrival_time: float = field(default_factory=time.time)
    route: str = "api"
    client_tag: str | None = None
    client_action: str | None = None


class SeqId(int):
    """A sequence id: an ``int`` whose type marks it as one, so the leak check's census
    (``census.request_census``) can tell a map keyed by sequence ids from one keyed by block
    ids or counts. It hashes and compares as the plain ``int``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)


_seq_counter = itertools.count()


class Sequence:
    """One generated sequence: its tokens, progress, sampling state and origin.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; the tokens still to
    run are ``all_token_ids[num_computed_tokens:]``. Recompute preemption resets it to 0.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, origin: RequestOrigin,
                 eos_token_ids: frozenset[int] = frozenset(), index: int = 0) -> None:
        self.seq_id: int = SeqId(next(_seq_counter))
        self.request_id = request_id
        self.index = index  # output index within its request (n > 1, beams)
        self.parent_seq_id: int | None = None  # set on forked sequences
        self.block_hashes: list[int] = []  # prefix-caching hash of each full logical block (memo)
        self.cumulative_logprob = 0.0
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []
        # Prompt logprobs (vlite.engine.core.prompt_logprobs): the complete list once the prompt has
        # run, and the entries gathered so far during a chunked prefill.
        self.prompt_logprobs: list | None = None
        self.partial_prompt_logprobs: list | None = None
        # logit_bias / allowed_token_ids / bad_words (vlite.engine.worker.logits_processors), or None
        self.logits_processor = None
        self.sampling_params = sampling_params
        self.origin = origin
        self.eos_token_ids = eos_token_ids
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # "request": the request's own parameters made it fail (an HTTP 400); "engine": anything else.
        self.error_kind: str | None = None
        self.arrival_time = origin.arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        # Per-request generator: the same seed gives the same random numbers in any batch. The
        # samples repeat when the logits do: in float32 they did in every batch tested; in bfloat16
        # the GEMMs' rounding depends on the batch's row count, so other traffic can change them.
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            import torch  # torch is loaded by then; importing here keeps `import vlite.engine` light

            self.generator = torch.Generator().manual_seed(sampling_params.seed)
        # Structured output: this sequence's grammar matcher (llguidance ``LLMatcher``), set and
        # dropped by the scheduler's StructuredOutputManager; None when unconstrained.
        self.grammar_matcher = None
        # Detokenizer state (see detokenizer.py).
        self.output_text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def fork(self, index: int) -> Sequence:
        """A child with the same tokens and progress (parallel sampling, beam search).

        The caller shares the parent's KV blocks with it through ``KVCacheManager.fork``. A
        seeded request gives child ``index`` the seed ``seed + index``.
        """
        child = Sequence(self.request_id, self.prompt, self.prompt_token_ids, self.sampling_params, self.origin,
                         self.eos_token_ids, index)
        child.parent_seq_id = self.seq_id
        child.output_token_ids = list(self.output_token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.prompt_logprobs = self.prompt_logprobs
        child.logits_processor = self.logits_processor
        child.block_hashes = list(self.block_hashes)
        child.cumulative_logprob = self.cumulative_logprob
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.first_scheduled_time = self.first_scheduled_time
        child.first_token_time = self.first_token_time
        child.last_token_time = self.last_token_time
        child.output_text = self.output_text
        child.prefix_offset, child.read_offset = self.prefix_offset, self.read_offset
        if self.sampling_params.seed is not None:
            import torch

            child.generator = torch.Generator().manual_seed(self.sampling_params.seed + index)
        return child

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` (0 <= start <= end) without copying the whole prompt and output."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while the prompt (or a recompute after preemption) is still being run."""
        return self.num_computed_tokens < self.num_tokens - 1

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
