"""``python -m vlite_probe``: install or remove the start-up hook, or show what the probe found.

* ``install-pth``: write ``vlite_probe.pth`` into this interpreter's site-packages: every Python
  process of that environment then starts the probe at start-up when ``VLITE_PROBE=1`` is set
  (a server with no plugin entry point: SGLang, a LiteLLM proxy, uvicorn apps). Without the
  variable the hook reads one environment variable and imports nothing.
* ``remove-pth``: remove it.
* ``show DIR``: the passes written to ``DIR`` as Prometheus text (``export.exposition``).
"""

from __future__ import annotations

import os
import sys
import sysconfig

PTH_NAME = "vlite_probe.pth"
# One line; site.py runs lines that start with "import".
PTH_LINE = ('import os; os.environ.get("VLITE_PROBE", "").strip().lower() in ("1", "true", "on", "yes") '
            'and __import__("vlite_probe").start()\n')


def pth_path() -> str:
    """Where ``install-pth`` writes: this interpreter's purelib site-packages."""
    return os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)


def main(argv: list[str]) -> int:
    usage = "usage: python -m vlite_probe {install-pth | remove-pth | show DIR}"
    if not argv or argv[0] not in ("install-pth", "remove-pth", "show") or (argv[0] == "show") != (len(argv) == 2):
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "install-pth":
        with open(pth_path(), "w") as f:
            f.write(PTH_LINE)
        print(f"wrote {pth_path()}: processes of {sys.prefix} start the probe when VLITE_PROBE=1")
        return 0
    if argv[0] == "remove-pth":
        if os.path.exists(pth_path()):
            os.remove(pth_path())
            print(f"removed {pth_path()}")
        else:
            print(f"no {pth_path()}")
        return 0
    from vlite_probe import export

    sys.stdout.write(export.exposition(export.read_all(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
