"""``vlite leak-check --url ROUTER --replica URL ...``: one verdict per replica behind a router, and
the hop where a client's abort was lost.

The judgement (``checks/fleet.py``) is tested on hand-made probes; the whole check runs against
fake replicas (threads that stream tokens, notice a closed connection as an abort and export
vlite's /metrics) behind tests/interop/drop_abort_proxy.py, passing aborts on or dropping them.
No router binary, no model: the live fleet (vllm-router, two `vlite serve`, Prometheus) is
tests/interop/fleet.sh, outside CI.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from fake_http import QuietHandler, ServerPool
from typer.testing import CliRunner

from vlite.cli.main import app
from vlite.diagnostics.checks import fleet as judge
from vlite.diagnostics.checks.fleet import HOP_REPLICA, HOP_ROUTER, Probe, ReplicaFacts, judge_fleet, lines
from vlite.diagnostics.targets.fleet import FleetOptions, FleetRun

_spec = importlib.util.spec_from_file_location(
    "drop_abort_proxy", Path(__file__).parents[1] / "interop" / "drop_abort_proxy.py")
proxy_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proxy_mod)

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


def _facts(before=0.0, after_a=0.0, after_b=0.0):
    return [ReplicaFacts(A, "vlite", "blocks", before, after_a), ReplicaFacts(B, "vlite", "blocks", before, after_b)]


def _left(pid, url, lag, aborted=True, path="router", t0=1000.0):
    return Probe(pid, path, "disconnect-stream", url, t0, None if lag is None else t0 + lag, aborted=aborted)


# --- the judgement --------------------------------------------------------------------------

def test_clean_fleet_every_replica_clean():
    res = judge_fleet(_facts(), [_left("p1", A, 0.1), _left("p2", B, 0.2)])
    assert [r["verdict"] for r in res["replicas"]] == ["CLEAN", "CLEAN"]
    assert res["verdict"] == "CLEAN"


def test_leak_names_the_replica_never_an_average():
    res = judge_fleet(_facts(after_b=6.0), [_left("p1", A, 0.1), _left("p2", B, 0.2)])
    by = {r["url"]: r for r in res["replicas"]}
    assert by[A]["verdict"] == "CLEAN"
    assert by[B]["verdict"] == "LEAK" and "6 blocks of KV still in use" in by[B]["reasons"][0]
    assert res["verdict"] == "LEAK"


def test_abort_dropped_by_the_router_is_zombie_at_the_router_hop():
    probes = [_left("p1", A, 5.0, aborted=False), _left("c1", A, 0.05, path="direct")]
    res = judge_fleet(_facts(), probes + [_left("p2", B, 0.1)])
    by = {r["url"]: r for r in res["replicas"]}
    assert by[A]["verdict"] == "ZOMBIE" and by[A]["hop"] == HOP_ROUTER
    assert by[A]["zombies"][0]["direct_control"] == "released in time"
    assert by[B]["verdict"] == "CLEAN"
    assert any("hop router -> replica" in line for line in lines(res))


def test_replica_deaf_to_aborts_is_zombie_at_the_replica_hop():
    probes = [_left("p1", A, 5.0, aborted=False), _left("c1", A, 5.0, aborted=False, path="direct"),
              _left("p2", B, 4.0, aborted=True)]  # B counted the abort, late: B's own hop
    res = judge_fleet(_facts(), probes)
    assert [(r["verdict"], r["hop"]) for r in res["replicas"]] == [("ZOMBIE", HOP_REPLICA), ("ZOMBIE", HOP_REPLICA)]


def test_a_request_never_ended_is_a_zombie():
    res = judge_fleet(_facts(), [_left("p1", A, None, aborted=False), _left("p2", B, 0.1)])
    assert res["replicas"][0]["verdict"] == "ZOMBIE" and res["replicas"][0]["zombies"][0]["never_ended"]


def test_steps_judge_where_the_replica_counts_them():
    # 1.5 s late but one engine step after the client left: a slow step, not a zombie (the pace rule)
    slow = Probe("p1", "router", "abort-prefill", A, 1000.0, 1001.5, end_step=11,
                 timeline=[(999.9, 10), (1000.05, 10), (1001.5, 11)], aborted=True)
    res = judge_fleet(_facts(), [slow, _left("p2", B, 0.1)])
    assert res["replicas"][0]["verdict"] == "CLEAN"
    many = Probe("p1", "router", "abort-prefill", A, 1000.0, 1001.5, end_step=40,
                 timeline=[(1000.05, 10), (1001.5, 40)], aborted=False)
    assert judge_fleet(_facts(), [many, _left("p2", B, 0.1)])["replicas"][0]["verdict"] == "ZOMBIE"


def test_router_in_flight_must_match_idle_replicas():
    probes = [_left("p1", A, 0.1), _left("p2", B, 0.1)]
    assert judge_fleet(_facts(), probes, {A: 0.0, B: 0.0})["router"]["verdict"] == "CLEAN"
    res = judge_fleet(_facts(), probes, {A: 0.0, B: 2.0})
    assert res["router"]["verdict"] == "LEAK" and res["verdict"] == "LEAK"
    assert [r["verdict"] for r in res["replicas"]] == ["CLEAN", "CLEAN"]
    assert judge_fleet(_facts(), probes)["router"]["verdict"] is None  # not exported: said, not judged


def test_router_not_reconciled_says_whether_router_metrics_was_given():
    probes = [_left("p1", A, 0.1), _left("p2", B, 0.1)]
    why = judge_fleet(_facts(), probes)["router"]["reasons"]
    assert why == [w for w in why if "needs --router-metrics URL" in w and "not given" in w] and why
    assert "exports no" not in " ".join(why)  # the router may export one: the option was missing
    given = judge_fleet(_facts(), probes, router_metrics="http://router:29000/metrics")["router"]["reasons"]
    assert len(given) == 1 and "http://router:29000/metrics" in given[0] and "vllm_router_running_requests" in given[0]


def test_a_replica_no_early_leaver_reached_is_inconclusive():
    res = judge_fleet(_facts(), [_left("p1", A, 0.1)])
    assert res["replicas"][1]["verdict"] == "INCONCLUSIVE" and res["verdict"] == "INCONCLUSIVE"


# --- the whole check against fake replicas behind the proxy -----------------------------------

class FakeReplica:
    """A threaded fake `vlite serve`: streams one token every ``token_s``, counts a closed
    connection as an abort, exports vlite's series. ``leak``: an abort keeps its blocks."""

    def __init__(self, leak: bool = False, token_s: float = 0.02, empty_after_abort: bool = False) -> None:
        self.leak, self.token_s, self.lock = leak, token_s, threading.Lock()
        self.empty_after_abort = empty_after_abort  # TensorRT-LLM #15018: 200s with no token after aborts
        self.used, self.running, self.steps = 0, 0, 0
        self.ended = {"stop": 0, "length": 0, "abort": 0}

    def page(self) -> str:
        with self.lock:
            rows = [("vlite:num_total_blocks", 64), ("vlite:num_free_blocks", 64 - self.used),
                    ("vlite:num_cached_blocks", 0), ("vlite:num_requests_running", self.running),
                    ("vlite:num_requests_waiting", 0), ("vlite:engine_steps_total", self.steps),
                    ("vlite:generation_tokens_total", self.steps)]
            out = [f"{k} {v}" for k, v in rows]
            out += [f'vlite:request_success_total{{finished_reason="{k}"}} {v}' for k, v in self.ended.items()]
        return "\n".join(out) + "\n"

    def handler(self):
        fake = self

        class H(QuietHandler):
            protocol_version = "HTTP/1.0"

            def do_GET(self):
                if self.path == "/metrics":
                    self.reply(200, fake.page())
                elif self.path == "/v1/models":
                    self.reply(200, json.dumps({"data": [{"id": "fake"}]}), "application/json")
                else:
                    self.reply(200, "")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.running += 1
                    fake.used += 2
                if not body.get("stream"):
                    time.sleep(fake.token_s)
                    fake._end("length")
                    empty = fake.empty_after_abort and fake.ended["abort"] > 0
                    self.reply(200, json.dumps({"choices": [{"text": "" if empty else "x", "finish_reason": "length"}],
                                                "usage": {"completion_tokens": 0 if empty else 1}}),
                               "application/json")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for _ in range(body["max_tokens"]):
                    time.sleep(fake.token_s)
                    with fake.lock:
                        fake.steps += 1
                    try:
                        self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
                        self.wfile.flush()
                    except OSError:
                        fake._end("abort")
                        return
                fake._end("length")
                try:
                    self.wfile.write(b"data: [DONE]\n\n")
                except OSError:
                    pass

        return H

    def _end(self, reason: str) -> None:
        with self.lock:
            self.running -= 1
            self.ended[reason] += 1
            if not (reason == "abort" and self.leak):
                self.used -= 2


