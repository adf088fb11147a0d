"""PEP 562 lazy exports: a package names its public objects without importing their modules
until first use, so that importing it (and ``vlite --help``) does not load torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, namespace: dict[str, Any], table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` in ``table`` (public name -> defining
    module) is imported on first access and kept in ``namespace`` (the package's ``globals()``),
    so later lookups skip the hook.

    Raises (from the returned function):
        AttributeError: ``name`` is not in ``table``.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
