"""Metric label cardinality: a /metrics family whose series count grows with
requests served is a LEAK named by the family and the label that grows; a fixed label set that
fills up in the first waves is not. Recorded pages and fake servers only."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from fake_http import QuietHandler, ServerPool

from vlite.diagnostics.checks.cardinality import cardinality_check, series_counts
from vlite.diagnostics.targets.blackbox import run_blackbox, split_waves
from vlite.diagnostics.targets.connection import connect
from vlite.diagnostics.targets.http import census_from_metrics
from vlite.diagnostics.workload.sources import synthetic_workload

FIX = Path(__file__).parent / "fixtures"


def test_series_are_label_sets_with_a_histograms_buckets_counted_once():
    counts = series_counts((FIX / "vllm-0.32.0-cpu-after-abort.prom").read_text())
    n, labels = counts["vllm:e2e_request_latency_seconds"]
    assert n == 1 and set(labels) == {"engine", "model_name"}  # buckets, _sum and _count: one series
    n, labels = counts["vllm:request_success"]
    assert n == labels["finished_reason"] > 1
    assert series_counts("<html>not metrics</html>") == {}


def _page(finished: dict[str, int], stops: list[str]) -> str:
    lines = ["# TYPE vlite:request_success_total counter"]
    lines += [f'vlite:request_success_total{{finished_reason="{r}",model_name="m"}} {v}' for r, v in finished.items()]
    lines += ["# TYPE vlite:stop_string_hits_total counter"]
    lines += [f'vlite:stop_string_hits_total{{model_name="m",stop={json.dumps(s)}}} 1' for s in stops]
    lines += ["# TYPE vlite:num_requests_running gauge", 'vlite:num_requests_running{model_name="m"} 0']
    return "\n".join(lines) + "\n"


def test_a_family_labelled_by_client_values_grows_with_requests_and_is_named_with_its_label():
    # 5 idle points, 8 requests per wave, each with a stop string of its own
    points = [(8 * i, series_counts(_page({"stop": i, "length": i}, [f"stop-{k}" for k in range(8 * i)])))
              for i in range(5)]
    check = cardinality_check(points)
    assert check["verdict"] == "LEAK"
    [g] = check["growing"]
    assert (g["family"], g["label"]) == ("vlite:stop_string_hits", "stop")
    assert (g["series_first"], g["series_last"], g["series_per_request"]) == (8, 32, 1.0)
    few = [(n, c) for n, c in points[:4]]  # 16 new series: within what a fixed label set may fill late
    assert cardinality_check(few)["verdict"] == "CLEAN"


def test_a_fixed_label_set_filling_up_in_the_first_waves_is_clean():
    reasons = ["stop", "length", "abort", "error", "stop", "stop"]
    points = [(4 * i, series_counts(_page({r: 1 for r in reasons[:min(i + 1, 4)]}, ["\n\n"] if i else [])))
              for i in range(6)]
    assert cardinality_check(points)["verdict"] == "CLEAN"
    assert cardinality_check(points[:3])["verdict"] == "too few idle points"


def test_census_overdue_is_read_from_metrics_with_what_blocks_it():
    page = ('vlite:census_pending_requests{model_name="m"} 3\n'
            'vlite:census_overdue_seconds{blocked_by="requests_in_flight",model_name="m",process="api_server"} 4.5\n')
    census = census_from_metrics(page)
    assert census["held"] == [] and census["overdue"] == [
        {"process": "api_server", "seconds": 4.5, "blocked_by": ["requests_in_flight"]}]


class _FakeVllm(QuietHandler):
    """A fake vLLM: KV gauges always at 0 (no KV leak), and a counter labelled by each request's
    stop string when ``label_by_stop`` (the planted defect), else by its finish reason."""

    label_by_stop = False
    stops: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's spelling
        if self.path != "/metrics":
            return self.reply(200, b"ok" if self.path == "/health" else b"{}")
        page = ('vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
                'vllm:num_requests_running{engine="0"} 0.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'
                'vllm:kv_cache_usage_perc{engine="0"} 0.0\n# TYPE vllm:request_stop_total counter\n')
        labels = sorted(set(self.stops)) if self.label_by_stop else ["length"] * bool(self.stops)
        page += "".join(f'vllm:request_stop_total{{engine="0",stop={json.dumps(v)}}} 1.0\n' for v in labels)
        self.reply(200, page)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("prompt") != "probe":
            type(self).stops.append(str(body.get("prompt"))[:12])  # a client-chosen value
        self.reply(200, json.dumps({"choices": [{"text": "x", "finish_reason": "length"}], "usage": {}}),
                   "application/json")


@pytest.fixture
def fake_vllm():
    pool = ServerPool()
    yield lambda label_by_stop: pool.start(type("H", (_FakeVllm,), {"label_by_stop": label_by_stop, "stops": []}))
    pool.close()


@pytest.mark.parametrize("label_by_stop", [True, False], ids=["labelled-by-client-value", "fixed-labels"])
def test_blackbox_names_a_family_whose_series_grow_with_requests(fake_vllm, label_by_stop):
    specs = [dataclasses.replace(s, prompt=f"req-{i:03d} {s.prompt}")  # distinct values, as a stop string per client
             for i, s in enumerate(synthetic_workload(30, input_len=(8, 8), output_len=(4, 4), seed=3))]
    res = run_blackbox(connect(fake_vllm(label_by_stop)), split_waves(specs, 6), drain_timeout_s=5,
                       bisect_budget_s=0, server_pid=None)
    if label_by_stop:
        assert res.verdict == "LEAK", res.summary
        assert "vllm:request_stop" in res.summary and "'stop'" in res.summary
        assert res.cardinality["growing"][0]["label"] == "stop"
    else:
        assert res.verdict == "CLEAN", res.summary


def test_in_process_a_vlite_metric_labelled_by_request_id_is_a_leak_named_by_family_and_label(
        tiny_checkpoint, monkeypatch):
    from conftest import make_engine
    from prometheus_client import Counter

    from vlite.diagnostics.targets.inprocess import run_in_process
    from vlite.entrypoints.metrics import ServerMetrics

    observe = ServerMetrics.observe

    def labelled(self, out):  # planted: one series per request, labelled by its (client-chosen) id
        observe(self, out)
        if out.finished:
            if not hasattr(self, "by_client"):
                self.by_client = Counter("vlite:request_finished_by_client", "Finished requests.",
                                         ["model_name", "client_request_id"], registry=self.registry)
            self.by_client.labels(self.model_name, out.request_id).inc()

    specs = synthetic_workload(32, input_len=(8, 16), output_len=(2, 4), seed=4)
    clean = run_in_process(make_engine(tiny_checkpoint, num_blocks=64), specs, idle_every=4, sample_interval_s=0.05)
    assert clean.findings.cardinality["verdict"] == "CLEAN" and clean.findings.verdict == "CLEAN", clean.findings.summary()
    monkeypatch.setattr(ServerMetrics, "observe", labelled)
    run = run_in_process(make_engine(tiny_checkpoint, num_blocks=64), specs, idle_every=4, sample_interval_s=0.05)
    f = run.findings
    assert f.verdict == "LEAK" and f.drain.ok, f.summary()
    [g] = f.cardinality["growing"]
    assert (g["family"], g["label"], g["series_per_request"]) == ("vlite:request_finished_by_client",
                                                                   "client_request_id", 1.0)
    assert "vlite:request_finished_by_client" in f.summary() and "'client_request_id'" in f.summary()
