"""LLMEngine: add_request / step / abort / generate over the paged KV cache.

``step`` is wiring (vLLM v1's engine core loop): ``Scheduler.schedule()`` ->
``ModelRunner.execute()`` -> ``Scheduler.update_from_output()`` (tokens, stops, forks,
finishes) -> ``OutputProcessor.process()`` (RequestOutputs). The scheduler owns each
``Request`` and every exit goes through ``Scheduler.finish_sequence`` (the one free path),
which keeps a bounded record of finished sequences so that the leak checker can name the
origin of any block still held. The read-only methods at the bottom delegate to
``EngineView`` (``vlite.engine.introspection``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import uuid

import torch

from vlite.engine.config import EngineConfig
from vlite.engine.core.beam_search import BeamState
from vlite.engine.core.faults import FaultSet
from vlite.engine.core.request import Request, RequestRecord
from vlite.engine.core.sched_output import ScheduledSequence, SchedulerOutput
from vlite.engine.core.scheduler import Scheduler
from vlite.engine.core.sequence import RequestOrigin, Sequence
from vlite.engine.core.structured_output import StructuredOutputManager
from vlite.engine.introspection import EngineView, LedgerRecord
from vlite.engine.kv_cache_fit import check_kv_cache_fits
from vlite.engine.metrics import EngineStats
from vlite.engine.output_processor import OutputProcessor
from vlite.engine.outputs import RequestOutput
from vlite.engine.sampling_params import RequestOutputKind, SamplingParams
from vlite.engine.worker.executor import Executor, WorkerFailedError
from vlite.engine.worker.executor_factory import create_executor
from vlite.engine.worker.loader import LoadedCheckpoint, load_checkpoint
from vlite.engine.worker.logits_processors import build_logits_processor
from vlite.engine.worker.model_runner import SequenceError

logger = logging.getLogger("vlite.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["EngineDeadError", "LLMEngine", "LedgerRecord", "Request", "RequestRecord", "RequestRejectedError"]


class RequestRejectedError(ValueError):
    """A request the engine will never run (bad input, or it could never fit); nothing was allocated."""


class EngineDeadError(RuntimeError):
    """The engine can run nothing more: a tensor-parallel rank failed (the message names it)."""


_request_counter = itertools.count()


def resolve_device(config: EngineConfig) -> torch.device:
    """The device ``config`` runs on (``config.device``, else CUDA when available), checked
    against this torch build and the dtype.

    Raises:
        ValueError: CUDA asked for but this torch has none, or float16 on CPU (one line each).
    """
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda, but this torch ({torch.__version__}) sees no CUDA device; "
                         "use --device cpu")
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and config.dtype == "float16":
        raise ValueError("--dtype float16 needs CUDA; on CPU use float32 (the default) or bfloat16")
    return device


def check_engine_config(config: EngineConfig) -> LoadedCheckpoint:
    """The checks of ``LLMEngine`` that need torch or the model's config but not its weights,
    for a command to run before the model loads (a server: before it binds its port): the
    device and dtype, whether ``tensor_parallel_size`` can split the model, whether
    ``max_model_len`` fits the model, and whether ``--num-blocks`` / ``--kv-cache-memory-bytes``
    fit in memory (``vlite.engine.kv_cache_fit``).

    Returns:
        the checkpoint without its weights (config and tokenizer), for prompt checks.

    Raises:
        ValueError: one line saying what is wrong and what is allowed.
        ModelNotFoundError: the model cannot be found locally.
    """
    from vlite.engine.kv_cache_fit import check_kv_cache_fits, estimate_weight_bytes, kv_bytes_per_block

    device = resolve_device(config)
    tp = config.parallel.tensor_parallel_size
    ckpt = load_checkpoint(config.model, weights=False)
    hf = ckpt.config
    derive_max_model_len(hf, config.scheduler.max_model_len)
    if tp > 1:
        from vlite.engine.worker.models.parallel_layers import check_tp_size

        num_kv = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        check_tp_size(tp, hf.num_attention_heads, num_kv, hf.intermediate_size)
    cache = config.cache
    check_kv_cache_fits(num_blocks=cache.num_blocks, kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
                        bytes_per_block=kv_bytes_per_block(hf, cache.block_size, config.dtype, tp),
                        block_size=cache.block_size, device_type=device.type,
                        weights_to_load=estimate_weight_bytes(hf, config.dtype))
    return ckpt


def derive_max_model_len(hf_config, asked: int | None) -> int:
    """The engine's max_model_len (tokens): ``asked``, or the model's limit when None. The limit
    is ``max_position_embeddings`` (2048 if absent), or the sliding window if smaller (vlite has
    no sliding-window attention, so it stays inside the window).

    Raises:
        ValueError: ``asked`` exceeds the model's limit.
    """
    limit = int(getattr(hf_config, "max_position_embeddings", 2048))
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, int(window))
    if asked is not None and asked > limit:
        raise ValueError(f"--max-model-len {asked} exceeds the model's limit of {limit} tokens "
                         f"(max_position_embeddings or sliding_window in its config); the largest that fits is {limit}")
    return asked or limit


class LLMEngine:
    """The offline/online engine.

    Args:
        config: engine configuration; the model is loaded from ``config.model``.
        checkpoint: an already loaded checkpoint (tests reuse one across engines).

    With ``config.parallel.tensor_parallel_size`` N > 1 the model runs on N ranks (worker
    processes or Ray actors, ``vlite.engine.worker.executor``); this process keeps the scheduler, the
    block manager and the sampler, and does not load the weights. Call ``shutdown()`` (or let
    the process exit) to stop the ranks.

    Raises:
        ModelNotFoundError: the model cannot be found locally.
        ValueError: an invalid configuration (e.g. a tensor-parallel size that cannot split the model).
        ExecutorStartupError: a rank failed to start (one line).
    """

    def __init__(self, config: EngineConfig | None = None, checkpoint: LoadedCheckpoint | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.faults = FaultSet(config.inject_faults)
        tp = config.parallel.tensor_parallel_size
        ckpt = checkpoint or load_checkpoint(config.model, weights=tp == 1)
        self.model_name = ckpt.name
        self.tokenizer = ckpt.tokenizer
        self.hf_config = ckpt.config
        self.device = resolve_device(config)
        self.dtype = _DTYPES[config.dtype]
        self.max_model_len = derive_max_model_len(self.hf_config, config.scheduler.max_model_len)
        torch.manual_seed(config.seed)
        self.dead_error: str | None = None  # set when a rank failed: the engine runs nothing more
        self.executor: Executor = create_executor(config, ckpt, self.max_model_len, self.device, self.dtype,
                                                  self.faults)
        try:
            # in-process (N = 1): the runner and the model, as before; None under tensor parallelism
            self.model_runner = getattr(self.executor, "model_runner", None)
            self.model = self.model_runner.model if self.model_runner is not None else None
            self.cpu_gemm = self.executor.cpu_gemm
            self.eos_token_ids = self._eos_token_ids()

            cache = config.cache
            self.block_size = cache.block_size
            # bytes one block takes on all ranks together
            self.bytes_per_block = self.executor.kv_cache_bytes_per_block(cache.block_size)
            # before allocating: a KV cache larger than the memory there is is one line naming the option
            check_kv_cache_fits(num_blocks=cache.num_blocks, kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
                                bytes_per_block=self.bytes_per_block, block_size=cache.block_size,
                                device_type=self.device.type)
            num_blocks = self.executor.determine_num_blocks(cache, config.scheduler.max_num_batched_tokens)
            self.executor.initialize_kv_cache(num_blocks, cache.block_size,
                                              max_num_seqs=config.scheduler.max_num_seqs,
                                              enforce_eager=config.enforce_eager)
        except BaseException:
            self.executor.shutdown()
            raise
        self.output_processor = OutputProcessor(self.tokenizer)
        # Structured output: grammar compiler cache (thread-safe) and per-sequence matchers.
        self.structured_output = StructuredOutputManager(self.tokenizer, self.hf_config.vocab_size,
                                                         self.eos_token_ids)
        make_scheduler = Scheduler
        if config.inject_faults:  # a planted fault attaches through a subclass, only when asked for
            from vlite.engine.core.fault_seams import scheduler_factory

            make_scheduler = scheduler_factory(self.faults)
        self.scheduler = make_scheduler(config.scheduler, cache, num_blocks, enable_ledger=config.enable_ledger,
                                        max_model_len=self.max_model_len,
                                        detokenize=self.output_processor.detokenize,
                                        finished_history=config.finished_history,
                                        structured_output=self.structured_output)
        # requests refused, by stage (``Coverage.rejections``): "at admission" (add_request
        # raised RequestRejectedError) and "sibling rejected" (admitted by add_requests, then
        # aborted because another request of the same group was refused)
        self.rejection_counts: collections.Counter[str] = collections.Counter()

    # ---- set-up helpers ------------------------------------------------------------------
    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (getattr(self.hf_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return frozenset(ids)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                    origin: RequestOrigin | None = None) -> str:
        """Queue one request; returns its request id.

        Args:
            prompt: text to tokenize (with the tokenizer's special tokens), or None with
                ``prompt_token_ids``.
            sampling_params: defaults to ``SamplingParams()``.
            request_id: defaults to ``origin.request_id`` or a fresh uuid.
            origin: who sent it; defaults to route "api".

        Raises:
            RequestRejectedError: empty prompt, token ids outside the vocabulary, a duplicate
                live request id, a request that can never fit (prompt + max_tokens beyond
                max_model_len or beyond the whole KV cache), or a structured-output constraint
                that does not compile. Nothing is allocated.
            EngineDeadError: a tensor-parallel rank failed earlier.
        """
        try:
            return self._add_request(prompt, sampling_params, prompt_token_ids, request_id, origin)
        except RequestRejectedError:
            self.rejection_counts["at admission"] += 1
            raise

    def add_requests(self, requests: list) -> list[str]:
        """Queue several requests all or none (the prompts of one multi-prompt completion);
        returns their ids.

        Args:
            requests: ``EngineRequest``-like items (``prompt``, ``sampling_params``,
                ``prompt_token_ids``, ``origin``; the engine request id is ``origin.request_id``).

        Raises:
            RequestRejectedError (or EngineDeadError): the first refusal. The requests of the
                group admitted before it are aborted first (they were waiting: no block was
                allocated), so nothing stays queued for a client that got an error
                (vllm#27420, sglang#28380).
        """
        added: list[str] = []
        try:
            for r in requests:
                added.append(self.add_request(r.prompt, r.sampling_params, prompt_token_ids=r.prompt_token_ids,
                                              request_id=r.origin.request_id, origin=r.origin))
        except Exception:
            for rid in added:
                self.abort(rid)
                self.rejection_counts["sibling rejected"] += 1
            raise
        return added

    def _add_request(self, prompt, sampling_params, prompt_token_ids, request_id, origin) -> str:
        """``add_request`` without the rejection count."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")
        params = sampling_params or SamplingParams()
        if request_id is None:
            request_id = origin.request_id if origin else f"req-{next(_request_counter)}-{uuid.uuid4().hex[:8]}"
        if origin is None:
            origin = RequestOrigin(request_id)
        elif origin.request_id != request_id:
            raise RequestRejectedError(f"origin.request_id {origin.request_id!r} != request_id {request_id!r}")
        if prompt_token_ids is None:
            if not isinstance(prompt, str) or not prompt:
                raise RequestRejectedError("prompt must be a non-empty string (or give prompt_token_ids)")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        prompt_token_ids = list(prompt_token_ids)
        if not prompt_token_ids:
            raise RequestRejectedError("prompt is empty: at least one token is required")
        vocab = self.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestRejectedError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        self._check_fits(len(prompt_token_ids), params)
        if params.structured_outputs is not None:  # compiled (and cached) now: a bad one is rejected here
            try:
                self.structured_output.compile(params.structured_outputs)
            except ValueError as exc:
                raise RequestRejectedError(str(exc)) from None
        if request_id in self.scheduler.requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use by a live request")
        try:  # logit_bias / allowed_token_ids / bad_words, checked against the vocabulary
            processor = build_logits_processor(params, self.tokenizer, vocab)
        except ValueError as exc:
            raise RequestRejectedError(str(exc)) from None
        seq = Sequence(request_id, prompt, prompt_token_ids, params, origin, self.eos_token_ids)
        seq.logits_processor = processor
        self.output_processor.init_sequence(seq)
        beam = None
        if params.beam_width > 1:
            beam = BeamState(params.beam_width, params.length_penalty, params.max_tokens,
                             frozenset() if params.ignore_eos else self.eos_token_ids, running=[seq])
        self.scheduler.add_request(Request.of(seq, beam))
        return request_id

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejectedError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"asks for {total} ({num_prompt_tokens} prompt + {params.max_tokens} max_tokens); "
                "shorten the prompt or lower max_tokens")
        # n samples or W beams must be able to hold their blocks at the same time.
        width = max(params.n, params.beam_width)
        needed, num_total_blocks = self.scheduler.num_blocks_for(total, width)
        if needed > num_total_blocks:
            raise RequestRejectedError(
                f"the request needs {needed} KV blocks ({width} x {total} tokens at block_size {self.block_size}) but "
                f"the whole KV cache has {num_total_blocks}; lower max_tokens or raise --num-blocks")

    def abort(self, request_id: str) -> bool:
        """Abort a live request (every sequence of it) in any state; its blocks go back to
        the free list.

        Returns False if no live request has that id (already finished or unknown).
        Raises:
            PlantedFault: only with the planted ``skip-free-on-abort`` fault.
        """
        if request_id not in self.scheduler.requests:
            return False
        self.scheduler.abort(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return an output for every request that advanced or ended
        (a request with ``output_kind`` FINAL_ONLY: only when it ended).

        A failed forward ends that batch's requests with finish reason "error", not the engine.
        A failed tensor-parallel rank ends every live request with finish reason "error" and a
        message naming the rank, and marks the engine dead (``dead_error``).
        """
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        try:
            result = self.executor.execute(sched)
        except WorkerFailedError as exc:
            logger.error("%s; ending every request", exc)
            self.dead_error = str(exc)
            everything = SchedulerOutput(sched.step, [ScheduledSequence(seq, 0, False)
                                                      for req in list(self.scheduler.requests.values())
                                                      for seq in req.live])
            touched = self.scheduler.fail(everything, None, str(exc))
        except SequenceError as exc:
            touched = self.scheduler.fail(sched, exc.seq_ids, str(exc))
        except Exception as exc:  # a failed forward ends this batch's requests, not the engine
            logger.exception("step %d failed", sched.step)
            touched = self.scheduler.fail(sched, None, f"{type(exc).__name__}: {exc}")
        else:
            touched = self.scheduler.update_from_output(sched, result)
        return self.output_processor.process(touched)

    def shutdown(self) -> None:
        """Stop the executor's ranks (worker processes or actors); idempotent. In-process: nothing."""
        self.executor.shutdown()

    # ---- offline batch -------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]], sampling_params: SamplingParams | list[SamplingParams]
                 | None = None, *, show_progress: bool = False, stop=None) -> list[RequestOutput]:
        """Run a batch to completion with continuous batching; outputs in prompt order.

        ``prompts`` are strings or lists of token ids. Raises RequestRejectedError before
        anything runs if any prompt is invalid (nothing queued stays behind). ``stop`` (a
        ``threading.Event``, set by a Ctrl-C in ``vlite bench``): once set, the requests not
        finished are aborted (their blocks freed) and stand as None in the returned list.
        """
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # only the final outputs are read here: nothing is built or decoded for a request before it ends
        params = [dataclasses.replace(p or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                if isinstance(prompt, str):
                    ids.append(self.add_request(prompt, p, origin=None))
                else:
                    ids.append(self.add_request(None, p, prompt_token_ids=list(prompt)))
        except Exception:
            for rid in ids:
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        progress = None
        if show_progress:
            from rich.progress import Progress

            progress = Progress(transient=True)
            task = progress.add_task("Generating", total=len(ids))
            progress.start()
        try:
            while self.has_unfinished_requests():
                if self.dead_error is not None:
                    raise EngineDeadError(f"the engine is dead: {self.dead_error}")
                if stop is not None and stop.is_set():
                    for rid in ids:
                        if rid not in final:
                            self.abort(rid)
                    return [final.get(rid) for rid in ids]
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
                        if progress:
                            progress.advance(task)
        finally:
            if progress:
                progress.stop()
        return [final[rid] for rid in ids]

    # ---- read-only views for metrics and diagnostics (see EngineView) ---------------------
    @property
    def prompt_tokens_total(self) -> int:
        """Prefill tokens computed since start (tokens)."""
        return self.scheduler.stats.prompt_tokens_total

    @property
    def generation_tokens_total(self) -> int:
        """Output tokens generated since start (tokens)."""
        return self.scheduler.stats.generation_tokens_total

    def stats(self) -> EngineStats:
        return EngineView(self).stats()

    def ledger(self) -> list[LedgerRecord]:
        return EngineView(self).ledger()

    def sequences_view(self) -> list[dict]:
        return EngineView(self).sequences_view()

    def ledger_anomalies(self) -> list:
        return EngineView(self).ledger_anomalies()

    def request_record(self, seq_id: int) -> RequestRecord | None:
        return EngineView(self).request_record(seq_id)

    def live_state(self) -> dict[str, list]:
        return EngineView(self).live_state()

    def block_tables_view(self) -> dict[int, list[int]]:
        return EngineView(self).block_tables()

    def ref_counts(self) -> list[int]:
        return EngineView(self).ref_counts()
