"""Offline runners: the same requests through vlite's engine and through transformers.

Every runner returns a :class:`GenerationRun`: wall time of the generation alone (model loading
and warm-up excluded) and the generated token ids per request, so callers can compute
throughput and compare outputs token by token.

The transformers baselines:
  * ``hf-static``: vLLM's ``run_hf``: requests in order, packed into left-padded batches of at
    most ``max_batch_size``; each batch generates up to its longest requested output, and only
    the requested tokens count.
  * ``hf-continuous``: transformers' own continuous batching
    (``continuous_batching_context_manager``), one request per prompt with its own
    ``max_new_tokens``.
Both run greedy with EOS disabled, like the vlite run (``ignore_eos``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vlite.bench.datasets import SampleRequest

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class GenerationRun:
    """elapsed_s: wall seconds of generation. token_ids: generated ids per request, in request order."""

    backend: str
    elapsed_s: float
    token_ids: list[list[int]]
    # Stopped early (Ctrl-C): the indices of the requests that finished; None for a whole run.
    finished: list[int] | None = None

    def summary(self, requests: list[SampleRequest]) -> dict[str, float]:
        """vLLM's throughput numbers; prompt and output totals count what was requested (of an
        interrupted run: of the requests that finished, over the time until the interruption)."""
        if self.finished is not None:
            requests = [requests[i] for i in self.finished]
        prompt = sum(r.prompt_len for r in requests)
        output = sum(r.expected_output_len for r in requests)
        return {
            "elapsed_time": self.elapsed_s,
            "num_requests": len(requests),
            "total_num_tokens": prompt + output,
            "total_prompt_tokens": prompt,
            "total_output_tokens": output,
            "requests_per_second": len(requests) / self.elapsed_s,
            "tokens_per_second": (prompt + output) / self.elapsed_s,
            "output_tokens_per_second": output / self.elapsed_s,
        }


def progress_bar(enabled: bool = True):
    """A transient rich progress bar (description, bar, done/total, elapsed)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    transient=True, disable=not enabled)


def run_vlite(engine, requests: list[SampleRequest], show_progress: bool = True, temperature: float = 0.0,
              warmup: bool = True, stop=None) -> GenerationRun:
    """All requests through ``engine.generate`` (continuous batching), greedy unless ``temperature`` > 0.

    Each request gets ``max_tokens = expected_output_len`` and ``ignore_eos``. A short warm-up
    batch (2 requests x 4 tokens) runs first so one-time costs (allocator, thread pools) stay out.

    ``stop`` (a ``threading.Event`` set by a first Ctrl-C): the run ends there; the result counts
    the requests that finished (``finished``), over the time until then.

    Raises:
        BenchRunError: a request ended in an engine error (no figure is computed from such a run).
    """
    from vlite.engine import SamplingParams

    if warmup:
        engine.generate([r.prompt_token_ids[:16] for r in requests[:2]],
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=r.expected_output_len, temperature=temperature, ignore_eos=True,
                             seed=0 if temperature > 0 else None) for r in requests]
    start = time.perf_counter()
    outs = engine.generate([r.prompt_token_ids for r in requests], params, show_progress=show_progress, stop=stop)
    elapsed = time.perf_counter() - start
    if stop is not None and stop.is_set():  # interrupted: the finished requests only
        done = [i for i, o in enumerate(outs) if o is not None]
        failed = [outs[i] for i in done if outs[i].error or outs[i].outputs[0].finish_reason == "error"]
        if failed:
            raise BenchRunError(f"{len(failed)} of {len(done)} finished requests failed in the engine, e.g. "
                                f"{failed[0].request_id}: {failed[0].error or 'finish_reason error'}")
        return GenerationRun("vlite", elapsed, [list(outs[i].outputs[0].token_ids) for i in done], finished=done)
    failed = [o for o in outs if o.error or o.outputs[0].finish_reason == "error"]
    if failed:  # a throughput over tokens that were never generated would be a false figure
        raise BenchRunError(f"{len(failed)} of {len(outs)} requests failed in the engine, e.g. "
                            f"{failed[0].request_id}: {failed[0].error or 'finish_reason error'}")
    return GenerationRun("vlite", elapsed, [list(o.outputs[0].token_ids) for o in outs])


