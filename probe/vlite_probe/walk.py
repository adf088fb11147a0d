"""The census walk: which containers in this process hold request ids, and how many entries.

Standard library only. It starts from *published* roots: the globals of imported modules and
the suspended coroutines of its asyncio tasks, and goes down through
instance attributes and container entries. It never calls ``gc.get_objects()`` or
``gc.get_referrers()``: those hand out objects that another thread is still building in C (a
tuple that ``_PyTuple_Resize`` must own alone; holding it across a thread switch made vLLM's
``torch.compile`` fail with ``SystemError: Objects/tupleobject.c``). Everything reached here is
already referenced from a published place, so an extra reference to it changes no one's
ownership.

It runs no code of the host: containers are read through the C methods of their base type
(``dict.keys``, ``list.copy``), instance attributes through the type's own ``__dict__``
descriptor, never ``getattr``, ``__iter__`` or ``__len__`` overrides, properties or ``__eq__``.

A container is named by its owner and attribute, ``<module>.<Class>.<attr>`` (or
``<module>.<name>`` for a module global), so the same name comes back at every pass whichever
route reached it first; several instances of one class add up under one name. An entry is a
request id where a key, an element or a value's ``request_id`` attribute is a string that
``id_pattern`` matches: the ids the client was handed (``cmpl-...``, ``chatcmpl-...``,
``resp_...``, ``msg_...``) and the ids derived from them (``cmpl-<id>-0``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import gc
import itertools
import re
import signal
import sys
import threading
import time
import types

# vLLM's, SGLang's and LiteLLM's request and response ids, OpenAI's formats, and the ids vlite's
# own leak-check client sends (X-Request-Id: lc-..., vlite-...), which servers adopt as their
# request id (vLLM: cmpl-lc-00012-0): a prefix, a dash or underscore, then 6 or more letters,
# digits, dashes or underscores with a digit among them ("batch_size" or "msg_template" is no id)
DEFAULT_ID_PATTERN = r"(?:cmpl|chatcmpl|resp|msg|req|batch|vlite|lc)[-_](?=[0-9A-Za-z_-]{6})[0-9A-Za-z_-]*[0-9]"
MAX_SCAN = 20_000  # entries read per container (its size is still len())
MAX_CONTAINERS = 200  # containers reported per pass (most request ids first)
YIELD_EVERY = 1_024  # objects between two time.sleep(0): the host's threads get the GIL back
WALL_FACTOR = 10  # wall-clock bound of a pass, in CPU budgets (the host's threads share the GIL)

_CONTAINERS = (dict, list, set, frozenset, collections.deque, tuple)
_SKIP_TYPES = (str, bytes, bytearray, int, float, complex, bool, type(None), types.ModuleType, type,
               types.BuiltinFunctionType, types.CodeType, memoryview, range)
# A module's functions are its code, not its state: not roots (a function reached from an object,
# a callback or a thread's target, is walked: its closure, or a bound method's owner)
_ROOT_SKIP = _SKIP_TYPES + (types.FunctionType, types.MethodType)
_CLOSURE = types.FunctionType.__dict__["__closure__"]
_CELL = types.CellType.__dict__["cell_contents"]
_METHOD_SELF = types.MethodType.__dict__["__self__"]
_METHOD_FUNC = types.MethodType.__dict__["__func__"]
_PARTIAL = tuple(functools.partial.__dict__[a] for a in ("func", "args", "keywords"))
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, n))
# Packages with no per-request state of a server's, and much to walk (tensors' modules, compilers).
SKIP_PACKAGES = frozenset({
    "vlite_probe", "torch", "numpy", "triton", "sympy", "scipy", "pandas", "jinja2", "google", "grpc", "pydantic_core",
    "pygments", "rich", "numba", "llvmlite", "mpmath", "networkx", "IPython", "setuptools", "pkg_resources", "pip",
    "_pytest", "pytest", "hypothesis", "matplotlib", "PIL", "cv2", "sentencepiece", "tiktoken", "safetensors",
    "regex", "yaml", "idna", "certifi", "charset_normalizer", "zmq", "psutil", "cryptography", "cffi",
})


def _isa(obj: object, classes) -> bool:
    """``isinstance`` by the object's real type: ``isinstance`` reads ``obj.__class__``, which the
    host's class may override (a proxy's ``__getattribute__``)."""
    return issubclass(type(obj), classes)


def _instance_dict(obj: object) -> dict | None:
    """``obj.__dict__`` through its type's own descriptor (C), or None (no dict, or a Python
    ``__dict__`` property that would run the host's code)."""
    for klass in type(obj).__mro__:
        descr = klass.__dict__.get("__dict__")
        if descr is None:
            continue
        if type(descr) in (types.GetSetDescriptorType, types.MemberDescriptorType):
            try:
                d = descr.__get__(obj, type(obj))
            except Exception:
                return None
            return d if type(d) is dict else None
        return None
    return None


