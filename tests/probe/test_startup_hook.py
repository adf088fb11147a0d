"""The ``.pth`` start-up hook in a fresh environment: ``python -m vlite_probe install-pth``, then
every Python process of that environment starts the probe when ``VLITE_PROBE=1``, and imports
nothing of it otherwise; ``remove-pth`` takes it out."""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

PROBE = Path(__file__).resolve().parents[2] / "probe" / "vlite_probe"
SHOW = ("import sys, threading, time; time.sleep(0.2); "
        "print(sorted(t.name for t in threading.enumerate()), 'vlite_probe' in sys.modules)")


def test_install_pth_starts_the_probe_only_when_enabled(tmp_path):
    env_dir = tmp_path / "server-env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    shutil.copytree(PROBE, site / "vlite_probe")  # what pip install --no-deps of probe/ puts there
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("VLITE_PROBE", "PYTHON"))}
    out = subprocess.run([py, "-m", "vlite_probe", "install-pth"], capture_output=True, text=True, env=base_env)
    assert out.returncode == 0 and (site / "vlite_probe.pth").is_file(), out.stderr

    off = subprocess.run([py, "-c", SHOW], capture_output=True, text=True, env=base_env, timeout=60)
    assert off.stdout.strip() == "['MainThread'] False", off.stdout + off.stderr
    on = subprocess.run([py, "-c", SHOW], capture_output=True, text=True, timeout=60,
                        env={**base_env, "VLITE_PROBE": "1", "VLITE_PROBE_DIR": str(tmp_path / "p")})
    assert on.stdout.strip() == "['MainThread', 'vlite-probe'] True", on.stdout + on.stderr

    assert subprocess.run([py, "-m", "vlite_probe", "remove-pth"], env=base_env).returncode == 0
    assert not (site / "vlite_probe.pth").exists()
    bad = subprocess.run([py, "-m", "vlite_probe", "install"], capture_output=True, text=True, env=base_env)
    assert bad.returncode == 2 and bad.stderr.startswith("usage: python -m vlite_probe")
