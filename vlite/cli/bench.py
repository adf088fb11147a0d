"""``vlite bench``: throughput, latency and serving benchmarks (flags and output follow ``vllm bench``).

  vlite bench throughput   offline, in-process; ``--backend hf`` adds transformers baselines in the same run
  vlite bench latency      one batch end to end, repeated
  vlite bench serve        streaming clients against an OpenAI-compatible server
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import typer

from vlite.cli import common
from vlite.cli.interrupt import EXIT_INTERRUPTED, graceful_interrupt
from vlite.engine import EngineArgs

app = typer.Typer(help="Benchmarks with vLLM's metrics (throughput, latency, serving).", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)

DatasetOpt = typer.Option("random", "--dataset-name", help="random | sharegpt | prefix-repetition.")
DatasetPathOpt = typer.Option(None, "--dataset-path", help="ShareGPT JSON file (--dataset-name sharegpt).")
NumPromptsOpt = typer.Option(64, "--num-prompts", min=1, help="Requests to run.")
InputLenOpt = typer.Option(128, "--input-len", "--random-input-len", min=1, help="Prompt tokens (random dataset).")
OutputLenOpt = typer.Option(None, "--output-len", "--random-output-len", min=1,
                            help="Output tokens per request (default 128; sharegpt: its answers).")
RangeRatioOpt = typer.Option(0.0, "--random-range-ratio", min=0.0, max=0.999,
                             help="Lengths uniform in [len*(1-r), len*(1+r)] (random dataset).")
InputRangeOpt = typer.Option(None, "--input-len-range", metavar="MIN:MAX",
                             help="vlite extension: prompt lengths uniform in [MIN, MAX] (overrides --input-len).")
OutputRangeOpt = typer.Option(None, "--output-len-range", metavar="MIN:MAX",
                              help="vlite extension: output lengths uniform in [MIN, MAX] (overrides --output-len).")
PrefixLenOpt = typer.Option(256, "--prefix-repetition-prefix-len", min=1, help="Shared prefix tokens.")
SuffixLenOpt = typer.Option(256, "--prefix-repetition-suffix-len", min=0, help="Unique suffix tokens.")
NumPrefixesOpt = typer.Option(10, "--prefix-repetition-num-prefixes", min=1, help="Distinct prefixes.")
SeedOpt = typer.Option(0, "--seed", help="Dataset and sampling seed.")
OutputJsonOpt = typer.Option(None, "--output-json", help="Write the results as JSON here.")


def _parse_range(text: str | None, option: str) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        common.fail(f"{option} must look like MIN:MAX, got {text!r}")
    if not 1 <= lo <= hi:
        common.fail(f"{option} needs 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def load_requests(tokenizer, dataset_name: str, dataset_path: Path | None, num_prompts: int, input_len: int,
                  output_len: int, range_ratio: float, input_range: str | None, output_range: str | None,
                  prefix_len: int, suffix_len: int, num_prefixes: int, seed: int, output_len_given: bool = True):
    """Build the workload named by the CLI flags; exits with code 2 and a message on bad flags."""
    from vlite.bench import datasets

    try:
        if dataset_name == "random":
            in_r = _parse_range(input_range, "--input-len-range") or datasets.length_range(input_len, range_ratio)
            out_r = _parse_range(output_range, "--output-len-range") or datasets.length_range(output_len, range_ratio)
            return datasets.random_requests(tokenizer, num_prompts, in_r, out_r, seed)
        if dataset_name == "sharegpt":
            if dataset_path is None:
                common.fail("--dataset-name sharegpt needs --dataset-path")
            return datasets.sharegpt_requests(dataset_path, tokenizer, num_prompts,
                                              output_len if output_len_given else None, seed)
        if dataset_name == "prefix-repetition":
            return datasets.prefix_repetition_requests(tokenizer, num_prompts, prefix_len, suffix_len, num_prefixes,
                                                       output_len, seed)
    except (ValueError, FileNotFoundError) as exc:
        common.fail(str(exc))
    common.fail(f"--dataset-name must be random, sharegpt or prefix-repetition, got {dataset_name!r}")


def _engine(engine_args: EngineArgs):
    return common.load_engine(common.create_engine_config(engine_args))


def _throughput_line(s: dict) -> str:
    return (f"Throughput: {s['requests_per_second']:.2f} requests/s, {s['tokens_per_second']:.2f} total tokens/s, "
            f"{s['output_tokens_per_second']:.2f} output tokens/s")


def _say_interrupted(what: str) -> None:
    common.err_console.print(f"[bold yellow]INTERRUPTED:[/] {what}", highlight=False, soft_wrap=True)


def _say_threads() -> None:
    """The CPU thread report's line on stderr, and a warning when the machine is oversubscribed."""
    from vlite.engine import thread_report

    report = thread_report()
    common.err_console.print(report.line(), highlight=False, soft_wrap=True)
    warning = report.oversubscribed()
    if warning:
        common.warn(warning)


