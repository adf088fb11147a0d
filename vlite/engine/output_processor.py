"""OutputProcessor: detokenization and ``RequestOutput`` assembly.

The scheduler books a step (tokens, stops, forks, finishes) and hands back the requests that
advanced; the output processor turns each into a ``RequestOutput`` (vLLM v1 splits the same
way: ``Scheduler.update_from_output`` in the engine core, detokenization and outputs in the
``OutputProcessor``). It also owns incremental detokenization (``detokenize``), which the
scheduler calls after appending a token of a sequence with stop strings so that they end it
in the same step; every other sequence's text is decoded here, when its output is built.
It keeps no per-request state: what it needs lives on the ``Request``.
"""

from __future__ import annotations

from vlite.engine.core.detokenizer import detokenize_incrementally, fast_decoder, init_detokenizer, stop_holdback
from vlite.engine.core.request import Request
from vlite.engine.core.sequence import FinishReason, Sequence
from vlite.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vlite.engine.sampling_params import RequestOutputKind


class OutputProcessor:
    """Turns advanced requests into ``RequestOutput``s.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``), used for incremental detokenization
            and to decode the best beams.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoder = fast_decoder(tokenizer)  # incremental text: the Rust decoder where it gives the same text

    @staticmethod
    def init_sequence(seq: Sequence) -> None:
        """Start ``seq``'s detokenizer window at the end of its prompt."""
        init_detokenizer(seq)

    def detokenize(self, seq: Sequence) -> str:
        """Append the text of ``seq``'s newest tokens to ``seq.output_text``; return the new text."""
        return detokenize_incrementally(self.decoder, seq)

    def process(self, requests: list[Request]) -> list[RequestOutput]:
        """One ``RequestOutput`` per advanced or ended request that has a consumer this step,
        in the given order: every one of them, except the unfinished requests that asked for
        their final output only (``RequestOutputKind.FINAL_ONLY``)."""
        final_only = RequestOutputKind.FINAL_ONLY
        return [self.make_output(r) for r in requests if r.params.output_kind is not final_only or r.is_finished]

    def make_output(self, req: Request) -> RequestOutput:
        """The request's state: one CompletionOutput per sample (by index), or the best beams
        once a beam search is done. Timestamps (``time.time()`` s) span all its sequences;
        ``new_token_ids`` are the output tokens of sample 0 not returned before."""
        seqs = req.seqs
        primary = seqs[0]
        finished = req.is_finished
        if req.beam is not None:
            completions = self._beam_completions(req) if finished else []
        elif len(seqs) == 1:
            completions = [self._completion(primary)]
        else:
            completions = [self._completion(s) for s in sorted(seqs, key=lambda s: s.index)]
        if len(seqs) == 1:  # most requests: no lists to build
            finished_time = primary.finished_time if finished else None
            metrics = RequestMetrics(primary.arrival_time, primary.first_scheduled_time, primary.first_token_time,
                                     primary.last_token_time, finished_time, primary.num_preemptions)
        else:
            first_tokens = [s.first_token_time for s in seqs if s.first_token_time]
            last_tokens = [s.last_token_time for s in seqs if s.last_token_time]
            finishes = [s.finished_time for s in seqs if s.finished_time]
            metrics = RequestMetrics(primary.arrival_time, primary.first_scheduled_time,
                                     min(first_tokens, default=None), max(last_tokens, default=None),
                                     max(finishes) if finished and finishes else None,
                                     sum(s.num_preemptions for s in seqs))
        new_token_ids = primary.output_token_ids[req.num_reported_tokens:] if req.beam is None else []
        req.num_reported_tokens = primary.num_output_tokens
        failed = next((s for s in seqs if s.error), None)
        return RequestOutput(req.request_id, primary.prompt, primary.prompt_token_ids, completions, finished,
                             req.origin, metrics, error=failed.error if failed else None,
                             error_kind=failed.error_kind if failed else None,
                             stream_holdback=0 if finished else stop_holdback(primary),
                             new_token_ids=new_token_ids, prompt_logprobs=primary.prompt_logprobs)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        finished = seq.is_finished
        detokenize_incrementally(self.decoder, seq)  # the tokens whose text nobody needed before
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
