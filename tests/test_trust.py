"""Trust at the seams: nothing hangs (bad Redis URLs, FIFOs, forks), the cache directory
and shared storage are checked before anything read back from them is used.

Waits are bounded: a call that could hang runs on a thread (or in a forked child) and
the test fails when it does not return within ``HANG_S``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from safecompile import safe_compile
from safecompile.base import killswitch as ks
from safecompile.fleet import switch as fleet_switch
from safecompile.fleet.switch import POLL_ENV_VAR, SOURCE_ENV_VAR, WATCHER, FileSource
from safecompile.persist import remote as _remote
from safecompile.persist.bounded import ReadTimeoutError, read_file
from safecompile.persist.remote import REMOTE_ENV_VAR, RedisLink, RemoteUnavailableError

HANG_S = 20.0  # far above any bounded wait here; only a hang reaches it


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(SOURCE_ENV_VAR, raising=False)
    monkeypatch.delenv(POLL_ENV_VAR, raising=False)
    monkeypatch.delenv(REMOTE_ENV_VAR, raising=False)
    WATCHER.reset()
    _remote.reset()
    yield
    WATCHER.reset()
    _remote.reset()


def returns_within(fn: Callable[[], Any], seconds: float = HANG_S) -> Any:
    """``fn()`` on a daemon thread; fails the test if it has not returned in ``seconds``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still blocked after {seconds} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == f"safecompile.{name}"]