def _write_json(path: Path | None, data: dict) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(data, indent=4) + "\n")
        common.err_console.print(f"wrote {path}")


@app.command("throughput")
@common.engine_args_options()
def throughput(
    backend: str = typer.Option("vlite", "--backend",
                                help="vlite, or hf: vlite plus transformers' static batch and continuous batching "
                                     "on the same prompts in the same process, with vlite's ratio against each."),
    dataset_name: str = DatasetOpt,
    dataset_path: Path | None = DatasetPathOpt,
    num_prompts: int = NumPromptsOpt,
    input_len: int = InputLenOpt,
    output_len: int | None = OutputLenOpt,
    random_range_ratio: float = RangeRatioOpt,
    input_len_range: str | None = InputRangeOpt,
    output_len_range: str | None = OutputRangeOpt,
    prefix_len: int = PrefixLenOpt,
    suffix_len: int = SuffixLenOpt,
    num_prefixes: int = NumPrefixesOpt,
    seed: int = SeedOpt,
    hf_max_batch_size: int | None = typer.Option(None, "--hf-max-batch-size", min=1,
                                                 help="Static batch size of the hf baseline (default: all prompts)."),
    hf_modes: str = typer.Option("static,continuous", "--hf-modes", help="Which hf baselines to run."),
    engine_args: EngineArgs = None,
    disable_ledger: bool = typer.Option(False, "--disable-ledger",
                                        help="Run without the block allocation ledger (to measure its cost)."),
    output_json: Path | None = OutputJsonOpt,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Rich progress bars."),
) -> None:
    """Offline throughput: every request queued at once, run to completion (greedy, EOS ignored)."""
    from vlite.bench import runners

    if backend not in ("vlite", "hf"):
        common.fail(f"--backend must be vlite or hf, got {backend!r}")
    modes = [m.strip() for m in hf_modes.split(",") if m.strip()]
    if any(m not in ("static", "continuous") for m in modes):
        common.fail(f"--hf-modes takes static and/or continuous, got {hf_modes!r}")
    engine_args.seed, engine_args.enable_ledger = seed, not disable_ledger
    model, dtype = engine_args.model, engine_args.dtype
    engine = _engine(engine_args)
    requests = load_requests(engine.tokenizer, dataset_name, dataset_path, num_prompts, input_len, output_len or 128,
                             random_range_ratio, input_len_range, output_len_range, prefix_len, suffix_len,
                             num_prefixes, seed, output_len_given=output_len is not None)
    import torch

    device = engine.device
    common.err_console.print(f"vlite: {engine.model_name}, {dtype}, device {device}, "
                             f"{common.plural(len(requests), 'request')}, torch threads {torch.get_num_threads()}, "
                             f"CPU GEMM {engine.cpu_gemm or '-'}")
    _say_threads()
    with graceful_interrupt("the benchmark") as stop:
        try:
            result = runners.run_vlite(engine, requests, show_progress=progress, stop=stop)
        except runners.BenchRunError as exc:
            common.fail(str(exc), code=1)
        summary = result.summary(requests)
        if result.finished is not None:
            _say_interrupted(f"{common.plural(len(result.finished), 'request')} of {len(requests)} finished in "
                             f"{result.elapsed_s:.1f} s; the figures below count those only")
        print(_throughput_line(summary))
        print(f"Total num prompt tokens:  {summary['total_prompt_tokens']}")
        print(f"Total num output tokens:  {summary['total_output_tokens']}")
        print(f"Device: {device}")
        data = dict(summary, backend="vlite", model=engine.model_name, dtype=dtype, device=str(device),
                    cpu_gemm=engine.cpu_gemm,
                    num_preemptions=engine.stats().num_preemptions_total, enable_ledger=not disable_ledger)
        if result.finished is not None:
            data["interrupted"] = True
            _write_json(output_json, data)
            raise typer.Exit(EXIT_INTERRUPTED)
    if backend == "hf":
        del engine  # free the KV cache before loading the second model
        if device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        hf_model = runners.load_hf_model(str(_model_dir(model)), dtype, device)  # vlite's device
        pad = hf_model.config.pad_token_id if hf_model.config.pad_token_id is not None else 0
        data["baselines"] = {}
        for mode in modes:
            if mode == "static":
                base = runners.run_hf_static(hf_model, requests, pad, hf_max_batch_size or len(requests), progress)
            else:
                base = runners.run_hf_continuous(hf_model, requests, progress)
            s = base.summary(requests)
            ratio = summary["output_tokens_per_second"] / s["output_tokens_per_second"]
            agree = runners.token_agreement(result.token_ids, base.token_ids)
            print(f"[{base.backend} on {device}] {_throughput_line(s)}")
            print(f"vlite / {base.backend}: {ratio:.2f}x output tokens/s; greedy tokens equal at "
                  f"{agree['positions'] * 100:.1f}% of positions ({agree['identical'] * 100:.0f}% of requests identical)")
            data["baselines"][base.backend] = dict(s, ratio=ratio, token_agreement=agree, device=str(device))
    _write_json(output_json, data)


