"""Compiles that take a while say so, so no one stares at silence.

A compile (one graph handed to safecompile's backend) starts a timer; if it is still
running :data:`SLOW_COMPILE_S` seconds after dynamo started tracing, the guarded callable
records one ``compiling`` event (a log line ``safecompile.compiling``, an
:class:`~safecompile.Event` in ``.events()``) naming the graph or bucket, and everyone
watching through :func:`spinner` is told; while it goes on, a log line
``safecompile.still_compiling`` every :data:`PLAIN_EVERY_S` seconds (a log, not an event),
so piped output is never silent for long. The timer is cancelled when the compile ends,
so fast compiles say nothing (a timer, rather than a start event at debug level: the
log stays one line per state change a person cares about).

:func:`spinner` is what the demo and the doctor use: on a terminal, while a slow compile
runs, it keeps one line up to date (``compiling demo.ranker [8x32:float32] … 12 s``),
clears it before any log line a ``logging`` handler writes to a terminal (no line merges
with it) and when the compile ends; on anything else (a pipe, a CI log) it writes that
line whole when the compile turns slow and every :data:`PLAIN_EVERY_S` seconds after, so
a long compile is never silent.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

__all__ = ["PLAIN_EVERY_S", "SLOW_COMPILE_S", "Compiling", "spinner", "watch_compile"]

#: Seconds after which a compile still running announces itself.
SLOW_COMPILE_S = 2.0
#: Seconds between progress lines when the output is not a terminal.
PLAIN_EVERY_S = 5.0
_TICK_S = 0.5  # a terminal's line is redrawn this often
_LINE_LIMIT = 200


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


class _Listener(Protocol):
    def slow(self, compiling: Compiling) -> None: ...
    def done(self, compiling: Compiling) -> None: ...


class _Watchers:
    """Who wants to hear about slow compiles (the spinners), process-wide."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.listeners: list[_Listener] = []

    def _each(self, call: Callable[[_Listener], None]) -> None:
        with self.lock:
            listeners = list(self.listeners)
        for listener in listeners:
            with contextlib.suppress(Exception):  # a broken terminal never breaks a compile
                call(listener)

    def tell(self, compiling: Compiling) -> None:
        self._each(lambda listener: listener.slow(compiling))

    def finish(self, compiling: Compiling) -> None:
        self._each(lambda listener: listener.done(compiling))


_watchers = _Watchers()


def watch_compile(
    function: str,
    graph: str,
    started: float,
    on_slow: Callable[[Compiling], None],
    *,
    on_still: Callable[[Compiling], None] | None = None,
    delay: float | None = None,
    timer: TimerFactory | None = None,
) -> Callable[[], None]:
    """Start watching one compile; returns the function to call when it ends.

    If the compile is still running ``delay`` (default :data:`SLOW_COMPILE_S`) seconds
    after ``started`` (a ``time.perf_counter()`` reading), ``on_slow`` is called once, on
    the timer's thread, and every :func:`spinner` is told; then ``on_still``, if given,
    every :data:`PLAIN_EVERY_S` seconds until it ends. Ending the compile cancels the
    timer, or tells the spinners it is done (a terminal's line is cleared before ``end()``
    returns). ``timer(seconds, fn)`` makes the timers (default: daemon
    ``threading.Timer``; tests pass ones they fire by hand).
    """
    wait = SLOW_COMPILE_S if delay is None else delay
    make = timer if timer is not None else _daemon_timer
    lock = threading.Lock()
    state: dict[str, Any] = {"ended": False, "compiling": None}
    handles: list[_Timer] = []  # the first timer, then each still_compiling one

    def schedule(seconds: float, fn: Callable[[], None]) -> None:
        handle = make(seconds, fn)
        handles.append(handle)
        handle.start()

    def still() -> None:
        with lock:
            if state["ended"] or on_still is None:
                return
            compiling = state["compiling"]
            schedule(PLAIN_EVERY_S, still)
        with contextlib.suppress(Exception):  # telemetry never breaks a compile
            on_still(compiling)

    def fire() -> None:
        with lock:
            if state["ended"]:
                return
            compiling = Compiling(function=function, graph=graph, started=started)
            state["compiling"] = compiling
            if on_still is not None:
                schedule(PLAIN_EVERY_S, still)
        _watchers.tell(compiling)
        with contextlib.suppress(Exception):  # telemetry never breaks a compile
            on_slow(compiling)

    with lock:
        schedule(max(wait - (time.perf_counter() - started), 0.0), fire)

    def end() -> None:
        with lock:
            state["ended"] = True
            compiling = state["compiling"]
            made = list(handles)
        for handle in made:
            handle.cancel()
        if compiling is not None:
            compiling.done.set()
            _watchers.finish(compiling)

    return end


