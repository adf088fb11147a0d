"""What a huge prompt costs a running `vlite serve`.

Sends ``--repeats`` prompts of ``--chars`` characters (default 6.3 MB, under the 8 MiB body
limit, far more tokens than any context) to /v1/completions, one after another, while a thread
polls GET /health every 20 ms. Prints each request's status and time, the slowest /health, and
the server's RSS (psutil, by --pid) before and after.

    vlite serve --port 8000 &
    python benchmarks/serving/serve_big_prompt.py --base-url http://127.0.0.1:8000 --pid $!

Numbers in docs/serve.md ("Limits"). Not part of CI.
"""

from __future__ import annotations

import argparse
import threading
import time

import httpx
import psutil


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--pid", type=int, required=True, help="the server's process id (for RSS)")
    ap.add_argument("--chars", type=int, default=6_300_000, help="prompt length in characters")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    proc = psutil.Process(args.pid)
    prompt = ("word " * (args.chars // 5 + 1))[: args.chars]
    latencies: list[float] = []
    stop = threading.Event()

    def poll_health() -> None:
        with httpx.Client(base_url=args.base_url, timeout=60) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                c.get("/health")
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)

    rss0 = proc.memory_info().rss
    watcher = threading.Thread(target=poll_health, daemon=True)
    watcher.start()
    with httpx.Client(base_url=args.base_url, timeout=300) as c:
        for i in range(args.repeats):
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            print(f"request {i}: {r.status_code} in {time.perf_counter() - t0:.2f} s: {r.text[:110]}")
    stop.set()
    watcher.join(timeout=60)
    time.sleep(1.0)
    rss1 = proc.memory_info().rss
    print(f"prompt: {args.chars} characters; /health: {len(latencies)} polls, max {max(latencies) * 1000:.0f} ms, "
          f"median {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms")
    print(f"server RSS: {rss0 / 2**20:.0f} MiB before, {rss1 / 2**20:.0f} MiB after ({(rss1 - rss0) / 2**20:+.0f} MiB)")


if __name__ == "__main__":
    main()
