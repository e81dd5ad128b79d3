"""Compile once per fleet: ``SAFECOMPILE_REMOTE_CACHE`` against a real ``redis-server``.

Processes are real subprocesses, each with its own fresh ``SAFECOMPILE_CACHE_DIR`` (so
torch's local caches and the local verdict files are not shared): only Redis is.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from redis_server import RedisServer, free_port, require_redis_server
from structlog.testing import capture_logs

from safecompile import safe_compile
from safecompile.persist import cache as _cache
from safecompile.persist import remote as _remote
from safecompile.persist.remote import REMOTE_ENV_VAR, RedisLink, RemoteUnavailableError
from safecompile.testing import FailingBackend, FakeClock

HERE = Path(__file__).resolve().parent

# A replica: guards one function with a backend that fails to compile, calls it, and
# prints what happened. Its backend is a FailingBackend in every process: the artifact key
# holds the backend's name and the function's code, not an object's identity.
FAILING_CHILD = """
import json, torch
from safecompile import safe_compile
from safecompile.testing import FailingBackend

def score(x):
    return torch.sin(x) * 2 + 1

backend = FailingBackend()
guarded = safe_compile(score, backend=backend, name="fleet.score", shadow=None)
x = torch.linspace(-1, 1, 12).reshape(3, 4)
out = guarded(x)
print(json.dumps({
    "equal": bool(torch.equal(out, score(x))),
    "backend_compiles": backend.compiles,
    "state": guarded.safecompile.state.value,
    "events": [[e.kind.value, e.message or ""] for e in guarded.safecompile.events()],
}))
"""

# A replica compiling a small MLP with inductor; prints torch's cache counters.
INDUCTOR_CHILD = """
import json, torch
from torch._dynamo.utils import counters
from safecompile import safe_compile

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
x = torch.randn(8, 16)
with torch.no_grad():
    expected = model(x)
    guarded = safe_compile(model, backend="inductor", name="fleet.mlp", shadow=None)
    out = guarded(x)
print(json.dumps({
    "close": bool(torch.allclose(out, expected)),
    "state": guarded.safecompile.state.value,
    "compiled_calls": guarded.safecompile.stats().compiled_calls,
    "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
    "fx_misses": counters["inductor"]["fxgraph_cache_miss"],
    "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
}))
"""


def replica(code: str, *, url: str, cache_dir: Path, timeout: float = 300) -> dict[str, Any]:
    """Run one replica in a fresh process; its printed JSON."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "SAFECOMPILE_"))
    }
    env.update({REMOTE_ENV_VAR: url, "SAFECOMPILE_CACHE_DIR": str(cache_dir)})
    env["SAFECOMPILE_CACHE_KEY"] = os.environ["SAFECOMPILE_CACHE_KEY"]  # the fleet's key
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(autouse=True)
def _no_remote_leak(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test activates its own remote cache; torch's flags and transport come back."""
    monkeypatch.delenv(REMOTE_ENV_VAR, raising=False)
    _remote.reset()
    yield
    _remote.reset()


def remote_events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == f"safecompile.{name}"]


# ---------------------------------------------------------------- across processes


def test_a_verdict_one_process_wrote_is_honoured_by_another(redis_url: str, tmp_path: Path) -> None:
    """Replica 1 fails to compile and persists it; replica 2, with an empty local cache,
    reads the verdict from Redis and never calls the backend."""
    first = replica(FAILING_CHILD, url=redis_url, cache_dir=tmp_path / "one")
    second = replica(FAILING_CHILD, url=redis_url, cache_dir=tmp_path / "two")

    assert first["equal"]
    assert second["equal"]
    assert first["backend_compiles"] >= 1
    assert first["state"] == "rolled_back"
    assert second["backend_compiles"] == 0
    assert second["state"] == "rolled_back"
    messages = [message for kind, message in second["events"] if kind == "rollback"]
    assert any("known compile failure" in m for m in messages), second["events"]
    assert not list((tmp_path / "two" / "verdicts").rglob("*.json"))  # came from Redis


