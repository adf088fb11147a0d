"""Request-id census: every container reachable from the engine that still holds an ended request.

The leak check's registry list (``introspection.REGISTRIES``) names the per-request maps someone
thought of. The census finds the ones nobody registered: it walks the object graph from a few
roots (the engine, the serving loop, the server's state) and reports every container that holds
an ended request's id (a ``str``, or a string derived from one: ``DerivedIds``) or an object of one (anything whose ``request_id`` is an ended
id: ``Request``, ``Sequence``, ``RequestRecord``, a client's own state object) as a key, a value,
an element or an attribute. Each hit is named by its attribute path from the root, e.g.
``engine.output_processor.holdback['lc-00017']``.

Why walk references rather than ``gc.get_objects()``: objects that ``gc.freeze()`` moved to the
permanent generation are missing from ``gc.get_objects()`` (that is how vLLM's ``new_block_ids``
list, vllm#44175, hid for months); references reach them (and tracemalloc still traces what they
allocate: ``leak-check --trace-allocations``).

Bounded histories kept on purpose (the finished-request records kept for attribution, the
release history) are passed in ``skip`` and not entered. Tensors, modules, classes, functions and
pydantic's own objects (type adapters, compiled validators and serializers) are not entered either: a per-request tensor
is found through the map that keys it, and a compiled schema is fixed when its class is built.

Cost: one visit per reachable object; about 5-40 ms for a SmolLM2 engine (see docs/benchmarks.md, "Request-id census: cost per idle point"),
so it runs only at idle points, never inside a step.
"""

from __future__ import annotations

import collections
import functools
import gc
import logging
import os
import time
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

logger = logging.getLogger("vlite.engine")

# When a serving process runs its census (``EngineLoop`` in the engine's process, the API server's
# ``vlite.entrypoints.census``): at idle points, at most this often (s), over at most this many
# ended request ids (the most recent). An idle point is the process's own: the engine's when its
# scheduler has no running or waiting sequence and no step ran for CENSUS_QUIET_S; the API
# server's when no HTTP request (but an observer's) is in flight and none ended for CENSUS_QUIET_S.
# What its per-request maps hold does not matter (a leaked entry must not switch off
# the census that would report it).
CENSUS_INTERVAL_S = 1.0
CENSUS_QUIET_S = 0.5
ENDED_HISTORY = 10_000
# A census due for this many intervals while its process saw no new work (no request added, no
# HTTP request started), yet never at an idle point, is overdue: a finding of its own, with what
# kept the process from being idle (``IdleCensus.overdue``).
CENSUS_OVERDUE_INTERVALS = 3

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, slice)
_OPAQUE = (types.ModuleType, type, types.BuiltinFunctionType,
           types.CodeType, types.FrameType, types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType,
           types.TracebackType, types.MethodWrapperType, types.WrapperDescriptorType, types.GetSetDescriptorType,
           types.MemberDescriptorType, property, staticmethod, classmethod)


# Callables that hold state: a closure's cells, a bound method's owner, a partial's arguments,
# an ``lru_cache``'s cache (its keys hold the arguments). Entered after everything else, so that
# an object both held plainly and reached through a callback keeps its plain path.
_LRU_CACHE_WRAPPER = type(functools.lru_cache(maxsize=1)(lambda: None))
_CALLABLES = (types.FunctionType, types.MethodType, functools.partial, _LRU_CACHE_WRAPPER)


@dataclass(frozen=True)
class HeldRequestState:
    """One container that still holds ended requests.

    path: attribute path from a root to the container (``engine.output_processor.holdback``);
    kind: ``"key"`` | ``"value"`` | ``"element"`` | ``"attribute"`` (joined by ``+`` when a
    map holds them as both, e.g. ``"key+value"``), how the ids are held;
    container_type: the container's type name; request_ids: the ended requests it holds (sorted,
    at most ``max_ids_per_container``); num_entries: how many entries hold ended requests
    (the most of any one kind).
    """

    path: str
    kind: str
    container_type: str
    request_ids: tuple[str, ...]
    num_entries: int

    def to_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "container_type": self.container_type,
                "request_ids": list(self.request_ids), "num_entries": self.num_entries}


