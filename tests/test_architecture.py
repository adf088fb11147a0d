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
    allowed = {"vlite/engine/core/block_manager.py", "vlite/engine/core/scheduler.py", "vlite/engine/introspection.py"}
    offenders = [_rel(p) for p in _modules(ROOT / "engine")
                 if "vlite.engine.core.block_manager" in _imported_modules(p) and _rel(p) not in allowed]
    assert offenders == []


def test_the_rule_scanner_sees_the_scheduler_import():  # the scanner above is not vacuous
    assert "vlite.engine.core.block_manager" in _imported_modules(ROOT / "engine" / "core" / "scheduler.py")


def test_code_outside_the_engine_imports_only_vlite_engine_public_names():
    import vlite.engine as engine

    offenders = []
    for path in _modules(ROOT):
        if path.relative_to(ROOT).parts[0] == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                offenders += [(_rel(path), a.name) for a in node.names if a.name.startswith("vlite.engine.")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("vlite.engine."):
                    offenders.append((_rel(path), node.module))
                elif node.module == "vlite.engine":
                    offenders += [(_rel(path), f"vlite.engine.{a.name}") for a in node.names
                                  if a.name not in engine.__all__]
    assert offenders == []


def test_every_public_engine_name_resolves():
    import vlite.engine as engine

    missing = [name for name in engine.__all__ if getattr(engine, name, None) is None]
    assert missing == []


def test_importing_the_engine_package_and_the_cli_does_not_load_torch():
    import subprocess
    import sys

    code = "import sys, vlite.engine, vlite.cli.main; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def _engine_attribute_uses(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) for every ``engine.X`` and ``self.engine.X`` in a file."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id == "engine") or (
                isinstance(v, ast.Attribute) and v.attr == "engine" and isinstance(v.value, ast.Name)
                and v.value.id == "self"):
            uses.append((node.lineno, node.attr))
    return uses


def test_diagnostics_touch_the_engine_only_through_the_client_protocol_and_the_view():
    from vlite.engine.protocol import ENGINE_CLIENT_MEMBERS, EngineClient

    assert ENGINE_CLIENT_MEMBERS == {n for n in dir(EngineClient) if not n.startswith("_")} | {"tokenizer"}
    offenders, seen = [], 0
    internals = {"scheduler", "block_manager", "model_runner", "_engine", "output_processor"}

    def reaches_inside(n: ast.AST) -> bool:  # engine internals under any name (a config's .scheduler is fine)
        return isinstance(n, ast.Attribute) and n.attr in internals and not (
            isinstance(n.value, ast.Name) and n.value.id.endswith("config"))
    for path in _modules(ROOT / "diagnostics"):
        uses = _engine_attribute_uses(path)
        seen += len(uses)
        offenders += [f"{_rel(path)}:{line} engine.{attr}" for line, attr in uses if attr not in ENGINE_CLIENT_MEMBERS]
        offenders += [f"{_rel(path)}:{n.lineno} .{n.attr}" for n in ast.walk(ast.parse(path.read_text()))
                      if reaches_inside(n)]
    assert offenders == []
    assert seen > 5  # the scan does find the client's engine.step(), engine.add_request(), ...


def test_the_engine_satisfies_the_client_protocol(tiny_checkpoint):
    from conftest import make_engine

    from vlite.engine import EngineClient

    assert isinstance(make_engine(tiny_checkpoint, num_blocks=8, block_size=4), EngineClient)


def test_class_names_are_unique_across_vlite():
    where: dict[str, list[str]] = {}
    for path in _modules(ROOT):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{_rel(path)}:{node.lineno}")
    assert len(where) > 50  # the scan sees the code base
    assert {name: places for name, places in where.items() if len(places) > 1} == {}