@pytest.fixture
def pool():
    p = ServerPool()
    yield p
    p.close()


def _fleet(pool, drop_aborts=False, leak_b=False, empty_b=False):
    reps = [FakeReplica(), FakeReplica(leak=leak_b, empty_after_abort=empty_b)]
    urls = [pool.start(r.handler()) for r in reps]
    srv = ThreadingHTTPServer(("127.0.0.1", 0), proxy_mod.make_handler(urls, drop_aborts))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    pool._servers.append(srv)
    return f"http://127.0.0.1:{srv.server_address[1]}", urls


def _run(router, urls, probes=2, storm=0):
    opts = FleetOptions(router, urls, max_tokens=100, drain_timeout_s=10.0, threshold_s=0.5, probes_per_replica=probes,
                        storm_requests=storm)
    return FleetRun(opts, on_line=lambda line: None).run()


def test_fake_fleet_passing_aborts_is_clean(pool):
    router, urls = _fleet(pool)
    res = _run(router, urls)
    assert [r["verdict"] for r in res["replicas"]] == ["CLEAN", "CLEAN"], lines(res)
    assert all(r["left_early"] >= 2 and r["aborts_seen"] == r["left_early"] for r in res["replicas"])
    assert "per-replica counters" in res["attribution"]


def test_fake_fleet_behind_a_proxy_that_drops_aborts_is_zombie_at_the_router_hop(pool):
    router, urls = _fleet(pool, drop_aborts=True)
    res = _run(router, urls, probes=1)
    assert [(r["verdict"], r["hop"]) for r in res["replicas"]] == [("ZOMBIE", HOP_ROUTER)] * 2, lines(res)
    assert [p for p in res["probes"] if p["path"] == "direct"]  # the control that names the hop


