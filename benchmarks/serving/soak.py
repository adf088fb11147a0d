"""Soak `vlite serve`: many requests with client cancellations and timeouts; does memory stay flat?

Starts ``vlite serve`` on a loopback port (a tiny random Llama with SmolLM2's tokenizer by
default, built in a temporary folder, so the run measures the server and not the model; or
``--model``), then sends ``--num-requests`` requests, ``--concurrency`` at a time:

* 70% complete normally (half streamed, half not);
* 30% are cut short by the client: half are streams closed after 1-3 chunks (a disconnect),
  half are non-streaming requests whose client times out after 50-200 ms.

Every 1,000 finished requests it prints the server's RSS (psutil). At the end it checks the
drain invariant on /metrics (no request running or waiting, every block free or cached,
``kv_cache_usage_perc`` 0, and ``request_success_total`` counting every request the engine
took) and fits the RSS slope (MB per 1,000 requests, least squares) over the last 5,000
requests. Exit code 1 if the invariant fails.

With ``--tracemalloc`` the server runs in this process (uvicorn in a thread) under tracemalloc,
and the Python allocations that grew over the last 5,000 requests are listed by source line: the
account of what grows.

    python benchmarks/serving/soak.py                          # 10,000 requests, about 2.5 min on 2 cores
    python benchmarks/serving/soak.py --tracemalloc            # the same, with the account (slower)
    python benchmarks/serving/soak.py --num-requests 3000 --model SmolLM2-135M-Instruct

Not part of CI. The measured numbers are in docs/serve.md ("Soak").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import httpx
import numpy as np
import psutil

from vlite.diagnostics.readers.metrics_text import labelled_values

VLITE = str(Path(sys.executable).parent / "vlite")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_tiny_model(out: Path) -> Path:
    """A 2-layer random Llama (hidden 64) with SmolLM2's tokenizer, as the test suite builds it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL).path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.3, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(cfg).eval().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(base_url: str) -> dict[str, float]:
    """/metrics as {name or name{finished_reason}: value}."""
    return labelled_values(httpx.get(base_url + "/metrics", timeout=30).text)


def drained(m: dict[str, float]) -> bool:
    return (m["vlite:num_requests_running"] == 0 and m["vlite:num_requests_waiting"] == 0
            and m["vlite:num_free_blocks"] + m["vlite:num_cached_blocks"] == m["vlite:num_total_blocks"]
            and m["vlite:kv_cache_usage_perc"] == 0)


def finished_total(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("vlite:request_success_total{"))


