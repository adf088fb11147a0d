"""Every planted defect of ``benchmarks/leak_check/mutants.py`` still applies to today's source.

A mutant is a textual patch (``old`` replaced exactly once); an engine change that rewrites its
anchor makes ``mutants.py`` stop at that mutant, and the mutation check would silently lose it.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("vlite_mutants", ROOT / "benchmarks" / "leak_check" / "mutants.py")
mutants = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mutants  # its dataclasses look their module up
_spec.loader.exec_module(mutants)


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.name)
def test_mutant_patch_occurs_exactly_once(m):
    text = (ROOT / "vlite" / m.path).read_text()
    assert text.count(m.old) == 1, f"{m.name}: its patched text occurs {text.count(m.old)} times in vlite/{m.path}"
    assert m.new != m.old


def test_mutant_names_are_unique():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))