class BenchRunError(RuntimeError):
    """Requests of a benchmark run ended in an engine error, so the run has no valid figure."""


def load_hf_model(model_path: str, dtype: str = "float32", device: torch.device | str = "cpu"):
    """transformers' AutoModelForCausalLM from a local directory, in eval mode on ``device``
    (the device vlite ran on, so the baseline is compared on the same hardware).

    Raises:
        ValueError: a dtype other than float32 or bfloat16, or a device this torch lacks.
    """
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"the transformers baseline takes dtype float32 or bfloat16, got {dtype!r}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for the transformers baseline, but this torch sees no CUDA device")
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype]).to(device).eval()


@torch.inference_mode()
def run_hf_static(model, requests: list[SampleRequest], pad_token_id: int, max_batch_size: int = 64,
                  show_progress: bool = True) -> GenerationRun:
    """Left-padded static batches of at most ``max_batch_size`` requests, in request order, on
    the model's device (the timing ends after the last batch's tokens are back on the host)."""
    progress = progress_bar(show_progress)
    device = next(model.parameters()).device
    token_ids: list[list[int]] = []
    start = time.perf_counter()
    with progress:
        task = progress.add_task("transformers static batch", total=len(requests))
        for b in range(0, len(requests), max_batch_size):
            batch = requests[b:b + max_batch_size]
            width = max(r.prompt_len for r in batch)
            ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
                mask[i, width - r.prompt_len:] = 1
            max_new = max(r.expected_output_len for r in batch)
            out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=pad_token_id)
            for i, r in enumerate(batch):
                token_ids.append(out[i, width:width + r.expected_output_len].tolist())  # a device sync
            progress.advance(task, len(batch))
    return GenerationRun("hf-static", time.perf_counter() - start, token_ids)


@torch.inference_mode()
def run_hf_continuous(model, requests: list[SampleRequest], show_progress: bool = True,
                      timeout_s: float = 3600.0) -> GenerationRun:
    """transformers' continuous batching, each request with its own ``max_new_tokens``.

    Raises:
        RuntimeError: the manager stopped or ``timeout_s`` passed before every request finished.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.expected_output_len for r in requests),
                              eos_token_id=-1, pad_token_id=0)
    # Without num_blocks, transformers sizes its cache at 90% of free host memory on CPU (14.6 GB seen in a
    # 5-request test); a cache that holds every request at once is all the baseline can use.
    cb_config = ContinuousBatchingConfig()
    cb_config.num_blocks = sum(-(-(r.prompt_len + r.expected_output_len) // cb_config.page_size) + 1 for r in requests)
    progress = progress_bar(show_progress)
    results: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb_config,
                                                   block=True, timeout=5) as manager:
        start = time.perf_counter()
        with progress:
            task = progress.add_task("transformers continuous batching", total=len(requests))
            for i, r in enumerate(requests):
                manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.expected_output_len,
                                    eos_token_id=-1)
            while len(results) < len(requests):
                if time.perf_counter() - start > timeout_s:
                    raise RuntimeError(f"transformers continuous batching: timed out after {timeout_s:.0f}s")
                out = manager.get_result(timeout=1)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers continuous batching stopped before finishing")
                    continue
                if out.is_finished():
                    if out.error:
                        raise RuntimeError(f"transformers continuous batching: {out.request_id}: {out.error}")
                    results[out.request_id] = list(out.generated_tokens)
                    progress.advance(task)
        elapsed = time.perf_counter() - start
    return GenerationRun("hf-continuous", elapsed, [results[f"r{i}"] for i in range(len(requests))])


def token_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far two runs' greedy outputs agree.

    Returns ``positions``: fraction of output positions with the same token (compared up to the
    shorter output of each pair); ``prefix``: mean fraction of each output before the first
    difference; ``identical``: fraction of requests whose outputs are equal.
    """
    same = total = 0
    prefix, identical = [], 0
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        same += sum(int(p == q) for p, q in zip(x[:n], y[:n]))
        total += n
        first = next((i for i in range(n) if x[i] != y[i]), n)
        prefix.append(first / max(1, max(len(x), len(y))))
        identical += int(x == y)
    return {"positions": same / max(1, total), "prefix": sum(prefix) / max(1, len(prefix)),
            "identical": identical / max(1, len(prefix))}
