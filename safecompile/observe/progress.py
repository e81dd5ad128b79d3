"""Compiles that take a while say so, so no one stares at silence.

A compile (one graph handed to safecompile's backend) starts a timer; if it is still
running :data:`SLOW_COMPILE_S` seconds after dynamo started tracing, the guarded callable
records one ``compiling`` event (a log line ``safecompile.compiling``, an
:class:`~safecompile.Event` in ``.events()``) naming the graph or bucket, and everyone
watching through :func:`spinner` is told. The timer is cancelled when the compile ends,
so fast compiles say nothing (a timer, rather than a start event at debug level: the
log stays one line per state change a person cares about).

:func:`spinner` is what the demo and the doctor use on a terminal: while a slow compile
runs it keeps one line up to date (``compiling demo.ranker [8x32:float32] … 12 s``) and
clears it when the compile ends; on anything but a TTY it prints nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

__all__ = ["SLOW_COMPILE_S", "Compiling", "spinner", "watch_compile"]

#: Seconds after which a compile still running announces itself.
SLOW_COMPILE_S = 2.0
_TICK_S = 0.5


@dataclass(frozen=True)
class Compiling:
    """A compile still running after :data:`SLOW_COMPILE_S`: what, since when."""

    function: str  # the guarded callable's stable name
    graph: str  # the bucket, or the graph's inputs as text
    started: float  # time.perf_counter() when tracing started
    done: threading.Event = field(default_factory=threading.Event, compare=False)

    def elapsed(self) -> float:
        """Seconds since the compile started."""
        return time.perf_counter() - self.started


class _Timer(Protocol):
    def start(self) -> None: ...
    def cancel(self) -> None: ...


TimerFactory = Callable[[float, Callable[[], None]], _Timer]


def _daemon_timer(delay: float, fn: Callable[[], None]) -> _Timer:
    timer = threading.Timer(delay, fn)
    timer.daemon = True
    return timer


class _Watchers:
    """Who wants to hear about slow compiles (the spinners), process-wide."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.listeners: list[Callable[[Compiling], None]] = []

    def tell(self, compiling: Compiling) -> None:
        with self.lock:
            listeners = list(self.listeners)
        for listener in listeners:
            with contextlib.suppress(Exception):  # a broken terminal never breaks a compile
                listener(compiling)


_watchers = _Watchers()


def watch_compile(
    function: str,
    graph: str,
    started: float,
    on_slow: Callable[[Compiling], None],
    *,
    delay: float | None = None,
    timer: TimerFactory | None = None,
) -> Callable[[], None]:
    """Start watching one compile; returns the function to call when it ends.

    If the compile is still running ``delay`` (default :data:`SLOW_COMPILE_S`) seconds
    after ``started`` (a ``time.perf_counter()`` reading), ``on_slow`` is called once, on
    the timer's thread, and every :func:`spinner` is told. Ending the compile cancels
    the timer, or tells the spinners it is done. ``timer(seconds, fn)`` makes the timer
    (default: a daemon ``threading.Timer``; tests pass one they fire by hand).
    """
    wait = SLOW_COMPILE_S if delay is None else delay
    lock = threading.Lock()
    state: dict[str, Any] = {"ended": False, "compiling": None}

    def fire() -> None:
        with lock:
            if state["ended"]:
                return
            compiling = Compiling(function=function, graph=graph, started=started)
            state["compiling"] = compiling
        _watchers.tell(compiling)
        with contextlib.suppress(Exception):  # telemetry never breaks a compile
            on_slow(compiling)

    make = timer if timer is not None else _daemon_timer
    handle = make(max(wait - (time.perf_counter() - started), 0.0), fire)
    handle.start()

    def end() -> None:
        with lock:
            state["ended"] = True
            compiling = state["compiling"]
        handle.cancel()
        if compiling is not None:
            compiling.done.set()

    return end


@contextlib.contextmanager
def spinner(stream: TextIO | None = None) -> Iterator[None]:
    """While inside, a slow compile shows ``compiling <function> [<graph>] … 12 s`` on
    ``stream`` (default ``sys.stderr``), updated in place and cleared when it ends.
    Nothing at all when ``stream`` is not a terminal."""
    out = sys.stderr if stream is None else stream
    try:
        tty = out.isatty()
    except Exception:
        tty = False
    if not tty:
        yield
        return
    write_lock = threading.Lock()
    tickers: list[tuple[threading.Thread, Compiling]] = []

    def show(compiling: Compiling) -> None:
        ticker = threading.Thread(
            target=_tick, args=(out, write_lock, compiling), name="safecompile-spinner", daemon=True
        )
        tickers.append((ticker, compiling))
        ticker.start()

    with _watchers.lock:
        _watchers.listeners.append(show)
    try:
        yield
    finally:
        with _watchers.lock:
            _watchers.listeners.remove(show)
        for ticker, compiling in tickers:  # a line of ours is never left behind
            if compiling.done.is_set():
                ticker.join(timeout=1.0)


def _tick(out: TextIO, write_lock: threading.Lock, compiling: Compiling) -> None:
    width = 0
    while True:
        line = (
            f"compiling {compiling.function} [{compiling.graph}] \u2026 {compiling.elapsed():.0f} s"
        )
        with write_lock, contextlib.suppress(Exception):
            out.write("\r" + line.ljust(width))
            out.flush()
        width = max(width, len(line))
        if compiling.done.wait(_TICK_S):
            break
    with write_lock, contextlib.suppress(Exception):
        out.write("\r" + " " * width + "\r")
        out.flush()
