"""A warm restart loads precompiled functions instead of tracing (safecompile.guard._precompile).

In one process a second ``safe_compile`` of the same function is a restart as far as the
cache dir goes: it loads what the first one's warmup saved. "Not traced" is read from
dynamo's own count of frames it converted; whatever cannot be loaded, or does not match,
takes the traced path with one ``safecompile.precompiled`` event.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from children import child_env, run_json
from structlog.testing import capture_logs
from torch._dynamo.utils import counters

from safecompile import Buckets, Shadow, State, Warmup, safe_compile
from safecompile.base import torchcompat
from safecompile.guard import _isa_checks, _precompile
from safecompile.guard._graph_backend import GuardBackend
from safecompile.guard._isa_checks import ISA_SCOPE, IsaChecks, _isa_key
from safecompile.observe.log import forget_said
from safecompile.persist import remote as _remote
from safecompile.persist.cache import Verdict, VerdictStore
from safecompile.persist.remote import REMOTE_ENV_VAR
from safecompile.persist.restart import BUCKET_VERIFIED, bucket_scope

REPO = Path(__file__).resolve().parents[1]
# The tests that save and load: where this torch cannot (2.9.1, 2.11), it says so instead.
needs_precompile = pytest.mark.skipif(
    not torchcompat.compiled_function_loader(),
    reason="this torch cannot precompile (torchcompat.compiled_function_loader is Missing)",
)
X = torch.randn(8, 8)
SCALE = 2.0


def score(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ x.T) + 1


def scaled(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * SCALE


def guard(fn: Any = score, **changes: Any) -> Any:
    options: dict[str, Any] = {
        "backend": "aot_eager",
        "shadow": Shadow(canary=2, every=0),
        "warmup": Warmup(inputs=[(X,)]),
    }
    return safe_compile(fn, **(options | changes))


def traced() -> int:
    """How many frames dynamo has converted in this process so far."""
    return int(counters["frames"]["total"])


def outcomes(logs: list[dict[str, Any]]) -> list[str]:
    return [e["outcome"] for e in logs if e["event"] == "safecompile.precompiled"]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SAFECOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))
    return tmp_path


def saved_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "precompiled").rglob("*.bin"))


@needs_precompile
def test_a_restart_loads_instead_of_tracing_and_still_checks(cache_dir: Path) -> None:
    """The loaded graph serves compiled calls, counted, and its canary checks run."""
    guard()
    assert len(saved_files(cache_dir)) == 1
    before = traced()
    with capture_logs() as logs:
        g = guard()
        for _ in range(3):
            torch.testing.assert_close(g(X), score(X))
    assert traced() == before  # neither the warmup nor the calls traced
    assert outcomes(logs) == ["loaded"]
    stats = g.safecompile.stats()
    assert (stats.graphs, stats.compiled_calls, stats.shadow_checks) == (1, 3, 2)
    assert g.safecompile.state is State.COMPILED  # its canary passed


@needs_precompile
def test_a_loaded_graph_that_drifts_rolls_back(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded graph is checked like a traced one: wrong outputs trip, eager answers."""
    guard(warmup=Warmup(inputs=[(X,)]))
    adopt = GuardBackend.adopt

    def off_by_one(self: GuardBackend, inner: Any, facts: Any) -> Any:
        return adopt(self, lambda *a: [out + 1 for out in inner(*a)], facts)

    monkeypatch.setattr(GuardBackend, "adopt", off_by_one)
    g = guard(warmup=None)
    torch.testing.assert_close(g(X), score(X))  # the canary caught it: eager's result
    assert g.safecompile.state is State.ROLLED_BACK