def test_fake_fleet_one_leaking_replica_names_it(pool):
    router, urls = _fleet(pool, leak_b=True)
    res = _run(router, urls)
    by = {r["url"]: r for r in res["replicas"]}
    assert by[urls[0]]["verdict"] == "CLEAN" and by[urls[1]]["verdict"] == "LEAK", lines(res)


def test_fake_fleet_storm_checks_name_the_replica_that_returns_empty_output(pool):
    router, urls = _fleet(pool, empty_b=True)
    res = _run(router, urls, storm=6)
    by = {r["url"]: r for r in res["replicas"]}
    assert by[urls[0]]["verdict"] == "CLEAN", lines(res)
    assert by[urls[1]]["verdict"] == "EMPTY-OUTPUT", lines(res)
    assert res["verdict"] == "EMPTY-OUTPUT"
    assert by[urls[0]]["storm"]["wedge"]["completed"] and by[urls[0]]["storm"]["storm"]["sent"] == 6
    assert any("storm check: EMPTY-OUTPUT" in line for line in lines(res))


def test_fleet_storm_verdict_beside_a_leak_keeps_the_leak():
    res = {"replicas": [{"url": "a", "verdict": "LEAK", "reasons": []}, {"url": "b", "verdict": "ZOMBIE", "reasons": []}],
           "router": {"verdict": "CLEAN"}, "verdict": "LEAK"}
    wedged = {"verdict": "WEDGED", "summary": "WEDGED: no answer"}
    judge.apply_storm(res, {"a": wedged, "b": wedged})
    assert [r["verdict"] for r in res["replicas"]] == ["LEAK", "WEDGED"]
    assert res["replicas"][0]["reasons"] == ["after the abort storm: WEDGED: no answer"]
    assert "before the storm checks: ZOMBIE" in res["replicas"][1]["reasons"]
    assert res["verdict"] == "LEAK"


