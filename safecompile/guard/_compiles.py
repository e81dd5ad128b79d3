"""Compiles in flight, and compile failures persisted across restarts.

:class:`CompileTracker` knows which thread is compiling (single flight: while one thread
compiles, eager serves every other call, clear of a torch race where a compiled call
racing the install of a new graph misses the cache); every way out of a compile releases
it. A compile that starts closes the gate's hot path; the last one to end has the gate
recomputed (:class:`~._gate.Gate`). :class:`KnownFailures` persists "this code fails to
compile here" under ``SAFECOMPILE_CACHE_DIR``, keyed by code, torch, Python, device and
options.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from safecompile.base.model import Reason
from safecompile.observe.source import error_type_name, safe_message
from safecompile.persist import remote
from safecompile.persist.cache import CallKey, Verdict, signed_store, use_torch_caches
from safecompile.persist.signing import warn_ignored


class _Gate(Protocol):
    """What a compile touches of the gate (:class:`~._gate.Gate`)."""

    deferred: bool
    fast: bool
    lock: threading.RLock

    def update(self) -> None: ...


__all__ = ["CompileTracker", "KnownFailures"]


class CompileTracker:
    """Which threads compile now (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth: dict[int, int] = {}
        self.busy = False  # some thread compiles
        self.gate: _Gate | None = None  # closed while a compile runs (set by the engine)
        self._here = threading.local()  # .allowed: this thread is in a warmup call
        # held by each warmup call (they may compile) and by reset(): torch cannot drop a
        # code's graphs while another thread is between compiling and installing one
        self.warm_lock = threading.RLock()

    def may_here(self) -> bool:
        """Whether a call on this thread may make a new graph (with deferred compiles, only
        a warmup call may: a live call's new graph is compiled later, on a worker)."""
        return getattr(self._here, "allowed", False)

    @contextmanager
    def here(self) -> Iterator[None]:
        """A warmup call: this thread may make new graphs while the block runs."""
        before = self.may_here()
        with self.warm_lock:
            self._here.allowed = True
            try:
                yield
            finally:
                self._here.allowed = before

    def busy_elsewhere(self) -> bool:
        me = threading.get_ident()
        return any(thread != me for thread in list(self._depth))

    @contextmanager
    def claim(self, *, exclusive: bool = False) -> Iterator[bool]:
        """Note that this thread compiles while the block runs (nested claims count),
        released whatever way it ends. ``exclusive``: only if no other thread compiles
        (``False`` then, and nothing noted)."""
        me = threading.get_ident()
        with self._lock:
            got = not (exclusive and self.busy_elsewhere())
            if got:
                self._depth[me] = self._depth.get(me, 0) + 1
                self.busy = True
            outermost = got and self._depth[me] == 1
        if not got:
            yield False
            return
        gate = self.gate
        if outermost:
            remote.mark_compile()  # what torch reads from Redis from here is this compile's
            if gate is not None and not gate.deferred:
                with gate.lock:  # after ``busy``: a recompute now sees it (no reopening)
                    gate.fast = False
        try:
            yield True
        finally:
            with self._lock:
                depth = self._depth.pop(me, 1) - 1
                if depth > 0:
                    self._depth[me] = depth
                self.busy = bool(self._depth)
            if outermost and gate is not None:
                gate.update()  # the graphs it made, or the compile it no longer blocks

    def reset(self) -> None:
        with self._lock:
            self._depth.clear()
            self.busy = False


class KnownFailures:
    """Compile failures persisted under ``SAFECOMPILE_CACHE_DIR`` (a no-op without it)."""

    def __init__(self, target: Callable[..., Any], options: dict[str, Any]) -> None:
        root, self._store = signed_store()
        if root is not None:
            try:
                use_torch_caches(root)
            except OSError as exc:  # a cache never fails a decoration
                warn_ignored(root / "torch", f"cannot use: {type(exc).__name__}: {exc}")
        self._key = CallKey(target, options)
        self._checked = False

    def known(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Once per process, before the first compile: the persisted failure's message."""
        if self._store is None or self._checked:
            return None
        self._checked = True
        key = self._key.get(args, kwargs)
        verdict = self._store.get(key) if key is not None else None
        if verdict is None or verdict.kind != "compile_failed":
            return None
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(verdict.time))
        return (
            f"known compile failure, persisted {when} UTC under this code, torch, Python "
            f"and device ({verdict.error_type}: {verdict.message}); not retried until "
            "one of them changes or reset()"
        )

    def persist(
        self, name: str, error: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if self._store is None:
            return
        key = self._key.get(args, kwargs)
        if key is None:
            return
        self._store.put(
            key,
            Verdict(
                kind="compile_failed",
                time=time.time(),
                name=name,
                reason=Reason.COMPILE_ERROR.value,
                error_type=error_type_name(error),
                message=safe_message(error),
            ),
        )

    def forget(self) -> None:
        """``reset()``: drop the persisted verdict, check again before the next compile."""
        if self._store is not None and self._key.value is not None:
            self._store.clear(self._key.value)
        self._checked = False