@dataclass(frozen=True)
class CensusResult:
    """The census of one idle point: the containers found, objects visited, whether the walk
    stopped at ``max_objects`` (then some containers may be missing), and the size (entries) of
    every non-empty container reached, by path: a host-memory leak that holds no request id (a
    list of block ids growing per allocation, vllm#44175) shows as a container that keeps growing
    from one idle point to the next (``diagnostics/checks/host_memory.py``)."""

    held: tuple[HeldRequestState, ...]
    objects_visited: int
    truncated: bool
    container_sizes: Mapping[str, int] = field(default_factory=dict)  # path -> entries, every non-empty container
    # path -> the cap its type declares (a deque's maxlen, an lru_cache's maxsize), for those in container_sizes
    container_caps: Mapping[str, int] = field(default_factory=dict)

    @property
    def num_requests_held(self) -> int:
        """Distinct ended requests held anywhere (counted from the reported ids)."""
        return len({rid for h in self.held for rid in h.request_ids})

    def to_dict(self) -> dict:
        return {"held": [h.to_dict() for h in self.held], "objects_visited": self.objects_visited,
                "truncated": self.truncated}  # sizes are per idle point: kept there, not in the report


# Ids derived from a request id: the response id handed to the client (``chatcmpl-<id>``,
# ``cmpl-<id>``), a choice's or a prompt's (``<id>-1``, vLLM's ``1_<id>``), a cache key
# (``<id>:prefix``). They are found where the ended id sits between these separators (or the
# string's ends), and only for ids of at least DERIVED_MIN_LEN characters: a short id such as
# ``r-1`` would sit inside unrelated strings.
DERIVED_SEPARATORS = frozenset("-_:/.|#@")
DERIVED_MIN_LEN = 6
_DERIVED_MAX_LEN = 256  # longer strings (texts, not keys) are not searched
_DERIVED_MAX_SEPARATORS = 16


class DerivedIds:
    """Finds the ended request a string stands for: the id itself, a string that contains it
    between separators (``chatcmpl-<id>``, ``<id>-0``), or one that contains the parent id of a
    multi-prompt request's ended ``<parent>-<k>`` (the response id ``cmpl-<parent>``).

    Meant for an idle point, when every request the process knew has ended: a live request's
    id never shares a parent with an ended one there.
    """

    def __init__(self, ended: Iterable[str]) -> None:
        self.exact = frozenset(ended)
        lookup: dict[str, str] = {}
        for rid in sorted(self.exact):  # sorted: a parent names its first child, run after run
            if len(rid) >= DERIVED_MIN_LEN:
                lookup.setdefault(rid, rid)
                parent, sep, tail = rid.rpartition("-")
                if sep and tail.isdigit() and len(parent) >= DERIVED_MIN_LEN:
                    lookup.setdefault(parent, rid)
        self._lookup = lookup

    def __call__(self, text: str) -> str | None:
        if text in self.exact:
            return text
        if not self._lookup or not DERIVED_MIN_LEN < len(text) <= _DERIVED_MAX_LEN:
            return None
        cuts = [i for i, ch in enumerate(text) if ch in DERIVED_SEPARATORS]
        if not cuts or len(cuts) > _DERIVED_MAX_SEPARATORS:
            return None
        starts = [0, *(i + 1 for i in cuts)]
        ends = [*cuts, len(text)]
        for a in starts:
            for b in ends:
                if b - a >= DERIVED_MIN_LEN:
                    rid = self._lookup.get(text[a:b])
                    if rid is not None:
                        return rid
        return None


class _Match:
    """What counts as an ended request: its id (str) or a string derived from it
    (``DerivedIds``), a sequence id of ``seq_id_type`` that is not live (named ``seq <id>`` or by
    its request where ``seq_names`` knows it), or an object whose ``request_id`` is an ended id."""

    def __init__(self, ended, seq_id_type, live_seq_ids, seq_names) -> None:
        self.ended = DerivedIds(ended)
        self.seq_id_type, self.live, self.seq_names = seq_id_type, live_seq_ids, seq_names

    def __call__(self, obj: object) -> str | None:
        if self.seq_id_type is not None and type(obj) is self.seq_id_type:
            return None if obj in self.live else self.seq_names.get(obj, f"seq {int(obj)}")
        return _request_id_of(obj, self.ended)


