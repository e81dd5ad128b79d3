"""Bounds at the seams, as an attacker or a sick network would test them: a Redis that
trickles its replies or claims a huge value, a key that is not UTF-8, a key file in a
folder others can write or behind a symlink, a ``precompiled/`` folder others can write.

Waits are bounded: a call that could hang runs on a thread and the test fails when it
has not returned within its bound (generous next to the documented one).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from redis_server import FakeRedis
from structlog.testing import capture_logs
from test_trust import events, returns_within

from safecompile import safe_compile
from safecompile.base import killswitch as ks
from safecompile.base import torchcompat
from safecompile.fleet.switch import MAX_BYTES, POLL_ENV_VAR, SOURCE_ENV_VAR, WATCHER
from safecompile.persist import remote as _remote
from safecompile.persist import signing
from safecompile.persist.cache import CACHE_ENV_VAR, VerdictStore, signed_store, usable_root
from safecompile.persist.remote import REMOTE_ENV_VAR, RedisLink, RemoteVerdicts

pytest.importorskip("redis")

# The documented bound of a command is COMMAND_TIMEOUT_S (1 s); asserts allow far more,
# and far less than the 12 s one trickled reply takes.
BOUND_S = 5.0
TRICKLE_S = 0.3  # one byte of the reply every 0.3 s
CLAIM = 400 << 20  # a value Redis claims to hold: 400 MiB


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(SOURCE_ENV_VAR, raising=False)
    monkeypatch.setenv(POLL_ENV_VAR, "3600")  # the watcher thread reads once, at start
    monkeypatch.delenv(REMOTE_ENV_VAR, raising=False)
    WATCHER.reset()
    _remote.reset()
    signing.reset()
    yield
    WATCHER.reset()
    _remote.reset()
    signing.reset()


def within(fn: Callable[[], Any]) -> Any:
    """``fn()``'s value; the test fails if it has not returned within ``BOUND_S``."""
    return returns_within(fn, BOUND_S)


