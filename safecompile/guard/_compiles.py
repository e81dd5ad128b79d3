"""Compiles in flight, and compile failures persisted across restarts.

:class:`CompileTracker` knows which thread is compiling (single flight: while one thread
compiles, eager serves every other call, clear of a torch race where a compiled call
racing the install of a new graph misses the cache); every way out of a compile releases
it. :class:`KnownFailures` persists "this code fails to compile here" under
``SAFECOMPILE_CACHE_DIR``, keyed by code, torch, Python, device and options.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from safecompile.base.model import Reason
from safecompile.observe.source import error_type_name, safe_message
from safecompile.persist import remote
from safecompile.persist.cache import CallKey, Verdict, signed_store, use_torch_caches
from safecompile.persist.signing import warn_ignored

__all__ = ["CompileTracker", "KnownFailures"]


class CompileTracker:
    """Which threads compile now; ``on_change`` is told whenever that changes."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._depth: dict[int, int] = {}
        self._on_change = on_change

    @property
    def busy(self) -> bool:
        return bool(self._depth)

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
            outermost = got and self._depth[me] == 1
        if not got:
            yield False
            return
        if outermost:
            remote.mark_compile()  # what torch reads from Redis from here is this compile's
        self._on_change()
        try:
            yield True
        finally:
            with self._lock:
                depth = self._depth.pop(me, 1) - 1
                if depth > 0:
                    self._depth[me] = depth
            self._on_change()

    def reset(self) -> None:
        with self._lock:
            self._depth.clear()


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
