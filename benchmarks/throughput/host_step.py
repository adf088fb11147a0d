"""The engine's host (Python) time per step, split into its parts.

N sequences (64, 256, 512 by default) decode together in one ``LLMEngine``: prompts of 8-23
random token ids, greedy, EOS ignored, ``max_tokens`` far beyond the run. After a warm-up
that lasts until every sequence is decoding, ``--steps`` steps are timed. The default model
is a tiny random Llama built in-process (1 layer, hidden 64, vocab 512, SmolLM2's
tokenizer), so the forward is near zero and what is left is the engine's own work;
``--model smollm2`` runs the default model instead.

The split comes from wrapping the engine's methods from outside (nothing in vlite knows it
is timed), so the same script runs against an older commit: each wrapped call's time minus
the wrapped calls inside it (exclusive time) goes to its phase:

  schedule  Scheduler.schedule
  prepare   the runner's input preparation (prepare_input / InputBatch, build_metadata)
  forward   ModelRunner.compute_logits (the model and the logits), less its prepare
  sample    sample_step / argmax_on_device
  update    Scheduler.update_from_output (tokens, stops, forks, finishes)
  output    OutputProcessor.process (RequestOutputs)
  other     the rest of LLMEngine.step (executor dispatch, copy-on-write, glue)

``host`` is the step less its forward. Each figure is the median over the timed steps (so
the phases need not add up to the step's median). ``--clock cpu`` times with the thread's CPU
time instead of wall time: on a loaded machine the wall time of any phase includes the slices
other processes took.

vlite runs its torch paths (no C++ CPU kernel: a fresh worktree would build them, minutes)
on one torch thread unless ``--cpp-kernels`` / ``--threads`` say otherwise.

``--baseline-commit REV`` makes a temporary ``git worktree`` of REV, runs this same file
there in a subprocess (``PYTHONPATH`` at that tree, the same arguments), and prints both
side by side; the worktree is removed afterwards.

    python benchmarks/throughput/host_step.py --baseline-commit ac83c58
    python benchmarks/throughput/host_step.py --num-seqs 256 --steps 50 --json /tmp/host_step.json
    python benchmarks/throughput/host_step.py --model smollm2 --num-seqs 64 --steps 10

Requests are added with ``SamplingParams.output_kind`` FINAL_ONLY where the engine has it
(the consumer of ``LLMEngine.generate``, vLLM's offline default); ``--stream`` asks for an
output of every request at every step (a server streaming every request). A commit without
``output_kind`` builds every output at every step either way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# vlite's switches to its torch paths: no C++ CPU kernel is loaded (or built, in a fresh worktree)
TORCH_PATHS = {"VLITE_ATTENTION_BACKEND": "torch", "VLITE_FUSED_OPS": "torch", "VLITE_CPU_LAYER_LOOP": "python",
               "VLITE_CPU_GEMM": "torch"}
PHASES = ("schedule", "prepare", "forward", "sample", "update", "output", "other")

# (phase, module, attribute path): wrapped where they exist (an older or newer tree may lack some)
HOOKS = (
    ("other", "vlite.engine.llm_engine", "LLMEngine.step"),
    ("schedule", "vlite.engine.core.scheduler", "Scheduler.schedule"),
    ("prepare", "vlite.engine.worker.model_runner", "prepare_input"),
    ("prepare", "vlite.engine.worker.input_batch", "InputBatch.prepare"),
    ("prepare", "vlite.engine.worker.model_runner", "ModelRunner.build_metadata"),
    ("forward", "vlite.engine.worker.model_runner", "ModelRunner.compute_logits"),
    ("sample", "vlite.engine.worker.model_runner", "sample_step"),
    ("sample", "vlite.engine.worker.model_runner", "argmax_on_device"),
    ("update", "vlite.engine.core.scheduler", "Scheduler.update_from_output"),
    ("output", "vlite.engine.output_processor", "OutputProcessor.process"),
)


class PhaseTimer:
    """Exclusive time per phase: a wrapped call's time less that of the wrapped calls inside it."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.stack: list[float] = []
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn):
        perf = self.clock

        def timed(*args, **kwargs):
            t0 = perf()
            self.stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = perf() - t0
                inner = self.stack.pop()
                self.acc[phase] += elapsed - inner
                if self.stack:
                    self.stack[-1] += elapsed

        timed.__wrapped__ = fn
        return timed

    def take(self) -> dict[str, float]:
        acc, self.acc = self.acc, defaultdict(float)
        return dict(acc)


