"""Output a person reads: one short line per log event, torch's text once, slow compiles
announced (an event, a log line, and on a terminal a progress line)."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import structlog
import structlog.testing
import torch

from safecompile import EventKind, safe_compile
from safecompile.observe import progress
from safecompile.observe.log import LINE_LIMIT, Once, readable_line
from safecompile.observe.progress import (
    PLAIN_EVERY_S,
    SLOW_COMPILE_S,
    Compiling,
    spinner,
    watch_compile,
)
from safecompile.testing import BlockingBackend

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "quickstart.py"


# ---------------------------------------------------------------------------- the demo


@pytest.fixture(scope="module")
def demo() -> tuple[list[str], str]:
    """The demo's stdout lines and its stderr (not a terminal), run on aot_eager."""
    env = {**os.environ, "SAFECOMPILE_EXAMPLE_BACKEND": "aot_eager", "PYTHONWARNINGS": "ignore"}
    env.pop("SAFECOMPILE_DISABLE", None)
    env.pop("SAFECOMPILE_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, str(DEMO)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines(), done.stderr


def log_messages(lines: list[str]) -> list[str]:
    """The messages of the demo's log lines (it prints them as ``   log: <message>``)."""
    return [line.split("log: ", 1)[1] for line in lines if line.lstrip().startswith("log: ")]


def test_demo_log_lines_are_short_single_lines(demo: tuple[list[str], str]) -> None:
    """Every log event is one line of at most 200 characters, figures rounded."""
    lines, _ = demo
    messages = log_messages(lines)
    kinds = [m.split(" ", 1)[0] for m in messages]
    assert {"compiled", "compile_failed", "rollback", "breach", "disabled"} <= set(kinds)
    for message in messages:
        assert len(message) <= LINE_LIMIT, message
        assert not message.endswith("\u2026"), f"cut short: {message}"
        # no unrounded float (0.4590475279983366): at most 4 significant digits
        assert not re.search(r"\d\.0*[1-9]\d{4,}", message), message
    assert all(len(line) <= LINE_LIMIT + 10 for line in lines), max(lines, key=len)


def test_demo_says_a_data_dependent_branch_in_plain_words(demo: tuple[list[str], str]) -> None:
    """The failing branch is named by its line and code, not torch's internal wording."""
    lines, stderr = demo
    text = "\n".join(lines) + stderr
    (number,) = [
        n
        for n, line in enumerate(DEMO.read_text(encoding="utf-8").splitlines(), 1)
        if "if scores.max().item() > 0:" in line
    ]
    (failed,) = [m for m in log_messages(lines) if m.startswith("compile_failed ")]
    assert f"a branch on a tensor's value at quickstart.py:{number} " in failed
    assert "(`if scores.max().item() > 0:`)" in failed
    assert "torch.cond" in failed
    for internal in ("Could not guard", "zuf0", "Consider annotating", "torch._check"):
        assert internal not in text


def test_demo_never_repeats_a_description(demo: tuple[list[str], str]) -> None:
    """The rollback after a failed compile refers to it instead of repeating it; no long
    description appears in two log lines, nor in two lines of the summary."""
    lines, _ = demo
    messages = log_messages(lines)
    (rollback,) = [m for m in messages if m.startswith("rollback demo.postprocess")]
    assert "see compile_failed" in rollback
    descriptions = [m.split("]: ", 1)[-1].split(": ", 1)[-1] for m in messages]
    long = [d for d in descriptions if len(d) >= 60]
    assert len(long) == len(set(long)), long
    summary = [line for line in lines if line.lstrip().startswith("- ")]
    assert len(summary) == len(set(summary)), summary


def test_demo_progress_off_a_terminal_is_whole_short_lines(demo: tuple[list[str], str]) -> None:
    """Piped, the demo never draws in place; a slow compile's progress is whole lines."""
    _, stderr = demo
    assert "\r" not in stderr
    for line in stderr.splitlines():
        if line.startswith("compiling demo."):
            assert len(line) <= LINE_LIMIT, line
            assert re.fullmatch(r"compiling demo\.\S+ \[.*\] \u2026 \d+ s", line), line


# ---------------------------------------------------------------------------- the line


def test_readable_line_rounds_and_keeps_torchs_text_out() -> None:
    fields = {
        "function": "ranker.score",
        "reason": "compile_error",
        "duration_s": 0.4590475279983366,
        "description": "a branch on a tensor's value at model.py:42 (`if x.sum() > 0:`)",
        "error_message": "Could not guard on data-dependent expression zuf0 > 0.0\n(unhinted)",
        "code_file": "/srv/app/model.py",
        "code_line": 42,
    }
    line = readable_line("safecompile.compile_failed", fields)
    assert line == (
        "compile_failed ranker.score [0.459 s]: "
        "a branch on a tensor's value at model.py:42 (`if x.sum() > 0:`)"
    )
    rollback = readable_line(
        "safecompile.rollback",
        {**fields, "description": "compile failed: x (see compile_failed)", "retry_in_s": 30.0},
    )
    assert rollback == (
        "rollback ranker.score [compile_error, 0.459 s, retry in 30 s]: "
        "compile failed: x (see compile_failed) (at model.py:42)"
    )


def test_readable_line_is_one_bounded_line() -> None:
    line = readable_line(
        "safecompile.breach", {"function": "f", "description": "a\nb\n" + "word " * 100}
    )
    assert "\n" not in line
    assert len(line) == LINE_LIMIT
    assert line.endswith("\u2026")


def test_stdlib_record_carries_the_raw_text_as_a_field(caplog: pytest.LogCaptureFixture) -> None:
    """Without structlog configured: the message is the readable line, torch's own text
    is the record's ``error_message`` attribute, once, on the compile_failed event."""
    structlog.reset_defaults()
    caplog.set_level(logging.INFO, logger="safecompile")

    def branchy(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x + 1
        return x - 1

    guarded = safe_compile(branchy, backend="eager", fullgraph=True, name="tests.branchy")
    guarded(torch.ones(3))
    records = [r for r in caplog.records if r.name == "safecompile"]
    by_event = {getattr(r, "safecompile_event", None): r for r in records}
    failed = by_event["safecompile.compile_failed"]
    rollback = by_event["safecompile.rollback"]
    assert "Data-dependent branching" in failed.error_message
    assert "\n" not in failed.error_message  # torch's headline, not its whole text
    assert len(failed.error_message) <= 160
    assert "Data-dependent branching" not in failed.getMessage()
    assert failed.error_kind == "data_dependent_branch"
    assert not hasattr(rollback, "error_message")
    assert "see compile_failed" in rollback.getMessage()
    event = guarded.safecompile.stats().last_rollback
    assert event is not None
    assert "error_message" not in event.details
    assert event.message == "compile failed: a branch on a tensor's value (see compile_failed)"


def test_readable_line_of_an_event_without_a_function() -> None:
    """A process-wide event (the cache, the fleet switch) names no function: no ``?``."""
    line = readable_line(
        "safecompile.cache_untrusted", {"description": "SAFECOMPILE_CACHE_DIR without a key"}
    )
    assert line == "cache_untrusted: SAFECOMPILE_CACHE_DIR without a key"


# ---------------------------------------------------------------------------- slow compiles


class FakeTimer:
    """A timer the test fires by hand: no sleeping, no thread."""

    made: ClassVar[list[FakeTimer]] = []

    def __init__(self, delay: float, fn: Callable[[], None]) -> None:
        self.delay = delay
        self.fn = fn
        self.started = False
        self.cancelled = False
        FakeTimer.made.append(self)

    def start(self) -> None:
        self.started = True

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        self.fn()


@pytest.fixture
def fake_timers(monkeypatch: pytest.MonkeyPatch) -> list[FakeTimer]:
    """Every compile's timer is a FakeTimer, listed here in the order made."""
    FakeTimer.made = []
    monkeypatch.setattr("safecompile.observe.progress._daemon_timer", FakeTimer)
    return FakeTimer.made


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


def test_a_slow_compile_announces_itself(fake_timers: list[FakeTimer]) -> None:
    """A compile still running when its timer fires records one ``compiling`` event (and
    one log line) naming the graph; the compile's end cancels the timer."""
    backend = BlockingBackend()
    guarded = safe_compile(affine, backend=backend, shadow=None, name="tests.slow")
    x = torch.randn(4, 8)
    with structlog.testing.capture_logs() as logs:
        caller = threading.Thread(target=guarded, args=(x,))
        caller.start()
        assert backend.started.wait(60)
        (timer,) = fake_timers
        assert timer.started
        assert 0.0 <= timer.delay <= SLOW_COMPILE_S
        timer.fire()  # the compile is still blocked: it is slow
        (announced,) = [e for e in guarded.safecompile.events() if e.kind is EventKind.COMPILING]
        assert announced.bucket == "4x8:float32"
        assert announced.message is not None
        assert announced.message.startswith("still compiling after ")
        assert announced.message.endswith(" s: 4x8:float32")
        backend.release()
        caller.join(60)
    assert timer.cancelled
    kinds = [e.kind for e in guarded.safecompile.events()]
    assert kinds == [EventKind.COMPILING, EventKind.COMPILED]
    assert [log["event"] for log in logs] == ["safecompile.compiling", "safecompile.compiled"]
    assert logs[0]["log_level"] == "info"
    assert logs[0]["function"] == "tests.slow"


def test_a_long_compile_logs_progress_every_few_seconds(fake_timers: list[FakeTimer]) -> None:
    """After the ``compiling`` event, a ``still_compiling`` log line every PLAIN_EVERY_S
    seconds while the compile goes on (piped output is never silent for long); progress
    is not an event, and the compile's end stops it."""
    backend = BlockingBackend()
    guarded = safe_compile(affine, backend=backend, shadow=None, name="tests.long")
    with structlog.testing.capture_logs() as logs:
        caller = threading.Thread(target=guarded, args=(torch.randn(4, 8),))
        caller.start()
        assert backend.started.wait(60)
        fake_timers[0].fire()  # slow: the compiling event, and the next timer
        assert fake_timers[1].delay == PLAIN_EVERY_S
        fake_timers[1].fire()
        fake_timers[2].fire()
        assert fake_timers[3].delay == PLAIN_EVERY_S
        backend.release()
        caller.join(60)
    assert all(t.cancelled for t in fake_timers)
    fake_timers[3].fire()  # lost the race with the end: says nothing
    still = [log for log in logs if log["event"] == "safecompile.still_compiling"]
    assert len(still) == 2
    assert still[0]["function"] == "tests.long"
    assert still[0]["bucket"] == "4x8:float32"
    assert isinstance(still[0]["duration_s"], float)
    kinds = [e.kind for e in guarded.safecompile.events()]
    assert kinds == [EventKind.COMPILING, EventKind.COMPILED]


def test_a_fast_compile_says_nothing(fake_timers: list[FakeTimer]) -> None:
    """The timer of a compile that ended is cancelled; firing it late does nothing."""
    guarded = safe_compile(affine, backend="eager", shadow=None)
    guarded(torch.randn(3))
    (timer,) = fake_timers
    assert timer.cancelled
    timer.fire()  # a timer that lost the race with cancel()
    assert EventKind.COMPILING not in [e.kind for e in guarded.safecompile.events()]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_spinner_on_a_terminal_shows_then_clears_the_line() -> None:
    stream = FakeTerminal()
    seen: list[Compiling] = []
    timers: list[FakeTimer] = []

    def make(delay: float, fn: Callable[[], None]) -> FakeTimer:
        timers.append(FakeTimer(delay, fn))
        return timers[-1]

    with spinner(stream):
        end = watch_compile("demo.ranker", "8x32:float32", 0.0, seen.append, timer=make)
        timers[0].fire()
        end()
    (compiling,) = seen
    assert compiling.done.is_set()
    text = stream.getvalue()
    assert text.startswith("\rcompiling demo.ranker [8x32:float32] \u2026 ")
    assert re.match(r"\rcompiling demo\.ranker \[8x32:float32\] \u2026 \d+ s", text)
    assert text.endswith("\r")  # the line is cleared when the compile ends
    assert text.rstrip("\r ").count("\r") >= 1


def test_spinner_off_a_terminal_writes_whole_lines_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a pipe or a CI log a long compile is never silent: one whole line when it turns
    slow, then one every PLAIN_EVERY_S seconds (time scripted), never a carriage return."""
    stream = io.StringIO()
    timers: list[FakeTimer] = []
    waits: list[float] = []
    script = [False, False]  # two intervals pass, then the compile is waited on
    scripted = threading.Event()

    def wait(done: threading.Event, seconds: float) -> bool:
        waits.append(seconds)
        if script:
            return script.pop(0)
        scripted.set()
        return done.wait(60)

    def make(delay: float, fn: Callable[[], None]) -> FakeTimer:
        timers.append(FakeTimer(delay, fn))
        return timers[-1]

    monkeypatch.setattr(progress, "_wait", wait)
    with spinner(stream):
        end = watch_compile("demo.ranker", "Nx32:float32", 0.0, lambda _c: None, timer=make)
        timers[0].fire()
        assert scripted.wait(60)
        end()
    lines = stream.getvalue().split("\n")
    assert lines[-1] == ""  # every line ends
    assert len(lines[:-1]) == 3
    for line in lines[:-1]:
        assert re.fullmatch(r"compiling demo\.ranker \[Nx32:float32\] \u2026 \d+ s", line)
    assert "\r" not in stream.getvalue()
    assert waits[:3] == [PLAIN_EVERY_S] * 3
    assert PLAIN_EVERY_S <= 5.0


def _visible(text: str) -> list[str]:
    """What a terminal shows for ``text``: each ``\\r`` returns to the line's start and
    later characters overwrite earlier ones."""
    shown = []
    for raw in text.split("\n"):
        cells: list[str] = []
        column = 0
        for char in raw:
            if char == "\r":
                column = 0
                continue
            if column < len(cells):
                cells[column] = char
            else:
                cells.append(char)
            column += 1
        shown.append("".join(cells).rstrip())
    return shown


def test_spinner_clears_its_line_before_a_log_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A log line written to the same terminal while the spinner shows starts on a clean
    line (never ``… 34 s   log: compiled ...``), and the spinner's line is gone when the
    compile ends, before end() returns."""
    monkeypatch.setattr(progress, "_TICK_S", 3600.0)  # no redraw during the test
    terminal = FakeTerminal()
    handler = logging.StreamHandler(terminal)
    handler.setFormatter(logging.Formatter("log: %(message)s"))
    logger = logging.getLogger("safecompile")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    timers: list[FakeTimer] = []

    def make(delay: float, fn: Callable[[], None]) -> FakeTimer:
        timers.append(FakeTimer(delay, fn))
        return timers[-1]

    try:
        with spinner(terminal):
            end = watch_compile("demo.ranker", "8x32:float32", 0.0, lambda _c: None, timer=make)
            timers[0].fire()
            assert "compiling demo.ranker" in _visible(terminal.getvalue())[-1]
            logger.info("compiled demo.ranker [33.8 s]")
            end()
            after_end = terminal.getvalue()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert _visible(after_end) == ["log: compiled demo.ranker [33.8 s]", ""]
    assert handler.stream is terminal  # the handler's own stream is given back


def test_on_slow_failing_never_breaks_a_compile() -> None:
    timers: list[FakeTimer] = []

    def make(delay: float, fn: Callable[[], None]) -> FakeTimer:
        timers.append(FakeTimer(delay, fn))
        return timers[-1]

    def broken(_c: Any) -> None:
        raise RuntimeError("sink down")

    end = watch_compile("f", "g", 0.0, broken, timer=make)
    timers[0].fire()
    end()
    assert timers[0].cancelled


def test_once_warns_per_key_until_forgotten() -> None:
    """A warning said once per key, across threads; forget() lets it be said again."""
    once = Once()
    with structlog.testing.capture_logs() as logs:
        threads = [
            threading.Thread(target=once.warn, args=(key, "safecompile.test"), kwargs={"key": key})
            for key in ("a", "b", "a", "a", "b")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        once.forget()
        once.warn("a", "safecompile.test", key="a")
    assert sorted(e["key"] for e in logs) == ["a", "a", "b"]
    assert {e["log_level"] for e in logs} == {"warning"}
