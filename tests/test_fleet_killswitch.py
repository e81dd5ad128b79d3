"""The fleet kill switch: ``SAFECOMPILE_DISABLE_SOURCE`` (a file or a Redis key) turns
running callables off and on without a restart; a broken source never breaks a call.

Tests that need the polling thread use a short ``SAFECOMPILE_DISABLE_POLL`` and wait for
the state with a bounded loop; the others set a long interval and call
``WATCHER.poll()`` themselves, so nothing depends on timing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from redis_server import free_port
from structlog.testing import capture_logs

import safecompile
from safecompile import safe_compile
from safecompile.base import killswitch as ks
from safecompile.fleet import switch as switch_module
from safecompile.fleet.switch import (
    DEFAULT_KEY,
    DEFAULT_POLL_S,
    POLL_ENV_VAR,
    SOURCE_ENV_VAR,
    WATCHER,
    FileSource,
    RedisKeySource,
    open_source,
    poll_interval,
    rule_of,
)
from safecompile.persist import remote as _remote

WAIT_S = 20.0  # a bound on waiting for the thread under a loaded CI machine, not a figure


@pytest.fixture(autouse=True)
def _fresh_watcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No source, no thread, nothing disabled by a source before and after each test."""
    monkeypatch.delenv(SOURCE_ENV_VAR, raising=False)
    monkeypatch.delenv(POLL_ENV_VAR, raising=False)
    WATCHER.reset()
    yield
    WATCHER.reset()
    _remote.reset()


def score(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 3


def guard(name: str) -> Any:
    return safe_compile(score, backend="eager", name=name, shadow=None)


def state_of(fn: Any, x: torch.Tensor) -> str:
    """Call ``fn`` (checking its result) and return its state after the call."""
    assert torch.equal(fn(x), score(x))
    value: str = fn.safecompile.state.value
    return value


def call_until(fn: Any, x: torch.Tensor, wanted: Callable[[str], bool]) -> float:
    """Call ``fn`` until its state satisfies ``wanted``; the seconds it took (fails after
    ``WAIT_S``)."""
    start = time.monotonic()
    while not wanted(state_of(fn, x)):
        if time.monotonic() - start > WAIT_S:
            pytest.fail(f"state still {fn.safecompile.state.value!r} after {WAIT_S} s")
        time.sleep(0.01)
    return time.monotonic() - start


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == f"safecompile.{name}"]


class FileSwitch:
    """An operator's file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.spec = f"file://{path}"

    def set(self, text: str) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


class RedisSwitch:
    """An operator's Redis key."""

    def __init__(self, url: str, key: str = "fleet:disable") -> None:
        redis = pytest.importorskip("redis")
        self.client = redis.Redis.from_url(url)
        self.key = key
        self.spec = f"{url}#{key}"

    def set(self, text: str) -> None:
        self.client.set(self.key, text)

    def clear(self) -> None:
        self.client.delete(self.key)


@pytest.fixture(params=["file", "redis"])
def switch(request: pytest.FixtureRequest, tmp_path: Path) -> FileSwitch | RedisSwitch:
    """The operator's switch: a file, or a key on the session's redis-server."""
    if request.param == "file":
        return FileSwitch(tmp_path / "disable")
    return RedisSwitch(request.getfixturevalue("redis_url"))


# ---------------------------------------------------------------- a running process