def _request_id_of(obj: object, ended: DerivedIds) -> str | None:
    """The ended request an object stands for: itself if an ended id (or derived from one), or
    its ``request_id`` (exact)."""
    if isinstance(obj, str):
        return ended(obj)
    if isinstance(obj, _ATOMS) or isinstance(obj, _OPAQUE):
        return None
    try:
        rid = obj.__dict__.get("request_id") if hasattr(obj, "__dict__") else getattr(obj, "request_id", None)
    except Exception:  # noqa: BLE001 - any object may be walked; a broken __getattr__ is not ours to fix
        return None
    return rid if isinstance(rid, str) and rid in ended.exact else None


# Not entered, by the module of an object's type: tensors and arrays (a per-request one is found
# through the map that keys it), and pydantic's own objects (type adapters, field infos, the
# compiled validators and serializers of pydantic-core; their schemas are fixed when a model
# class is built, and in the API server they were 80% of what the routes hold). A request body
# (a pydantic model of vlite's own) is entered.
_NOT_ENTERED_MODULES = ("torch", "numpy", "pydantic_core", "pydantic.")


def _not_entered(obj: object) -> bool:
    return type(obj).__module__.startswith(_NOT_ENTERED_MODULES)


def _callable_children(obj: object) -> Iterable[tuple[str, str, object]]:
    """What a callable holds: a closure's cells (by variable name), a bound method's owner, a
    partial's function and arguments, an ``lru_cache``'s cache dict. Never a function's globals."""
    if isinstance(obj, types.FunctionType):
        names = obj.__code__.co_freevars
        for name, cell in zip(names, obj.__closure__ or ()):
            try:
                yield f".<closure {name}>", "attribute", cell.cell_contents
            except ValueError:  # an empty cell
                continue
    elif isinstance(obj, types.MethodType):
        yield ".__self__", "attribute", obj.__self__
    elif isinstance(obj, functools.partial):
        yield ".func", "attribute", obj.func
        for i, arg in enumerate(obj.args):
            yield f".args[{i}]", "element", arg
        for k, v in obj.keywords.items():
            yield f".keywords[{k!r}]", "value", v
    elif isinstance(obj, _LRU_CACHE_WRAPPER):
        for ref in gc.get_referents(obj):  # the C wrapper's cache is only reachable this way
            if type(ref) is dict and ref is not getattr(obj, "__dict__", None):
                yield ".<lru_cache>", "element", ref


def _children(obj: object) -> Iterable[tuple[str, str, object]]:
    """(path suffix, kind, child) for everything an object holds; kind says how it is held."""
    if isinstance(obj, _CALLABLES):
        yield from _callable_children(obj)
        return
    if isinstance(obj, Mapping) or isinstance(obj, (dict, types.MappingProxyType)):
        try:
            items = list(obj.items())
        except Exception:  # noqa: BLE001 - a mapping that fails to iterate is skipped, not fatal
            return
        for k, v in items:
            yield f"[{k!r}]", "key", k
            yield f"[{k!r}]", "value", v
        return
    if isinstance(obj, (list, tuple, collections.deque)):
        for i, v in enumerate(list(obj)):
            yield f"[{i}]", "element", v
        return
    if isinstance(obj, (set, frozenset)):
        for v in list(obj):
            yield "{}", "element", v
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        for k, v in list(d.items()):
            yield f".{k}", "attribute", v
    slots = [s for cls in type(obj).__mro__ for s in getattr(cls, "__slots__", ())]
    for s in slots if not isinstance(slots, str) else [slots]:
        if s in ("__dict__", "__weakref__"):
            continue
        try:
            yield f".{s}", "attribute", getattr(obj, s)
        except AttributeError:
            continue
    if not isinstance(d, dict) and not slots:
        # C-level containers and objects without __dict__ (e.g. a queue's internals): unnamed refs
        for v in gc.get_referents(obj):
            yield ".<ref>", "element", v