@pytest.mark.inductor
def test_a_graph_one_replica_compiled_is_loaded_by_the_next(redis_url: str, tmp_path: Path) -> None:
    """Replica 2 (its own empty cache dir) gets inductor's FX graph and AOTAutograd
    entries from Redis: torch's hit counters say so, and results match eager."""
    first = replica(INDUCTOR_CHILD, url=redis_url, cache_dir=tmp_path / "one")
    second = replica(INDUCTOR_CHILD, url=redis_url, cache_dir=tmp_path / "two")

    assert first["close"]
    assert second["close"]
    assert first["state"] == second["state"] == "compiled"
    assert first["compiled_calls"] == second["compiled_calls"] == 1
    assert first["fx_hits"] == 0
    assert first["aot_hits"] == 0
    assert second["fx_hits"] + second["aot_hits"] >= 1, second


# ---------------------------------------------------------------- in this process


def test_torch_remote_caches_are_on_for_every_thread(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Activation switches torch's flags on process-wide (a new thread sees them too) and
    routes torch's Redis traffic through safecompile's link; reset() puts it all back."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor import remote_cache

    for name, _module, _attr in _remote.TORCH_FLAGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(REMOTE_ENV_VAR, redis_url)
    assert _remote.activate() is not None

    seen: dict[str, object] = {}

    def read() -> None:
        seen["fx"] = inductor_config.fx_graph_remote_cache
        seen["aot"] = functorch_config.enable_remote_autograd_cache

    worker = threading.Thread(target=read)
    worker.start()
    worker.join()
    assert seen == {"fx": True, "aot": True}

    cache = remote_cache.RemoteFxGraphCache("fx-graph-v1")
    cache.put("k1", {"data": "abc"})
    assert cache.get("k1") == {"data": "abc"}
    redis = pytest.importorskip("redis")
    assert redis.Redis.from_url(redis_url).exists("pt2:fx-graph-v1::k1:c1") == 1

    _remote.reset()
    assert inductor_config.fx_graph_remote_cache is None
    assert remote_cache.RedisRemoteCache.backend_override_cls is None
    assert "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE" not in os.environ


def test_a_flag_the_user_set_off_stays_off(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE=0`` is the user's word: not switched on."""
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE", "0")
    monkeypatch.setenv(REMOTE_ENV_VAR, redis_url)
    with capture_logs() as logs:
        _remote.activate()
    (enabled,) = remote_events(logs, "remote_cache_enabled")
    assert "enable_remote_autograd_cache" not in enabled["torch_caches"]
    assert "fx_graph_remote_cache" in enabled["torch_caches"]
    assert os.environ["TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE"] == "0"


def test_remote_cache_settings_do_not_change_the_artifact_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the remote cache is, and whether torch's remote flags are on, says nothing
    about what is compiled: replicas with and without it share verdict keys."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    before = _cache.artifact_key(fn, backend="inductor")
    monkeypatch.setenv("TORCHINDUCTOR_REDIS_URL", "redis://cache.internal:6379/0")
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE", "1")
    assert _cache.artifact_key(fn, backend="inductor") == before
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")  # what is compiled: a new key
    assert _cache.artifact_key(fn, backend="inductor") != before


def test_verdicts_round_trip_through_redis_alone(redis_url: str, tmp_path: Path) -> None:
    """Two stores with separate local directories share verdicts through Redis; clearing
    one key clears it fleet-wide."""
    link = RedisLink(redis_url)
    one = _cache.VerdictStore(tmp_path / "one", remote=_remote.RemoteVerdicts(link))
    two = _cache.VerdictStore(tmp_path / "two", remote=_remote.RemoteVerdicts(link))
    verdict = _cache.Verdict(kind="compile_failed", time=1.0, name="f", error_type="E")
    assert one.put("ab" * 16, verdict, scope="bucket=128")

    assert two.get("ab" * 16, scope="bucket=128") == verdict
    assert two.get("ab" * 16) is None
    assert two.all("ab" * 16) == {"bucket=128": verdict}
    assert two.clear("ab" * 16) == 1  # the remote entry (two had no file)
    assert one.get("ab" * 16, scope="bucket=128") == verdict  # its own file remains
    assert (
        _cache.VerdictStore(tmp_path / "three", remote=_remote.RemoteVerdicts(link)).all("ab" * 16)
        == {}
    )


def test_blobs_travel_with_their_key(redis_url: str) -> None:
    """A binary artifact stored under a key is read back by another link, and goes when
    the key's verdicts are cleared."""
    one = _remote.RemoteVerdicts(RedisLink(redis_url))
    two = _remote.RemoteVerdicts(RedisLink(redis_url))
    assert one.put_blob("ab" * 16, "artifacts", b"\x00torch\xff")
    assert two.get_blob("ab" * 16, "artifacts") == b"\x00torch\xff"
    assert two.get_blob("cd" * 16, "artifacts") is None
    assert one.put("ab" * 16, "", b"{}")
    assert two.delete("ab" * 16) == 2
    assert one.get_blob("ab" * 16, "artifacts") is None


def test_a_foreign_document_in_redis_is_ignored_with_a_warning(
    redis_url: str, tmp_path: Path
) -> None:
    """A value that is not a verdict document (another tool, a corrupt write) is not
    trusted: no verdict, one warning naming where it was."""
    redis = pytest.importorskip("redis")
    link = RedisLink(redis_url)
    verdicts = _remote.RemoteVerdicts(link)
    redis.Redis.from_url(redis_url).hset(verdicts.name("cd" * 16), "", b"{not json")
    store = _cache.VerdictStore(tmp_path, remote=verdicts)
    with capture_logs() as logs:
        assert store.get("cd" * 16) is None
    (ignored,) = remote_events(logs, "cache_file_ignored")
    assert "corrupt" in ignored["reason"]
    assert "safecompile:v1:verdicts:" in ignored["path"]


# ---------------------------------------------------------------- Redis away


def test_redis_down_calls_stay_correct_with_one_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """Nothing listens at the URL: calls answer eager's result, the failure is persisted
    locally, and one warning event says the remote cache is unavailable."""
    monkeypatch.setenv(REMOTE_ENV_VAR, f"redis://127.0.0.1:{free_port()}/0")
    monkeypatch.setenv("SAFECOMPILE_CACHE_DIR", str(tmp_path))

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t.cos() - 1

    with capture_logs() as logs:
        guarded = safe_compile(fn, backend=FailingBackend(), shadow=None)
        results = [guarded(x) for _ in range(3)]
        again = safe_compile(fn, backend=FailingBackend(), shadow=None)
        results.append(again(x))

    assert all(torch.equal(r, fn(x)) for r in results)
    assert again.safecompile.state.value == "rolled_back"  # the local verdict
    assert list((tmp_path / "verdicts").rglob("*.json"))
    down = remote_events(logs, "remote_cache_unavailable")
    assert len(down) == 1, down
    assert down[0]["use"] == "verdicts"


def test_a_redis_that_hangs_costs_a_short_timeout_not_a_stall(tmp_path: Path) -> None:
    """A server that accepts and never answers: each command gives up after the socket
    timeout, then the link backs off and touches the network no more."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        clock = FakeClock()
        link = RedisLink(url, clock=clock, retry_after=30.0)
        store = _cache.VerdictStore(tmp_path, remote=_remote.RemoteVerdicts(link))
        started = time.monotonic()
        assert store.get("ef" * 16) is None
        first = time.monotonic() - started
        assert store.get("ef" * 16) is None  # backing off: no network
        assert link.failures == 1
        assert first < _remote.SOCKET_TIMEOUT_S + _remote.CONNECT_TIMEOUT_S + 2.0


def test_a_redis_that_goes_away_and_comes_back(tmp_path: Path) -> None:
    """Down: one warning, local only while backing off; back (after ``retry_after`` on
    the link's clock): one info event and the shared verdicts again."""
    server = RedisServer.start(require_redis_server())
    port = server.port
    clock = FakeClock()
    link = RedisLink(server.url, clock=clock, retry_after=30.0)
    verdicts = _remote.RemoteVerdicts(link)
    verdict = _cache.Verdict(kind="compile_failed", time=2.0)
    try:
        assert verdicts.put("12" * 16, "", b"x")
        server.stop()
        with capture_logs() as logs:
            assert verdicts.get("12" * 16) is None
            assert verdicts.get("12" * 16) is None
            with pytest.raises(RemoteUnavailableError):
                link.run(lambda r: r.ping())
        assert link.failures == 1
        assert len(remote_events(logs, "remote_cache_unavailable")) == 1

        server = RedisServer.start(require_redis_server(), port=port)
        clock.advance(30.0)
        store = _cache.VerdictStore(tmp_path, remote=verdicts)
        with capture_logs() as logs:
            assert store.put("34" * 16, verdict)
        assert len(remote_events(logs, "remote_cache_restored")) == 1
        assert verdicts.get("34" * 16) is not None
    finally:
        server.stop()


def test_without_redis_py_one_warning_and_local_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, x: torch.Tensor
) -> None:
    """redis-py missing: the variable is set, but everything stays local after one warning;
    calls and decorations go on as without it."""
    monkeypatch.setattr(_remote, "_import_redis", lambda: None)
    monkeypatch.setenv(REMOTE_ENV_VAR, "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("SAFECOMPILE_CACHE_DIR", str(tmp_path))
    with capture_logs() as logs:
        first = safe_compile(lambda t: t * 3, backend="eager", shadow=None)
        second = safe_compile(lambda t: t * 4, backend="eager", shadow=None)
        assert torch.equal(first(x), x * 3)
        assert torch.equal(second(x), x * 4)
    (warning,) = remote_events(logs, "remote_cache_unavailable")
    assert "redis-py is not installed" in warning["reason"]
    assert _remote.activate() is None
    assert _cache.VerdictStore(tmp_path).remote is None


@pytest.mark.parametrize(
    "value", ["http://cache:6379", "redis://", "cache:6379", "redis://h:notaport/0"]
)
def test_a_url_that_is_not_redis_warns_once_and_stays_local(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """A typo in the variable is not worth an outage: one warning naming it, local only."""
    monkeypatch.setenv(REMOTE_ENV_VAR, value)
    with capture_logs() as logs:
        assert _remote.activate() is None
        assert _remote.activate() is None
    (warning,) = remote_events(logs, "remote_cache_unavailable")
    assert "not a Redis URL" in warning["reason"]


def test_passwords_never_reach_logs() -> None:
    """URLs in events and reports have their password masked."""
    assert _remote.redacted("redis://user:s3cret@cache:6380/2") == "redis://user:***@cache:6380/2"
    assert _remote.redacted("redis://cache:6379/0") == "redis://cache:6379/0"


def test_without_redis_server_the_fleet_tests_skip_unless_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No ``redis-server``: a skip on a laptop, a failure where CI requires it."""
    import redis_server as helper

    monkeypatch.setattr(helper, "redis_server_binary", lambda: None)
    monkeypatch.delenv(helper.REQUIRE_ENV_VAR, raising=False)
    with pytest.raises(pytest.skip.Exception):
        helper.require_redis_server()
    monkeypatch.setenv(helper.REQUIRE_ENV_VAR, "1")
    with pytest.raises(pytest.fail.Exception, match="SAFECOMPILE_REQUIRE_REDIS=1"):
        helper.require_redis_server()
