"""OutputProcessor: detokenization and ``RequestOutput`` assembly.

The scheduler books a step (tokens, stops, forks, finishes) and hands back the requests that
advanced; the output processor turns each into a ``RequestOutput`` (vLLM v1 splits the same
way: ``Scheduler.update_from_output`` in the engine core, detokenization and outputs in the
``OutputProcessor``). It also owns incremental detokenization (``detokenize``), which the
scheduler calls after appending a token so that stop strings end a sequence in the same step.
It keeps no per-request state: what it needs lives on the ``Request``.
"""

from __future__ import annotations

from vlite.engine.core.detokenizer import detokenize_incrementally, init_detokenizer, stop_holdback
from vlite.engine.core.request import Request
from vlite.engine.core.sequence import FinishReason, Sequence
from vlite.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


class OutputProcessor:
    """Turns advanced requests into ``RequestOutput``s.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``), used for incremental detokenization
            and to decode the best beams.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @staticmethod
    def init_sequence(seq: Sequence) -> None:
        """Start ``seq``'s detokenizer window at the end of its prompt."""
        init_detokenizer(seq)

    def detokenize(self, seq: Sequence) -> str:
        """Append the text of ``seq``'s newest tokens to ``seq.output_text``; return the new text."""
        return detokenize_incrementally(self.tokenizer, seq)

    def process(self, requests: list[Request]) -> list[RequestOutput]:
        """One ``RequestOutput`` per advanced or ended request, in the given order."""
        return [self.make_output(r) for r in requests]

    def make_output(self, req: Request) -> RequestOutput:
        """The request's state: one CompletionOutput per sample (by index), or the best beams
        once a beam search is done. Timestamps (``time.time()`` s) span all its sequences;
        ``new_token_ids`` are the output tokens of sample 0 not returned before."""
        primary = req.seqs[0]
        finished = req.is_finished
        if req.beam is not None:
            completions = self._beam_completions(req) if finished else []
        else:
            completions = [self._completion(s) for s in sorted(req.seqs, key=lambda s: s.index)]
        first_tokens = [s.first_token_time for s in req.seqs if s.first_token_time]
        last_tokens = [s.last_token_time for s in req.seqs if s.last_token_time]
        finishes = [s.finished_time for s in req.seqs if s.finished_time]
        metrics = RequestMetrics(primary.arrival_time, primary.first_scheduled_time,
                                 min(first_tokens, default=None), max(last_tokens, default=None),
                                 max(finishes) if finished and finishes else None,
                                 sum(s.num_preemptions for s in req.seqs))
        new_token_ids = primary.output_token_ids[req.num_reported_tokens:] if req.beam is None else []
        req.num_reported_tokens = primary.num_output_tokens
        return RequestOutput(req.request_id, primary.prompt, primary.prompt_token_ids, completions, finished,
                             req.origin, metrics, error=next((s.error for s in req.seqs if s.error), None),
                             error_kind=next((s.error_kind for s in req.seqs if s.error), None),
                             stream_holdback=0 if finished else stop_holdback(primary),
                             new_token_ids=new_token_ids, prompt_logprobs=primary.prompt_logprobs)

    @staticmethod
    def _completion(seq: Sequence) -> CompletionOutput:
        finished = seq.is_finished
        return CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason.value if finished and seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None)

    def _beam_completions(self, req: Request) -> list[CompletionOutput]:
        if any(s.finish_reason is FinishReason.ERROR for s in req.seqs):
            return [self._completion(req.seqs[0])]
        return [CompletionOutput(index=i, text=self.tokenizer.decode(h.token_ids, skip_special_tokens=True),
                                 token_ids=h.token_ids, finish_reason="stop" if h.ends_with_eos else "length",
                                 cumulative_logprob=h.score)
                for i, h in enumerate(req.beam.best(req.params.n))]
