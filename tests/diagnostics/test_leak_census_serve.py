"""`vlite serve` runs the request-id census at idle points in both of its processes (the serving
loop's over the engine, the API server's over its own objects) and exports both in /metrics
(vlite:ended_requests_held, `engine.<path>` / `api_server.<path>`); `leak-check --url` without debug
endpoints finds a map nobody registered that keeps ended requests, in the engine and in the API
server, in the thread and in the engine-core-process layouts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from vlite.diagnostics.targets.http import run_http
from vlite.diagnostics.workload.sources import synthetic_workload

PLANT = '''
import vlite.engine.output_processor as _op

_make_output = _op.OutputProcessor.make_output


def _keep_finished(self, req):  # planted: every finished request's output kept in a map of its own
    out = _make_output(self, req)
    if out.finished:
        self.__dict__.setdefault("holdback_by_request", {})[req.request_id] = out
    return out


_op.OutputProcessor.make_output = _keep_finished

import sys

if sys.argv[1:2] == ["serve"]:  # the API server's process (the engine core is spawned with other argv)
    import vlite.entrypoints.serving as _serving
    import vlite.entrypoints.serving_completion as _sc

    _sc._SEEN_REQUEST_IDS = {}  # planted: each HTTP request's id, kept at module level, never emptied
    _serve = _serving.OpenAIServing.serve

    async def _keep_ids(self):
        _sc._SEEN_REQUEST_IDS[self.request.state.request_id] = True
        return await _serve(self)

    _serving.OpenAIServing.serve = _keep_ids
'''
ENGINE_MAP = "engine.output_processor.holdback_by_request"
API_MAP = "api_server.vlite.entrypoints.serving_completion._SEEN_REQUEST_IDS"
VLITE = str(Path(sys.executable).with_name("vlite"))
LAYOUTS = pytest.mark.parametrize("layout", [("--disable-frontend-multiprocessing",), ()],
                                  ids=["thread", "engine-core-process"])


@pytest.fixture
def serve(vlite_serve, tmp_path):
    def start(*extra: str, plant: bool = False) -> str:
        env = None
        if plant:  # sitecustomize runs in every Python process of the server, the engine core's too
            site = tmp_path / "plant"
            site.mkdir(exist_ok=True)
            (site / "sitecustomize.py").write_text(PLANT)
            env = {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}
        return vlite_serve(*extra, env=env)

    return start


def _specs():
    return synthetic_workload(8, input_len=(8, 20), output_len=(4, 8), abort_rate=0.25, abort_mode="mix", seed=2)


@LAYOUTS
def test_maps_planted_in_both_processes_are_found_through_metrics_alone(serve, layout):
    url = serve(*layout, plant=True)
    specs = _specs()
    run = run_http(url, specs, max_concurrency=4, idle_every=4, sample_interval_s=0.05)
    f = run.findings
    assert f.verdict == "LEAK", f.summary()
    assert f.drain.ok  # the blocks are fine: only the census sees it
    held = {h["path"]: h["num_entries"] for h in f.census["held"]}
    # each map once, named by its process; nothing else (in one process nothing is walked twice)
    assert set(held) == {ENGINE_MAP, API_MAP}, held
    # every request its client saw finish, and those the engine finished before their clients left
    finished = sum(1 for r in run.replay.requests if r.outcome == "finished")
    assert 1 <= finished <= held[ENGINE_MAP] <= len(specs)
    # every request whose handler ran, aborted ones too (a client may leave before its body is read)
    assert finished <= held[API_MAP] <= len(specs)
    assert ENGINE_MAP in f.summary() and API_MAP in f.summary()


@LAYOUTS
def test_a_clean_server_exports_an_empty_current_census_of_both_processes(serve, layout):
    url = serve(*layout, "--enable-debug-endpoints")
    run = run_http(url, _specs(), max_concurrency=4, idle_every=4, sample_interval_s=0.05)
    assert run.findings.verdict == "CLEAN", run.findings.summary()
    assert run.findings.census["held"] == []
    page = httpx.get(f"{url}/metrics").text
    assert 'vlite:census_pending_requests{model_name=' in page and "vlite:ended_requests_held" in page
    doc = httpx.get(f"{url}/debug/census").json()
    for side in ("engine", "api_server"):  # both ran after the last request and found nothing
        assert doc[side]["process"] == side and doc[side]["taken_at"] is not None, doc
        assert doc[side]["held"] == [] and doc[side]["pending"] == 0, doc
    assert (doc["engine"]["pid"] == doc["api_server"]["pid"]) == bool(layout)


# An ended request left in the map that used to gate each process's census
# (the engine loop's live map, the async client's open groups) must not switch that census off.
PLANT_LIVE_MAPS = '''
import vlite.engine.serving.engine_loop as _el

_step = _el.EngineLoop._step


def _keep_live(self):  # planted: a finished request's entry is left in the loop's live map
    before = dict(self._live)
    _step(self)
    for rid, entry in before.items():
        if rid not in self._live and rid in self._ended:
            self._live[rid] = entry


_el.EngineLoop._step = _keep_live

import vlite.engine.serving.async_engine as _ae

_handle = _ae._AsyncClient._handle_events


def _keep_groups(self, events, stats):  # planted: a finished request's group is left open
    before = dict(self._groups)
    _handle(self, events, stats)
    for rid, group in before.items():
        if rid not in self._groups and rid in self.ended:
            self._groups[rid] = group


_ae._AsyncClient._handle_events = _keep_groups
'''
LIVE_MAP = "async_engine._live"
GROUPS_MAP = "api_server.client._groups"


@LAYOUTS
def test_an_ended_request_left_in_the_maps_that_gated_the_census_is_found(vlite_serve, tmp_path, layout):
    site = tmp_path / "plant-live"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PLANT_LIVE_MAPS)
    url = vlite_serve(*layout, "--enable-debug-endpoints",
                      env={"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)})
    run = run_http(url, _specs(), max_concurrency=4, idle_every=4, sample_interval_s=0.05)
    f = run.findings
    assert f.verdict == "LEAK", f.summary()
    held = {h["path"]: h["num_entries"] for h in f.census["held"]}
    assert LIVE_MAP in held and GROUPS_MAP in held, held  # both censuses ran, each naming its map
    assert LIVE_MAP in f.summary() and GROUPS_MAP in f.summary()
    page = httpx.get(f"{url}/metrics").text
    assert f'container="{LIVE_MAP}"' in page and f'container="{GROUPS_MAP}"' in page
    doc = httpx.get(f"{url}/debug/census").json()
    for side in ("engine", "api_server"):  # current, not overdue: the maps no longer gate the census
        assert doc[side]["pending"] == 0 and doc[side]["overdue"] is None, doc
    # and the command the docs give for a server says so, with exit code 1
    res = subprocess.run([VLITE, "leak-check", "--url", url, "--num-requests", "6", "--report", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "LEAK" in res.stdout and LIVE_MAP in res.stdout and GROUPS_MAP in res.stdout, res.stdout
