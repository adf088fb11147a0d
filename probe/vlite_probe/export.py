"""Where a pass goes: one JSON file per process, and ``vlite_probe:*`` series on the host's
``/metrics`` (``prometheus_client``'s default registry, where the host uses it).

Every process of a server writes ``<dir>/<pid>.json`` (atomically: a reader never sees half a
file); the collector, in whichever process serves ``/metrics``, reads every live process's file,
so the API server's page carries the engine core's and the workers' censuses too.

Series (labels ``process``, ``pid``; the container ones add ``container``):

* ``vlite_probe:info{dir}``: the probe's directory (a reader on the same host asks for passes there);
* ``vlite_probe:passes_total``: passes so far (a reader waits for it to move after its idle point);
* ``vlite_probe:pass_start_seconds``: Unix time the last pass started;
* ``vlite_probe:pass_seconds`` (wall clock), ``vlite_probe:pass_cpu_seconds``, ``vlite_probe:pass_objects``, ``vlite_probe:pass_truncated`` (1: a
  budget ran out, the counts are partial);
* ``vlite_probe:request_ids_held``: entries of the container that hold a request id;
* ``vlite_probe:container_entries``: its size (``len``), summed over instances;
* ``vlite_probe:container_maxlen``: its cap, for bounded deques.
"""

from __future__ import annotations

import json
import os
import sys

PREFIX = "vlite_probe:"
PASS_REQUEST = "pass-requested"  # a reader touches <dir>/pass-requested to ask every process for a pass
_registered = False


def write(directory: str, doc: dict) -> None:
    """Write ``doc`` to ``<directory>/<pid>.json`` atomically; a write that fails is dropped."""
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{doc['pid']}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_all(directory: str) -> list[dict]:
    """The last pass of every live process that wrote to ``directory`` (by pid)."""
    out = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    except OSError:
        return out
    for name in names:
        try:
            with open(os.path.join(directory, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("pid"), int) and _alive(doc["pid"]):
            out.append(doc)
    return out


def families(docs: list[dict]) -> list[tuple[str, str, str, list[tuple[dict, float]]]]:
    """(name, type, help, [(labels, value)]) of every series, from the passes ``docs``."""
    per_process = [("passes_total", "counter", "census passes of the vlite probe", "passes"),
                   ("pass_start_seconds", "gauge", "Unix time the last pass started", "pass_start"),
                   ("pass_seconds", "gauge", "wall-clock duration of the last pass (s)", "pass_seconds"),
                   ("pass_cpu_seconds", "gauge", "CPU time of the last pass (s): the GIL time it took", "pass_cpu_seconds"),
                   ("pass_objects", "gauge", "objects the last pass visited", "objects"),
                   ("pass_truncated", "gauge", "1: the last pass ran out of its budget", "truncated")]
    out = [(PREFIX + "info", "gauge", "the probe's directory (where a reader on this host asks for passes)",
            [({"dir": str(d.get("dir", ""))}, 1.0) for d in docs[:1]])]
    for name, kind, help_text, key in per_process:
        rows = [({"process": str(d.get("process")), "pid": str(d["pid"])}, float(d.get(key) or 0)) for d in docs]
        out.append((PREFIX + name, kind, help_text, rows))
    for name, help_text, key in (("request_ids_held", "entries holding a request id, by container", "ids"),
                                 ("container_entries", "entries of the container (len), by container", "entries"),
                                 ("container_maxlen", "the cap of a bounded container", "maxlen")):
        rows = []
        for d in docs:
            for container, c in (d.get("containers") or {}).items():
                if c.get(key) is not None:
                    rows.append(({"process": str(d.get("process")), "pid": str(d["pid"]), "container": container},
                                 float(c[key])))
        out.append((PREFIX + name, "gauge", help_text, rows))
    return out


def exposition(docs: list[dict]) -> str:
    """The series of ``docs`` in Prometheus's text format (for a host without prometheus_client)."""
    lines = []
    for name, kind, help_text, rows in families(docs):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, value in rows:
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{body}}} {value:g}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def register_collector(directory: str) -> bool:
    """Register a collector of ``directory``'s passes on ``prometheus_client.REGISTRY`` if the host
    has imported ``prometheus_client`` (True: registered, now or before; False: not yet)."""
    global _registered
    if _registered:
        return True
    client = sys.modules.get("prometheus_client")
    core = sys.modules.get("prometheus_client.core") or sys.modules.get("prometheus_client.metrics_core")
    if client is None or core is None:
        return False

    class ProbeCollector:
        """The vlite probe's series, read from every process's file at each scrape."""

        def collect(self):
            for name, kind, help_text, rows in families(read_all(directory)):
                if kind == "counter":
                    family = core.CounterMetricFamily(name[:-len("_total")], help_text,
                                                      labels=["process", "pid"])
                else:
                    family = core.GaugeMetricFamily(name, help_text, labels=sorted({k for r, _ in rows for k in r})
                                                    or ["process", "pid"])
                for labels, value in rows:
                    family.add_metric([labels[k] for k in sorted(labels)] if kind != "counter"
                                      else [labels["process"], labels["pid"]], value)
                yield family

        def describe(self):
            return []  # unchecked collector: no name clash with the host's own series is possible

    try:
        client.REGISTRY.register(ProbeCollector())
    except Exception:
        return False
    _registered = True
    return True