@needs_precompile
@pytest.mark.parametrize("fault", ["tampered", "unsigned"])
def test_a_tampered_or_unsigned_artifact_is_traced_as_usual(cache_dir: Path, fault: str) -> None:
    guard()
    (path,) = saved_files(cache_dir)
    data = path.read_bytes()
    if fault == "tampered":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        path.write_bytes(data[len(b"safecompile-hmac-v1\n") + 32 :])
    before = traced()
    with capture_logs() as logs:
        g = guard()
        torch.testing.assert_close(g(X), score(X))
    assert traced() > before
    found = [e for e in logs if e["event"] == "safecompile.precompiled"]
    assert [e["outcome"] for e in found] == ["not_loaded"]
    assert ("HMAC does not verify" if fault == "tampered" else "not signed") in found[0]["reason"]
    assert g.safecompile.state is State.COMPILED


@needs_precompile
def test_an_artifact_from_another_torch_is_traced_as_usual(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's own check of the saving process's versions refuses it: today's path."""
    guard()
    from torch._dynamo.package import SystemInfo

    now = SystemInfo.current()
    other = type(now)(**{**vars(now), "torch_version": "9.9.9"})
    monkeypatch.setattr(SystemInfo, "current", classmethod(lambda cls: other))
    before = traced()
    with capture_logs() as logs:
        g = guard()
        torch.testing.assert_close(g(X), score(X))
    assert traced() > before
    refused = next(e for e in logs if e["event"] == "safecompile.precompiled")
    assert refused["outcome"] == "not_loaded"
    assert "different PyTorch version" in refused["reason"]
    assert g.safecompile.stats().graphs == 1  # the traced one, nothing half-loaded


@needs_precompile
def test_a_call_no_loaded_guard_matches_is_traced(cache_dir: Path) -> None:
    """Another shape, or grad mode off: the loaded guards fail, the call traces."""
    guard()
    with capture_logs() as logs:
        g = guard()
        before = traced()
        y = torch.randn(4, 8)
        torch.testing.assert_close(g(y), score(y))
        with torch.no_grad():
            torch.testing.assert_close(g(X), score(X))
    assert traced() > before
    assert outcomes(logs) == ["loaded", "no_guard_matched"]  # said once
    assert g.safecompile.stats().graphs == 3


def rows(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * 2 + x.sum(0)


@needs_precompile
def test_dynamic_ranges_are_saved_as_ranges(cache_dir: Path) -> None:
    """Buckets(strategy="dynamic"): each range is saved marked dynamic, so a restart
    serves a length of a range the warmup never called without tracing."""
    buckets = Buckets(dims={"x": 0}, sizes=[4, 16], strategy="dynamic")
    example = (torch.randn(16, 8),)
    guard(rows, buckets=buckets, warmup=Warmup(inputs=[example]))
    with capture_logs() as logs:
        g = guard(rows, buckets=buckets, warmup=Warmup(inputs=[example]))
        before = traced()
        for n in (1, 3, 9, 13, 16):
            y = torch.randn(n, 8)
            torch.testing.assert_close(g(y), rows(y))
    assert traced() == before
    assert outcomes(logs) == ["loaded"]


def breaks(x: torch.Tensor) -> torch.Tensor:
    y = torch.relu(x)
    torch._dynamo.graph_break()
    return y * 2


@needs_precompile
def test_a_graph_break_says_it_is_not_saved_and_where(cache_dir: Path) -> None:
    """torch precompiles whole graphs only: the event names the cause and the line."""
    with capture_logs() as logs:
        g = guard(breaks)
        torch.testing.assert_close(g(X), breaks(X))
    (event,) = [e for e in logs if e.get("outcome") == "not_saved"]
    assert event["cause"] == "graph_break"
    line = breaks.__code__.co_firstlineno + 2
    assert f"test_precompile.py:{line}" in event["reason"]
    assert saved_files(cache_dir) == []


def plain(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return gm.forward


@needs_precompile
def test_what_cannot_be_saved_is_said_once(cache_dir: Path) -> None:
    """A backend whose result torch cannot serialize: nothing saved, one event."""
    with capture_logs() as logs:
        guard(backend=plain, warmup=Warmup(inputs=[(X,), (torch.randn(4, 8),)]))
    assert outcomes(logs) == ["missing", "not_saved"]
    assert "SerializableCallable" in [e for e in logs if "outcome" in e][1]["reason"]
    assert [e for e in logs if "outcome" in e][1]["cause"] == "not_serializable"
    assert saved_files(cache_dir) == []


@needs_precompile
def test_a_global_value_read_is_saved_with_it_and_checked_at_load(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch drops a loaded function's guards on globals: the value each held is saved
    and compared before loading; once it changed, the function is stale and traced."""
    guard(scaled)
    assert len(saved_files(cache_dir)) == 1
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
    before = traced()
    with capture_logs() as logs:
        g = guard(scaled)
        torch.testing.assert_close(g(X), scaled(X))  # 3.0's result, not the saved 2.0's
    assert traced() > before
    stale = next(e for e in logs if e.get("outcome") == "stale")
    assert "G['SCALE']: was 2.0, now 3.0" in stale["reason"]


@needs_precompile
def test_a_stale_function_under_its_own_key_drops_the_keys_verdicts(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit the key does not see (a helper reached by a computed name), found by the
    check at load: the function is traced, and the key's bucket verdicts are learnt again."""
    guard()
    store = VerdictStore(cache_dir)
    saved = {d.name: store.get(d.name, _precompile.SCOPE) for d in store.directory.iterdir()}
    (key,) = [k for k, v in saved.items() if v is not None and v.kind == _precompile.PURPOSE]
    verdict = Verdict(kind=BUCKET_VERIFIED, time=0.0, details={"cut": []})
    store.put(key, verdict, bucket_scope("8x8"))
    monkeypatch.setattr(_precompile, "stale_reasons", lambda entry, scope: ["h.py: act changed"])
    before = traced()
    with capture_logs() as logs:
        g = guard()
        torch.testing.assert_close(g(X), score(X))
    assert traced() > before
    assert outcomes(logs) == ["stale"]
    assert "h.py: act changed" in next(e for e in logs if "outcome" in e)["reason"]
    assert store.get(key, bucket_scope("8x8")) is None


def weighted(x: torch.Tensor) -> torch.Tensor:
    return x * WEIGHT


WEIGHT = torch.ones(8)


@needs_precompile
def test_a_function_reading_a_global_tensor_is_not_saved(cache_dir: Path) -> None:
    """A tensor's guards are not recorded: its graph is traced at every restart."""
    with capture_logs() as logs:
        guard(weighted)
    assert "WEIGHT" in next(e for e in logs if e.get("outcome") == "not_saved")["reason"]
    assert saved_files(cache_dir) == []


@needs_precompile
def test_reset_forgets_the_precompiled_functions(cache_dir: Path) -> None:
    guard()
    g = guard()
    assert saved_files(cache_dir) != []
    before = traced()
    g.safecompile.reset()  # forgotten: the warmup it runs again traces (and saves anew)
    assert traced() > before
    torch.testing.assert_close(g(X), score(X))


def test_a_torch_that_cannot_precompile_traces_every_restart_and_says_so_once(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11's ``torch.compile`` result has no ``aot_compile``: nothing is saved or
    loaded, one torch_feature_missing event for two guards, eager's values."""
    gone = torchcompat.Missing("torch.compile(...).aot_compile", "a warm restart traces again")
    monkeypatch.setattr(torchcompat, "compiled_function_loader", lambda: gone)
    forget_said()
    with capture_logs() as logs:
        guard()
        before = traced()
        g = guard()
        torch.testing.assert_close(g(X), score(X))
    assert traced() > before
    assert saved_files(cache_dir) == []
    said = [e for e in logs if e["event"] == "safecompile.torch_feature_missing"]
    assert [e["effect"] for e in said if e["torch_name"] == gone.name] == [gone.effect]
    assert outcomes(logs) == []
    assert g.safecompile.state is State.COMPILED


@needs_precompile
def test_a_replica_loads_what_another_saved_through_the_remote_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """Another machine's cache dir is empty: the functions come from Redis, still signed."""
    monkeypatch.setenv(REMOTE_ENV_VAR, redis_url)
    _remote.reset()
    try:
        monkeypatch.setenv("SAFECOMPILE_CACHE_DIR", str(tmp_path / "one"))
        guard()
        monkeypatch.setenv("SAFECOMPILE_CACHE_DIR", str(tmp_path / "two"))
        before = traced()
        g = guard()
        torch.testing.assert_close(g(X), score(X))
        assert traced() == before
        assert saved_files(tmp_path / "two") == []
    finally:
        _remote.reset()


def test_isa_checks_that_passed_are_kept_signed_and_answered_without_running(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check that passed is answered in the next process; a failed one, another torch or
    CPU, or a tampered record runs the check again."""
    monkeypatch.setattr(torchcompat, "route_vec_isa_checks", lambda answer: None)
    store = VerdictStore(cache_dir)
    ran: list[bool] = []

    def check(result: bool) -> Any:
        return lambda: ran.append(result) or result

    def restarted() -> IsaChecks:
        checks = IsaChecks()
        checks.route(store)
        ran.clear()
        return checks

    first = restarted()
    assert first.answer("passed", check(True))
    assert not first.answer("failed", check(False))
    first.save(store)
    second = restarted()
    assert second.answer("passed", check(True))
    assert not second.answer("failed", check(False))
    assert ran == [False]
    record = store.path(_isa_key(), ISA_SCOPE)
    doc = json.loads(record.read_text())
    doc["verdict"]["details"]["passed"].append("forged")
    record.write_text(json.dumps(doc))
    restarted().answer("forged", check(True))
    assert ran == [True]
    monkeypatch.setattr(_isa_checks, "environment", lambda device: {"torch": "9.9.9"})
    restarted().answer("passed", check(True))
    assert ran == [True]


def test_inductor_asks_its_isa_checks_with_its_own_key(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor import cpu_vec_isa
    from torch._inductor.codecache import write

    built: list[str] = []
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda self, code: built.append(code))
    asked: list[str] = []

    def answer(key: str, check: Any) -> bool:
        asked.append(key)
        return key == "never"  # without running torch's check

    assert torchcompat.route_vec_isa_checks(answer) is None
    isa = cpu_vec_isa.VecAVX2()
    assert isa.check_build("int f() { return 1; }") is False
    fingerprint = cpu_vec_isa._get_isa_dry_compile_fingerprint(isa.build_arch_flags())
    assert asked == [write("int f() { return 1; }", "cpp", extra=fingerprint)[0]]
    assert built == []


CHILD = """
import copy, json, sys
sys.path[:0] = [{here!r}, {repo!r}]
import torch
from torch._dynamo.utils import counters
import usercode
from safecompile import Warmup, safe_compile
from torch._inductor import cpu_vec_isa

probes = []  # inductor's vector-ISA probes run in this process
probe = cpu_vec_isa.VecISA._probe_load
cpu_vec_isa.VecISA._probe_load = lambda self, path: probes.append(path) or probe(self, path)

m = usercode.Net().eval()
with torch.no_grad():
    m.a.weight.mul_({scale})  # this process's own weights
ref = copy.deepcopy(m)
g = safe_compile(m, backend="inductor", warmup=Warmup(inputs=[(usercode.X,)]))
torch.testing.assert_close(g(usercode.X), ref(usercode.X))
stats = g.safecompile.stats()
print(json.dumps({{"frames": counters["frames"]["total"], "graphs": stats.graphs,
                  "compiled_calls": stats.compiled_calls, "checks": stats.shadow_checks,
                  "state": g.safecompile.state.value, "probes": len(probes)}}))
"""

USERCODE = """
import torch

torch.manual_seed(0)
X = torch.randn(4, 16)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))
"""


@needs_precompile
@pytest.mark.inductor
def test_a_new_process_loads_inductor_graphs_without_tracing(tmp_path: Path) -> None:
    """A real warm restart: the second process traces no frame, and its calls are
    compiled and checked against eager (a module, whose weights the new process owns)."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "usercode.py").write_text(textwrap.dedent(USERCODE))
    env = child_env(tmp_path / "cache")

    def run(scale: float) -> dict[str, Any]:
        return run_json(CHILD.format(here=str(code), repo=str(REPO), scale=scale), env)

    cold = run(1.0)
    assert cold["frames"] > 0
    warm = run(3.0)
    assert warm["frames"] == 0
    assert cold["probes"] > 0
    assert warm["probes"] == 0
    assert (warm["graphs"], warm["compiled_calls"]) == (1, 1)
    assert warm["checks"] == 2  # the warmup call and the first live call, both passed
    assert warm["state"] == "canary"


REPLICA = """
import json, sys
sys.path[:0] = [{here!r}, {repo!r}]
import torch
from torch._dynamo.utils import counters
from torch._inductor import cpp_builder
from structlog.testing import capture_logs
import usercode
from safecompile import Warmup, safe_compile
from safecompile.persist import kernels

if {other_cpu!r}:  # as if on another machine: the kernels shipped are not for this one
    kernels._cpu = lambda: "another CPU"
builds = []  # every C++ compile or link inductor starts in this process
build = cpp_builder.CppBuilder.build
def counted(self):
    builds.append(self.get_target_file_path())
    return build(self)
cpp_builder.CppBuilder.build = counted

m = usercode.Net().eval()
with torch.no_grad(), capture_logs() as logs:
    g = safe_compile(m, backend="inductor", warmup=Warmup(inputs=[(usercode.X,)]))
    torch.testing.assert_close(g(usercode.X), m(usercode.X))
events = [e for e in logs if e["event"] == "safecompile.precompiled"]
print(json.dumps({{"frames": counters["frames"]["total"], "builds": builds,
                  "state": g.safecompile.state.value, "events": events}}, default=str))
"""


@needs_precompile
@pytest.mark.inductor
def test_a_replica_with_an_empty_disk_builds_no_kernel(tmp_path: Path) -> None:
    """The store a first process filled, copied without torch's own caches (an image's
    prebuilt store, or what Redis holds): the replica neither traces nor builds any C++,
    and says its kernels were shipped; on another CPU it builds them, and says why."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "usercode.py").write_text(textwrap.dedent(USERCODE))
    built, replica = tmp_path / "built", tmp_path / "replica"

    def run(cache: Path, other_cpu: bool = False) -> dict[str, Any]:
        script = REPLICA.format(here=str(code), repo=str(REPO), other_cpu=other_cpu)
        return run_json(script, child_env(cache, drop="TORCHINDUCTOR_"))

    first = run(built)
    assert first["frames"] > 0
    assert first["builds"]
    top = str(built)  # its torch/ alone: torch's own caches
    shutil.copytree(built, replica, ignore=lambda d, names: ["torch"] if d == top else [])
    assert not (replica / "torch").exists()
    shutil.copytree(replica, tmp_path / "elsewhere")
    second = run(replica)
    assert second["frames"] == 0
    assert second["builds"] == []
    assert second["state"] in ("canary", "compiled")
    (loaded,) = [e for e in second["events"] if e["outcome"] == "loaded"]
    assert "C++ kernel(s) shipped, not built" in loaded["reason"]
    other = run(tmp_path / "elsewhere", other_cpu=True)
    assert other["frames"] == 0
    assert any(path.endswith(".so") for path in other["builds"])
    assert "kernels_built_here" in [e["outcome"] for e in other["events"]]