def request_census(roots: Mapping[str, object], ended: Iterable[str], *, skip: Iterable[object] = (),
                   seq_id_type: type | None = None, live_seq_ids: Iterable[int] = (),
                   seq_names: Mapping[int, str] | None = None,
                   max_objects: int = 500_000, max_ids_per_container: int = 20,
                   callbacks_not_followed_into: tuple[str, ...] = ()) -> CensusResult:
    """Walk everything reachable from ``roots`` and report each container holding ended requests.

    roots: name -> object to start from (the name starts each path); ended: ids of requests that
    have ended (at an idle point: every request the run submitted); skip: objects not to enter
    (bounded histories kept on purpose); max_objects: visit budget (the result says truncated
    when it is hit). seq_id_type: the type of sequence ids (``sequence.SeqId``): every instance
    not in ``live_seq_ids`` counts as an ended request's, reported by ``seq_names[seq_id]`` (its
    request id, where known) or ``"seq <id>"``. callbacks_not_followed_into: packages whose objects
    are not entered when a callable leads to them (another census's side of a callback: the API
    server's async client behind the engine loop's event callback, with the API server in the
    same process); they are still matched. A matched object (an ended request's id or an object whose ``request_id``
    is one) is reported in its container and not entered. Raises nothing for odd objects: what
    cannot be iterated is skipped.
    """
    match = _Match(frozenset(ended), seq_id_type, frozenset(live_seq_ids), dict(seq_names or {}))
    skipped = {id(o) for o in skip}
    seen: set[int] = set(skipped)
    hits: dict[str, tuple[str, dict[str, list[str]]]] = {}  # path -> (type, kind -> ids)
    stack: list[tuple[str, object]] = []
    for name, root in roots.items():
        if root is not None and id(root) not in seen:
            seen.add(id(root))
            stack.append((name, root))
    visited = 0
    truncated = False
    sizes: dict[str, int] = {}
    caps: dict[str, int] = {}
    deferred: list[tuple[str, object]] = []  # callables, entered once nothing else is left
    while stack or deferred:
        if not stack:
            stack, deferred = deferred[::-1], []
        if visited >= max_objects:
            truncated = True
            break
        path, obj = stack.pop()
        visited += 1
        if isinstance(obj, (dict, list, set, frozenset, collections.deque, tuple)) and len(obj) and \
                not isinstance(obj, tuple):
            sizes[path] = len(obj)
            if isinstance(obj, collections.deque) and obj.maxlen is not None:
                caps[path] = obj.maxlen
        elif isinstance(obj, _LRU_CACHE_WRAPPER):
            maxsize = obj.cache_info().maxsize
            if maxsize is not None:
                caps[path + ".<lru_cache>"] = maxsize
        held_key = None  # the suffix of a map entry whose key is an ended request's
        for suffix, kind, child in _children(obj):
            rid = match(child)
            if rid is None and kind == "key" and isinstance(child, (tuple, list)):
                # a compound key, e.g. the ledger's (seq_id, block_id), an lru_cache's arguments
                rid = next((r for r in map(match, child) if r is not None), None)
            if rid is not None:
                if kind == "key":
                    held_key = suffix
                # a string held as an object's attribute is owned by that object: report the object
                where = path + suffix if kind == "attribute" else path
                if kind == "attribute" and match(obj) is not None:
                    continue  # the object is itself an ended request's: reported where it is held
                hits.setdefault(where, (type(obj).__name__, {}))[1].setdefault(kind, []).append(rid)
                continue
            if isinstance(child, _ATOMS) or isinstance(child, _OPAQUE) or _not_entered(child):
                continue
            if kind == "value" and suffix == held_key:
                continue  # an ended request's entry is reported at its map, not per part of its value
            if id(child) in seen:
                continue
            if callbacks_not_followed_into and isinstance(obj, _CALLABLES) and \
                    _under(type(child).__module__, callbacks_not_followed_into):
                continue
            seen.add(id(child))
            (deferred if isinstance(child, _CALLABLES) else stack).append((path + suffix, child))
    held = []
    for where, (tname, by_kind) in sorted(hits.items()):
        uniq = sorted({rid for ids in by_kind.values() for rid in ids})
        held.append(HeldRequestState(where, "+".join(sorted(by_kind)), tname, tuple(uniq[:max_ids_per_container]),
                                     max(len(ids) for ids in by_kind.values())))
    return CensusResult(tuple(held), visited, truncated, sizes, {p: c for p, c in caps.items() if p in sizes})


