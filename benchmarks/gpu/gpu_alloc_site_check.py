"""Proof for `leak-check --trace-gpu-allocations`: plant the mutant
"tensor-kept-per-request-on-device" (benchmarks/leak_check/mutants.py) in a copy of vlite, run the
in-process leak check on it with the option, and check that the report names the planted line's
allocation site (vlite/engine/worker/model_runner.py, in compute_logits) among the CUDA sites
whose live bytes grew, with its bytes per request.

    python benchmarks/gpu/gpu_alloc_site_check.py --model CKPT [--device cuda] [--workdir DIR] [--json OUT]

Exit 0: on CUDA the site was named; on the CPU (benchmarks/gpu/gpu_check.sh --dry-run) the report
said in one line that nothing could be recorded, and the run still gave its verdict. Exit 1
otherwise. Step 5b of benchmarks/gpu/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "leak_check"))
import mutants  # noqa: E402 - benchmarks/leak_check/mutants.py, a script beside this one

MUTANT = "tensor-kept-per-request-on-device"
SITE = ("vlite/engine/worker/model_runner.py:", " in compute_logits")  # the planted line's innermost frame


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--model", required=True, help="A checkpoint directory (gpu_check.sh's SmolLM2-shape float32).")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--workdir", default=None, help="Where the patched copy and the report go (default: a temp dir).")
    ap.add_argument("--json", default=None, help="Also write the result here.")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vlite-gpu-site-"))
    m = next(m for m in mutants.MUTANTS if m.name == MUTANT)
    tree = work / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(mutants.ROOT / "vlite", tree / "vlite")
    src = tree / "vlite" / m.path
    text = src.read_text()
    if text.count(m.old) != 1:
        print(f"mutant {MUTANT}: the patched text occurs {text.count(m.old)} times in {m.path}")
        return 1
    src.write_text(text.replace(m.old, m.new))
    planted_line = text[:text.index(m.old)].count("\n") + 5  # the `.append(...clone())` line of the patch
    if args.device == "cpu":  # the copy would build its own C++ CPU kernels (minutes): the torch path instead
        os.environ.update(VLITE_FUSED_OPS="torch", VLITE_CPU_LAYER_LOOP="python", VLITE_CPU_GEMM="torch")
    rep = work / "report"
    shutil.rmtree(rep, ignore_errors=True)
    code, out, secs = mutants.run_leak_check(tree, ["--model", args.model, "--device", args.device,
                                                    "--num-requests", str(args.num_requests), "--abort-rate", "0.3",
                                                    "--abort-mode", "mix", "--num-blocks", "512",
                                                    "--trace-gpu-allocations", "--report", str(rep)], timeout=600)
    try:
        report = json.loads((rep / "report.json").read_text())
    except (OSError, ValueError):
        print(f"no report (exit {code}, {secs:.0f} s):\n{out[-3000:]}")
        return 1
    g = report.get("gpu_allocations") or {}
    sites = g.get("sites") or []
    named = next((s for s in sites if s["site"].split(" <- ")[0].startswith(SITE[0])
                  and s["site"].split(" <- ")[0].endswith(SITE[1])), None)
    result = {"device": args.device, "exit": code, "verdict": report.get("verdict"), "seconds": round(secs, 1),
              "planted_line": f"vlite/engine/worker/model_runner.py:{planted_line}", "named": named,
              "unavailable": g.get("unavailable"), "sites": sites[:5], "from_requests": g.get("from_requests"),
              "to_requests": g.get("to_requests")}
    print(f"leak-check --trace-gpu-allocations on {MUTANT} ({args.device}): exit {code}, verdict "
          f"{report.get('verdict')}, {secs:.0f} s")
    for s in sites[:5]:
        print(f"  +{s['bytes_diff'] / 1024:.1f} KiB, {s['bytes_per_request']:.0f} B/request: {s['site']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.device == "cuda":
        ok = named is not None
        print(f"{'PASS' if ok else 'FAIL'}: the planted allocation site (model_runner.py:{planted_line}, "
              f"compute_logits) {'named, ' + str(named['bytes_per_request']) + ' B/request' if ok else 'not named'}")
        if not ok and g.get("unavailable"):
            print(f"  (not recorded: {g['unavailable']})")
        return 0 if ok else 1
    ok = bool(g.get("unavailable")) and "no CUDA device" in g["unavailable"]
    print(f"{'PASS' if ok else 'FAIL'} (dry run on the CPU): GPU allocation sites: {g.get('unavailable')}; verdict "
          f"{report.get('verdict')} (exit {code}). This checks the no-CUDA line only: on the CPU the mutant is the "
          f"host checks' to catch (mutants.py's default 60 requests: HOST-LEAK, docs/leak-check/replay.md)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