def test_cli_fleet_exit_code_and_report(pool, tmp_path):
    router, urls = _fleet(pool, drop_aborts=True)
    r = CliRunner().invoke(app, ["leak-check", "--url", router, "--replica", urls[0], "--replica", urls[1],
                                 "--num-requests", "4", "--zombie-max-tokens", "100", "--zombie-threshold-s", "0.5",
                                 "--drain-timeout", "10", "--probes-per-replica", "1", "--storm-requests", "4",
                                 "--report", str(tmp_path)],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output
    assert "verdict: ZOMBIE" in r.output and "hop router -> replica" in r.output
    doc = json.loads((tmp_path / "fleet.json").read_text())
    assert doc["verdict"] == "ZOMBIE"
    assert all(r["storm"]["storm"]["sent"] == 4 and r["storm"]["wedge"]["completed"] for r in doc["replicas"])


@pytest.mark.parametrize("args, words", [
    (["--replica", "http://127.0.0.1:9"], "--replica needs --url"),
    (["--router-metrics", "http://127.0.0.1:9"], "add --replica"),
    (["--url", "http://127.0.0.1:9", "--replica", "http://127.0.0.1:9"], "is also a --replica"),
    (["--url", "http://127.0.0.1:9", "--replica", "http://127.0.0.1:8", "--blackbox"], "cannot be combined"),
])
def test_cli_fleet_option_errors(args, words):
    r = CliRunner().invoke(app, ["leak-check", *args], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and words in r.output, r.output


# --- recorded router pages --------------------------------------------------------------------

FIX = Path(__file__).parent / "fixtures"
R1, R2 = "http://127.0.0.1:8101", "http://127.0.0.1:8102"


def test_recorded_vllm_router_page_gives_routed_and_in_flightper_worker():
    # vllm-router 0.1.17 --policy power_of_two, recorded at idle after 4 requests (tests/interop/fleet.sh's router)
    from vlite.diagnostics.checks.fleet import ROUTER_IN_FLIGHT, ROUTER_ROUTED
    from vlite.diagnostics.readers.metrics_text import parse_page

    text = (FIX / "vllm-router-0.1.17-power_of_two-idle.prom").read_text()
    page = parse_page(text)
    assert FleetRun.per_worker(page, (ROUTER_ROUTED,)) == {R1: 2.0, R2: 2.0}
    in_flight = FleetRun.per_worker(page, ROUTER_IN_FLIGHT)
    assert in_flight == {R1: 0.0, R2: 0.0}
    facts = [ReplicaFacts(R1, "vlite", "blocks", 0, 0), ReplicaFacts(R2, "vlite", "blocks", 0, 0)]
    probes = [_left("p1", R1, 0.1), _left("p2", R2, 0.1)]
    assert judge_fleet(facts, probes, in_flight)["router"]["verdict"] == "CLEAN"
    stuck = parse_page(text.replace(f'vllm_router_running_requests{{worker="{R2}"}} 0',
                                    f'vllm_router_running_requests{{worker="{R2}"}} 3'))
    res = judge_fleet(facts, probes, FleetRun.per_worker(stuck, ROUTER_IN_FLIGHT))
    assert res["router"]["verdict"] == "LEAK" and R2 in res["router"]["reasons"][0]


def test_recorded_sglang_router_page_has_no_per_worker_counts():
    # sglang-router 0.3.2 (smg) --policy round_robin: neither a routed counter nor an in-flight gauge per worker
    from vlite.diagnostics.checks.fleet import ROUTER_IN_FLIGHT, ROUTER_ROUTED
    from vlite.diagnostics.readers.metrics_text import parse_page

    page = parse_page((FIX / "sglang-router-0.3.2-round_robin-idle.prom").read_text())
    assert FleetRun.per_worker(page, (ROUTER_ROUTED,)) is None
    assert FleetRun.per_worker(page, ROUTER_IN_FLIGHT) is None


# --- the live fleet's recorded runs (tests/interop/fleet.sh with RECORD=1) ----------------------

@pytest.mark.parametrize("run, expected", [
    ("clean", [("CLEAN", None), ("CLEAN", None)]),
    ("drop-aborts", [("ZOMBIE", HOP_ROUTER), ("ZOMBIE", HOP_ROUTER)]),
    ("leak", [("CLEAN", None), ("LEAK", None)]),
])
def test_recorded_live_fleet_rejudged_gives_the_same_verdicts(run, expected):
    from vlite.diagnostics.checks.fleet import rejudge

    doc = json.loads((FIX / f"fleet-live-{run}.json").read_text())
    res = rejudge(doc)
    assert [(r["verdict"], r["hop"]) for r in res["replicas"]] == expected
    assert [r["verdict"] for r in res["replicas"]] == [r["verdict"] for r in doc["replicas"]]
    assert res["verdict"] == doc["verdict"]
    if run != "drop-aborts":  # the proxy exports no router page
        assert res["router"]["verdict"] == "CLEAN"
    if run == "drop-aborts":  # judged in engine steps, from the replica's own counter
        assert all(z["outlived_steps"] > 100 for r in res["replicas"] for z in r["zombies"])
