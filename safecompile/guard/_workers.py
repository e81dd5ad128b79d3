"""The guard's threads: those that compile off the request path (background warmups and
deferred compiles), and the one that runs async shadow checks.

A compiling thread runs at a lowered CPU priority (its own: on Linux niceness is per
thread, and it cannot be raised back unprivileged, so only a thread of its own lowers
it), and the interpreter's exit waits a little for those still running. A forked child
starts with none of them, and with its own locks.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator

from safecompile.base.forks import in_forked_child

__all__ = ["CHECKS", "EXITING", "EXIT_WAIT_S", "lower_priority", "running", "start"]

#: Seconds the interpreter's exit waits, in all, for compiling threads still running.
EXIT_WAIT_S = 10.0
#: Set when the interpreter exits: a worker starts no new compile from then on.
EXITING = threading.Event()
_WORKERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_LOCK = threading.Lock()  # EXITING and the workers the exit waits for, read together


def start(name: str, work: Callable[[], None], *, nice: int | None) -> threading.Thread:
    """Run ``work`` on a daemon thread whose priority is lowered to ``nice`` first."""

    def run() -> None:
        if nice:
            lower_priority(nice)
        work()

    worker = threading.Thread(target=run, name=name, daemon=True)
    _WORKERS.add(worker)
    worker.start()
    return worker


@atexit.register
def _join_workers(timeout: float = EXIT_WAIT_S) -> None:
    """At exit, give running workers up to ``timeout`` seconds to end: torch's C++ frames
    turn the unwind of a daemon thread still inside torch at finalisation into
    ``std::terminate`` (the process aborts)."""
    with _LOCK:  # from now on no compile starts (running()): only those running are waited for
        EXITING.set()
        workers = list(_WORKERS)
    deadline = time.monotonic() + timeout
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def running() -> Iterator[bool]:
    """A long-lived worker compiles while the block runs (``True``): the exit waits for it
    then. Once the interpreter is exiting, ``False``: start no compile."""
    me = threading.current_thread()
    with _LOCK:
        exiting = EXITING.is_set()
        if not exiting:
            _WORKERS.add(me)
    try:
        yield not exiting
    finally:
        _WORKERS.discard(me)


def lower_priority(nice: int) -> None:
    """Raise this thread's niceness to ``nice`` (Linux: per thread; it cannot be lowered
    back unprivileged, so only a thread of its own calls this)."""
    with contextlib.suppress(AttributeError, OSError):  # not POSIX, or a sandbox forbids it
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, max(os.getpriority(os.PRIO_PROCESS, me), nice))


class _Checks:
    """One daemon thread for every callable's async shadow checks."""

    def __init__(self) -> None:
        self.renew()

    def renew(self) -> None:
        """No queue, no thread (at the start, and in a forked child, which has neither)."""
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._in_flight = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._idle:
            self._in_flight += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="safecompile-shadow", daemon=True
                )
                self._thread.start()
        self._queue.put(job)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                job()
            finally:
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued async shadow check has run (tests, graceful shutdown);
        False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)


#: The async shadow checks' thread (:mod:`.shadow`).
CHECKS = _Checks()


@in_forked_child
def _forked() -> None:
    """A forked child has none of the parent's threads: fresh locks, no workers waited for,
    no queued checks (their thread is not there to run them)."""
    global _LOCK, _WORKERS
    _LOCK = threading.Lock()
    _WORKERS = weakref.WeakSet()
    CHECKS.renew()  # the same object: shadow holds its bound methods
