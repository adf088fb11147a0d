"""What the request-id census costs `vlite serve` per idle point, in each of its processes.

Starts ``vlite serve --enable-debug-endpoints`` (the engine core in its own process, or with
``--layout thread`` in a thread of the API server), then for each round sends a few requests
(completions and chat, streamed and not), waits for the idle point's censuses (both
``/debug/census`` sides taken again, ``vlite:census_pending_requests`` 0) and records each side's
``elapsed_ms`` and ``objects_visited``. Prints min / median / max per side and writes the rows as
JSON (``--out``).

    .venv/bin/python benchmarks/leak_check/census_cost.py --model tiny --layout core --rounds 12
    .venv/bin/python benchmarks/leak_check/census_cost.py --model SmolLM2-135M-Instruct --layout thread

``--model tiny`` builds the test suite's tiny random Llama (tests/conftest.py) in a temporary
directory. The figures are in docs/benchmarks.md ("Request-id census: cost per idle point").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, i: int) -> None:
    stream = i % 2 == 1
    if i % 3 == 2:
        route, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"say {i}"}]}
    else:
        route, body = "/v1/completions", {"prompt": f"Count to {i}:"}
    body |= {"max_tokens": 8, "temperature": 0.0, "stream": stream}
    with httpx.stream("POST", url + route, json=body, timeout=120) as r:
        r.raise_for_status()
        for _ in r.iter_bytes():
            pass


def _pending(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vlite:census_pending_requests{"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("the server exports no vlite:census_pending_requests")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (the tests' random Llama) or a model for --model")
    ap.add_argument("--layout", choices=("core", "thread"), default="core")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=6, help="requests per round (4 at a time)")
    ap.add_argument("--out", type=Path, default=None, help="JSON rows (default: print only)")
    args = ap.parse_args()

    model = args.model
    if model == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import build_tiny_model_dir

        model = str(build_tiny_model_dir(Path(tempfile.mkdtemp(prefix="census-tiny-"))))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    vlite = str(Path(sys.executable).with_name("vlite"))
    cmd = [vlite, "serve", "--model", model, "--port", str(port), "--enable-debug-endpoints",
           "--uvicorn-log-level", "warning"]
    if args.layout == "thread":
        cmd.append("--disable-frontend-multiprocessing")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
    rows = []
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, "the server exited"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.5)
        last = {"engine": None, "api_server": None}
        for rnd in range(args.rounds):
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: _request(url, i), range(args.requests)))
            t_end = time.time()
            while True:  # both sides taken after this round's requests ended
                doc = httpx.get(url + "/debug/census", timeout=10).json()
                if all(doc[s]["taken_at"] not in (None, last[s]) for s in last) and _pending(url) == 0:
                    break
                assert time.time() < t_end + 30, f"no census after round {rnd}: {doc}"
                time.sleep(0.1)
            for side in last:
                last[side] = doc[side]["taken_at"]
                rows.append({"round": rnd, "process": side, "elapsed_ms": doc[side]["elapsed_ms"],
                             "objects_visited": doc[side]["objects_visited"], "held": len(doc[side]["held"])})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"model {args.model}, layout {args.layout}, {args.rounds} idle points, {args.requests} requests each")
    for side in ("engine", "api_server"):
        ms = [r["elapsed_ms"] for r in rows if r["process"] == side]
        objs = [r["objects_visited"] for r in rows if r["process"] == side]
        print(f"  {side:10s} ms per idle point: min {min(ms):.1f}  median {statistics.median(ms):.1f}  "
              f"max {max(ms):.1f}; objects visited {min(objs)}-{max(objs)}; "
              f"containers held {max(r['held'] for r in rows if r['process'] == side)}")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "layout": args.layout, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