def _text(compiling: Compiling) -> str:
    line = f"compiling {compiling.function} [{compiling.graph}] \u2026 {compiling.elapsed():.0f} s"
    return line if len(line) <= _LINE_LIMIT else line[: _LINE_LIMIT - 1] + "\u2026"


def _wait(done: threading.Event, seconds: float) -> bool:
    """Wait for a compile's end (tests replace this to script the passing of time)."""
    return done.wait(seconds)


class _TerminalLine:
    """The one line a spinner keeps on a terminal: drawn in place, cleared whenever
    anything else is about to be written to the terminal."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.lock = threading.RLock()
        self.width = 0
        self.shown = False

    def draw(self, compiling: Compiling) -> None:
        with self.lock:
            if compiling.done.is_set():
                return
            line = _text(compiling)
            self.out.write("\r" + line.ljust(self.width))
            self.out.flush()
            self.width = max(self.width, len(line))
            self.shown = True

    def clear(self) -> None:
        with self.lock:
            if self.shown:
                self.out.write("\r" + " " * self.width + "\r")
                self.out.flush()
            self.shown = False
            self.width = 0


class _ClearingStream:
    """A log handler's terminal stream that clears the spinner's line before each write."""

    def __init__(self, stream: TextIO, line: _TerminalLine) -> None:
        self.stream = stream
        self.line = line

    def write(self, text: str) -> int:
        with self.line.lock:
            with contextlib.suppress(Exception):
                self.line.clear()
            return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _is_tty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except Exception:
        return False


def _terminal_handlers() -> list[logging.StreamHandler[Any]]:
    """The ``logging`` handlers a ``safecompile`` record reaches that write to a terminal."""
    found: list[logging.StreamHandler[Any]] = []
    logger: logging.Logger | None = logging.getLogger("safecompile")
    while logger is not None:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and _is_tty(handler.stream):
                found.append(handler)
        logger = logger.parent if logger.propagate else None
    return found


class _Spinner:
    """One :func:`spinner`: a terminal line redrawn in place, or whole lines now and then."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = _is_tty(out)
        self.line = _TerminalLine(out)
        self.write_lock = threading.Lock()
        self.tickers: list[tuple[threading.Thread, Compiling]] = []
        self.closed = threading.Event()  # the ``with spinner()`` block ended

    def slow(self, compiling: Compiling) -> None:
        self._show(compiling)
        every = _TICK_S if self.tty else PLAIN_EVERY_S
        ticker = threading.Thread(
            target=self._tick, args=(compiling, every), name="safecompile-spinner", daemon=True
        )
        self.tickers.append((ticker, compiling))
        ticker.start()

    def done(self, compiling: Compiling) -> None:
        if self.tty:
            self.line.clear()

    def _show(self, compiling: Compiling) -> None:
        if self.tty:
            with self.line.lock:
                if not self.closed.is_set():
                    self.line.draw(compiling)
            return
        with self.write_lock:
            if not compiling.done.is_set() and not self.closed.is_set():
                self.out.write(_text(compiling) + "\n")
                self.out.flush()

    def _tick(self, compiling: Compiling, every: float) -> None:
        with contextlib.suppress(Exception):  # a closed terminal ends the ticker, not the app
            while not _wait(compiling.done, every):
                self._show(compiling)

    @contextlib.contextmanager
    def clearing_log_lines(self) -> Iterator[None]:
        """Log handlers that write to a terminal clear the spinner's line first."""
        if not self.tty:
            yield
            return
        wrapped = []
        for handler in _terminal_handlers():
            with handler.lock or contextlib.nullcontext():
                handler.stream = _ClearingStream(handler.stream, self.line)
            wrapped.append(handler)
        try:
            yield
        finally:
            for handler in wrapped:
                with handler.lock or contextlib.nullcontext():
                    stream = handler.stream
                    if isinstance(stream, _ClearingStream):
                        handler.stream = stream.stream


@contextlib.contextmanager
def spinner(stream: TextIO | None = None) -> Iterator[None]:
    """While inside, a slow compile shows ``compiling <function> [<graph>] … 12 s`` on
    ``stream`` (default ``sys.stderr``): on a terminal one line updated in place, cleared
    before each log line and when the compile ends; otherwise a whole line when the
    compile turns slow and every :data:`PLAIN_EVERY_S` seconds until it ends."""
    shown = _Spinner(sys.stderr if stream is None else stream)
    with _watchers.lock:
        _watchers.listeners.append(shown)
    try:
        with shown.clearing_log_lines():
            yield
    finally:
        with _watchers.lock:
            _watchers.listeners.remove(shown)
        with shown.line.lock, shown.write_lock:
            shown.closed.set()
        shown.line.clear()  # a line of ours is never left behind
        for ticker, compiling in shown.tickers:
            if compiling.done.is_set():
                ticker.join(timeout=1.0)