def score(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 3


# ---------------------------------------------------------------- item 5: bad Redis URLs

BAD_QUERIES = [
    "redis://127.0.0.1:1/0?socket_timeout=abc",
    "redis://127.0.0.1:1/0?socket_connect_timeout=x",
    "redis://127.0.0.1:1/0?health_check_interval=soon",
    "redis://127.0.0.1:1/0?db=abc",
    "unix:///tmp/nothing-here.sock?db=abc",
]


@pytest.mark.parametrize("url", BAD_QUERIES)
def test_a_url_redis_py_refuses_fails_the_command_not_the_process(url: str) -> None:
    """redis-py refuses the query string when the client is built: the command fails
    with RemoteUnavailableError and one warning, and the link backs off; nothing waits on
    a lock the failing build already holds."""
    link = RedisLink(url)
    with capture_logs() as logs:
        with pytest.raises(RemoteUnavailableError, match="Invalid value"):
            returns_within(lambda: link.run(lambda r: r.ping()))
        with pytest.raises(RemoteUnavailableError, match="backing off"):
            returns_within(lambda: link.run(lambda r: r.ping()))
    assert link.failures == 1
    assert len(events(logs, "remote_cache_unavailable")) == 1


@pytest.mark.parametrize("url", BAD_QUERIES[:2])
def test_a_bad_url_as_the_switch_source_does_not_block_safe_compile(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the kill-switch source, the same URL used to block ``safe_compile()`` itself."""
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    monkeypatch.setenv(SOURCE_ENV_VAR, f"{url}#fleet:disable")
    with capture_logs() as logs:
        guarded = returns_within(lambda: safe_compile(score, backend="eager", shadow=None))
    x = torch.randn(3)
    assert torch.equal(guarded(x), score(x))
    (error,) = events(logs, "disable_source_error")
    assert "Invalid value" in error["reason"]


# ---------------------------------------------------------------- item 7: reads that block


def test_a_fifo_as_the_switch_source_does_not_block_safe_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO nobody writes to used to block the first read, inside ``safe_compile()``:
    now it is refused as not a regular file, with one warning, and calls go on."""
    fifo = tmp_path / "disable"
    os.mkfifo(fifo)
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    monkeypatch.setenv(SOURCE_ENV_VAR, f"file://{fifo}")
    with capture_logs() as logs:
        guarded = returns_within(lambda: safe_compile(score, backend="eager", shadow=None))
    x = torch.randn(3)
    assert torch.equal(guarded(x), score(x))
    (error,) = events(logs, "disable_source_error")
    assert "not a regular file" in error["reason"]


def test_a_read_that_hangs_times_out_and_is_not_stacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that never returns (a hung mount, simulated) costs the timeout once; while
    it is still stuck, the next read of that path fails at once without a new thread."""
    from safecompile.persist import bounded

    release = threading.Event()
    calls: list[str] = []

    def hung_read(name: str, limit: int) -> bytes | None:
        calls.append(name)
        release.wait(HANG_S)
        return b"1"

    real_read = bounded._read
    monkeypatch.setattr(bounded, "_read", hung_read)
    path = tmp_path / "disable"
    started = time.monotonic()
    with pytest.raises(ReadTimeoutError, match="took over"):
        read_file(path, limit=10, timeout=0.2)
    with pytest.raises(ReadTimeoutError, match="has not returned"):
        read_file(path, limit=10, timeout=0.2)
    assert time.monotonic() - started < HANG_S / 2
    assert len(calls) == 1
    release.set()
    deadline = time.monotonic() + HANG_S
    while str(path) in bounded._stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert read_file(path, limit=10) == b"1"
    monkeypatch.setattr(bounded, "_read", real_read)
    assert FileSource(tmp_path / "missing").read() is None
    path.write_bytes(b"x" * 20)
    assert read_file(path, limit=10) == b"x" * 11  # the caller sees it is too large


# ---------------------------------------------------------------- item 7: fork


def run_in_child(child: Callable[[], bool], *, timeout: float = HANG_S) -> int:
    """Fork; the child runs ``child()`` and exits 0 if it returned true, 1 if false, 2 on
    an exception. The child's exit code (the test fails if it has not exited in time)."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 2
        try:
            code = 0 if child() else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child did not exit within {timeout} s")


def test_a_worker_forked_after_decoration_obeys_the_fleet_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gunicorn --preload: the parent decorates (the watcher starts), then forks. The
    child has no watcher thread unless the fork hook restarts it: the operator's file,
    written after the fork, must reach the child."""
    source = tmp_path / "disable"
    monkeypatch.setenv(POLL_ENV_VAR, "0.02")
    monkeypatch.setenv(SOURCE_ENV_VAR, f"file://{source}")
    safe_compile(score, backend="eager", name="fleet.score", shadow=None)
    assert WATCHER.running

    def child() -> bool:
        source.write_text("fleet.*\n")
        deadline = time.monotonic() + HANG_S / 2
        while time.monotonic() < deadline:
            if ks.is_disabled("fleet.score"):
                return WATCHER.running
            time.sleep(0.01)
        return False

    assert run_in_child(child) == 0


def test_a_fork_during_a_poll_does_not_deadlock_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork while another thread is inside a poll (holding the poll lock): the child's
    first ``safe_compile()`` used to wait on that lock for good."""
    monkeypatch.setenv(POLL_ENV_VAR, "3600")
    monkeypatch.setenv(SOURCE_ENV_VAR, f"file://{tmp_path / 'disable'}")
    inside, release = threading.Event(), threading.Event()

    class Blocking:
        label = "blocking"

        def read(self) -> str | None:
            inside.set()
            release.wait(HANG_S)
            return None

    WATCHER.poll()  # opens the real source for the spec...
    monkeypatch.setattr(WATCHER, "_source", Blocking())  # ...then blocks in its read
    poller = threading.Thread(target=WATCHER.poll, daemon=True)
    poller.start()
    assert inside.wait(HANG_S)

    def child() -> bool:
        monkeypatch.setattr(WATCHER, "_source", None)
        guarded = safe_compile(score, backend="eager", shadow=None)
        return guarded.safecompile.name.endswith("score")

    try:
        assert run_in_child(child) == 0
    finally:
        release.set()
        poller.join(HANG_S)


def test_fork_hooks_give_the_child_fresh_locks() -> None:
    """Every lock the seams share is new in a child (one held at the fork is released
    there), and a link's client is built again (the parent's sockets are not reused)."""
    link = RedisLink("redis://127.0.0.1:1/0")
    link._client = object()
    held = [_remote._lock, ks.SWITCH.lock, WATCHER._poll_lock, link._lock]
    for lock in held:
        lock.acquire()
    try:

        def child() -> bool:
            locks = [_remote._lock, ks.SWITCH.lock, WATCHER._poll_lock, link._lock]
            free = all(lock.acquire(timeout=1) for lock in locks)
            return free and link._client is None

        assert run_in_child(child) == 0
    finally:
        for lock in held:
            lock.release()
    assert fleet_switch.WATCHER is WATCHER
