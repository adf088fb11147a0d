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
    # fault_seams: the scheduler's and the manager's fault-planting subclasses, built only for --inject-fault
    allowed = {"vlite/engine/core/kv_cache_manager.py", "vlite/engine/core/scheduler.py", "vlite/engine/introspection.py",
               "vlite/engine/core/fault_seams.py"}
    offenders = [_rel(p) for p in _modules(ROOT / "engine")
                 if "vlite.engine.core.kv_cache_manager" in _imported_modules(p) and _rel(p) not in allowed]
    assert offenders == []


def test_the_rule_scanner_sees_the_scheduler_import():  # the scanner above is not vacuous
    assert "vlite.engine.core.kv_cache_manager" in _imported_modules(ROOT / "engine" / "core" / "scheduler.py")


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
    internals = {"scheduler", "block_manager", "kv_cache_manager", "block_pool", "model_runner", "_engine", "output_processor"}

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


# ---- the import graph: no circle, no arrow back up -------------------------------------------------
# Every import counts, also those inside functions (lazy) and under ``if TYPE_CHECKING:``.

def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """vlite module -> the vlite modules it imports (a name imported from a package resolves to
    its submodule when there is one, else to the package)."""
    modules = {_module_name(p): p for p in _modules(ROOT)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                candidates = [[a.name] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package
                    pkg = name.split(".") if is_package else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                candidates = [[f"{base}.{a.name}", base] for a in node.names]
            else:
                continue
            for options in candidates:
                for option in options:
                    if option in modules:
                        if option != name:
                            targets.add(option)
                        break
        graph[name] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_vlite():
    assert _circles(_import_graph()) == []


def test_the_circle_finder_sees_a_circle():  # the check above is not vacuous
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _import_graph()
    assert "vlite.engine.core.sched_output" in graph["vlite.engine.core.scheduler"]
    assert "vlite.engine.worker.loader" in graph["vlite.engine.worker.models.llama"]  # a lazy import is seen


# Floors, from the ground up: a module may import only modules on its own floor or below.
_FLOORS = [
    ("vlite.env", "vlite"),
    ("vlite.kernels",),
    # census: stdlib only, so that a tensor-parallel worker (vlite.engine.worker) walks its own process too
    ("vlite.engine.config", "vlite.engine.kv_cache_fit", "vlite.engine.metrics", "vlite.engine.sampling_params",
     "vlite.engine.census"),
    ("vlite.engine.core",),
    ("vlite.engine.worker",),
    ("vlite.engine.outputs", "vlite.engine.output_processor", "vlite.engine.protocol", "vlite.engine.arg_utils",
     "vlite.engine.introspection", "vlite.engine.llm_engine"),
    ("vlite.engine.serving",),
    ("vlite.engine",),
    ("vlite.bench", "vlite.entrypoints", "vlite.diagnostics.workload", "vlite.diagnostics.readers"),
    ("vlite.diagnostics.checks",),
    ("vlite.diagnostics.targets",),
    ("vlite.diagnostics.report",),
    ("vlite.diagnostics.scenarios", "vlite.diagnostics"),
    ("vlite.cli",),
]


def _floor(module: str) -> int:
    best, floor = -1, None
    for i, prefixes in enumerate(_FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), i
    assert floor is not None, f"{module} stands on no floor: add it to _FLOORS"
    return floor


def test_no_import_arrow_runs_back_up():
    graph = _import_graph()
    upward = sorted(f"{a} (floor {_floor(a)}) -> {b} (floor {_floor(b)})"
                    for a, targets in graph.items() for b in targets if _floor(b) > _floor(a))
    assert upward == []
    assert len(graph) > 100 and sum(map(len, graph.values())) > 250  # the scan sees the code base


def test_the_probe_imports_the_standard_library_only():
    # it installs into another server's environment: nothing of vlite, nothing the host may lack
    import sys

    probe = ROOT.parent / "probe" / "vlite_probe"
    files = _modules(probe)
    assert files, probe
    foreign = {f"{p.name}: {m}" for p in files for m in _imported_modules(p)
               if m.partition(".")[0] not in sys.stdlib_module_names and m.partition(".")[0] != "vlite_probe"}
    assert foreign == set()
