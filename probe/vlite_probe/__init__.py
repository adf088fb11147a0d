"""vlite's probe: what runs inside another server's Python processes (vLLM, SGLang, a LiteLLM proxy).

At each process's idle points it walks the objects the process holds and counts, per container,
the entries that hold a request id (``walk.py``); each pass goes to a small JSON file per process
and, where the process serves ``prometheus_client``'s registry, onto the server's own
``/metrics`` as ``vlite_probe:*`` series (``export.py``). ``vlite leak-check --url`` reads them
and names a container that keeps growing with requests.

Harmless by construction: off unless ``VLITE_PROBE=1`` is in the environment; the standard
library only (nothing the server does not already have is imported); one daemon thread that
walks only while the process is idle, within a time budget per pass, from published roots only,
and keeps nothing of the host's between passes but names and counts (``runner.py``).
"""

__version__ = "0.1.0"
ENV_ENABLE = "VLITE_PROBE"


def enabled() -> bool:
    """Whether ``VLITE_PROBE`` asks for the probe (``1``, ``true``, ``on``, ``yes``)."""
    import os

    return os.environ.get(ENV_ENABLE, "").strip().lower() in ("1", "true", "on", "yes")


def start() -> bool:
    """Start the probe in this process if ``VLITE_PROBE`` enables it (idempotent per process);
    True if it runs. Never raises: a probe that cannot start leaves the host as it was."""
    if not enabled():
        return False
    try:
        from vlite_probe.runner import start_probe

        return start_probe()
    except Exception:  # the host must not fail because of the probe
        return False
