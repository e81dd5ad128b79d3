"""Trust at the seams: nothing hangs (bad Redis URLs, FIFOs, forks), the cache directory
and shared storage are checked before anything read back from them is used.

Waits are bounded: a call that could hang runs on a thread (or in a forked child) and
the test fails when it does not return within ``HANG_S``.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from safecompile import Buckets, Warmup, pow2, safe_compile
from safecompile.base import killswitch as ks
from safecompile.fleet import switch as fleet_switch
from safecompile.fleet.switch import POLL_ENV_VAR, SOURCE_ENV_VAR, WATCHER, FileSource
from safecompile.persist import remote as _remote
from safecompile.persist import signing
from safecompile.persist.bounded import ReadTimeoutError, read_file
from safecompile.persist.cache import CACHE_ENV_VAR, Verdict, VerdictStore
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
    while str(path) in bounded.STATE.stuck and time.monotonic() < deadline:
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
    held = [_remote._PROCESS.lock, ks.SWITCH.lock, WATCHER._poll_lock, link._lock]
    for lock in held:
        lock.acquire()
    try:

        def child() -> bool:
            locks = [_remote._PROCESS.lock, ks.SWITCH.lock, WATCHER._poll_lock, link._lock]
            free = all(lock.acquire(timeout=1) for lock in locks)
            return free and link._client is None

        assert run_in_child(child) == 0
    finally:
        for lock in held:
            lock.release()
    assert fleet_switch.WATCHER is WATCHER


# ---------------------------------------------------------------- shared storage is code


class Payload:
    """A pickle that creates ``marker`` when it is unpickled: what an attacker writes."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def torch_entry(marker: Path) -> bytes:
    """torch's remote-cache value format (JSON, the pickle base64'd) holding a payload."""
    data = base64.b64encode(pickle.dumps(Payload(marker))).decode()
    return json.dumps({"data": data, "time_taken_ms": 1}).encode()