def _model_dir(model: str) -> Path:
    from vlite.engine import ModelNotFoundError, resolve_model

    try:
        return resolve_model(model).path
    except ModelNotFoundError as exc:
        common.fail(str(exc))


@app.command("latency")
@common.engine_args_options()
def latency(
    input_len: int = typer.Option(32, "--input-len", min=1, help="Prompt tokens of each request."),
    output_len: int = typer.Option(128, "--output-len", min=1, help="Output tokens of each request."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Requests per batch."),
    num_iters_warmup: int = typer.Option(10, "--num-iters-warmup", min=0, help="Untimed iterations first."),
    num_iters: int = typer.Option(30, "--num-iters", min=1, help="Timed iterations."),
    seed: int = SeedOpt,
    engine_args: EngineArgs = None,
    output_json: Path | None = OutputJsonOpt,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Rich progress bars."),
) -> None:
    """Latency of one batch of random prompts generated to completion (vLLM: temperature 1, EOS ignored)."""
    import numpy as np

    from vlite.bench import datasets, runners
    from vlite.engine import SamplingParams

    engine_args.seed = seed
    engine = _engine(engine_args)
    reqs = datasets.random_requests(engine.tokenizer, batch_size, (input_len, input_len), (output_len, output_len),
                                    seed)
    prompts = [r.prompt_token_ids for r in reqs]
    params = SamplingParams(max_tokens=output_len, temperature=1.0, top_p=1.0, ignore_eos=True)

    def run_once() -> float:
        start = time.perf_counter()
        engine.generate(prompts, params, stop=stop)  # a Ctrl-C ends the iteration at once
        return time.perf_counter() - start

    common.err_console.print(f"vlite: {engine.model_name}, batches of {common.plural(batch_size, 'request')}, "
                             f"{num_iters_warmup} warm-up + {num_iters} timed iterations (Ctrl-C stops and prints what "
                             "was measured)", highlight=False)
    _say_threads()
    latencies: list[float] = []
    with graceful_interrupt("the benchmark") as stop, runners.progress_bar(progress) as bar:
        task = bar.add_task("Warmup iterations", total=num_iters_warmup)
        for _ in range(num_iters_warmup):
            if stop.is_set():
                break
            run_once()
            bar.advance(task)
        task = bar.add_task("Profiling iterations", total=num_iters)
        for _ in range(num_iters):
            if stop.is_set():
                break
            latency_s = run_once()
            if not stop.is_set():  # an iteration cut short by Ctrl-C is not a latency
                latencies.append(latency_s)
            bar.advance(task)
    if stop.is_set():
        _say_interrupted(f"{common.plural(len(latencies), 'timed iteration')} of {num_iters} measured; the figures "
                         "below count those only")
        if not latencies:
            raise typer.Exit(EXIT_INTERRUPTED)
    percentages = [10, 25, 50, 75, 90, 99]
    percentiles = np.percentile(latencies, percentages)
    print(f"Avg latency: {np.mean(latencies)} seconds")
    for p, v in zip(percentages, percentiles):
        print(f"{p}% percentile latency: {v} seconds")
    _write_json(output_json, {"avg_latency": float(np.mean(latencies)), "latencies": latencies,
                              "percentiles": {str(p): float(v) for p, v in zip(percentages, percentiles)},
                              **({"interrupted": True} if stop.is_set() else {})})
    if stop.is_set():
        raise typer.Exit(EXIT_INTERRUPTED)


@app.command("serve")
def serve(
    model: str = common.ModelOpt,
    base_url: str | None = typer.Option(None, "--base-url",
                                        help="Server to benchmark, e.g. http://127.0.0.1:8000 (default: start "
                                             "`vlite serve` on a free loopback port and stop it afterwards)."),
    served_model_name: str | None = typer.Option(None, "--served-model-name",
                                                 help="'model' field of the requests (default: the server's first)."),
    dataset_name: str = DatasetOpt,
    dataset_path: Path | None = DatasetPathOpt,
    num_prompts: int = typer.Option(100, "--num-prompts", min=1, help="Requests to send."),
    input_len: int = InputLenOpt,
    output_len: int | None = OutputLenOpt,
    random_range_ratio: float = RangeRatioOpt,
    input_len_range: str | None = InputRangeOpt,
    output_len_range: str | None = OutputRangeOpt,
    prefix_len: int = PrefixLenOpt,
    suffix_len: int = SuffixLenOpt,
    num_prefixes: int = NumPrefixesOpt,
    request_rate: float = typer.Option(float("inf"), "--request-rate",
                                       help="Requests per second (inf: all at once; else gamma arrivals)."),
    burstiness: float = typer.Option(1.0, "--burstiness", min=0.0001,
                                     help="Gamma shape of the arrivals: 1 = Poisson, < 1 burstier, > 1 steadier."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", min=1, help="Most requests in flight."),
    percentile_metrics: str = typer.Option("ttft,tpot,itl", "--percentile-metrics",
                                           help="Comma-separated subset of ttft,tpot,itl,e2el to report."),
    metric_percentiles: str = typer.Option("99", "--metric-percentiles", help="Comma-separated percentiles, e.g. 50,90,99."),
    seed: int = SeedOpt,
    save_result: bool = typer.Option(False, "--save-result", help="Write the JSON result file."),
    result_dir: str | None = typer.Option(None, "--result-dir", help="Folder for --save-result (default: cwd)."),
    result_filename: str | None = typer.Option(None, "--result-filename", help="File name for --save-result."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="VLITE_API_KEY", help="Bearer token for the server."),
    server_args: str = typer.Option("", "--server-args",
                                    help="Extra `vlite serve` arguments when bench starts the server itself."),
    request_timeout: float = typer.Option(600.0, "--request-timeout", min=1.0, help="Seconds per request."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Rich progress bar."),
) -> None:
    """Serving benchmark: streamed completions; prints vLLM's "Serving Benchmark Result" block."""
    import asyncio

    from vlite.bench import metrics as bm
    from vlite.bench import runners, serving
    from vlite.bench.server import start_server, stop_server

    selected = [m.strip() for m in percentile_metrics.split(",") if m.strip()]
    if any(m not in bm.METRIC_NAMES for m in selected):
        common.fail(f"--percentile-metrics takes ttft, tpot, itl, e2el; got {percentile_metrics!r}")
    try:
        pcts = [float(p) for p in metric_percentiles.split(",") if p.strip()]
    except ValueError:
        common.fail(f"--metric-percentiles must be numbers, got {metric_percentiles!r}")
    if any(not 0 <= p <= 100 for p in pcts):
        common.fail("--metric-percentiles must lie in [0, 100]")
    if request_rate <= 0:
        common.fail("--request-rate must be > 0 (or inf)")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(_model_dir(model)))
    requests = load_requests(tokenizer, dataset_name, dataset_path, num_prompts, input_len, output_len or 128,
                             random_range_ratio, input_len_range, output_len_range, prefix_len, suffix_len,
                             num_prefixes, seed, output_len_given=output_len is not None)
    proc = None
    if base_url is None:
        proc, base_url = start_server(model, server_args.split(), api_key=api_key)
    try:
        name = served_model_name or _first_model(base_url, api_key)
        with graceful_interrupt("the benchmark") as stop, runners.progress_bar(progress) as bar:
            task = bar.add_task("Requests", total=len(requests))
            outputs, duration = asyncio.run(serving.run_requests(
                base_url, name, requests, request_rate, burstiness, max_concurrency, seed, request_timeout, api_key,
                on_done=lambda: bar.advance(task), stop=stop))
    finally:
        if proc is not None:
            stop_server(proc)
    if stop.is_set():
        _say_interrupted(f"{common.plural(len(outputs), 'request')} of {len(requests)} answered in {duration:.1f} s; "
                         "the results below count those only")
        if not outputs:
            raise typer.Exit(EXIT_INTERRUPTED)
    m = bm.calculate_metrics(outputs, duration, pcts)
    text, keys = bm.format_serving_result(m, duration, selected, max_concurrency, request_rate)
    print(text)
    errors = [o.error for o in outputs if not o.success]
    for e in errors[:5]:
        common.err_console.print(f"[red]failed request:[/] {e}", highlight=False)
    if save_result:
        result = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "vlite", "model_id": name,
            "tokenizer_id": model, "num_prompts": len(requests),
            "request_rate": request_rate if request_rate != float("inf") else "inf", "burstiness": burstiness,
            "max_concurrency": max_concurrency, "duration": duration, "completed": m.completed, "failed": m.failed,
            "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
            "request_throughput": m.request_throughput, "output_throughput": m.output_throughput,
            "total_token_throughput": m.total_token_throughput,
            "input_lens": [o.prompt_len for o in outputs], "output_lens": [o.output_tokens for o in outputs],
            "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
            "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
            **keys, **({"interrupted": True} if stop.is_set() else {}),
        }
        rate = "inf" if request_rate == float("inf") else f"{request_rate:g}"
        conc = f"-concurrency{max_concurrency}" if max_concurrency else ""
        filename = result_filename or f"vlite-{rate}qps{conc}-{Path(name).name}-{result['date']}.json"
        _write_json(Path(result_dir or ".") / filename, result)
    if stop.is_set():
        raise typer.Exit(EXIT_INTERRUPTED)
    if m.failed:
        raise typer.Exit(1)


def _first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        common.fail(f"could not list the models at {base_url}: {exc}")
