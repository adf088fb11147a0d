"""``vlite leak-check --prometheus`` over a fleet: a verdict per replica (``instance``, or another
label with ``--instance-label``), never an average. The fake API answers with two real recordings
merged into one job of two instances, one leaking (fixtures/prometheus-range-vlite-fleet.json says
how)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from typer.testing import CliRunner

from vlite.diagnostics.targets.base import TargetPlan
from vlite.diagnostics.targets.prometheus_range import PrometheusTarget, judge_range, parse_since

FIX = Path(__file__).parent / "fixtures"
REC = json.loads((FIX / "prometheus-range-vlite-fleet.json").read_text())
CLEAN = next(i for i, v in REC["instances"].items() if v == "CLEAN")
LEAKING = next(i for i, v in REC["instances"].items() if v == "LEAK")


def _transport(rec: dict, label: str = "instance", seen: list | None = None) -> httpx.MockTransport:
    """Answers each call of the recording: by path, and for one replica's calls by the
    ``label="value"`` its selector names (label renamed for --instance-label tests)."""
    def handler(req: httpx.Request) -> httpx.Response:
        params = dict(req.url.params.multi_items())
        text = params.get("match[]", "") + params.get("query", "")
        if seen is not None:
            seen.append((req.url.path, text))
        if req.url.path.startswith("/api/v1/label/") and req.url.path.endswith("/values") and "__name__" not in req.url.path:
            if req.url.path != f"/api/v1/label/{label}/values":
                return httpx.Response(200, json={"status": "success", "data": []})
            return httpx.Response(200, json=rec["calls"][0]["body"])
        for c in rec["calls"][1:]:
            if c["path"] == req.url.path and f'{label}="{c["instance"]}"' in text:
                body = json.loads(json.dumps(c["body"]))
                if label != "instance" and c["path"] == "/api/v1/query_range":
                    for s in body["data"]["result"]:
                        s["metric"][label] = s["metric"].pop("instance")
                return httpx.Response(200, json=body)
        return httpx.Response(404, json={"status": "error", "errorType": "not_found", "error": req.url.path})
    return httpx.MockTransport(handler)


def _judge(label: str = "instance", seen=None, **kw):
    return judge_range("http://prom:9090", REC["job"], parse_since(REC["since"]), end=REC["end"],
                       step_s=REC["step_s"], client=httpx.Client(transport=_transport(REC, label, seen)),
                       on_line=lambda line: None, label=label, **kw)


def test_fleet_range_gives_each_replica_its_own_verdict():
    seen = []
    res = _judge(seen=seen)
    rows = {r["instance"]: r for r in res.instances}
    assert rows[CLEAN]["verdict"] == "CLEAN" and rows[LEAKING]["verdict"] == "LEAK"
    assert res.verdict == "LEAK" and res.exit_code == 1
    assert res.summary.startswith(f"LEAK on 1 of 2 replicas (instance): {LEAKING}: LEAK: 2 blocks of KV cache held")
    assert res.summary.endswith(f"CLEAN: {CLEAN}")
    assert rows[CLEAN]["idle_points"] >= 6
    # each replica's range query names its own instance: nothing is summed across replicas
    queries = [q for path, q in seen if path == "/api/v1/query_range"]
    assert len(queries) == 2 and all(q.count('instance="') == 1 for q in queries)
    assert res.alerts and all(a.message.startswith(f"{LEAKING}: ") for a in res.alerts)
    assert set(res.samples["instance"]) == {CLEAN, LEAKING}


def test_one_replica_alone_and_a_pod_label():
    assert _judge(instance=CLEAN).verdict == "CLEAN"
    alone = _judge(instance=LEAKING)
    assert alone.verdict == "LEAK" and alone.instances is None
    pods = _judge(label="pod")  # the same fleet told apart by a pod label
    assert {r["instance"]: r["verdict"] for r in pods.instances} == {CLEAN: "CLEAN", LEAKING: "LEAK"}
    assert "(pod)" in pods.summary


def test_fleet_report_and_cli(tmp_path):
    from vlite.cli.common import make_console
    from vlite.cli.leak_check_target import run_target

    target = PrometheusTarget("http://prom:9090", REC["job"], REC["since"], step_s=REC["step_s"], end=REC["end"],
                              client=httpx.Client(transport=_transport(REC)))
    code = run_target(target, TargetPlan(), make_console(), tmp_path / "r")
    assert code == 1
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## Replicas (a verdict each)" in md and LEAKING in md and CLEAN in md
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert {r["instance"]: r["verdict"] for r in rep["instances"]} == {CLEAN: "CLEAN", LEAKING: "LEAK"}


def test_instance_label_needs_prometheus():
    from vlite.cli.main import app

    res = CliRunner().invoke(app, ["leak-check", "--instance-label", "pod"])
    assert res.exit_code == 2 and "--instance-label applies to --watch or --prometheus" in res.output
