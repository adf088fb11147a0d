"""Print the vlite / vLLM ratio table from the raw JSON that ``benchmarks/vs_vllm/vs_vllm.sh`` wrote.

    .venv/bin/python benchmarks/vs_vllm/vs_vllm_table.py benchmarks/results/vs_vllm-<stamp> [--json summary.json]

Reads, where present: ``w1_{vlite,vllm}_{float32,bfloat16}.json`` (``output_tokens_per_second``),
``serve_{vlite,vllm}.json`` and ``sat_{vlite,vllm}_<rate>.json`` (vLLM ``bench serve --save-result``
files: ``mean_ttft_ms``, ``mean_tpot_ms``, ``median_itl_ms``, ``p99_ttft_ms``, ``output_throughput``).
With both W1 dtypes present it adds each engine's bfloat16 over its own float32 (the target
asks vlite for 1.6x). Missing files (a subset run, ``--only``) leave their rows out; a folder with no
pairs at all, or no folder, is an error (exit 1). The saturating rate is the first
swept rate at which vLLM's output throughput grows by less than 5% over the previous rate (the
highest rate if it never stops growing).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

GROWTH = 0.05  # below this relative gain, vLLM's output throughput has stopped growing


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _number(value: float) -> str:
    """Two decimals for ratios (below 10), one for tok/s and ms."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def saturating_rate(vllm_by_rate: dict[float, float]) -> float | None:
    """The first rate whose output throughput (tok/s) is < 5% above the previous rate's; else the last rate."""
    rates = sorted(vllm_by_rate)
    for prev, cur in zip(rates, rates[1:]):
        if vllm_by_rate[cur] < vllm_by_rate[prev] * (1 + GROWTH):
            return cur
    return rates[-1] if rates else None


def rows(d: Path) -> list[tuple[str, float, float, str, str]]:
    """(work, vlite, vllm, ratio text, unit) per available measurement."""
    out = []
    w1 = {}
    for dtype in ("float32", "bfloat16"):
        a, b = _load(d / f"w1_vlite_{dtype}.json"), _load(d / f"w1_vllm_{dtype}.json")
        if a and b:
            va, vb = a["output_tokens_per_second"], b["output_tokens_per_second"]
            w1[dtype] = (va, vb)
            out.append((f"W1 offline {dtype}: output tok/s", va, vb, f"{va / vb:.2f}x", "higher is better"))
    if len(w1) == 2:
        # the target asks vlite's bfloat16 for 1.6x its own float32; each engine's own gain, side by side
        (fa, fb), (ba, bb) = w1["float32"], w1["bfloat16"]
        out.append(("W1 bfloat16 over the same engine's float32 (x)", ba / fa, bb / fb, "", "higher is better"))
    a, b = _load(d / "serve_vlite.json"), _load(d / "serve_vllm.json")
    if a and b:
        for key, label in (("mean_ttft_ms", "mean TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"),
                           ("median_itl_ms", "median ITL (ms)"), ("output_throughput", "output tok/s")):
            better = "higher is better" if key == "output_throughput" else "lower is better"
            out.append((f"serving 2 req/s: {label}", a[key], b[key], f"{a[key] / b[key]:.2f}x", better))
    sat = {}
    for p in d.glob("sat_vllm_*.json"):
        rate = re.fullmatch(r"sat_vllm_(.+)\.json", p.name).group(1)
        sat[float(rate)] = json.loads(p.read_text())["output_throughput"]
    rate = saturating_rate(sat)
    if rate is not None:
        tag = f"{rate:g}"
        a, b = _load(d / f"sat_vlite_{tag}.json"), _load(d / f"sat_vllm_{tag}.json")
        if a and b:
            for key, label, better in (("output_throughput", "output tok/s", "higher is better"),
                                       ("p99_ttft_ms", "P99 TTFT (ms)", "lower is better")):
                out.append((f"saturating ({tag} req/s): {label}", a[key], b[key], f"{a[key] / b[key]:.2f}x", better))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = ap.parse_args()
    if not args.dir.is_dir():
        raise SystemExit(f"vs_vllm_table: {args.dir} is not a directory (give a benchmarks/results/vs_vllm-<stamp> folder)")
    table = rows(args.dir)
    if not table:
        raise SystemExit(f"vs_vllm_table: no result pairs in {args.dir} (expected w1_vlite_*.json with "
                         "w1_vllm_*.json, serve_*.json or sat_*.json from benchmarks/vs_vllm/vs_vllm.sh)")
    print("| work | vlite | vLLM | vlite / vLLM | |\n|---|---:|---:|---:|---|")
    for work, a, b, ratio, better in table:
        print(f"| {work} | {_number(a)} | {_number(b)} | {ratio} | {better} |")
    sweep = sorted((float(re.fullmatch(r"sat_(?:vlite|vllm)_(.+)\.json", p.name).group(1)), p)
                   for p in args.dir.glob("sat_*.json"))
    if sweep:
        print("\nrate sweep (output tok/s, P99 TTFT ms):")
        for _rate, p in sweep:
            r = json.loads(p.read_text())
            print(f"  {p.stem:>22}: {r['output_throughput']:8.1f} tok/s  P99 TTFT {r['p99_ttft_ms']:8.1f} ms")
    if args.json:
        args.json.write_text(json.dumps([dict(zip(("work", "vlite", "vllm", "ratio", "better"), r)) for r in table],
                                        indent=1))


if __name__ == "__main__":
    main()
