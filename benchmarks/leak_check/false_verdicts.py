"""False verdicts of the bare `vlite leak-check` on the clean tree: how often a tree with no defect
is called anything but CLEAN, on a quiet machine and beside a busy neighbour, in process and under
`-tp 2`.

Four conditions, each run ``--runs`` times (default 20):

* ``in-process quiet`` / ``in-process neighbour``: `vlite leak-check` with no flags (the default
  model, 60 requests); ``--model`` picks another.
* ``-tp 2 quiet`` / ``-tp 2 neighbour``: `vlite leak-check --model M -tp 2`, where M is the tiny
  random Llama that `mutants.py` builds (4 attention heads, 2 KV heads: `-tp` needs both to divide
  by the rank count; SmolLM2-135M has 9 and 3, so it cannot run under `-tp 2`); ``--tp-model``
  picks another.

"Beside a neighbour" is `benchmarks/throughput/neighbour.py`'s neighbour: one Python process
spinning in ``while True: pass``, started before the condition's runs and killed after them (also
on Ctrl-C). The command runs from a copy of this tree's `vlite` package, as in `mutants.py`, whose
C++ CPU kernels are built once before the first run. Each
run's exit code, verdict word, host-memory verdict (report.json) and the load average before it
are kept; the table counts them per condition. Ctrl-C stops and writes the table of the runs done.

    .venv/bin/python benchmarks/leak_check/false_verdicts.py                  # 80 runs: hours on 2 cores
    .venv/bin/python benchmarks/leak_check/false_verdicts.py --runs 3 --out /tmp/false-verdicts

Writes ``false_verdicts.md`` and ``false_verdicts.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "throughput")]
from mutants import ROOT, build_model, run_leak_check  # noqa: E402 (a sibling script)
from neighbour import NEIGHBOUR, loadavg  # noqa: E402

CONDITIONS = ("in-process quiet", "in-process neighbour", "-tp 2 quiet", "-tp 2 neighbour")
VERDICTS = ("LEAK", "HOST-LEAK", "ZOMBIE", "CLEAN", "INCONCLUSIVE", "INTERRUPTED", "WEDGED", "EMPTY-OUTPUT",
            "OUTPUT-DRIFT")


def verdict_word(text: str) -> str:
    """The verdict word of the command's summary line ("CLEAN", "HOST-LEAK", ...), or "none"."""
    for line in text.splitlines():
        word = line.strip().split(":", 1)[0].split(",", 1)[0]
        if word in VERDICTS:
            return word
    return "none"


def build_kernels(tree: Path) -> float:
    """Build the tree's C++ CPU kernels once, before any timed run (minutes on a busy machine, which
    would otherwise eat the first run's timeout); seconds taken."""
    env = os.environ | {"TORCH_EXTENSIONS_DIR": str(tree.parent / f"torch-extensions-{tree.name}")}
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from vlite.kernels import "
                    "cpu_extension; cpu_extension.load()", str(tree)], env=env, check=False)
    return time.time() - t0


def one_run(tree: Path, args: list[str], out: Path, timeout: int) -> dict:
    """One leak-check; its exit code, verdict, host-memory verdict and seconds."""
    shutil.rmtree(out, ignore_errors=True)
    load = loadavg()
    code, text, secs = run_leak_check(tree, [*args, "--report", str(out)], timeout=timeout)
    try:
        host = (json.loads((out / "report.json").read_text()).get("host_memory") or {}).get("verdict")
    except (OSError, ValueError):
        host = None
    return {"exit": code, "verdict": verdict_word(text), "host_memory": host, "seconds": round(secs, 1),
            "loadavg_before": load, "tail": text[-300:] if code not in (0, 1) else ""}


def run_condition(name: str, args: list[str], tree: Path, work: Path, runs: int, timeout: int,
                  rows: list[dict]) -> None:
    """``runs`` runs of one condition, appended to ``rows`` as they end (so Ctrl-C keeps them)."""
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if name.endswith("neighbour") else None
    try:
        if neighbour:
            time.sleep(1.0)  # let the scheduler see it
        for i in range(runs):
            res = one_run(tree, args, work / f"out-{name.replace(' ', '_')}-{i}", timeout)
            rows.append({"condition": name, "run": i, **res})
            print(f"{name} #{i + 1}: exit {res['exit']} {res['verdict']} (host memory: {res['host_memory']}) "
                  f"[{res['seconds']} s, load {res['loadavg_before']}]", flush=True)
    finally:
        if neighbour:
            neighbour.kill()
            neighbour.wait()


