"""Graphs compiled off the request path (``Warmup(background=True)``).

A live call that would make a graph no warmup covered is served eager now; a copy of its
inputs is handed here and compiled later on one worker thread of low priority shared by
every callable (one compile at a time in the process), at most ``Warmup.queue_size``
waiting per callable (more are served eager and counted). A signature is compiled once:
a call it still misses later is served eager (counted), not queued again, until
``reset()``.
"""

from __future__ import annotations

import collections
import copy
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from safecompile.base import torchcompat
from safecompile.base.forks import in_forked_child

from . import _workers

__all__ = ["Deferred", "copy_call", "signature"]

_DONE_KEPT = 256  # signatures remembered as compiled, per callable (oldest forgotten first)
#: Seconds the worker waits after taking a job, so the live call that handed it over
#: returns before the compile competes with it for the interpreter.
SETTLE_S = 0.02


@dataclass
class Counts:
    """What the deferred compiles of one callable did (``stats().extra["deferred"]``)."""

    queued: int = 0  # signatures handed to the worker
    compiled: int = 0  # of those, run on the worker
    full: int = 0  # live calls served eager with the queue full
    repeated: int = 0  # live calls still uncovered after their signature was compiled
    uncopyable: int = 0  # live calls whose inputs could not be copied

    def as_dict(self, pending: int) -> dict[str, int]:
        return {**self.__dict__, "pending": pending}


class _Worker:
    """The one thread that runs deferred compiles, every callable's, one at a time, in
    the order they came. Started with the first callable that defers (not on a live
    call: a thread's start costs the caller); idle, it waits on a condition."""

    def __init__(self) -> None:
        self.ready = threading.Condition(threading.Lock())
        self.jobs: collections.deque[tuple[Deferred, Hashable, Callable[[], None]]] = (
            collections.deque()
        )
        self.thread: threading.Thread | None = None
        self.nice: int | None = None

    def ensure(self, nice: int | None) -> None:
        with self.ready:
            if nice and (self.nice is None or nice > self.nice):
                self.nice = nice  # the lowest priority any callable asked for
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="safecompile-deferred-compiles", daemon=True
                )
                self.thread.start()
            self.ready.notify()  # a lowered priority is applied before the next job

    def put(self, owner: Deferred, key: Hashable, job: Callable[[], None]) -> None:
        with self.ready:
            self.jobs.append((owner, key, job))
            self.ready.notify()

    def _run(self) -> None:
        while True:
            with self.ready:
                while not self.jobs:
                    self.ready.wait()
                owner, key, job = self.jobs.popleft()
                nice = self.nice
            if nice:
                _workers.lower_priority(nice)
            time.sleep(SETTLE_S)
            with _workers.running() as allowed:  # the interpreter's exit waits for it
                if not allowed:  # the interpreter is exiting: compile no more
                    return
                owner.run(key, job)


_WORKER = _Worker()


@in_forked_child
def _no_worker_here() -> None:
    global _WORKER
    _WORKER = _Worker()


class Deferred:
    """The deferred compiles of one callable: a bounded queue on the shared worker."""

    def __init__(self, name: str, size: int, nice: int | None) -> None:
        self._name = name
        self._size = size
        self._nice = nice
        self._lock = threading.Lock()
        self._pending: dict[Hashable, Callable[[], None]] = {}
        self._running: Hashable | None = None
        self._done: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._generation = 0
        self._idle = threading.Event()
        self._idle.set()
        self.counts = Counts()
        # how a queued call compiles: one warmup call (``_paths.warm_call``, wired by the
        # controller); until wired, nothing is queued (see :meth:`wanted`)
        self.warm: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None = None
        _WORKER.ensure(nice)

    def wanted(self, key: Hashable) -> bool:
        """Whether a call of this signature should be copied and submitted (cheap: the
        copy is made only when this says so); counts the calls it turns away."""
        with self._lock:
            return self.warm is not None and self._admits(key)

    def _admits(self, key: Hashable) -> bool:
        if key in self._pending or key == self._running:
            return False
        if key in self._done:
            self.counts.repeated += 1
            return False
        if len(self._pending) >= self._size:
            self.counts.full += 1
            return False
        return True

    def submit(self, key: Hashable, job: Callable[[], None]) -> bool:
        """Queue ``job`` (a compile of one copied call) under ``key``; ``False`` when the
        queue is full or the key is there already."""
        with self._lock:
            if not self._admits(key):
                return False
            self._pending[key] = job
            self.counts.queued += 1
            self._idle.clear()
        _WORKER.ensure(self._nice)  # started again after a fork, say
        _WORKER.put(self, key, job)
        return True

    def run(self, key: Hashable, job: Callable[[], None]) -> None:
        """On the worker: run ``job`` unless ``reset()`` dropped it meanwhile."""
        with self._lock:
            if self._pending.get(key) is not job:
                return
            del self._pending[key]
            self._running = key
            generation = self._generation
        try:
            job()
        finally:
            with self._lock:
                self._running = None
                if generation == self._generation:  # not reset meanwhile
                    self.counts.compiled += 1
                    self._done[key] = None
                    while len(self._done) > _DONE_KEPT:
                        self._done.popitem(last=False)
                if not self._pending:
                    self._idle.set()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending) + (self._running is not None)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or compiling (``True``), or ``timeout`` passed."""
        return self._idle.wait(timeout)

    def clear(self) -> None:
        """``reset()``: drop what waits and what was compiled; a compile running goes on,
        into the table as it is then."""
        with self._lock:
            self._pending.clear()
            self._done.clear()
            self._generation += 1
            self.counts = Counts()
            if self._running is None:
                self._idle.set()


def signature(args: tuple[Any, ...], kwargs: dict[str, Any], training: bool | None) -> Hashable:
    """What tells one call's graph from another's, roughly as dynamo guards: each tensor's
    dtype, device, shape, strides and ``requires_grad``, plain values, other objects'
    types, the grad and inference modes, and a module's train/eval. Two signatures that
    dynamo serves with one graph cost one compile and one cache hit."""
    parts: list[object] = [
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        training,
        tuple(kwargs),
    ]
    for value in torchcompat.pytree.tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor):
            parts.append(
                (
                    type(value),
                    value.dtype,
                    value.device,
                    tuple(value.shape),
                    value.stride() if value.layout is torch.strided else None,
                    value.requires_grad,
                )
            )
        elif value is None or isinstance(value, bool | int | float | str):
            parts.append((type(value), value))
        else:
            parts.append(type(value))
    return tuple(parts)


def copy_call(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A copy of a call's arguments for a compile on another thread: tensors cloned (no
    autograd history; ``requires_grad``, strides and aliasing kept), other objects deep
    copied, so the compile's run changes nothing the caller holds. Raises when an
    argument cannot be copied."""
    leaves, spec = torchcompat.pytree.tree_flatten((args, kwargs))
    memo: dict[int, Any] = {}
    plain = True  # only tensors and immutable values: no deep copy needed
    for value in leaves:
        if type(value) is torch.Tensor:
            if id(value) not in memo:
                with torch.no_grad():
                    clone = value.detach().clone()
                memo[id(value)] = clone.requires_grad_(value.requires_grad)
        elif not (value is None or isinstance(value, bool | int | float | str)):
            plain = False
    if plain:
        copied_leaves = [memo.get(id(v), v) for v in leaves]
        rebuilt: tuple[tuple[Any, ...], dict[str, Any]] = spec.unflatten(copied_leaves)
        return rebuilt
    copied: tuple[tuple[Any, ...], dict[str, Any]] = copy.deepcopy((args, kwargs), memo)
    return copied