@pytest.fixture
def remote_on(redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The remote cache activated (with the test key) over the session's redis-server;
    a Redis client to play the attacker."""
    redis = pytest.importorskip("redis")
    for name, _module, _attr in _remote.TORCH_FLAGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(REMOTE_ENV_VAR, redis_url)
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    signing.reset()
    assert _remote.activate() is not None
    return redis.Redis.from_url(redis_url)


@pytest.mark.parametrize(
    ("cache_id", "cache"),
    [("fx-graph-v1", "FxGraphCache"), ("autograd-experimental", "AOTAutogradCache")],
)
def test_a_pickle_written_into_redis_is_never_unpickled(
    remote_on: Any, tmp_path: Path, cache_id: str, cache: str
) -> None:
    """Item 1, the attacker: a payload under torch's own key, read by torch's own lookup
    (``GuardedCache.iterate_over_candidates``, which unpickles) through our transport, is
    a miss with one warning; the same bytes sealed with the operator's key do reach torch
    (the control: this lookup does unpickle what the transport hands it)."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor import remote_cache
    from torch._inductor.codecache import FxGraphCache

    guarded = {"FxGraphCache": FxGraphCache, "AOTAutogradCache": AOTAutogradCache}[cache]
    transport = remote_cache.RedisRemoteCache(cache_id)
    redis_key = transport._get_key("k1")
    marker = tmp_path / "pwned"
    remote_on.set(redis_key, torch_entry(marker))
    with capture_logs() as logs:
        assert list(guarded.iterate_over_candidates(False, transport, "k1")) == []
    assert not marker.exists()
    (ignored,) = events(logs, "cache_file_ignored")
    assert "not signed" in ignored["reason"]
    assert redis_key in ignored["path"]

    key = signing.signer()
    assert key is not None
    remote_on.set(redis_key, key.seal(_remote.TORCH_PURPOSE, redis_key, torch_entry(marker)))
    list(guarded.iterate_over_candidates(False, transport, "k1"))
    assert marker.exists()  # signed by the key holder: trusted like the code


def test_another_keys_seal_or_another_name_does_not_verify(remote_on: Any) -> None:
    """An entry sealed under another key, or moved from another Redis key, is a miss."""
    from torch._inductor import remote_cache

    transport = remote_cache.RedisRemoteCache("fx-graph-v1")
    name, other = transport._get_key("k1"), transport._get_key("k2")
    value = json.dumps({"data": "x"}).encode()
    wrong = signing.Signer(secret=b"another-operator-key-1234", source="test")
    remote_on.set(name, wrong.seal(_remote.TORCH_PURPOSE, name, value))
    assert transport.get("k1") is None
    key = signing.signer()
    assert key is not None
    remote_on.set(name, key.seal(_remote.TORCH_PURPOSE, other, value))
    assert transport.get("k1") is None
    remote_on.set(name, key.seal(_remote.TORCH_PURPOSE, name, value))
    assert transport.get("k1") == {"data": "x"}
    transport.put("k3", {"data": "y"})  # what torch writes is sealed
    assert remote_on.get(transport._get_key("k3")).startswith(signing.MAGIC)


def test_without_a_key_torchs_remote_caches_stay_off(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key: nothing torch unpickles is read from Redis; torch's flags and transport are
    untouched, the verdict tier is off, one warning says so."""
    from torch._inductor import remote_cache

    for name, _module, _attr in _remote.TORCH_FLAGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(signing.KEY_ENV_VAR)
    monkeypatch.setenv(REMOTE_ENV_VAR, redis_url)
    with capture_logs() as logs:
        assert _remote.activate() is None
        assert _remote.activate() is None
    (warning,) = events(logs, "remote_cache_unavailable")
    assert "SAFECOMPILE_CACHE_KEY" in warning["reason"]
    assert remote_cache.RedisRemoteCache.backend_override_cls is None
    assert "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE" not in os.environ


def centered(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(dim=1, keepdim=True)  # zero padding moves the mean


def tokenwise(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ torch.ones(8, 8)) * 2


def bucketed(fn: Any) -> Any:
    return safe_compile(
        fn,
        backend="eager",
        shadow=None,
        buckets=Buckets(dims={"x": 1}, sizes=pow2(4, 32), strategy="pad"),
        warmup=Warmup(inputs=[(torch.randn(2, 5, 8),)]),
    )


def restored(g: Any) -> list[str | None]:
    return [b["restored"] for b in g.safecompile.report()["buckets"].values()]


def all_correct(g: Any, fn: Any, calls: int = 20) -> int:
    """How many of ``calls`` calls (lengths 1..) returned ``fn``'s eager result."""
    good = 0
    for n in range(1, calls + 1):
        x = torch.randn(2, n, 8)
        out = g(x)
        good += out.shape == fn(x).shape and torch.allclose(out, fn(x), atol=1e-5)
    return good


def test_a_rejected_bucket_rewritten_as_verified_in_redis_is_not_trusted(
    remote_on: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 2 through Redis: a replica rejects ``centered``'s buckets (padding moves the
    mean); an attacker rewrites each shared verdict as ``bucket_verified`` with a cut that
    fits. A replica with an empty local cache ignores them (HMAC), verifies again, and all
    its results are right with ``shadow=None``."""
    first = bucketed(centered)
    assert [b["status"] for b in first.safecompile.report()["buckets"].values()] == ["rejected"] * 4
    rewritten = 0
    for name in remote_on.scan_iter(match=f"{_remote.VERDICT_PREFIX}*"):
        for scope, raw in remote_on.hgetall(name).items():
            doc = json.loads(raw)
            if doc["verdict"]["kind"] != "bucket_rejected":
                continue
            size = int(doc["verdict"]["details"]["bucket"].split()[0])
            doc["verdict"]["kind"] = "bucket_verified"
            doc["verdict"]["details"]["cut"] = [["", [2, size, 8], [[1, 0]], True]]
            remote_on.hset(name, scope, json.dumps(doc))
            rewritten += 1
    assert rewritten == 4

    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "another-replica"))
    with capture_logs() as logs:
        second = bucketed(centered)
        assert all_correct(second, centered) == 20
    assert "verified" not in restored(second)
    assert any("HMAC" in e["reason"] for e in events(logs, "cache_file_ignored"))


def test_a_signed_cut_that_keeps_the_pad_rows_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 2, a local verdict whose cut keeps the pad rows (cuts nothing), even signed
    with the operator's key: inconsistent with its bucket, so the bucket is verified
    again against eager and every result has the input's length."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    bucketed(tokenwise)
    store = VerdictStore(tmp_path)
    keys = {p.parent.name for p in (tmp_path / "verdicts").rglob("*.json")}
    changed = 0
    for key in keys:
        for scope, verdict in store.all(key).items():
            if verdict.kind == "bucket_verified":
                cut = [[p, shape, [], c] for p, shape, _dims, c in verdict.details["cut"]]
                details = {**verdict.details, "cut": cut}
                store.put(key, Verdict(**{**verdict.to_dict(), "details": details}), scope)
                changed += 1
    assert changed == 4
    second = bucketed(tokenwise)
    assert all_correct(second, tokenwise, calls=12) == 12
    assert second.safecompile.stats().shadow_checks == 4  # each bucket verified again


def test_an_artifact_blob_is_verified_before_torch_loads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 3: ``artifacts/<key>.bin`` (which torch unpickles) written by someone who can
    write the cache directory but has no key never reaches
    ``torch.compiler.load_cache_artifacts``; a blob sealed with the key does."""
    from safecompile.persist import restart

    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    x = torch.randn(3)

    def persisted() -> tuple[Any, str]:
        kept = restart.Persisted(score, {"backend": "eager"})
        key = kept.key((x,), {})
        assert key is not None
        return kept, key

    kept, key = persisted()
    artifacts = Verdict(kind=restart.ARTIFACTS, time=1.0, details={"torch_cache_dir": "/x"})
    assert VerdictStore(tmp_path).put(key, artifacts, restart._ARTIFACTS_SCOPE)
    blob = kept._blob(key)
    blob.parent.mkdir()
    blob.write_bytes(pickle.dumps(Payload(tmp_path / "pwned")))
    with capture_logs() as logs:
        kept.load_artifacts((x,), {})
    assert loaded == []
    (ignored,) = events(logs, "cache_file_ignored")
    assert "not signed" in ignored["reason"]

    key_holder = signing.signer()
    assert key_holder is not None
    blob.write_bytes(key_holder.seal("artifacts", key, b"torch's blob"))
    persisted()[0].load_artifacts((x,), {})
    assert loaded == [b"torch's blob"]


def test_without_a_key_the_cache_directory_keeps_only_torchs_own_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key: no verdict is written or read (one warning), torch's on-disk cache still
    points there, and calls are eager-correct."""
    from safecompile.testing import FailingBackend

    monkeypatch.delenv(signing.KEY_ENV_VAR)
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    signing.reset()
    x = torch.randn(3)
    with capture_logs() as logs:
        g = safe_compile(score, backend=FailingBackend(), shadow=None)
        assert torch.equal(g(x), score(x))
    assert not list(tmp_path.rglob("*.json"))
    (warning,) = events(logs, "cache_untrusted")
    assert "without a key" in warning["reason"]


def test_a_key_file_is_read_once_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SAFECOMPILE_CACHE_KEY_FILE``: the key is the file's text; a file others can
    write, a short key or a FIFO is refused with one warning, never a hang."""
    monkeypatch.delenv(signing.KEY_ENV_VAR)
    path = tmp_path / "key"
    path.write_text("  a-key-from-a-mounted-secret \n")
    path.chmod(0o600)
    monkeypatch.setenv(signing.KEY_FILE_ENV_VAR, str(path))
    signing.reset()
    found = signing.signer()
    assert found is not None
    assert found.secret == b"a-key-from-a-mounted-secret"
    assert "key" not in repr(found).replace("KEY_FILE", "").split("source")[0]

    bad = {"open": tmp_path / "open", "short": tmp_path / "short", "fifo": tmp_path / "fifo"}
    bad["open"].write_text("a-key-others-can-rewrite-0123")
    bad["open"].chmod(0o666)
    bad["short"].write_text("short")
    os.mkfifo(bad["fifo"])
    for why, bad_path in bad.items():
        monkeypatch.setenv(signing.KEY_FILE_ENV_VAR, str(bad_path))
        with capture_logs() as logs:
            assert returns_within(signing.signer) is None, why
        assert len(events(logs, "cache_untrusted")) == 1, why


# ---------------------------------------------------------------- the cache directory


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o722])
def test_a_cache_directory_others_can_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    """torch unpickles from it: as ssh refuses such a key directory, a cache directory
    group or others can write is not used (one warning), and calls go on."""
    from safecompile.testing import FailingBackend

    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    monkeypatch.setenv(CACHE_ENV_VAR, str(root))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch-own"))
    x = torch.randn(3)
    with capture_logs() as logs:
        g = safe_compile(score, backend=FailingBackend(), shadow=None)
        assert torch.equal(g(x), score(x))
    assert list(root.iterdir()) == []
    (warning,) = events(logs, "cache_untrusted")
    assert "writable by other users" in warning["reason"]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "torch-own")