async def one_request(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """Send request ``i``; returns how it ended: ok, disconnect, timeout, or http-<status>."""
    prompt = f"Soak request {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
    body = {"prompt": prompt, "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.8]),
            "ignore_eos": True}
    kind = rng.random()
    if kind < 0.15:  # stream closed by the client after 1-3 chunks
        chunks = rng.randint(1, 3)
        async with client.stream("POST", "/v1/completions", json=dict(body, stream=True, max_tokens=200)) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= chunks:
                    return "disconnect"
        return "ok"
    if kind < 0.30:  # non-streaming client that gives up
        try:
            r = await client.post("/v1/completions", json=dict(body, max_tokens=200),
                                  timeout=httpx.Timeout(30, read=rng.uniform(0.05, 0.2)))
            return "ok" if r.status_code == 200 else f"http-{r.status_code}"
        except httpx.ReadTimeout:
            return "timeout"
    if kind < 0.65:
        async with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
            async for _ in r.aiter_lines():
                pass
            return "ok" if r.status_code == 200 else f"http-{r.status_code}"
    r = await client.post("/v1/completions", json=body)
    return "ok" if r.status_code == 200 else f"http-{r.status_code}"


WORDS = ("paged attention block table slot mapping prefill decode preemption prefix cache fork copy "
         "write sequence request token batch scheduler sampler kernel memory leak free list").split()


async def soak(base_url: str, proc: psutil.Process, num_requests: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    snapshots: list[tracemalloc.Snapshot] = []
    outcomes: dict[str, int] = {}
    rss: list[tuple[int, float]] = [(0, proc.memory_info().rss / 1e6)]
    done = 0
    next_i = 0
    t0 = time.monotonic()
    print(f"{'requests':>9} {'RSS MB':>8} {'elapsed s':>9}  outcomes", flush=True)
    print(f"{0:>9} {rss[0][1]:>8.1f} {0:>9.1f}", flush=True)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        async def worker() -> None:
            nonlocal done, next_i
            while next_i < num_requests:
                i = next_i
                next_i += 1
                try:
                    outcome = await one_request(client, random.Random(rng.random() + i), i)
                except httpx.TransportError as exc:
                    outcome = f"transport-{type(exc).__name__}"
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                done += 1
                if tracemalloc.is_tracing() and done == num_requests - 5000:
                    snapshots.append(tracemalloc.take_snapshot())
                if done % 1000 == 0:
                    mb = proc.memory_info().rss / 1e6
                    rss.append((done, mb))
                    print(f"{done:>9} {mb:>8.1f} {time.monotonic() - t0:>9.1f}  {dict(sorted(outcomes.items()))}",
                          flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    if snapshots:
        snapshots.append(tracemalloc.take_snapshot())
    return {"outcomes": outcomes, "rss": rss, "seconds": time.monotonic() - t0, "snapshots": snapshots}


def start_in_process(model: str, num_blocks: int, port: int):
    """``vlite serve`` in this process: the app and uvicorn (with vlite's protocol) in a thread."""
    import uvicorn

    from vlite.engine.config import CacheConfig, EngineConfig
    from vlite.engine.llm_engine import LLMEngine
    from vlite.entrypoints.api_server import create_app
    from vlite.entrypoints.header_timeout import with_header_timeout
    from vlite.entrypoints.state import ServerSettings

    config = EngineConfig(model=model, cache=CacheConfig(num_blocks=num_blocks))
    app = create_app(ServerSettings(), lambda: LLMEngine(config))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=with_header_timeout(10.0)))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    return server, thread


def wait_ready(base_url: str, alive, timeout: float = 300) -> bool:
    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return False


def finish(args, base_url: str, proc: psutil.Process) -> int:
    before = read_metrics(base_url)
    result = asyncio.run(soak(base_url, proc, args.num_requests, args.concurrency, args.seed))
    deadline = time.monotonic() + 60
    while not drained(m := read_metrics(base_url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return report(args, result, before, m)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--model", default=None, help="model for vlite serve (default: a tiny random Llama)")
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tracemalloc", action="store_true",
                    help="run the server in this process and list what Python allocations grew over the last 5,000")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="vlite-soak-") as tmp:
        model = args.model or str(build_tiny_model(Path(tmp) / "tiny"))
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        log_path = Path(tmp) / "server.log"
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        if args.tracemalloc:
            tracemalloc.start(8)
            server, thread = start_in_process(model, args.num_blocks, port)
            try:
                if not wait_ready(base_url, thread.is_alive):
                    return 1
                return finish(args, base_url, psutil.Process())
            finally:
                server.should_exit = True
                thread.join(timeout=30)
        with open(log_path, "wb") as log:
            server = subprocess.Popen([VLITE, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                                       "--num-blocks", str(args.num_blocks), "--uvicorn-log-level", "warning"],
                                      stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                if not wait_ready(base_url, lambda: server.poll() is None):
                    print(log_path.read_text()[-3000:])
                    return 1
                return finish(args, base_url, psutil.Process(server.pid))
            finally:
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    server.kill()


def report(args, result: dict, before: dict[str, float], m: dict[str, float]) -> int:
    outcomes = result["outcomes"]
    n = sum(outcomes.values())
    engine_took = n - sum(v for k, v in outcomes.items() if k.startswith("http-4"))
    counted = finished_total(m) - finished_total(before)
    ok_drain = drained(m)
    print(f"\n{n} requests in {result['seconds']:.0f} s ({n / result['seconds']:.1f} req/s), "
          f"concurrency {args.concurrency}: {dict(sorted(outcomes.items()))}")
    print(f"drain invariant: running {m['vlite:num_requests_running']:.0f}, waiting "
          f"{m['vlite:num_requests_waiting']:.0f}, free {m['vlite:num_free_blocks']:.0f} + cached "
          f"{m['vlite:num_cached_blocks']:.0f} of {m['vlite:num_total_blocks']:.0f} blocks, kv_cache_usage_perc "
          f"{m['vlite:kv_cache_usage_perc']:.3f} -> {'HOLDS' if ok_drain else 'BROKEN'}")
    # A client that gives up before its handler queued the request never reaches the engine, so
    # the counter may be a little below the number of requests sent; it can never be above.
    print(f"request_success_total grew by {counted:.0f} for {engine_took} requests sent and not refused "
          f"({'consistent' if counted <= engine_took else 'MISMATCH: counted more than sent'})")
    rss = result["rss"]
    tail = [(k, mb) for k, mb in rss if k >= n - 5000 and k > 0]
    if len(tail) >= 3:
        x = np.array([k for k, _ in tail], dtype=float) / 1000
        y = np.array([mb for _, mb in tail])
        slope = float(np.polyfit(x, y, 1)[0])
        print(f"RSS slope over requests {tail[0][0]}-{tail[-1][0]}: {slope:+.2f} MB per 1,000 requests "
              f"(RSS {rss[0][1]:.0f} MB at start, {rss[-1][1]:.0f} MB at the end)")
    if result["snapshots"]:
        first, last = result["snapshots"]
        stats = last.compare_to(first, "lineno")
        grown = sum(st.size_diff for st in stats)
        print(f"\ntracemalloc: Python allocations grew by {grown / 1e6:+.2f} MB over the last 5,000 requests; "
              "largest growth by source line:")
        for st in stats[:12]:
            frame = st.traceback[0]
            print(f"  {st.size_diff / 1e6:+8.3f} MB {st.count_diff:+8d} blocks  {frame.filename}:{frame.lineno}")
    return 0 if ok_drain and counted <= engine_took else 1


if __name__ == "__main__":
    sys.exit(main())
