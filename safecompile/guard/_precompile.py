"""A warm restart that loads compiled functions instead of tracing them again.

After a warmup that passed, each warm signature is compiled once more with
``torch.compile(fullgraph=True).aot_compile()`` and saved, sealed with the operator's key,
under ``SAFECOMPILE_CACHE_DIR`` and in the remote tier. A new process loads them before its
first compile and runs a call that passes one's guards through it, wrapped like a traced
graph; anything else takes today's path, with one ``safecompile.precompiled`` event. A torch
that cannot precompile (``torchcompat.compiled_function_loader``) traces every restart.
Inductor's vector-ISA checks that passed are kept the same way (``_isa_checks.py``), so
a restart skips them, and so are the C++ kernels a function's graphs load
(``persist/kernels.py``), so a replica with an empty disk builds none. What a warm
signature compiles to, and why one is not saved, is ``_aot_compile.py``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from safecompile.base import torchcompat
from safecompile.observe.log import Once, log_event, torch_missing
from safecompile.persist import kernels
from safecompile.persist.bounded import read_file
from safecompile.persist.cache import Verdict, _write_atomic, signed_store
from safecompile.persist.restart import Persisted
from safecompile.persist.sources import stale_reasons
from safecompile.shapes.table import BucketTable, unmark

from ._aot_compile import Args, aot_compile, as_compiled, not_saved
from ._isa_checks import ISA_CHECKS
from .facts import GraphFacts

__all__ = ["Precompiled"]

SCOPE = "torch.compile.aot_compile"  # the verdict listing a key's precompiled functions
LAST_KEY = "precompiled_key"  # under the key that outlives an edit: the last key saved
PURPOSE = "precompiled"  # the MAC's purpose for a function's bytes
MAX_BYTES = 1 << 30
READ_TIMEOUT_S = 30.0
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
            compiled = as_compiled(call, buckets)
            if compiled is None:
                continue  # a rejected bucket: it runs eager
            (args, kwargs), plan = compiled
            if any(f.guard_check(*args, **kwargs) for f in (*self._loaded, *made)):
                continue  # loaded, or saved by an earlier call of this warmup
            marked = buckets.mark_range(plan, args, kwargs) if buckets and plan else []
            try:
                made.append(self._save_one(key, args, kwargs))
            except Exception as exc:  # a graph break, a backend torch cannot serialize...
                cause, reason = not_saved(exc, self._top)
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
        made = aot_compile(self._top, self._compiler, self._dynamic, args, kwargs)
        saved = made.fn
        data: bytes = type(saved).serialize(saved, self._external).serialized_data
        file = f"{hashlib.sha256(data).hexdigest()[:32]}.bin"
        self._put(key, file, data)
        entry = dataclasses.asdict(made.facts) | {"file": file, "code": made.code}
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