def install_hooks(timer: PhaseTimer) -> list[str]:
    """Wrap every hook this tree has; returns the ones found ("module:attr")."""
    import importlib

    found = []
    for phase, module_name, path in HOOKS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner, _, name = path.rpartition(".")
        target = getattr(module, owner, None) if owner else module
        if target is None or not hasattr(target, name):
            continue
        setattr(target, name, timer.wrap(phase, getattr(target, name)))
        found.append(f"{module_name}:{path}")
    return found


def build_tiny_model(out: Path) -> Path:
    """A tiny random Llama (1 layer, hidden 64, vocab 512) with SmolLM2's tokenizer, saved to ``out``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL).path)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def run_one(checkpoint, num_seqs: int, steps: int, stream: bool, timer: PhaseTimer) -> dict:
    """Time ``steps`` decode steps of ``num_seqs`` sequences; per-step phase times in ms."""
    from vlite.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from vlite.engine.llm_engine import LLMEngine
    from vlite.engine.sampling_params import SamplingParams

    rng = random.Random(0)
    vocab = checkpoint.config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(8 + i % 16)] for i in range(num_seqs)]
    max_tokens = 64 + steps + 64
    block_size = 16
    blocks_per_seq = -(-(24 + max_tokens) // block_size) + 1
    config = EngineConfig(model=str(checkpoint.path), dtype="float32", device="cpu",
                          cache=CacheConfig(block_size=block_size, num_blocks=num_seqs * blocks_per_seq + 16),
                          scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, 24 * num_seqs),
                                                    max_num_seqs=num_seqs))
    engine = LLMEngine(config, checkpoint=checkpoint)
    kind = None
    try:
        from vlite.engine.sampling_params import RequestOutputKind

        kind = RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY
    except ImportError:
        pass
    for prompt in prompts:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if kind is not None:
            params.output_kind = kind
        engine.add_request(None, params, prompt_token_ids=prompt)
    sched = engine.scheduler
    warm = 0
    while sched.waiting or any(s.in_prefill for s in sched.running) or warm < 3:
        warm = warm + 1 if not sched.waiting and not any(s.in_prefill for s in sched.running) else 0
        engine.step()
    timer.take()
    per_step = []
    for _ in range(steps):
        t0 = timer.clock()
        engine.step()
        total = timer.clock() - t0
        parts = timer.take()
        row = {p: parts.get(p, 0.0) * 1e3 for p in PHASES}
        row["step"] = total * 1e3
        row["host"] = row["step"] - row["forward"]
        per_step.append(row)
    assert len(sched.running) == num_seqs, "a sequence ended during the timed steps"
    medians = {k: statistics.median(r[k] for r in per_step) for k in per_step[0]}
    return {"num_seqs": num_seqs, "steps": steps, "median_ms": medians}


def measure(args) -> dict:
    """Run every ``--num-seqs`` in this process (whichever vlite is on the path)."""
    import torch

    from vlite.engine.worker.loader import load_checkpoint

    torch.set_num_threads(args.threads) if args.threads else None
    timer = PhaseTimer(time.thread_time if args.clock == "cpu" else time.perf_counter)
    hooks = install_hooks(timer)
    if args.model:
        checkpoint = load_checkpoint(args.model)
    else:
        model_dir = Path(args.model_dir) if args.model_dir else build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
        checkpoint = load_checkpoint(str(model_dir))
    results = [run_one(checkpoint, n, args.steps, args.stream, timer) for n in args.num_seqs]
    import vlite
    from vlite.kernels import cpu_extension

    # the C++ CPU kernels (argmax, attention) or torch's: a build by another process can leave one run without them
    kernels = "C++" if cpu_extension.loaded() is not None else "torch"
    return {"tree": str(Path(vlite.__file__).resolve().parents[1]), "hooks": hooks, "kernels": kernels,
            "results": results}


def git(*cmd: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *cmd], check=True, capture_output=True, text=True).stdout.strip()


def run_baseline(rev: str, argv: list[str], model_dir: str | None) -> dict:
    """Run this file against a temporary worktree of ``rev``; returns its measurements."""
    sha = git("rev-parse", "--short", rev)
    tmp = Path(tempfile.mkdtemp(prefix="host_step_"))
    tree, out = tmp / "tree", tmp / "out.json"
    git("worktree", "add", "--detach", str(tree), sha)
    try:
        child = [sys.executable, str(Path(__file__).resolve()), *argv, "--json", str(out), "--_child"]
        if model_dir:
            child += ["--model-dir", model_dir]
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run(child, check=True, cwd=tree, env=env)
        data = json.loads(out.read_text())
    finally:
        git("worktree", "remove", "--force", str(tree))
    data["rev"] = sha
    return data


def strip_args(argv: list[str]) -> list[str]:
    """``argv`` without --baseline-commit / --json (and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--baseline-commit", "--json"):
            skip = True
            continue
        if a.startswith(("--baseline-commit=", "--json=")):
            continue
        out.append(a)
    return out


def print_table(runs: list[tuple[str, dict]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("seqs", "commit", "kernels", "step", "host", *PHASES):
        table.add_column(col, justify="right")
    by_n: dict[int, list] = defaultdict(list)
    for label, data in runs:
        for r in data["results"]:
            by_n[r["num_seqs"]].append((label, data.get("kernels", "?"), r["median_ms"]))
    for n, rows in by_n.items():
        for label, kernels, m in rows:
            table.add_row(str(n), label, kernels, f"{m['step']:.2f}", f"[bold]{m['host']:.2f}[/]",
                          *(f"{m[p]:.2f}" for p in PHASES))
    Console(width=max(Console().width, 120)).print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256, 512], help="decoding sequences per run")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run (after the warm-up)")
    ap.add_argument("--model", default=None, help="a model (e.g. smollm2) instead of the tiny random Llama")
    ap.add_argument("--stream", action="store_true", help="an output of every request at every step")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the forward is near zero, and OpenMP barriers on a busy "
                         "machine would add noise; 0: torch's default)")
    ap.add_argument("--cpp-kernels", action="store_true",
                    help="let vlite load its C++ CPU kernels (default: torch paths in both trees, so that "
                         "no tree builds them and both run the same ops)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: elapsed time; cpu: this thread's CPU time (host work on a loaded machine, "
                         "where wall time counts the time slices other processes take; the forward's "
                         "other threads are not counted)")
    ap.add_argument("--baseline-commit", default=None, help="also run this commit, side by side")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model and args.model.lower() == "smollm2":
        args.model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    if not args.cpp_kernels:  # before vlite is imported; the baseline's subprocess inherits them
        os.environ.update(TORCH_PATHS)
    if args._child:
        Path(args.json).write_text(json.dumps(measure(args)))
        return
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()
    model_dir = None
    if not args.model:  # one tiny model for both trees
        sys.path.insert(0, str(REPO))
        model_dir = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="host_step_model_")) / "tiny"))
        args.model_dir = model_dir
    runs = []
    if args.baseline_commit:
        runs.append((git("rev-parse", "--short", args.baseline_commit),
                     run_baseline(args.baseline_commit, strip_args(sys.argv[1:]), model_dir)))
    dirty = "+" if git("status", "--porcelain", "--untracked-files=no") else ""
    runs.append((git("rev-parse", "--short", "HEAD") + dirty, measure(args)))
    load_after = os.getloadavg()
    title = (f"host time per step, ms of {args.clock} time (median of {args.steps} steps; "
             f"{args.model or 'tiny Llama, 1 layer'}; "
             f"{'stream' if args.stream else 'final-only'} outputs; {started}; "
             f"load average {load[0]:.2f} -> {load_after[0]:.2f})")
    print_table(runs, title)
    if args.json:
        Path(args.json).write_text(json.dumps({"started": started, "load_before": load, "load_after": load_after,
                                               "argv": sys.argv[1:], "runs": [{"label": lb, **d} for lb, d in runs]},
                                              indent=2))


if __name__ == "__main__":
    main()
