"""Compiles that take a while say so, so no one stares at silence.

A compile (one graph handed to safecompile's backend) starts a timer; still running
:data:`SLOW_COMPILE_S` seconds after dynamo started tracing, it is announced once (the
guarded callable's ``compiling`` event, and every :func:`spinner`), then by a
``safecompile.still_compiling`` log line every :data:`PLAIN_EVERY_S` seconds until it
ends. Fast compiles say nothing: a timer, not a start event, keeps the log to one line
per state change a person cares about.
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

from safecompile.base.forks import in_forked_child

from .source import truncate

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


def _daemon_timer(delay: float, fn: Callable[[], None]) -> _Timer:
    timer = threading.Timer(delay, fn)
    timer.daemon = True
    return timer


class _Open:
    """Every :func:`spinner` open now, process-wide (a compile on any thread tells them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spinners: list[_Spinner] = []

    def now(self) -> list[_Spinner]:
        with self.lock:
            return list(self.spinners)

    def add(self, shown: _Spinner) -> None:
        with self.lock:
            self.spinners.append(shown)

    def remove(self, shown: _Spinner) -> None:
        with self.lock:
            self.spinners.remove(shown)

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork


_OPEN = _Open()
in_forked_child(_OPEN.after_fork_in_child)


def _tell_spinners(tell: Callable[[_Spinner], None]) -> None:
    for shown in _OPEN.now():
        with contextlib.suppress(Exception):  # a broken terminal never breaks a compile
            tell(shown)


def watch_compile(
    function: str,
    graph: str,
    started: float,
    on_slow: Callable[[Compiling], None],
    *,
    on_still: Callable[[Compiling], None] | None = None,
    timer: Callable[[float, Callable[[], None]], _Timer] | None = None,
) -> Callable[[], None]:
    """Watch one compile (``started``: its ``time.perf_counter()``): ``on_slow`` once
    after :data:`SLOW_COMPILE_S`, then ``on_still`` every :data:`PLAIN_EVERY_S`, on the
    timers' thread (``timer(seconds, fn)`` makes them; tests fire theirs by hand).
    Returns the function that ends the watch."""
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
            compiling = state["compiling"] = Compiling(function, graph, started)
            if on_still is not None:
                schedule(PLAIN_EVERY_S, still)
        _tell_spinners(lambda shown: shown.slow(compiling))
        with contextlib.suppress(Exception):  # telemetry never breaks a compile
            on_slow(compiling)

    def end() -> None:
        with lock:
            state["ended"] = True
            compiling = state["compiling"]
            made = list(handles)
        for handle in made:
            handle.cancel()
        if compiling is not None:
            compiling.done.set()
            _tell_spinners(_Spinner.clear)

    with lock:
        schedule(max(SLOW_COMPILE_S - (time.perf_counter() - started), 0.0), fire)
    return end


def _wait(done: threading.Event, seconds: float) -> bool:
    """Wait for a compile's end (tests replace this to script the passing of time)."""
    return done.wait(seconds)


def _is_tty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except Exception:
        return False


class _Spinner:
    """One :func:`spinner`: on a terminal one line drawn in place, cleared whenever anything
    else is about to be written there; elsewhere whole lines now and then."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = _is_tty(out)
        self.lock = threading.RLock()  # held while writing to ``out``
        self.width = 0  # of the line shown on the terminal (0: none)
        self.tickers: list[tuple[threading.Thread, Compiling]] = []
        self.closed = False  # the ``with spinner()`` block ended

    def slow(self, compiling: Compiling) -> None:
        self._show(compiling)
        every = _TICK_S if self.tty else PLAIN_EVERY_S
        ticker = threading.Thread(
            target=self._tick, args=(compiling, every), name="safecompile-spinner", daemon=True
        )
        self.tickers.append((ticker, compiling))
        ticker.start()

    def _show(self, compiling: Compiling) -> None:
        with self.lock:
            if compiling.done.is_set() or self.closed:
                return
            what = f"{compiling.function} [{compiling.graph}]"
            line = truncate(f"compiling {what} \u2026 {compiling.elapsed():.0f} s", _LINE_LIMIT)
            if self.tty:
                self.out.write("\r" + line.ljust(self.width))
                self.width = max(self.width, len(line))
            else:
                self.out.write(line + "\n")
            self.out.flush()

    def clear(self) -> None:
        with self.lock:
            if self.width:
                self.out.write("\r" + " " * self.width + "\r")
                self.out.flush()
            self.width = 0

    def _tick(self, compiling: Compiling, every: float) -> None:
        with contextlib.suppress(Exception):  # a closed terminal ends the ticker, not the app
            while not _wait(compiling.done, every):
                self._show(compiling)


class _ClearingStream:
    """A log handler's terminal stream that clears the spinner's line before each write."""

    def __init__(self, stream: TextIO, spinner: _Spinner) -> None:
        self.stream = stream
        self.spinner = spinner

    def write(self, text: str) -> int:
        with self.spinner.lock:
            with contextlib.suppress(Exception):
                self.spinner.clear()
            return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


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


@contextlib.contextmanager
def spinner(stream: TextIO | None = None) -> Iterator[None]:
    """While inside, a slow compile shows ``compiling <function> [<graph>] … 12 s`` on
    ``stream`` (default ``sys.stderr``): on a terminal one line updated in place, cleared
    before each log line and when the compile ends; otherwise a whole line when the
    compile turns slow and every :data:`PLAIN_EVERY_S` seconds until it ends."""
    shown = _Spinner(sys.stderr if stream is None else stream)
    _OPEN.add(shown)
    wrapped = _terminal_handlers() if shown.tty else []  # their lines clear ours first
    try:
        for handler in wrapped:
            with handler.lock or contextlib.nullcontext():
                handler.stream = _ClearingStream(handler.stream, shown)
        yield
    finally:
        for handler in wrapped:
            with handler.lock or contextlib.nullcontext():
                if isinstance(handler.stream, _ClearingStream):
                    handler.stream = handler.stream.stream
        _OPEN.remove(shown)
        with shown.lock:
            shown.closed = True
        shown.clear()  # a line of ours is never left behind
        for ticker, compiling in shown.tickers:
            if compiling.done.is_set():
                ticker.join(timeout=1.0)
