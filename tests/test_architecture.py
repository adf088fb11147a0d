"""Structural rules of the code base, checked by reading the source (ast), not by running it."""

from __future__ import annotations

import ast
from pathlib import Path

import vlite

ROOT = Path(vlite.__file__).parent  # .../vlite


def _modules(under: Path) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, as dotted names (``from a.b import c`` gives a.b and a.b.c)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _rel(path: Path) -> str:
    return path.relative_to(ROOT.parent).as_posix()


def test_only_the_scheduler_and_the_view_import_the_block_manager():
    allowed = {"vlite/engine/block_manager.py", "vlite/engine/scheduler.py", "vlite/engine/introspection.py"}
    offenders = [_rel(p) for p in _modules(ROOT / "engine")
                 if "vlite.engine.block_manager" in _imported_modules(p) and _rel(p) not in allowed]
    assert offenders == []


def test_the_rule_scanner_sees_the_scheduler_import():  # the scanner above is not vacuous
    assert "vlite.engine.block_manager" in _imported_modules(ROOT / "engine" / "scheduler.py")
