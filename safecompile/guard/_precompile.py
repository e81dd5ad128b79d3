"""A warm restart that loads compiled functions instead of tracing them again.

After a warmup that passed, each warm signature is compiled once more with
``torch.compile(fullgraph=True).aot_compile()`` and saved, sealed with the operator's key,
under ``SAFECOMPILE_CACHE_DIR`` and in the remote tier. A new process loads them before its
first compile and runs a call that passes one's guards through it, wrapped like a traced
graph; anything else takes today's path, with one ``safecompile.precompiled`` event. A torch
that cannot precompile (``torchcompat.compiled_function_loader``) traces every restart.
Inductor's vector-ISA checks that passed are kept the same way, so a restart skips them,
and so are the C++ kernels a function's graphs load (``persist/kernels.py``), so a replica
with an empty disk builds none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from safecompile.base import torchcompat
from safecompile.observe.explain import explain
from safecompile.observe.log import Once, log_event, torch_missing
from safecompile.observe.source import location_of_error
from safecompile.persist import kernels
from safecompile.persist.bounded import read_file
from safecompile.persist.cache import (
    Verdict,
    VerdictStore,
    _write_atomic,
    environment,
    signed_store,
)
from safecompile.persist.restart import Persisted
from safecompile.persist.sources import code_record, describe_global, stale_reasons
from safecompile.shapes.buckets import Plan
from safecompile.shapes.table import BucketStatus, BucketTable, unmark

from .facts import GraphFacts, read_facts

__all__ = ["Precompiled"]

SCOPE = "torch.compile.aot_compile"  # the verdict listing a key's precompiled functions
LAST_KEY = "precompiled_key"  # under the key that outlives an edit: the last key saved
PURPOSE = "precompiled"  # the MAC's purpose for a function's bytes
MAX_BYTES = 1 << 30
READ_TIMEOUT_S = 30.0
# Guards (``<kind>_MATCH``) on a global that a loaded function no longer checks, whose
# value (described) is saved and compared at load; a graph guarded on a global in any
# other way (a tensor's) is not saved.
_RECORDED = frozenset(
    [
        *("BUILTIN", "CLASS", "CLOSURE", "FUNCTION", "ID", "MODULE", "TYPE", "CONSTANT"),
        *("EQUALS", "SEQUENCE_LENGTH", "DICT_KEYS", "DICT_LENGTH", "LIST_LENGTH", "BOOL"),
        *("NONE", "NOT_NONE", "TUPLE_ITERATOR_LEN", "NOT_PRESENT_IN_GENERIC_DICT"),
        *("DICT_CONTAINS", "HASATTR", "DUPLICATE_INPUT"),
    ]
)
_UNRECORDED_VALUES = (torch.Tensor, torch.nn.Module)
_TORCH_GLOBAL = "G['__import_torch"  # torch's own modules: part of the torch version
ISA_SCOPE = "torch._inductor.cpu_vec_isa"  # the vector-ISA checks passed on this machine

Args = tuple[tuple[Any, ...], dict[str, Any]]  # a call's positional and keyword arguments
Adopt = Callable[[Callable[..., Any], GraphFacts], Callable[..., Any]]


class Precompiled:
    """One guarded callable's precompiled functions: saved after a warmup, loaded once."""

    def __init__(
        self,
        persisted: Persisted,
        top: Callable[..., Any],
        target: Callable[..., Any],
        compiler: Callable[..., Any],
        dynamic: bool | None,
        inductor: bool,
    ) -> None:
        root, store = signed_store()
        self._store = store
        self._signer = store.signer if store is not None else None
        found = torchcompat.compiled_function_loader() if store is not None else None
        if isinstance(found, torchcompat.Missing):
            torch_missing(found)  # inductor's vector-ISA checks are still kept
            found = None
        self._load_fn = found
        self._dir = root / "precompiled" if root is not None and found is not None else None
        self._persisted = persisted  # its key is ours, made by the first call's load()
        self._key: str | None = None
        self._identity: str | None = None  # persisted.identity_key(): outlives an edit
        self._top = top  # what torch.compile compiles (see backend.own_frame)
        self._external = {"target": target}  # the live module or function, never pickled
        self._compiler = compiler
        self._dynamic = dynamic
        self._inductor = inductor
        self._lock = threading.Lock()
        self._looked = False
        self._loaded: tuple[Any, ...] = ()
        self._traced: Callable[..., Any] | None = None
        self._saved: dict[str, dict[str, Any]] = {}  # file name -> its index entry
        self._shipped: set[str] = set()  # kernel files this process saved under its key
        self._said = Once()

    def serving(self, traced: Callable[..., Any]) -> Callable[..., Any]:
        """What the guard calls: ``traced``, or under a cache dir the loaded functions first."""
        self._traced = traced
        return self._call if self._dir is not None else traced

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        for fn in self._loaded:
            if fn.guard_check(*args, **kwargs):
                return fn.fn(*args, **kwargs)
        if self._loaded:
            found = _unmarked_match(self._loaded, args, kwargs)
            if found is not None:
                return found.fn(*args, **kwargs)
            self._event("no_guard_matched", "this call is traced as usual", logging.INFO)
        assert self._traced is not None  # serving() came first
        return self._traced(*args, **kwargs)

    def save(self, calls: list[Args], name: str, buckets: BucketTable | None) -> None:
        """After a warmup that passed: each warm signature, as the compiled function got
        it (padded, or marked dynamic over its range; a rejected bucket's left out),
        precompiled and saved."""
        key, store = self._key, self._store
        if store is None or key is None:
            return
        if self._dir is None:  # this torch cannot precompile: only its ISA checks are kept
            ISA_CHECKS.save(store)
            return
        made: list[Any] = []
        for call in calls:
            compiled = _as_compiled(call, buckets)
            if compiled is None:
                continue  # a rejected bucket: it runs eager
            (args, kwargs), plan = compiled
            if any(f.guard_check(*args, **kwargs) for f in (*self._loaded, *made)):
                continue  # loaded, or saved by an earlier call of this warmup
            marked = buckets.mark_range(plan, args, kwargs) if buckets and plan else []
            try:
                made.append(self._save_one(key, args, kwargs))
            except Exception as exc:  # a graph break, a backend torch cannot serialize...
                cause, reason = _not_saved(exc, self._top)
                self._event("not_saved", reason, logging.INFO, cause=cause)
                break  # the other signatures would most likely fail the same way
            finally:
                unmark(marked)
        if made:
            graphs = list(self._saved.values())
            verdict = Verdict(kind=PURPOSE, time=time.time(), name=name, details={"graphs": graphs})
            store.put(key, verdict, SCOPE)
            if self._identity is not None and self._identity != key:  # the last key saved
                last = Verdict(kind=LAST_KEY, time=time.time(), name=name, details={"key": key})
                store.put(self._identity, last, SCOPE)
        ISA_CHECKS.save(store)

    def _save_one(self, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        facts: list[GraphFacts] = []
        read: list[str] = []  # globals guarded on in a way no record checks
        recorded: dict[str, str] = {}  # the other globals guarded on: name -> value described
        unserializable = torchcompat.lookup(  # checked: 2.13.0 (torch's default filter's)
            "torch._dynamo.guards.CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES"
        )

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            compiled = self._compiler(gm, example_inputs)
            facts.append(read_facts(gm))
            return compiled

        def guards(entries: list[Any]) -> list[bool]:
            # as torch's default, no guard on a global is kept: each is recorded with the
            # value it held (checked before a load), or the graph is not saved
            for g in entries:
                if not g.is_global or g.name.startswith(_TORCH_GLOBAL):
                    continue
                if (
                    g.has_value
                    and g.guard_type.removesuffix("_MATCH") in _RECORDED
                    and not isinstance(g.value, _UNRECORDED_VALUES)
                ):
                    recorded[g.name] = describe_global(g.value)
                else:
                    read.append(g.name)
            return [not (g.is_global or g.guard_type in (unserializable or ())) for g in entries]

        compile_: Any = torchcompat.torch_compile()  # torch's own, under install() too
        options = {"guard_filter_fn": guards}
        fn = compile_(
            self._top, fullgraph=True, backend=backend, dynamic=self._dynamic, options=options
        )
        saved = fn.aot_compile((args, kwargs))
        if facts[0].effects:  # updates to find again at run time
            raise NotSaved("python_side_effects", "it updates Python objects")
        if read:  # global values no record checks
            raise NotSaved("global_read", f"it reads globals no record checks: {read[:3]}")
        inlined = torchcompat.inlined_sources(saved)
        if isinstance(inlined, torchcompat.Missing):  # what it came from cannot be checked
            raise NotSaved("untracked_code", f"{inlined.name}: {inlined.effect}")
        scope = str(self._top.__globals__.get("__name__"))
        record = code_record(inlined, recorded, scope)
        data: bytes = type(saved).serialize(saved, self._external).serialized_data
        file = f"{hashlib.sha256(data).hexdigest()[:32]}.bin"
        self._put(key, file, data)
        entry = dataclasses.asdict(facts[0]) | {"file": file, "code": record}
        self._saved[file] = entry | (self._ship_kernels(key, saved) if self._inductor else {})
        return saved

    def _ship_kernels(self, key: str, saved: Any) -> dict[str, Any]:
        """The C++ libraries ``saved``'s graphs load, saved sealed beside it: what its index
        entry lists (``{}``: none shipped, and an event says why)."""
        libraries = torchcompat.kernel_libraries(saved)
        root = torchcompat.inductor_cache_dir()
        if isinstance(libraries, torchcompat.Missing) or isinstance(root, torchcompat.Missing):
            missing = libraries if isinstance(libraries, torchcompat.Missing) else root
            assert isinstance(missing, torchcompat.Missing)
            self._event("kernels_not_saved", f"{missing.name}: {missing.effect}", logging.INFO)
            return {}
        listed: list[dict[str, str]] = []
        for path in libraries:
            rel = kernels.relative(root, path)
            data = kernels.read(path) if rel is not None else None
            if rel is None or data is None or len(data) > kernels.MAX_BYTES:
                reason = f"{path}: not a library in inductor's cache, or unreadable"
                self._event("kernels_not_saved", reason, logging.INFO)
                return {}
            file = kernels.blob_name(data)
            if file not in self._shipped:
                self._put(key, file, data)
                self._shipped.add(file)
            listed.append({"path": rel, "file": file})
        return {"kernels": listed, "kernels_for": kernels.machine()}

    def _put(self, key: str, file: str, data: bytes) -> None:
        assert self._signer is not None
        assert self._dir is not None
        assert self._store is not None
        sealed = self._signer.seal(PURPOSE, f"{key}/{file}", data)
        remote = self._store.remote
        shared = remote is not None and remote.put_blob(key, file, sealed)
        if not _write_atomic(self._dir / key / file, sealed) and not shared:
            raise OSError("written neither to the cache dir nor to the remote tier")

    def load(self, args: tuple[Any, ...], kwargs: dict[str, Any], adopt: Adopt) -> None:
        """Once per process, before the first compile: load what an earlier one saved."""
        with self._lock:
            if self._looked or self._store is None:
                return
            self._looked = True
        if self._inductor:
            ISA_CHECKS.route(self._store)
        key = self._key = self._persisted.key(args, kwargs)
        if self._dir is None:  # this torch cannot load them
            return
        self._identity = self._persisted.identity_key(args, kwargs)
        verdict = self._store.get(key, SCOPE) if key is not None else None
        if key is None or verdict is None:
            self._missing(key)
            return
        loaded = []
        built: list[int] = []  # the kernels installed, not built, per graph loaded
        stale: list[str] = []
        for entry in verdict.details.get("graphs", []):
            reasons = stale_reasons(entry, self._top.__globals__)
            if reasons:  # saved from other code: traced afresh, saved again
                stale.extend(r for r in reasons if r not in stale)
                continue
            try:
                loaded.append(self._load_one(key, entry, adopt, built))
                self._saved[str(entry["file"])] = entry  # kept when this process saves more
            except Exception as exc:  # unsigned, tampered, another torch, not loadable
                self._event("not_loaded", f"{type(exc).__name__}: {exc}", logging.WARNING)
        self._loaded = tuple(loaded)
        if stale:  # the key missed an edit: what else it holds is as old
            self._persisted.forget_verdicts()
            self._event("stale", _stale_text(stale), logging.INFO)
        if loaded:
            reason = f"{len(loaded)} graph(s) loaded, not traced"
            reason += f"; {sum(built)} C++ kernel(s) shipped, not built" if sum(built) else ""
            log_event("safecompile.precompiled", outcome="loaded", reason=reason)

    def _missing(self, key: str | None) -> None:
        """Nothing saved under this key: said ``stale`` with what changed when the last key
        saved for this callable was another (an edit in code the key's walk sees)."""
        assert self._store is not None
        last = self._store.get(self._identity, SCOPE) if self._identity is not None else None
        before = last.details.get("key") if last is not None else None
        old = self._store.get(before, SCOPE) if isinstance(before, str) and before != key else None
        reasons: list[str] = []
        for entry in old.details.get("graphs", []) if old is not None else []:
            reasons.extend(
                r for r in stale_reasons(entry, self._top.__globals__) if r not in reasons
            )
        if reasons:
            self._event("stale", _stale_text(reasons), logging.INFO)
        else:
            self._event("missing", "nothing saved for this key: traced as usual", logging.INFO)

    def _load_one(self, key: str, entry: dict[str, Any], adopt: Adopt, built: list[int]) -> Any:
        assert self._load_fn is not None
        data = self._get(key, str(entry["file"]), MAX_BYTES)  # a name this module made
        installed = self._install_kernels(key, entry)
        root = torchcompat.inductor_cache_dir() if installed else None
        headers = (  # every kernel is there: none is built, so no header is precompiled
            torchcompat.headers_not_precompiled(os.path.join(root, "safecompile-headers"))
            if isinstance(root, str)
            else nullcontext()
        )
        with headers:
            fn = self._load_fn(
                io.BytesIO(data), f_globals=self._top.__globals__, external_data=self._external
            )
        built.append(installed)
        fields = {f: entry[f] for f in ("label", "code", "unchecked", "mutates")}
        facts = GraphFacts(**fields, effects=())
        wrapped = torchcompat.precompiled_rewrapped(fn, lambda graph: adopt(graph, facts))
        if isinstance(wrapped, torchcompat.Missing):
            torch_missing(wrapped)
            raise LookupError(wrapped.name)
        return wrapped

    def _get(self, key: str, file: str, limit: int) -> bytes:
        """A file :meth:`_put` saved, from the cache dir or the remote tier, unsealed."""
        assert self._signer is not None
        assert self._dir is not None
        assert self._store is not None
        sealed = read_file(self._dir / key / file, limit=limit, timeout=READ_TIMEOUT_S)
        if sealed is None and self._store.remote is not None:
            sealed = self._store.remote.get_blob(key, file, limit)
        if sealed is None or len(sealed) > limit:
            raise FileNotFoundError(f"{file}: not found, or larger than {limit} bytes")
        return self._signer.unseal(PURPOSE, f"{key}/{file}", sealed)  # before it is used

    def _install_kernels(self, key: str, entry: dict[str, Any]) -> int:
        """The C++ kernels saved with ``entry``, written where inductor looks for them: how
        many (0: none was saved, they were built for another machine, or one is missing,
        and this process builds those its graphs need)."""
        listed = entry.get("kernels")
        if not listed:
            return 0
        if entry.get("kernels_for") != kernels.machine():
            reason = "built for another CPU, compiler, torch or Python: this process builds them"
            self._event("kernels_built_here", reason, logging.INFO)
            return 0
        root = torchcompat.inductor_cache_dir()
        try:
            if isinstance(root, torchcompat.Missing):
                raise LookupError(f"{root.name}: {root.effect}")
            for item in listed:
                rel = str(item["path"])
                if not (Path(root) / rel).exists():
                    data = self._get(key, str(item["file"]), kernels.MAX_BYTES)
                    if not kernels.install(root, rel, data):
                        raise OSError(f"{rel}: cannot be written under {root}")
        except Exception as exc:  # unsigned, tampered, gone from Redis: built here instead
            reason = f"{type(exc).__name__}: {exc}; this process builds them"
            self._event("kernels_built_here", reason, logging.WARNING)
            return 0
        return len(listed)

    def forget(self) -> None:
        """``reset()``: serve nothing loaded, and delete what this key saved."""
        self._loaded = ()
        self._saved.clear()
        if self._dir is not None and self._key is not None:
            for path in (self._dir / self._key).glob("*.bin"):
                path.unlink(missing_ok=True)

    def _event(self, outcome: str, reason: str, level: int, **fields: Any) -> None:
        if self._said.first(outcome):  # once per outcome
            log_event(
                "safecompile.precompiled", level=level, outcome=outcome, reason=reason, **fields
            )


class NotSaved(Exception):
    """A warm signature that is compiled but not saved, and why (``cause``: one word)."""

    def __init__(self, cause: str, reason: str) -> None:
        super().__init__(reason)
        self.cause = cause


def _not_saved(exc: Exception, fn: Callable[..., Any]) -> tuple[str, str]:
    """The ``cause`` and ``reason`` of a ``not_saved`` event: ``graph_break`` (torch
    precompiles whole graphs only), ``not_serializable`` (a backend's result torch cannot
    save), ``python_side_effects``, ``global_read``, ``untracked_code`` or ``error``."""
    if isinstance(exc, NotSaved):
        return exc.cause, f"{exc}: this signature is traced at every start"
    said = explain(exc, location_of_error(exc, fn)[0])
    if said.kind == "graph_break":
        location, _ = location_of_error(exc, fn)
        where = f" at {os.path.basename(location.file)}:{location.line}" if location else ""
        reason = (
            f"{said.summary}{where}: torch precompiles whole graphs only, so this "
            "signature is traced at every start"
        )
        return "graph_break", reason
    cause = "not_serializable" if "SerializableCallable" in str(exc) else "error"
    return cause, f"{type(exc).__name__}: {exc}"


class IsaChecks:
    """Inductor's vector-ISA checks (each builds a C++ program and loads it in a new Python:
    ten a process, ~3 s here) answered from those passed in an earlier process of the same
    torch, Python and CPU, kept signed. torch still reads the CPU's flags itself before it
    asks a check, and a check not passed before runs: no saved answer claims an instruction."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._routed = False
        self._passed: set[str] = set()  # torch's keys of the checks passed
        self._unsaved = False

    def route(self, store: VerdictStore) -> None:
        """Once per process, before inductor's first check: read what passed before."""
        with self._lock:
            if self._routed:
                return
            self._routed = True
        verdict = store.get(_isa_key(), ISA_SCOPE)
        passed = verdict.details.get("passed", []) if verdict is not None else []
        with self._lock:
            self._passed.update(k for k in passed if isinstance(k, str))
        missing = torchcompat.route_vec_isa_checks(self.answer)
        if isinstance(missing, torchcompat.Missing):
            torch_missing(missing)

    def answer(self, key: str, check: Callable[[], bool]) -> bool:
        if key in self._passed:
            return True
        if not check():
            return False  # not kept: a failure may be passing (a probe timed out)
        with self._lock:
            self._passed.add(key)
            self._unsaved = True
        return True

    def save(self, store: VerdictStore) -> None:
        with self._lock:
            if not self._unsaved:
                return
            self._unsaved = False
            passed = sorted(self._passed)
        verdict = Verdict(kind="vec_isa_checks", time=time.time(), details={"passed": passed})
        store.put(_isa_key(), verdict, ISA_SCOPE)


ISA_CHECKS = IsaChecks()


def _isa_key() -> str:
    """What a check's result depends on besides torch's key for it (which holds the
    compiler's version, the flags and the torch version): this torch build, its library
    directory, this Python, the CPU."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    facts = environment("cpu") | {"torch.lib": lib, "python.executable": sys.executable}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def _stale_text(reasons: list[str]) -> str:
    shown = "; ".join(reasons[:5]) + (f" (and {len(reasons) - 5} more)" if len(reasons) > 5 else "")
    return f"saved from other code ({shown}): traced afresh (saved again after a warmup)"


def _unmarked_match(loaded: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The loaded function whose guards pass the call with its tensors' dynamic marks
    left out (a dynamic range's first call arrives marked for dynamo to trace it so; a
    saved function's guards refuse a mark), or ``None``."""
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    marked = [(t, {m: getattr(t, m) for m in _MARKS if hasattr(t, m)}) for t in tensors]
    marked = [(t, marks) for t, marks in marked if marks]
    if not marked:
        return None
    try:
        for tensor, marks in marked:
            for name in marks:
                delattr(tensor, name)
        return next((fn for fn in loaded if fn.guard_check(*args, **kwargs)), None)
    finally:
        for tensor, marks in marked:
            for name, value in marks.items():
                setattr(tensor, name, value)


_MARKS = torchcompat.DYNAMIC_MARKS


def _as_compiled(call: Args, buckets: BucketTable | None) -> tuple[Args, Plan | None] | None:
    """A warm call's arguments as the compiled function got them, and with
    ``strategy="dynamic"`` the plan whose range to mark on them (``None``: it did not get
    them, a rejected bucket)."""
    plan = buckets.bucketer.plan(*call) if buckets is not None else None
    if buckets is None or plan is None or plan.status != "bucketed":
        return call, None
    if buckets.entry(plan).status is BucketStatus.REJECTED:
        return None
    if not buckets.pads:
        return call, plan
    return buckets.bucketer.pad(plan, *call), None