def table(rows: list[dict]) -> tuple[str, dict]:
    """The markdown table and its JSON summary: per condition, runs, verdicts, exit codes, host-memory verdicts."""
    summary = {}
    for name in CONDITIONS:
        mine = [r for r in rows if r["condition"] == name]
        if not mine:
            continue
        secs = sorted(r["seconds"] for r in mine)
        summary[name] = {"runs": len(mine), "verdicts": dict(Counter(r["verdict"] for r in mine)),
                         "exit_codes": dict(Counter(str(r["exit"]) for r in mine)),
                         "host_memory": dict(Counter(str(r["host_memory"]) for r in mine)),
                         "false_host_leak": sum(r["verdict"] == "HOST-LEAK" for r in mine),
                         "not_exit_0": sum(r["exit"] != 0 for r in mine), "median_seconds": secs[len(secs) // 2]}
    lines = ["| condition | runs | CLEAN | HOST-LEAK | exit != 0 | verdicts | exit codes | host-memory verdicts "
             "| median s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        fmt = lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c.items()))  # noqa: E731
        lines.append(f"| {name} | {s['runs']} | {s['verdicts'].get('CLEAN', 0)} | {s['false_host_leak']} | "
                     f"{s['not_exit_0']} | {fmt(s['verdicts'])} | {fmt(s['exit_codes'])} | {fmt(s['host_memory'])} "
                     f"| {s['median_seconds']} |")
    return "\n".join(lines) + "\n", summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--runs", type=int, default=20, help="Runs per condition (default: %(default)s).")
    ap.add_argument("--conditions", nargs="*", default=list(CONDITIONS), choices=CONDITIONS, metavar="CONDITION",
                    help=f"Which conditions (default: all): {', '.join(repr(c) for c in CONDITIONS)}.")
    ap.add_argument("--model", default=None, help="Model of the in-process runs (default: the command's own).")
    ap.add_argument("--tp-model", default=None,
                    help="Model of the -tp 2 runs (default: the tiny random Llama built under --workdir).")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "vlite-false-verdicts"),
                    help="The tree copy, the tiny model and each run's report (default: %(default)s).")
    ap.add_argument("--out", default=".", help="Where false_verdicts.md and .json go (default: here).")
    ap.add_argument("--timeout", type=int, default=300, help="Seconds per run (default: %(default)s).")
    args = ap.parse_args()
    if args.runs < 1:
        sys.exit(f"--runs must be at least 1, got {args.runs}")
    work, out = Path(args.workdir), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    tree = work / "clean"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(ROOT / "vlite", tree / "vlite")
    tp_model = args.tp_model or (str(build_model(work)) if any(c.startswith("-tp") for c in args.conditions) else None)
    print(f"C++ CPU kernels of the tree copy built in {build_kernels(tree):.0f} s (not counted)", flush=True)
    cmd = {"in-process": ["--model", args.model] if args.model else [], "-tp 2": ["--model", str(tp_model), "-tp", "2"]}
    rows: list[dict] = []
    t0 = time.time()
    try:
        for name in args.conditions:
            run_condition(name, cmd[name.rsplit(" ", 1)[0]], tree, work, args.runs, args.timeout, rows)
    except KeyboardInterrupt:
        print(f"interrupted after {len(rows)} runs: writing the table of those", flush=True)
    md, summary = table(rows)
    head = (f"Bare `vlite leak-check` on the clean tree, {args.runs} runs per condition; {len(rows)} runs in "
            f"{time.time() - t0:.0f} s, {time.strftime('%Y-%m-%d %H:%M %Z')}.\n\n")
    (out / "false_verdicts.md").write_text(head + md)
    (out / "false_verdicts.json").write_text(json.dumps({"argv": sys.argv[1:], "summary": summary, "runs": rows,
                                                         "seconds": round(time.time() - t0, 1)}, indent=2) + "\n")
    print("\n" + head + md)


if __name__ == "__main__":
    main()