def test_flipping_the_source_turns_a_running_callable_off_and_back(
    switch: FileSwitch | RedisSwitch, monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """The polling thread picks the operator's change up; the callable's next call runs
    eager (``disabled``), and compiled again once the switch is cleared."""
    monkeypatch.setenv(SOURCE_ENV_VAR, switch.spec)
    monkeypatch.setenv(POLL_ENV_VAR, "0.05")
    fn = guard("ranker.score")
    assert state_of(fn, x) == "compiled"
    assert WATCHER.running

    switch.set("1")
    call_until(fn, x, lambda s: s == "disabled")
    eager_before = fn.safecompile.stats().eager_calls
    assert state_of(fn, x) == "disabled"
    assert fn.safecompile.stats().eager_calls == eager_before + 1

    switch.clear()
    call_until(fn, x, lambda s: s != "disabled")
    kinds = [e.kind.value for e in fn.safecompile.events()]
    assert kinds.count("disabled") == 1
    assert kinds.count("enabled") == 1


def test_the_first_call_already_obeys_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """The source is read at decoration, before the thread's first interval."""
    path = tmp_path / "disable"
    path.write_text("ranker.*\n")
    monkeypatch.setenv(SOURCE_ENV_VAR, str(path))
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    fn = guard("ranker.score")
    assert state_of(fn, x) == "disabled"
    assert fn.safecompile.stats().compiles == 0


def test_a_glob_disables_only_matching_names(
    switch: FileSwitch | RedisSwitch, monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """Names and globs, as in ``SAFECOMPILE_DISABLE``: ``ranker.*`` spares ``embed``."""
    monkeypatch.setenv(SOURCE_ENV_VAR, switch.spec)
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    ranker, embed, other = guard("ranker.score"), guard("embed.forward"), guard("ranker2.x")
    switch.set("ranker.*, embed.other")
    WATCHER.poll()
    assert [state_of(f, x) for f in (ranker, embed, other)] == ["disabled", "compiled", "compiled"]
    assert ks.is_disabled("ranker.score")
    assert not ks.is_disabled("embed.forward")

    switch.set("# maintenance window\nembed.forward\n")
    WATCHER.poll()
    assert [state_of(f, x) for f in (ranker, embed, other)] == ["compiled", "disabled", "compiled"]


def test_enable_from_code_does_not_override_the_fleet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """``safecompile.enable()`` undoes what code disabled; the operator's source still
    holds."""
    path = tmp_path / "disable"
    path.write_text("all")
    monkeypatch.setenv(SOURCE_ENV_VAR, f"file://{path}")
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    fn = guard("ranker.score")
    safecompile.enable()
    assert state_of(fn, x) == "disabled"


def test_an_unchanged_value_costs_the_hot_path_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """Polls that read the same value leave the switch's generation alone, so callables
    never re-read the switch for them; a change moves it exactly once."""
    path = tmp_path / "disable"
    path.write_text("0")
    monkeypatch.setenv(SOURCE_ENV_VAR, str(path))
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    fn = guard("ranker.score")
    generation = ks.SWITCH.generation
    for _ in range(3):
        WATCHER.poll()
    assert ks.SWITCH.generation == generation
    path.write_text("ranker.score")
    WATCHER.poll()
    WATCHER.poll()
    assert ks.SWITCH.generation == generation + 1
    assert state_of(fn, x) == "disabled"


# ---------------------------------------------------------------- broken sources


def test_an_unreadable_file_keeps_the_last_value_and_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """A file replaced by a directory, then by bytes that are not UTF-8: the last good
    value stays in force, one warning for the outage, one event when it reads again."""
    path = tmp_path / "disable"
    path.write_text("1")
    monkeypatch.setenv(SOURCE_ENV_VAR, str(path))
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    fn = guard("ranker.score")
    assert state_of(fn, x) == "disabled"

    with capture_logs() as logs:
        path.unlink()
        path.mkdir()
        WATCHER.poll()
        assert state_of(fn, x) == "disabled"
        path.rmdir()
        path.write_bytes(b"\xff\xfe")
        WATCHER.poll()
        assert state_of(fn, x) == "disabled"
        path.write_text("0")
        WATCHER.poll()
        assert state_of(fn, x) == "compiled"
    (error,) = events(logs, "disable_source_error")
    assert error["keeping"] == "all"
    assert "IsADirectoryError" in error["reason"]
    assert len(events(logs, "disable_source_restored")) == 1


def test_a_missing_file_means_enabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting the operator's file switches everything back on (no warning)."""
    path = tmp_path / "disable"
    path.write_text("all")
    monkeypatch.setenv(SOURCE_ENV_VAR, str(path))
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    assert WATCHER.poll() == ks.EVERYTHING
    path.unlink()
    with capture_logs() as logs:
        assert WATCHER.poll() == ks.NOTHING
    assert not events(logs, "disable_source_error")


def test_redis_down_never_breaks_a_call(monkeypatch: pytest.MonkeyPatch, x: torch.Tensor) -> None:
    """Nothing listens at the source's Redis: decoration and calls go on, compiled; one
    warning however many polls fail."""
    monkeypatch.setenv(SOURCE_ENV_VAR, f"redis://127.0.0.1:{free_port()}/0#fleet:disable")
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    with capture_logs() as logs:
        fn = guard("ranker.score")
        for _ in range(3):
            WATCHER.poll()
            assert state_of(fn, x) == "compiled"
    (error,) = events(logs, "disable_source_error")
    assert error["keeping"] == "nothing"
    assert "#fleet:disable" in error["source"]


def test_redis_down_keeps_the_last_value(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """The key said "disabled"; Redis then fails: still disabled, not silently re-enabled."""
    switch = RedisSwitch(redis_url)
    switch.set("ranker.*")
    monkeypatch.setenv(SOURCE_ENV_VAR, switch.spec)
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    fn = guard("ranker.score")
    assert state_of(fn, x) == "disabled"
    source = WATCHER._source
    assert isinstance(source, RedisKeySource)

    def refuse(command: Any) -> Any:
        raise _remote.RemoteUnavailableError("connection refused")

    monkeypatch.setattr(source.link, "run", refuse)
    assert WATCHER.poll() == ks.Rule(patterns=("ranker.*",))
    assert state_of(fn, x) == "disabled"


@pytest.mark.parametrize("spec", ["ftp://host/disable", "disable.txt", "redis://#k"])
def test_a_source_that_names_nothing_warns_and_calls_go_on(
    spec: str, monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """A typo in the variable: one warning, the callable works as without it."""
    monkeypatch.setenv(SOURCE_ENV_VAR, spec)
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    with capture_logs() as logs:
        fn = guard("ranker.score")
        WATCHER.poll()
        assert state_of(fn, x) == "compiled"
    assert len(events(logs, "disable_source_invalid")) == 1


def test_a_value_too_large_is_refused(tmp_path: Path) -> None:
    """Over 64 KiB is not a kill-switch value (a wrong file): unreadable, last value kept."""
    path = tmp_path / "big"
    path.write_bytes(b"a," * 40_000)
    with pytest.raises(Exception, match="larger than"):
        FileSource(path).read()


# ---------------------------------------------------------------- syntax


def test_source_syntax() -> None:
    """Files by URL or absolute path; Redis URLs with ``#key`` (default key otherwise)."""
    assert isinstance(open_source("file:///etc/safecompile/disable"), FileSource)
    assert open_source("file:///etc/safe%20compile/x").path == Path("/etc/safe compile/x")  # type: ignore[attr-defined]
    assert isinstance(open_source("/etc/safecompile/disable"), FileSource)
    source = open_source("redis://:pw@cache:6380/2#ops:safecompile%20off")
    assert isinstance(source, RedisKeySource)
    assert source.key == "ops:safecompile off"
    assert source.label == "redis://:***@cache:6380/2#ops:safecompile off"
    default = open_source("redis://cache:6379/0")
    assert isinstance(default, RedisKeySource)
    assert default.key == DEFAULT_KEY
    for bad in ("file://otherhost/x", "relative/path", "http://x#k"):
        with pytest.raises(ValueError, match=r"file|redis"):
            open_source(bad)


def test_value_syntax_is_the_environment_variables() -> None:
    """The same words and globs as ``SAFECOMPILE_DISABLE``, one a line allowed."""
    assert rule_of(None) == ks.NOTHING
    assert rule_of("") == ks.NOTHING
    assert rule_of(" off\n") == ks.NOTHING
    assert rule_of("1\n") == ks.EVERYTHING
    assert rule_of("# comment\nranker.*\n\nembed.forward , x.y") == ks.Rule(
        patterns=("ranker.*", "embed.forward", "x.y")
    )


def test_poll_interval_syntax() -> None:
    """Seconds, clamped to [0.01, 3600]; unset means the default."""
    assert poll_interval(None) == poll_interval(" ") == DEFAULT_POLL_S
    assert poll_interval("0.5") == 0.5
    assert poll_interval("0") == 0.01
    assert poll_interval("1e9") == 3600.0
    for bad in ("soon", "nan"):
        with pytest.raises(ValueError, match=r"float|not a number"):
            poll_interval(bad)


def test_a_bad_poll_interval_warns_once_and_uses_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watcher never stops for a typo in the interval."""
    monkeypatch.setenv(POLL_ENV_VAR, "soon")
    with capture_logs() as logs:
        assert WATCHER.interval() == DEFAULT_POLL_S
        assert WATCHER.interval() == DEFAULT_POLL_S
    assert len(events(logs, "disable_source_invalid")) == 1


class _HungSource:
    """A source whose read blocks until released (a hung mount past every timeout)."""

    label = "hung://source"

    def __init__(self) -> None:
        self.reading = threading.Event()
        self.release = threading.Event()

    def read(self) -> str | None:
        self.reading.set()
        self.release.wait(WAIT_S)
        return "1"


def test_a_hung_read_holds_up_neither_stop_nor_another_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first read at ``start()`` holds no lock ``stop()`` needs, and a poll that
    finds another still reading keeps the rule in force after a bounded wait."""
    source = _HungSource()
    monkeypatch.setattr(switch_module, "open_source", lambda spec: source)
    monkeypatch.setattr(switch_module, "POLL_WAIT_S", 0.05)
    monkeypatch.setenv(SOURCE_ENV_VAR, "hung://source")
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    starter = threading.Thread(target=WATCHER.start, daemon=True)
    starter.start()
    try:
        assert source.reading.wait(WAIT_S)
        assert WATCHER.poll() == ks.NOTHING  # did not wait for the hung read
        stopper = threading.Thread(target=WATCHER.stop, daemon=True)
        stopper.start()
        stopper.join(WAIT_S)
        assert not stopper.is_alive()  # stop() was not held up by start()'s read
        assert starter.is_alive()  # the read is still hung
    finally:
        source.release.set()
        starter.join(WAIT_S)
    assert ks.SWITCH.watched != ks.NOTHING  # the read, once it came, was applied