# Whose module- and class-level containers each census walks (``module_roots``). The engine's
# census walks vlite's engine, kernels and server modules; the API server's census
# (``vlite.entrypoints.census``) walks the server's and the serving layer's. With the engine loop
# in a thread of the API server (one process), the engine's census leaves API_SERVER_MODULES to
# the API server's, so that no container is walked, or counted, twice.
ENGINE_MODULES = ("vlite.engine", "vlite.kernels", "vlite.entrypoints")
API_SERVER_MODULES = ("vlite.entrypoints", "vlite.engine.serving")


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_roots(prefixes: tuple[str, ...] = ENGINE_MODULES, exclude: tuple[str, ...] = ()) -> dict[str, object]:
    """Module-level and class-level containers (and ``lru_cache`` functions) of the loaded modules under ``prefixes`` and not
    under ``exclude`` (dotted package names: ``vlite.engine`` covers ``vlite.engine.serving.streams``),
    as census roots named by their dotted path (``vlite.engine.worker.sampler._CACHE``): state that
    no instance holds (a module cache, a class-level registry) is reached too."""
    import sys

    roots: dict[str, object] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not _under(name, prefixes) or _under(name, exclude):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    if cattr.startswith("_") and cattr.endswith("_"):
                        continue  # dunders, dataclass fields, Enum tables: the class's own machinery
                    if isinstance(cvalue, (dict, list, set, collections.deque, _LRU_CACHE_WRAPPER)):
                        roots[f"{name}.{attr}.{cattr}"] = cvalue
            elif isinstance(value, (dict, list, set, collections.deque, _LRU_CACHE_WRAPPER)) and \
                    not attr.startswith("__") and getattr(value, "__module__", name) == name:
                roots[f"{name}.{attr}"] = value
    return roots


class EndedRequests:
    """The requests that ended in one serving process's view: the ids of the last
    ``ENDED_HISTORY`` (what its census looks for) and how many ended in all (``total``)."""

    def __init__(self, maxlen: int = ENDED_HISTORY) -> None:
        self.ids: collections.deque[str] = collections.deque(maxlen=maxlen)
        self.total = 0

    def record(self, request_id: str) -> None:
        self.ids.append(request_id)
        self.total += 1

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.ids  # a scan: for the rare refused add, never per token


