"""Per-request registries at idle: every one must be empty, and every bounded history within
its bound (the names and their meaning: ``vlite.engine.introspection``).

The sampler also records each registry's size over time (columns ``reg:<name>`` in
samples.csv), so a registry that grows with the request count shows in the samples even when
it happens to be empty at the end.
"""

from __future__ import annotations

from vlite.engine import ASYNC_REGISTRIES, HISTORIES, REGISTRIES


def registry_check(registries: dict[str, int], histories: dict[str, dict], num_cached_blocks: int) -> dict:
    """Findings on one idle snapshot.

    leftover: registries not empty ({name, entries, holds}); over_bound: histories above their
    bound or, for the prefix-cache index, not equal to ``num_cached_blocks`` (blocks).
    """
    about = REGISTRIES | ASYNC_REGISTRIES
    leftover = [{"registry": k, "entries": v, "holds": about.get(k, "")} for k, v in registries.items() if v]
    over = []
    for name, h in histories.items():
        size, bound = int(h["size"]), int(h["bound"])
        if size > bound:
            over.append({"history": name, "size": size, "bound": bound, "holds": HISTORIES.get(name, ""),
                         "problem": "above its bound"})
        elif name == "prefix_cache.index" and size != num_cached_blocks:
            over.append({"history": name, "size": size, "bound": num_cached_blocks, "holds": HISTORIES.get(name, ""),
                         "problem": f"{size} index entries but {num_cached_blocks} cached blocks"})
    return {"checked": sorted(registries), "leftover": leftover, "histories": histories, "over_bound": over}


def sizes_source(view):
    """A sampler source adding ``reg:<name>`` columns (entries) from an EngineView."""

    def read() -> dict:
        return {f"reg:{k}": v for k, v in view.registries().items()}
    return read
