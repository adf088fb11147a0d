"""Compare two lm-evaluation-harness runs (``--log_samples`` output folders): every
loglikelihood of the ``vlite_mc`` task must agree within ``--tol`` (nats), and the greedy
``vlite_gen`` answers are listed side by side. Exit 1 on a mismatch.

    python benchmarks/quality/compare_lm_eval.py OUT_A OUT_B [--tol 1e-3]

Format: lm-eval's ``samples_<task>_<time>.jsonl``, one line per document; ``resps`` holds, per
request (one per choice), the model's ``[loglikelihood, is_greedy]`` (lm-eval 0.4).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def samples(out: Path, task: str) -> dict[int, dict]:
    """{doc_id: sample} of ``task`` under an lm-eval output folder.

    Raises:
        FileNotFoundError: no samples file for ``task``.
    """
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no samples_{task}_*.jsonl under {out}")
    return {s["doc_id"]: s for s in map(json.loads, files[-1].read_text().splitlines())}


def loglikelihoods(sample: dict) -> list[float]:
    """The loglikelihood of each choice (nats)."""
    return [float(resp[0][0]) for resp in sample["resps"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--tol", type=float, default=1e-3)
    args = ap.parse_args()
    a, b = samples(args.a, "vlite_mc"), samples(args.b, "vlite_mc")
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst, n = 0.0, 0
    for doc_id in sorted(a):
        la, lb = loglikelihoods(a[doc_id]), loglikelihoods(b[doc_id])
        assert len(la) == len(lb)
        for x, y in zip(la, lb):
            worst, n = max(worst, abs(x - y)), n + 1
        print(f"doc {doc_id}: " + "  ".join(f"{x:9.4f}/{y:9.4f}" for x, y in zip(la, lb)))
    acc_a = sum(a[d]["acc"] for d in a) / len(a)
    acc_b = sum(b[d]["acc"] for d in b) / len(b)
    print(f"vlite_mc: {n} loglikelihoods, max |difference| = {worst:.2e} nats (tolerance {args.tol:g}); "
          f"acc {acc_a:.3f} vs {acc_b:.3f}")
    ga, gb = samples(args.a, "vlite_gen"), samples(args.b, "vlite_gen")
    same = sum(ga[d]["resps"][0][0] == gb[d]["resps"][0][0] for d in ga)
    for d in sorted(ga):
        print(f"gen doc {d}: {ga[d]['resps'][0][0]!r} / {gb[d]['resps'][0][0]!r}")
    print(f"vlite_gen: {same}/{len(ga)} greedy generations identical; exact_match "
          f"{sum(ga[d]['exact_match'] for d in ga) / len(ga):.3f} vs {sum(gb[d]['exact_match'] for d in gb) / len(gb):.3f}")
    if worst > args.tol:
        print(f"FAIL: loglikelihoods differ by {worst:.2e} > {args.tol:g}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
