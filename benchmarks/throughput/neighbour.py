"""W1's shape, for vlite and for transformers, on a quiet machine and beside one busy process.

Runs ``vlite bench throughput --backend hf --hf-modes static`` (vlite, then transformers' static
batch on the same prompts in the same process) twice: once as the machine is, once beside a
neighbour this script starts, one Python process spinning in ``while True: pass`` (one CPU-bound
thread, killed at the end, also on Ctrl-C). Prints the four output-token rates, each engine's
slowdown (quiet / beside the neighbour) and the load average (``/proc/loadavg``) before each run,
since a "quiet" run on a shared machine is only as quiet as its load says.

    .venv/bin/python benchmarks/throughput/neighbour.py                        # a few minutes; more on a loaded machine
    .venv/bin/python benchmarks/throughput/neighbour.py --env OMP_NUM_THREADS=1 --env OMP_WAIT_POLICY=ACTIVE
    .venv/bin/python benchmarks/throughput/neighbour.py --num-prompts 64 --output-len-range 16:256  # W1 in full

The default is W1 (docs/benchmarks.md) cut short: 8 prompts of 32-256 tokens, 16-32 output
tokens, seed 0. ``--env KEY=VALUE`` (repeatable) sets a variable for both runs, e.g. to compare
thread settings (``KEY=`` removes one). The figures are in docs/benchmarks.md ("Beside other work").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NEIGHBOUR = "while True: pass"


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages and runnable/total tasks, as /proc/loadavg has them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:4])
    except OSError:
        return "unknown"


def run_bench(args: argparse.Namespace, env: dict[str, str]) -> dict:
    """One ``vlite bench throughput --backend hf`` run; returns its JSON (output tok/s of vlite and
    of the static batch) with the load average before it and its wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [args.vlite, "bench", "throughput", "--backend", "hf", "--hf-modes", "static", "--no-progress",
               "--num-prompts", str(args.num_prompts), "--input-len-range", args.input_len_range,
               "--output-len-range", args.output_len_range, "--seed", str(args.seed), "--model", args.model,
               "--dtype", args.dtype, "--output-json", str(out)]
        load, t0 = loadavg(), time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed with exit {proc.returncode}:\n{proc.stderr[-2000:]}")
        data = json.loads(out.read_text())
        threads = [line for line in proc.stderr.splitlines() if line.startswith("CPU threads:")]
    return {"loadavg_before": load, "wall_s": round(time.perf_counter() - t0, 1),
            "vlite_output_tok_s": data["output_tokens_per_second"],
            "hf_output_tok_s": data["baselines"]["hf-static"]["output_tokens_per_second"],
            "threads_line": threads[0].strip() if threads else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len-range", default="32:256")
    parser.add_argument("--output-len-range", default="16:32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for both runs (repeatable; KEY= removes KEY)")
    parser.add_argument("--vlite", default=str(Path(sys.executable).with_name("vlite")),
                        help="the vlite command (default: the one beside this Python)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()

    env = dict(os.environ)
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            sys.exit(f"--env takes KEY=VALUE, got {item!r}")
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    shown = " ".join(args.env) or "(environment as is)"
    print(f"W1 cut short: {args.num_prompts} prompts, input {args.input_len_range}, output {args.output_len_range}, "
          f"{args.dtype}; {shown}; {os.cpu_count()} CPUs", flush=True)

    quiet = run_bench(args, env)
    print(f"quiet      (load {quiet['loadavg_before']}): vlite {quiet['vlite_output_tok_s']:.1f}, "
          f"transformers {quiet['hf_output_tok_s']:.1f} output tok/s ({quiet['wall_s']} s)", flush=True)
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
    try:
        time.sleep(1.0)  # let the scheduler see it
        busy = run_bench(args, env)
    finally:
        neighbour.kill()
        neighbour.wait()
    print(f"neighbour  (load {busy['loadavg_before']}): vlite {busy['vlite_output_tok_s']:.1f}, "
          f"transformers {busy['hf_output_tok_s']:.1f} output tok/s ({busy['wall_s']} s)")
    slow_v = quiet["vlite_output_tok_s"] / busy["vlite_output_tok_s"]
    slow_h = quiet["hf_output_tok_s"] / busy["hf_output_tok_s"]
    print(f"slowdown beside one busy process: vlite {slow_v:.2f}x, transformers {slow_h:.2f}x "
          f"(vlite / transformers: {slow_v / slow_h:.2f})")
    if quiet["threads_line"]:
        print(f"threads: {quiet['threads_line']}")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "env": args.env, "quiet": quiet, "neighbour": busy,
                                         "slowdown_vlite": slow_v, "slowdown_hf": slow_h,
                                         "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