class IdleCensus:
    """One serving process's request-id census at its idle points: whether one is due, whether
    it is overdue, and the last result with its cost. The engine loop (``process="engine"``) and
    the API server (``"api_server"``) each hold one over their own ``EndedRequests``; each says
    what keeps it from being idle and what to walk (``tick``).

    Attributes:
        result: the last census (None before the first); held_counts: its container path ->
        ended requests held; elapsed_ms: its cost (ms); taken_at: when (s since the epoch);
        overdue: None, or ``{"seconds": s, "blocked_by": {what: count}}`` while the census has
        been due for ``CENSUS_OVERDUE_INTERVALS`` intervals with no new work in the process and
        never at an idle point (what kept it busy: ``scheduler.running``, ``requests_in_flight``).
    """

    def __init__(self, process: str, ended: EndedRequests) -> None:
        self.process = process
        self.ended = ended
        self.result: CensusResult | None = None
        self.held_counts: dict[str, int] = {}
        self.elapsed_ms: float | None = None
        self.taken_at: float | None = None
        self.overdue: dict | None = None
        self.runs = 0  # censuses run (failed walks included)
        self._total_at_last = 0  # ended.total when the last census started
        self._last = float("-inf")  # time.monotonic() of the last census
        self._due_since: float | None = None  # time.monotonic() when requests first ended since it
        self._looked = float("-inf")  # time.monotonic() of the last look at the blockers while busy

    @property
    def pending(self) -> int:
        """Requests ended since the last census (0: its counts are current)."""
        return self.ended.total - self._total_at_last

    def due(self) -> bool:
        """Requests ended since the last census and ``CENSUS_INTERVAL_S`` has passed (the caller
        also checks that this is an idle point)."""
        return bool(self.pending) and time.monotonic() - self._last >= CENSUS_INTERVAL_S

    def wait_s(self, quiet_since: float) -> float | None:
        """Seconds until a pending census may run (``CENSUS_QUIET_S`` after ``quiet_since``, a
        ``time.monotonic()``, and ``CENSUS_INTERVAL_S`` after the last one); None if none is pending."""
        if not self.pending:
            return None
        return max(0.01, max(quiet_since + CENSUS_QUIET_S, self._last + CENSUS_INTERVAL_S) - time.monotonic())

    def tick(self, blockers: Callable[[], Mapping[str, int]], quiet_since: float, last_work: float,
             walk: Callable[[set[str], list[object]], CensusResult]) -> bool:
        """Look once (cheap when nothing is due): run the census at an idle point, or say it is overdue.

        blockers(): what keeps the process from being idle now, by name -> count (empty: nothing;
        only called while a census is due); quiet_since: ``time.monotonic()`` of the process's
        last activity (a step, the end of an HTTP request): idle needs ``CENSUS_QUIET_S`` of quiet;
        last_work: ``time.monotonic()`` when new work last came (a request added, an HTTP request
        started): a census can only be overdue that long after it. ``walk``: as in ``run``.
        Returns True when the census ran, or when ``overdue`` changed (the caller publishes then).
        """
        if not self.pending:
            changed, self.overdue, self._due_since = self.overdue is not None, None, None
            return changed
        now = time.monotonic()
        if self._due_since is None:
            self._due_since = now
        if now - self._last < CENSUS_INTERVAL_S:
            return False
        quiet = now - quiet_since >= CENSUS_QUIET_S
        waited = now - max(self._due_since, last_work)
        overdue_now = waited >= CENSUS_OVERDUE_INTERVALS * CENSUS_INTERVAL_S
        if not quiet and (not overdue_now or now - self._looked < CENSUS_INTERVAL_S):
            return False  # busy (a step just ran, an HTTP request just ended): the cheap path, every step
        self._looked = now
        busy = dict(blockers())
        if not busy and quiet:
            self.run(walk)
            return True
        if not busy or not overdue_now:
            return False
        changed = self.overdue is None or self.overdue["blocked_by"].keys() != busy.keys()
        self.overdue = {"seconds": round(waited, 1), "blocked_by": busy}
        return changed

    def run(self, walk: Callable[[set[str], list[object]], CensusResult]) -> CensusResult | None:
        """Walk now: ``walk(ended ids, skip)`` is the process's ``request_census`` call, and must
        not enter ``skip`` (this census and its record of ended ids, which name every ended id).
        A failing walk is logged, never raised (a diagnostic must not stop a server); either way
        the requests ended so far count as censused. Returns the result, or None if it failed."""
        total = self.ended.total  # before the ids: a request ending during the walk stays pending
        self.runs += 1
        t0 = time.perf_counter()
        try:
            result = walk(set(self.ended.ids), [self, self.ended])
        except Exception:  # noqa: BLE001
            logger.exception("%s request-id census failed", self.process)
            result = None
        else:
            self.result, self.held_counts = result, {h.path: len(h.request_ids) for h in result.held}
            self.elapsed_ms, self.taken_at = round((time.perf_counter() - t0) * 1e3, 2), time.time()
        self._total_at_last, self._last = total, time.monotonic()
        self.overdue, self._due_since = None, None
        return result

    def document(self) -> dict:
        """The last census for ``/debug/census``: ``process``, ``pid``, ``taken_at`` (s since the
        epoch; None before the first), ``elapsed_ms``, ``pending``, ``overdue`` (None, or seconds
        and ``blocked_by``), ``held`` (each container's path, kind, type, request ids and
        entries), ``objects_visited``, ``truncated``."""
        doc = {"process": self.process, "pid": os.getpid(), "taken_at": self.taken_at,
               "elapsed_ms": self.elapsed_ms, "pending": self.pending, "overdue": self.overdue}
        if self.result is None:
            return doc | {"held": [], "objects_visited": 0, "truncated": False}
        return doc | self.result.to_dict()