def test_a_cache_directory_owned_by_someone_else_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    monkeypatch.setenv(CACHE_ENV_VAR, str(root))
    from safecompile.persist.cache import usable_root

    with capture_logs() as logs:
        assert usable_root() is None
    (warning,) = events(logs, "cache_untrusted")
    assert "owned by uid 65534" in warning["reason"]


def test_a_read_only_cache_directory_is_a_warning_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 12: on a read-only file system (simulated: creating anything under the
    directory fails with EROFS, as it does for root too) ``safe_compile()`` used to raise
    ``OSError``; now one warning, the cache off, and calls are right."""
    root = tmp_path / "ro"
    root.mkdir(mode=0o700)
    real_mkdir, real_open = os.mkdir, os.open

    def read_only(path: Any) -> None:
        if str(path).startswith(str(root)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        read_only(path)
        real_mkdir(path, *args, **kwargs)

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            read_only(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setenv(CACHE_ENV_VAR, str(root))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    x = torch.randn(3)
    with capture_logs() as logs:
        g = safe_compile(score, backend="eager", shadow=None)
        assert torch.equal(g(x), score(x))
    (warning,) = events(logs, "cache_untrusted")
    assert "Read-only file system" in warning["reason"]


# ---------------------------------------------------------------- bad input read back


def deep(levels: int) -> bytes:
    return b'{"schema": "safecompile.verdict", "x": ' + b"[" * levels + b"]" * levels + b"}"


@pytest.mark.parametrize("levels", [100, 200_000])
def test_a_deeply_nested_verdict_file_is_ignored_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, levels: int
) -> None:
    """Item 11: a verdict file nested far deeper than any verdict (deep enough to make the
    parser recurse past Python's limit, or just absurdly deep) is foreign: one warning,
    and the guarded call answers eager's result instead of raising RecursionError."""
    from safecompile.testing import FailingBackend

    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    x = torch.randn(3)
    safe_compile(score, backend=FailingBackend(), shadow=None)(x)  # persists a verdict
    files = list((tmp_path / "verdicts").rglob("*.json"))
    assert files
    for path in files:
        path.write_bytes(deep(levels))
    with capture_logs() as logs:
        g = safe_compile(score, backend=FailingBackend(), shadow=None)
        assert torch.equal(g(x), score(x))
    assert any("nested deeper" in e["reason"] for e in events(logs, "cache_file_ignored"))


def test_a_deeply_nested_verdict_in_redis_is_ignored(remote_on: Any, tmp_path: Path) -> None:
    """Item 11 through the remote tier."""
    verdicts = _remote.activate()
    assert verdicts is not None
    remote_on.hset(verdicts.name("ab" * 16), "", deep(200_000))
    with capture_logs() as logs:
        assert VerdictStore(tmp_path / "empty", remote=verdicts).get("ab" * 16) is None
    (ignored,) = events(logs, "cache_file_ignored")
    assert "nested deeper" in ignored["reason"]


# ---------------------------------------------------------------- item 4: a cache error


def test_a_cache_entry_torch_fails_on_is_not_a_compile_failure(
    remote_on: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 4: a value under torch's key that torch fails on (here sealed with the key,
    as a buggy key holder would write it; unsigned junk is already a miss) fails the
    compile that read it. That is the cache's failure, not the function's: no
    ``compile_failed`` verdict is persisted (locally or in Redis), the callable does not
    trip, the failure is counted, and the next call compiles without the remote tier."""
    from torch._inductor import remote_cache

    transport = remote_cache.RedisRemoteCache("fx-graph-v1")
    name = transport._get_key("graph")
    key = signing.signer()
    assert key is not None
    remote_on.set(name, key.seal(_remote.TORCH_PURPOSE, name, b"{junk"))
    reads: list[object] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        reads.append(remote_cache.RedisRemoteCache("fx-graph-v1").get("graph"))  # may raise
        return gm.forward

    x = torch.randn(3)
    with capture_logs() as logs:
        g = safe_compile(score, backend=backend, shadow=None)
        assert torch.equal(g(x), score(x))  # the failed compile: eager answers
        assert torch.equal(g(x), score(x))  # the retry, without the remote tier
    assert reads == [None]  # the retry's lookup was a miss; the first one raised
    assert g.safecompile.state.value == "compiled"
    assert g.safecompile.stats().rollbacks == 0
    assert _remote.cache_errors() == 1
    assert len(events(logs, "remote_cache_error")) == 1
    assert not list(remote_on.scan_iter(match=f"{_remote.VERDICT_PREFIX}*"))
    assert not list(Path(os.environ[CACHE_ENV_VAR]).rglob("*.json"))


def test_without_a_key_reset_works_and_nothing_is_persisted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keyless with a cache directory: buckets are learnt in memory, ``reset()`` forgets
    them (it used to fail on the missing artifact folder), nothing lands on disk."""
    monkeypatch.delenv(signing.KEY_ENV_VAR)
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    g = bucketed(tokenwise)
    assert all_correct(g, tokenwise, calls=6) == 6
    g.safecompile.reset()
    assert all_correct(g, tokenwise, calls=6) == 6
    assert not list(tmp_path.rglob("*.json"))
    assert not list(tmp_path.rglob("*.bin"))


def test_a_verdict_file_that_blocks_on_read_is_not_waited_for(tmp_path: Path) -> None:
    """A FIFO where a verdict file should be (or a hung mount): the read is bounded, the
    entry ignored with one warning."""
    store = VerdictStore(tmp_path)
    path = store.path("ab" * 16)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    with capture_logs() as logs:
        assert returns_within(lambda: store.get("ab" * 16)) is None
    (ignored,) = events(logs, "cache_file_ignored")
    assert "not a regular file" in ignored["reason"]


@pytest.mark.inductor
def test_a_replica_compiling_with_inductor_never_unpickles_an_attackers_entry(
    redis_url: str, tmp_path: Path
) -> None:
    """Item 1 end to end: replica 1 fills Redis through torch's own caches (inductor); an
    attacker overwrites every ``pt2:`` value with a pickle payload; replica 2 (its own
    empty cache dir) compiles: the payload never runs, results are right, and the graphs
    are compiled afresh instead of loaded."""
    from test_remote_cache import INDUCTOR_CHILD, replica

    redis = pytest.importorskip("redis")
    first = replica(INDUCTOR_CHILD, url=redis_url, cache_dir=tmp_path / "one")
    assert first["close"]
    client = redis.Redis.from_url(redis_url)
    names = list(client.scan_iter(match="pt2:*"))
    assert names, "replica 1 wrote nothing to torch's remote caches"
    marker = tmp_path / "pwned"
    for name in names:
        client.set(name, torch_entry(marker))
    second = replica(INDUCTOR_CHILD, url=redis_url, cache_dir=tmp_path / "two")
    assert not marker.exists()
    assert second["close"]
    assert second["state"] == "compiled"
    assert second["fx_hits"] == second["aot_hits"] == 0


def test_a_cache_directory_that_hangs_is_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache directory on a hung mount (simulated: creating the probe file never
    returns): the check gives up after its timeout and the directory is not used."""
    import tempfile

    from safecompile.persist import cache

    root = tmp_path / "hung"
    release = threading.Event()
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args: Any, **kwargs: Any) -> Any:
        if str(kwargs.get("dir", "")).startswith(str(root)):
            release.wait(HANG_S)
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(cache, "DIR_CHECK_TIMEOUT_S", 0.3, raising=False)
    monkeypatch.setenv(CACHE_ENV_VAR, str(root))
    try:
        with capture_logs() as logs:
            assert returns_within(cache.usable_root, HANG_S / 2) is None
        (warning,) = events(logs, "cache_untrusted")
        assert "does not answer" in warning["reason"]
    finally:
        release.set()
