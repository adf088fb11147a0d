"""Record the Prometheus API answers that ``judge_range`` reads, as the CI fixture of
tests/diagnostics/test_leak_prometheus.py: ``python record_prometheus.py PROM_URL JOB SINCE OUT.json``.
Not in CI (needs a real Prometheus; see prometheus.sh)."""

from __future__ import annotations

import json
import sys
import time

import httpx

from vlite.diagnostics.targets.prometheus_range import judge_range, parse_since


def main() -> None:
    prom, job, since, out = sys.argv[1:5]
    calls = []

    def keep(response: httpx.Response) -> None:
        response.read()
        calls.append({"path": response.request.url.path, "query": dict(response.request.url.params.multi_items()),
                      "body": response.json()})

    end = time.time()
    client = httpx.Client(timeout=60.0, event_hooks={"response": [keep]})
    res = judge_range(prom, job, parse_since(since), end=end, step_s=1.0, on_line=lambda line: None, client=client)
    version = httpx.get(f"{prom}/api/v1/status/buildinfo").json()["data"]["version"]
    json.dump({"recorded_from": f"Prometheus {version} scraping vlite serve every 1 s (tests/interop/prometheus.sh)",
               "job": job, "since": since, "end": end, "step_s": 1.0, "verdict": res.verdict, "summary": res.summary,
               "calls": calls}, open(out, "w"), indent=1)
    print(f"recorded {len(calls)} API answers to {out}: {res.verdict}")


if __name__ == "__main__":
    main()