def score(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 3


@pytest.fixture
def trickling() -> Iterator[FakeRedis]:
    with FakeRedis(trickle=TRICKLE_S) as server:
        yield server


# ---------------------------------------------------------------- a deadline per command


def test_a_trickling_redis_holds_a_verdict_read_one_deadline(
    trickling: FakeRedis, tmp_path: Path
) -> None:
    """Each byte arrives within the per-read timeout, so only a deadline for the whole
    command ends the read: the verdict is a miss after about ``COMMAND_TIMEOUT_S``, and
    the link backs off (one warning)."""
    link = RedisLink(trickling.url)
    store = VerdictStore(tmp_path, remote=RemoteVerdicts(link))
    started = time.monotonic()
    with capture_logs() as logs:
        assert within(lambda: store.get("ef" * 16)) is None
        assert store.get("ef" * 16) is None  # backing off: no network
    assert time.monotonic() - started >= _remote.COMMAND_TIMEOUT_S * 0.9
    assert link.failures == 1
    (down,) = events(logs, "remote_cache_unavailable")
    assert "Timeout" in down["reason"]


def test_a_trickling_kill_switch_source_holds_a_poll_and_safe_compile_one_deadline(
    trickling: FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll keeps the rule in force (one warning); ``safe_compile()``, which reads the
    source once, returns, and so does the call."""
    monkeypatch.setenv(SOURCE_ENV_VAR, f"{trickling.url}#fleet:disable")
    with capture_logs() as logs:
        assert within(WATCHER.poll) == ks.NOTHING
        guarded = within(lambda: safe_compile(score, backend="eager", shadow=None))
    (error,) = events(logs, "disable_source_error")
    assert "Timeout" in error["reason"]
    x = torch.randn(3)
    assert torch.equal(within(lambda: guarded(x)), score(x))


def test_a_trickling_remote_cache_holds_the_first_call_one_deadline(
    trickling: FakeRedis, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first call reads the bucket's shared verdict: one deadline, then local only."""
    monkeypatch.setenv(REMOTE_ENV_VAR, trickling.url)
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch-own"))
    guarded = within(lambda: safe_compile(score, backend="eager", shadow=None))
    x = torch.randn(3)
    assert torch.equal(within(lambda: guarded(x)), score(x))
    assert torch.equal(guarded(x), score(x))


# ---------------------------------------------------------------- values are bounded


@pytest.fixture
def huge() -> Iterator[FakeRedis]:
    with FakeRedis(claim=CLAIM) as server:
        yield server


def unread(server: FakeRedis, limit: int) -> None:
    """The client stopped reading past ``limit`` (socket buffers aside), far from the end."""
    assert server.sent < min(limit + (32 << 20), CLAIM // 2), f"{server.sent} of {CLAIM} read"


def test_a_verdict_claimed_huge_is_refused_unread(huge: FakeRedis, tmp_path: Path) -> None:
    link = RedisLink(huge.url)
    store = VerdictStore(tmp_path, remote=RemoteVerdicts(link))
    with capture_logs() as logs:
        assert within(lambda: store.get("ab" * 16)) is None
    unread(huge, _remote.VALUE_MAX_BYTES)
    assert link.failures == 0  # a bad value, not an outage
    (ignored,) = events(logs, "cache_file_ignored")
    assert f"larger than {_remote.VALUE_MAX_BYTES} bytes" in ignored["reason"]


def test_a_kill_switch_value_claimed_huge_is_refused_unread(
    huge: FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SOURCE_ENV_VAR, f"{huge.url}#fleet:disable")
    with capture_logs() as logs:
        assert within(WATCHER.poll) == ks.NOTHING
    unread(huge, MAX_BYTES)
    (error,) = events(logs, "disable_source_error")
    assert f"larger than {MAX_BYTES} bytes" in error["reason"]


def test_torch_values_and_blobs_claimed_huge_are_refused_unread(huge: FakeRedis) -> None:
    """torch's values have ``TORCH_MAX_BYTES``; a blob the limit its caller gives."""
    classes = torchcompat.remote_cache_classes()
    if isinstance(classes, torchcompat.Missing):
        pytest.skip(str(classes))
    key = signing.signer()
    assert key is not None
    link = RedisLink(huge.url)
    backend = _remote._torch_backend(link, key, classes[1])()
    with capture_logs() as logs:
        assert within(lambda: backend._get("pt2:fx-graph-v1::k1")) is None
        unread(huge, _remote.TORCH_MAX_BYTES)
        huge.sent = 0
        blobs = RemoteVerdicts(link)
        assert within(lambda: blobs.get_blob("cd" * 16, "f.bin", limit=1 << 20)) is None
        unread(huge, 1 << 20)
    assert len(events(logs, "cache_file_ignored")) == 2
    assert link.failures == 0


def test_values_within_their_limits_still_travel(redis_url: str) -> None:
    """Against a real redis-server: an 8 MiB blob round-trips within its deadline; asked
    with a 1 MiB limit, the same blob is refused (one warning) and the link stays up."""
    blobs = RemoteVerdicts(RedisLink(redis_url))
    data = os.urandom(8 << 20)
    assert blobs.put_blob("ab" * 16, "f.bin", data)
    assert blobs.get_blob("ab" * 16, "f.bin") == data
    with capture_logs() as logs:
        assert blobs.get_blob("ab" * 16, "f.bin", limit=1 << 20) is None
    assert len(events(logs, "cache_file_ignored")) == 1
    assert blobs.get_blob("ab" * 16, "f.bin") == data
    assert blobs.link.failures == 0


# ---------------------------------------------------------------- the key


def test_a_key_that_is_not_utf8_is_used_as_its_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``os.environ`` holds it with surrogate escapes; its bytes are the key (the same in
    every process given the same bytes), never a ``UnicodeEncodeError``."""
    raw = b"\xff\xfe" + b"k" * 20
    monkeypatch.setitem(os.environb, b"SAFECOMPILE_CACHE_KEY", raw)
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    x = torch.randn(3)
    with capture_logs() as logs:
        guarded = safe_compile(score, backend="eager", shadow=None)
        assert torch.equal(guarded(x), score(x))
    assert not events(logs, "cache_untrusted")
    key = signing.signer()
    assert key is not None
    assert key.secret == raw
    assert key.unseal("p", "n", key.seal("p", "n", b"data")) == b"data"


def key_file(folder: Path, text: str = "a-key-from-a-mounted-secret-01") -> Path:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / "key"
    path.write_text(text)
    path.chmod(0o600)
    return path


def key_from(path: Path | str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[str]]:
    """The signer ``SAFECOMPILE_CACHE_KEY_FILE=path`` gives, and the warnings' reasons."""
    monkeypatch.delenv(signing.KEY_ENV_VAR, raising=False)
    monkeypatch.setenv(signing.KEY_FILE_ENV_VAR, str(path))
    signing.reset()
    with capture_logs() as logs:
        found = within(signing.signer)
    return found, [e["reason"] for e in events(logs, "cache_untrusted")]


def test_a_key_file_in_a_folder_others_can_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anyone could replace it there: refused with one warning, as ssh would. A sticky
    folder (``/tmp``-style) is not such a folder: only the key's owner can replace it."""
    path = key_file(tmp_path / "open")
    path.parent.chmod(0o777)
    found, reasons = key_from(path, monkeypatch)
    assert found is None
    (reason,) = reasons
    assert "a folder on its path" in reason
    assert "writable by other users" in reason

    path.parent.chmod(0o1777)
    found, reasons = key_from(path, monkeypatch)
    assert found is not None
    assert not reasons


def test_a_key_file_linked_to_a_file_others_can_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link to ``/etc/os-release`` (root's, but anyone can read it: no secret) used to be
    taken as the key; a link in a folder others can write is refused for its folder."""
    if not os.path.exists("/etc/os-release"):
        pytest.skip("no /etc/os-release")
    (tmp_path / "good").mkdir(mode=0o700)
    link = tmp_path / "good" / "key"
    link.symlink_to("/etc/os-release")
    found, reasons = key_from(link, monkeypatch)
    assert found is None
    (reason,) = reasons
    assert "readable by other users" in reason

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "key").symlink_to(key_file(tmp_path / "secret"))
    found, reasons = key_from(shared / "key", monkeypatch)
    assert found is None
    assert "a folder on its path" in reasons[0]


def test_a_key_file_linked_to_a_good_file_in_a_good_folder_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Secrets are often mounted as links (Kubernetes: ``key -> ..data/key``): a link
    whose target passes the same checks is followed, relative or absolute."""
    target = key_file(tmp_path / "secret" / "..2026_01_01")
    (tmp_path / "secret" / "..data").symlink_to("..2026_01_01")
    (tmp_path / "secret" / "key").symlink_to("..data/key")
    (tmp_path / "mount").mkdir(mode=0o700)
    (tmp_path / "mount" / "key").symlink_to(tmp_path / "secret" / "key")
    for path in (tmp_path / "secret" / "key", tmp_path / "mount" / "key", target):
        found, reasons = key_from(path, monkeypatch)
        assert found is not None, reasons
        assert found.secret == b"a-key-from-a-mounted-secret-01"
        assert not reasons


def test_a_key_file_swapped_between_check_and_read_is_checked_on_what_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file others can write swapped in just as the key is opened, the good one back
    right after: the checks hold for the descriptor read (``fstat``), not for the path
    stat'ed before or after, so the forged key is refused."""
    path = key_file(tmp_path / "secret")
    forged = tmp_path / "secret" / "forged"
    forged.write_text("a-key-someone-else-wrote-0123")
    forged.chmod(0o666)
    aside = tmp_path / "secret" / "aside"
    real_open = os.open

    def swapping_open(name: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fspath(name) != str(path):
            return real_open(name, flags, *args, **kwargs)
        os.rename(path, aside)
        os.rename(forged, path)
        try:
            return real_open(name, flags, *args, **kwargs)
        finally:
            os.rename(path, forged)
            os.rename(aside, path)

    monkeypatch.setattr(os, "open", swapping_open)
    found, reasons = key_from(path, monkeypatch)
    assert found is None
    (reason,) = reasons
    assert "changed while it was checked" in reason or "writable by other users" in reason


# ---------------------------------------------------------------- precompiled/


def test_a_precompiled_folder_others_can_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``precompiled/`` holds what torch unpickles: checked like ``torch/``, ``verdicts/``
    and ``artifacts/`` (the cache directory is not used, one warning), and calls go on."""
    root = tmp_path / "cache"
    (root / "precompiled").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    monkeypatch.setenv(CACHE_ENV_VAR, str(root))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch-own"))
    assert usable_root() == root
    signing.reset()
    (root / "precompiled").chmod(0o777)
    x = torch.randn(3)
    with capture_logs() as logs:
        assert signed_store() == (None, None)
        guarded = safe_compile(score, backend="eager", shadow=None)
        assert torch.equal(guarded(x), score(x))
    (warning,) = events(logs, "cache_untrusted")
    assert "precompiled" in warning["reason"]
    assert "writable by other users" in warning["reason"]
