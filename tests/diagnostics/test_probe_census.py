"""The probe census check over idle points: a container that keeps taking request ids is a LEAK
named by process and container; one that levels off, a bounded deque, a nested copy of a grown
container, and a process's stale readings are not."""

from __future__ import annotations

from vlite.diagnostics.checks.probe_census import lines, probe_census_check
from vlite.diagnostics.readers.probe_series import ProbeReading, from_docs

MAIN = "main (pid 7)"


def _reading(containers: dict[str, int], stale=(), maxlen=None) -> ProbeReading:
    r = ProbeReading(processes={MAIN: {"pid": "7", "passes": 1}})
    for name, ids in containers.items():
        r.containers[f"{MAIN}: {name}"] = {"process": MAIN, "ids": ids, "entries": ids, "maxlen": maxlen}
    r.stale = list(stale)
    return r


def test_a_container_taking_an_id_per_request_is_named():
    pts = [(10 * i, _reading({"srv.Serving.store": 10 * i, "srv.Serving.store[]": 10 * i, "srv.Vocab.words": 3}))
           for i in range(8)]
    res = probe_census_check(pts)
    assert res["verdict"] == "LEAK"
    assert [(g["process"], g["container"], g["entries_per_request"]) for g in res["growing"]] == [
        (MAIN, "srv.Serving.store", 1.0)]  # the nested copy and the constant container are no findings
    assert any("LEAK main (pid 7): srv.Serving.store holds 70 request ids" in line for line in lines(res))


def test_levelling_off_bounded_and_too_few_points():
    level = [(10 * i, _reading({"srv.Cache.lru": min(10 * i, 30)})) for i in range(8)]
    assert probe_census_check(level)["verdict"] == "CLEAN"
    capped = [(10 * i, _reading({"srv.Recent.ids": 10 * i}, maxlen=1000)) for i in range(8)]
    res = probe_census_check(capped)
    assert res["verdict"] == "CLEAN" and res["bounded"][0]["maxlen"] == 1000
    assert probe_census_check([(0, _reading({}))] * 3)["verdict"] == "too few idle points"
    assert probe_census_check([(0, None)]) is None


def test_a_process_with_no_pass_after_an_idle_point_is_left_out_there():
    # the last three readings are stale (no pass since the idle point): their counts froze at 40
    pts = [(10 * i, _reading({"srv.Serving.store": 10 * min(i, 4)}, stale=[MAIN] if i > 4 else []))
           for i in range(8)]
    res = probe_census_check(pts)
    assert res["stale"] == [MAIN]
    # read as they are, the frozen counts would look levelled off (CLEAN); the 5 fresh points grow
    assert res["verdict"] == "LEAK" and res["growing"][0]["last"] == 40
    assert any("left out of its fit" in line for line in lines(res))
    fresh_only = [(x, r) for x, r in pts if not r.stale]
    for _, r in pts:
        r.stale = []
    assert probe_census_check(pts)["verdict"] == "CLEAN" and probe_census_check(fresh_only)["verdict"] == "LEAK"


def test_from_docs_reads_the_probes_files():
    doc = {"pid": 7, "process": "main", "passes": 3, "pass_start": 1.0, "pass_seconds": 0.1, "objects": 10,
           "truncated": False, "containers": {"srv.S.store": {"ids": 4, "entries": 5, "maxlen": None}}}
    r = from_docs([doc])
    assert r.passes == {MAIN: 3} and r.containers[f"{MAIN}: srv.S.store"]["ids"] == 4
