"""Request: everything the engine keeps about one request, in one object.

A request is 1 sequence, ``n`` parallel samples (forked after the prompt) or the beams of a
beam search. The ``Request`` holds all of them (``seqs``, in creation order, finished ones
included, so the output can be assembled), the live ones (``live``), the sampling params, the
beam state, the origin (who sent it) and one ``RequestRecord`` per sequence (its final state,
kept for leak attribution). The scheduler owns the live ``Request`` objects
(``Scheduler.requests``); finished records stay in the scheduler's bounded history.

Iterating a ``Request`` (and ``len``, indexing) goes over its live sequences, so
``scheduler.requests[request_id]`` reads as "the live sequences of that request".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlite.engine.core.beam_search import BeamState
from vlite.engine.core.sequence import RequestOrigin, Sequence, SequenceStatus
from vlite.engine.sampling_params import SamplingParams


@dataclass
class RequestRecord:
    """What the engine remembers about one sequence of a request, live or finished (for
    leak attribution). ``finished_time`` is ``time.time()`` seconds, ``finished_step`` the engine
    step counter when it ended (engine steps); counts are tokens."""

    seq_id: int
    origin: RequestOrigin
    num_prompt_tokens: int
    status: str = SequenceStatus.WAITING.value
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    finished_time: float | None = None
    finished_step: int | None = None
    error: str | None = None
    # Recorded by the finish path (evidence for the leak report, not a guess): how it ended
    # ("stop:stop_string", "stop:beam_pruned", "length", "abort in decode", "error", ...), and
    # the exception that cut its release short, if one did.
    finish_path: str | None = None
    release_error: str | None = None


@dataclass(eq=False)
class Request:
    """One request: its sequences, sampling params, beam state, origin and records.

    seqs: every sequence ever created for it (samples by ``index``, beams), finished included.
    live: the sequences not finished yet (the scheduler drops the request when it is empty).
    num_reported_tokens: output tokens of ``seqs[0]`` already returned in a RequestOutput.
    """

    request_id: str
    params: SamplingParams
    origin: RequestOrigin
    seqs: list[Sequence] = field(default_factory=list)
    beam: BeamState | None = None
    live: list[Sequence] = field(default_factory=list)
    records: dict[int, RequestRecord] = field(default_factory=dict)
    num_reported_tokens: int = 0
    _next_index: int = 1

    @classmethod
    def of(cls, seq: Sequence, beam: BeamState | None = None) -> Request:
        """A request whose first sequence is ``seq``."""
        req = cls(seq.request_id, seq.sampling_params, seq.origin, beam=beam)
        req.add_sequence(seq)
        return req

    def add_sequence(self, seq: Sequence) -> None:
        """Add a (first or forked) live sequence and start its record."""
        self.seqs.append(seq)
        self.live.append(seq)
        self.records[seq.seq_id] = RequestRecord(seq.seq_id, self.origin, seq.num_prompt_tokens,
                                                 status=seq.status.value)

    @property
    def needs_logits(self) -> bool:
        """Raw logits are needed to fork n samples after the prompt, or to rank beams."""
        return self.beam is not None or (self.params.n > 1 and len(self.seqs) == 1)

    @property
    def is_finished(self) -> bool:
        """A beam search when it is done; otherwise when every sequence has finished."""
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs)

    def next_index(self) -> int:
        """The next free sample/beam index (1, 2, ...)."""
        self._next_index += 1
        return self._next_index - 1

    # the live sequences, as a read-only sequence
    def __iter__(self):
        return iter(list(self.live))

    def __len__(self) -> int:
        return len(self.live)

    def __getitem__(self, i: int) -> Sequence:
        return self.live[i]
