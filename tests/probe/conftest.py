"""The probe is its own distribution (``probe/``); the tests import it from the checkout."""

import sys
from pathlib import Path

PROBE_DIR = Path(__file__).resolve().parents[2] / "probe"
if str(PROBE_DIR) not in sys.path:
    sys.path.insert(0, str(PROBE_DIR))