def _entries(obj: object, limit: int) -> tuple[list, list]:
    """(keys, values) of a container, at most ``limit`` each, read by its base type's C methods."""
    if _isa(obj, dict):
        return (list(itertools.islice(dict.keys(obj), limit)), list(itertools.islice(dict.values(obj), limit)))
    if _isa(obj, collections.deque):
        return [], list(itertools.islice(collections.deque.__iter__(obj), limit))
    if _isa(obj, list):
        return [], list.__getitem__(obj, slice(0, limit))
    if _isa(obj, tuple):
        return [], list(tuple.__getitem__(obj, slice(0, limit)))
    if _isa(obj, (set, frozenset)):
        return [], list(itertools.islice(set(obj), limit))  # set() merges a set's table in C
    return [], []


def _size(obj: object) -> int:
    for base in (dict, collections.deque, list, tuple, set, frozenset):
        if _isa(obj, base):
            return base.__len__(obj)
    return 0


_TYPE_QUALNAME = type.__dict__["__qualname__"]
_DEQUE_MAXLEN = collections.deque.__dict__["maxlen"]


def _qualname(obj: object) -> str:
    """``module.Class`` of ``obj``'s type, read without the metaclass's attribute lookup."""
    t = type(obj)
    mod = t.__dict__.get("__module__")
    return f"{mod if _isa(mod, str) else '?'}.{_TYPE_QUALNAME.__get__(t)}"


class Census:
    """One pass's result: per container, entries holding request ids and its size.

    ``containers``: name -> ``{"ids": request-id entries, "entries": len(), "maxlen": a deque's
    cap or None, "instances": containers added up under the name}``; ``objects``: objects
    visited; ``elapsed_s`` (wall clock) and ``cpu_s`` (the walk's thread); ``truncated``: the visit or time budget ran out (counts are partial).
    """

    def __init__(self) -> None:
        self.containers: dict[str, dict] = {}
        self.objects = 0
        self.elapsed_s = 0.0
        self.cpu_s = 0.0
        self.truncated = False

    def add(self, name: str, ids: int, entries: int, maxlen: int | None) -> None:
        c = self.containers.setdefault(name, {"ids": 0, "entries": 0, "maxlen": None, "instances": 0})
        c["ids"] += ids
        c["entries"] += entries
        c["instances"] += 1
        if maxlen is not None:
            c["maxlen"] = (c["maxlen"] or 0) + maxlen

    def top(self, n: int = MAX_CONTAINERS) -> dict[str, dict]:
        """The ``n`` containers holding the most request ids (those with none left out)."""
        held = sorted(((k, v) for k, v in self.containers.items() if v["ids"]), key=lambda kv: (-kv[1]["ids"], kv[0]))
        return dict(held[:n])


def _roots() -> list[tuple[str, object]]:
    """The coroutines of asyncio tasks (their locals: where an ASGI server keeps its app and a
    handler its request); the targets and arguments of running threads (a bound method's owner:
    vLLM's engine core is reached from its socket threads) and the signal handlers; then the
    containers and instances that modules hold as globals (not the standard library's, not
    ``SKIP_PACKAGES``), as (owner name, object). Running threads' frames are not read:
    ``frame.f_locals`` of a running frame writes into it."""
    out: list[tuple[str, object]] = []
    tasks = getattr(asyncio.tasks, "_all_tasks", None)
    pending: list = []
    for _ in range(3):  # a WeakSet another thread may change while it is copied
        try:
            pending = list(tasks or ())
            break
        except RuntimeError:
            continue
    for task in pending:
        coro = task.get_coro() if _isa(task, asyncio.Task) else None
        while _isa(coro, (types.CoroutineType, types.GeneratorType)):
            code = coro.cr_code if _isa(coro, types.CoroutineType) else coro.gi_code
            out.append((f"<task {code.co_qualname}>", coro))
            coro = coro.cr_await if _isa(coro, types.CoroutineType) else coro.gi_yieldfrom
    for thread in list(getattr(threading, "_active", {}).values()):
        d = _instance_dict(thread)
        if d is not None and thread is not threading.current_thread():
            out.extend((f"<thread {d.get('_name', '?')}>", d.get(k)) for k in ("_target", "_args", "_kwargs")
                       if d.get(k) is not None)
    for sig in _SIGNALS:
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if _isa(handler, (types.FunctionType, types.MethodType, functools.partial)):
            out.append((f"<signal handler {sig}>", handler))
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if top in stdlib or top in SKIP_PACKAGES or (top.startswith("_") and top != "__main__") \
                or not _isa(module, types.ModuleType):
            continue
        d = _instance_dict(module)
        if d is None:
            continue
        out.extend((f"{name}.{attr}", value) for attr, value in list(d.items())
                   if not _isa(value, _ROOT_SKIP) and not attr.startswith("__"))
    return out


SKIP, INSTANCE, CORO, DICT, DEQUE, LIST, TUPLE, SET, FUNCTION, METHOD, PARTIAL = range(11)


class _Types:
    """Per type, read once per pass: what the walk does with its instances, and its ``__dict__``
    descriptor (a C getset or member descriptor, else None)."""

    def __init__(self) -> None:
        self.kinds: dict[type, int] = {}
        self.dict_descr: dict[type, object] = {}

    def kind(self, obj: object) -> int:
        t = type(obj)
        k = self.kinds.get(t)
        if k is None:
            k = self.kinds[t] = _kind_of(t)
        return k

    def instance_dict(self, obj: object) -> dict | None:
        t = type(obj)
        try:
            descr = self.dict_descr[t]
        except KeyError:
            descr = self.dict_descr[t] = _dict_descriptor(t)
        if descr is None:
            return None
        try:
            d = descr.__get__(obj, t)
        except Exception:
            return None
        return d if type(d) is dict else None


def _kind_of(t: type) -> int:
    if issubclass(t, _SKIP_TYPES):
        return SKIP
    if issubclass(t, (types.CoroutineType, types.GeneratorType)):
        return CORO
    if issubclass(t, types.FunctionType):
        return FUNCTION
    if issubclass(t, types.MethodType):
        return METHOD
    if issubclass(t, functools.partial):
        return PARTIAL
    for base, kind in ((dict, DICT), (collections.deque, DEQUE), (list, LIST), (tuple, TUPLE),
                       ((set, frozenset), SET)):
        if issubclass(t, base):
            return kind
    return INSTANCE


def _dict_descriptor(t: type):
    for klass in t.__mro__:
        descr = klass.__dict__.get("__dict__")
        if descr is not None:
            return descr if type(descr) in (types.GetSetDescriptorType, types.MemberDescriptorType) else None
    return None


def census(id_pattern: str = DEFAULT_ID_PATTERN, *, max_objects: int = 300_000, budget_s: float = 2.0,
           skip: tuple = ()) -> Census:
    """Walk this process from its published roots and count request-id entries per container.

    ``id_pattern``: a regular expression a request id matches from its start; ``max_objects``:
    the visit budget; ``budget_s``: the CPU time the walk may take (this thread's, the GIL time it
    takes from the host), and at most ``WALL_FACTOR`` times as much wall-clock time when the
    host's threads hold the GIL; ``Census.truncated`` when a budget runs out. ``skip``: objects
    not to enter (the probe's own). Raises nothing: an object that cannot be read is skipped.
    """
    match = re.compile(id_pattern).match
    out = Census()
    t0, cpu0 = time.perf_counter(), time.thread_time()
    deadline, wall_deadline = cpu0 + budget_s, t0 + WALL_FACTOR * budget_s
    seen = {id(o) for o in skip}
    seen.add(id(out))
    kinds = _Types()
    kind = kinds.kind

    def is_id(value: object) -> bool:
        if type(value) is str:
            return match(value) is not None
        if kind(value) != INSTANCE:
            return False
        d = kinds.instance_dict(value)
        rid = d.get("request_id") if d is not None else None
        return type(rid) is str and match(rid) is not None

    queue = collections.deque(_roots())
    visits = 0
    while queue:
        owner, obj = queue.popleft()
        k = kind(obj)
        if k == SKIP or id(obj) in seen:
            continue
        seen.add(id(obj))
        visits += 1
        if visits % 256 == 0:
            if visits >= max_objects or time.thread_time() > deadline or time.perf_counter() > wall_deadline:
                out.truncated = True
                break
            if visits % YIELD_EVERY == 0:
                time.sleep(0)
        try:
            if k == CORO:  # a suspended task's locals
                queue.extend((owner, o) for o in gc.get_referents(obj) if kind(o) != SKIP)
                continue
            if k == FUNCTION:  # a callback's closure
                cells = _CLOSURE.__get__(obj) or ()
                for cell in cells:
                    try:
                        value = _CELL.__get__(cell)
                    except ValueError:  # an empty cell
                        continue
                    if kind(value) != SKIP:
                        queue.append((owner, value))
                continue
            if k == METHOD:  # a bound method: its owner (walked under its own class's name) and function
                queue.extend((owner, o) for o in (_METHOD_SELF.__get__(obj), _METHOD_FUNC.__get__(obj))
                             if kind(o) != SKIP)
                continue
            if k == PARTIAL:
                queue.extend((owner, o) for o in (d.__get__(obj) for d in _PARTIAL) if kind(o) != SKIP)
                continue
            if k == INSTANCE:
                d = kinds.instance_dict(obj)
                if d is not None:
                    prefix = _qualname(obj)
                    queue.extend((f"{prefix}.{a}", v) for a, v in list(d.items()) if kind(v) != SKIP)
                continue
            keys, values = _entries(obj, MAX_SCAN)
            if keys:  # a dict: an entry holds an id in its key or its value
                ids = sum(1 for a, v in zip(keys, values) if is_id(a) or is_id(v))
            else:
                ids = sum(1 for v in values if is_id(v))
            if k != TUPLE:
                out.add(owner, ids, _size(obj), _DEQUE_MAXLEN.__get__(obj) if k == DEQUE else None)
            inner = owner if owner.endswith("[]") else owner + "[]"
            queue.extend((inner, a) for a in keys if kind(a) != SKIP)
            queue.extend((inner, v) for v in values if kind(v) != SKIP)
        except Exception:  # an odd object: skipped, the walk goes on
            continue
    out.objects = visits
    out.elapsed_s = time.perf_counter() - t0
    out.cpu_s = time.thread_time() - cpu0
    return out
