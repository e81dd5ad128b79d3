"""Cold start across restarts: artifact keys, persisted verdicts, torch's cache dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from safecompile.base import torchcompat
from safecompile.persist import cache as _cache
from safecompile.persist.cache import (
    CallKey,
    Verdict,
    VerdictStore,
    artifact_key,
    cache_root,
    code_fingerprint,
    use_torch_caches,
)

REPO = Path(__file__).resolve().parents[1]


def make_function(source: str, name: str = "score", filename: str = "/app/model.py") -> Any:
    """A function built from source, as if it came from one file (``filename``)."""
    namespace: dict[str, Any] = {"torch": torch, "__name__": "app.model"}
    exec(compile(textwrap.dedent(source), filename, "exec"), namespace)
    return namespace[name]


def key(fn: Any, **overrides: Any) -> str:
    options: dict[str, Any] = {"backend": "inductor", "device": "cpu"}
    options.update(overrides)
    return artifact_key(fn, **options)


def ignored_events(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == "safecompile.cache_file_ignored"]


# ---------------------------------------------------------------- cache_root


def test_cache_root_reads_env_each_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Unset or blank means no cache; a path is made absolute, ~ expanded."""
    monkeypatch.delenv(_cache.CACHE_ENV_VAR, raising=False)
    assert cache_root() is None
    monkeypatch.setenv(_cache.CACHE_ENV_VAR, "  ")
    assert cache_root() is None
    monkeypatch.setenv(_cache.CACHE_ENV_VAR, str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(_cache.CACHE_ENV_VAR, "~/sc")
    assert cache_root() == tmp_path / "sc"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(_cache.CACHE_ENV_VAR, "rel")
    assert cache_root() == tmp_path / "rel"


# ---------------------------------------------------------------- keys

BASE = """
def score(x):
    return torch.relu(x) * 2
"""


def test_key_is_stable_and_hex() -> None:
    """The same function and options give the same 32-hex-digit key."""
    fn = make_function(BASE)
    assert key(fn) == key(make_function(BASE))
    assert len(key(fn)) == 32
    assert int(key(fn), 16) >= 0


def test_key_ignores_line_numbers() -> None:
    """Moving a function down its file (a comment above it) keeps the key."""
    assert key(make_function(BASE)) == key(make_function("\n\n# note\n" + BASE))


@pytest.mark.parametrize(
    "changed",
    [
        BASE.replace("* 2", "* 3"),  # a constant
        BASE.replace("relu", "tanh"),  # a name
        BASE.replace("return torch.relu(x) * 2", "y = x\n    return torch.relu(y) * 2"),
        BASE.replace("def score(x):", "def score(x, scale=1.0):"),
        BASE.replace("def score(x):", "def score(x, scale=2.0):"),
    ],
)
def test_key_changes_with_code(changed: str) -> None:
    """Any change to the code or its defaults is a new key."""
    assert key(make_function(BASE)) != key(make_function(changed))


def test_key_changes_with_file_and_qualname() -> None:
    """The same body in another file or under another name is another key."""
    base = key(make_function(BASE))
    assert base != key(make_function(BASE, filename="/app/other.py"))
    assert base != key(make_function(BASE.replace("score", "rank"), name="rank"))


def test_key_follows_called_helpers_and_closures() -> None:
    """Code fn reaches through globals or closures counts too."""
    source = """
    def helper(x):
        return x + {k}

    def score(x):
        return helper(x) * 2

    def outer():
        scale = {k}
        def inner(x):
            return x * scale
        return inner
    """
    one, two = (make_function(source.format(k=k)) for k in (1, 2))
    assert key(one) != key(two)
    inner_one = make_function(source.format(k=1), name="outer")()
    inner_two = make_function(source.format(k=2), name="outer")()
    assert key(inner_one) != key(inner_two)


def test_key_handles_recursion_and_odd_callables() -> None:
    """Recursive functions, partials, builtins and callable objects never break a key."""
    import functools

    fib = make_function(
        """
        def fib(n):
            return n if n < 2 else fib(n - 1) + fib(n - 2)
        """,
        name="fib",
    )
    for fn in (fib, functools.partial(fib, 3), len, torch.relu, lambda: None):
        assert len(key(fn)) == 32


@pytest.mark.parametrize(
    "change",
    [
        {"backend": "aot_eager"},
        {"mode": "max-autotune"},
        {"options": {"max_autotune": True}},
        {"dynamic": False},
        {"device": "meta"},
        {"extra": {"fullgraph": True}},
    ],
)
def test_key_changes_with_compile_options(change: dict[str, Any]) -> None:
    """backend, mode, options, dynamic, device and extras are part of the key."""
    fn = make_function(BASE)
    assert key(fn) != key(fn, **change)


def test_key_options_order_does_not_matter() -> None:
    """Options are compared as a mapping."""
    fn = make_function(BASE)
    assert key(fn, options={"a": 1, "b": 2}) == key(fn, options={"b": 2, "a": 1})


@pytest.mark.parametrize(
    ("target", "attribute", "value"),
    [
        (torch, "__version__", "9.9.9"),
        (torch.version, "git_version", "0" * 40),
        (torch.version, "cuda", "99.0"),
        (sys, "version", "3.99.0 (fake)"),
        (_cache, "__version__", "99.0"),
    ],
)
def test_key_changes_with_versions(
    monkeypatch: pytest.MonkeyPatch, target: Any, attribute: str, value: str
) -> None:
    """A torch, CUDA, Python or safecompile upgrade is a new key."""
    fn = make_function(BASE)
    before = key(fn)
    monkeypatch.setattr(target, attribute, value)
    assert before != key(fn)


def test_key_changes_with_compile_env_but_not_cache_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCHINDUCTOR_* settings count; where the cache lives, or the job id, does not."""
    fn = make_function(BASE)
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE", raising=False)
    before = key(fn)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    monkeypatch.setenv("TORCH_COMPILE_JOB_ID", "job-1234")
    assert before == key(fn)
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    assert before != key(fn)


def test_key_changes_with_device_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another CUDA capability is another key (simulated: no GPU here)."""
    props = {"major": 8, "minor": 0}

    def fake_props(index: int) -> Any:
        return types.SimpleNamespace(name="Fake GPU", gcnArchName="", **props)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", fake_props)
    fn = make_function(BASE)
    ampere = key(fn, device="cuda")
    assert ampere == key(fn, device="cuda:0")
    props["major"] = 9
    assert ampere != key(fn, device="cuda")
    assert ampere != key(fn, device="cpu")


def test_module_key_covers_class_code_settings_and_shapes() -> None:
    """A module's key changes with its classes' code, submodule settings and parameter
    shapes, not with weight values; its bound forward has a key too."""
    source = """
    class Block(torch.nn.Module):
        def __init__(self, width, causal=False):
            super().__init__()
            self.proj = torch.nn.Linear(width, width)
            self.causal = causal

        def forward(self, x):
            return torch.relu(self.proj(x)) {op}
    """
    one = make_function(source.format(op="* 2"), name="Block")
    two = make_function(source.format(op="* 3"), name="Block")
    base = key(one(8))
    assert base == key(one(8))
    with torch.no_grad():
        model = one(8)
        model.proj.weight.add_(1.0)
    assert base == key(model)
    assert base != key(two(8))
    assert base != key(one(16))
    assert base != key(one(8, causal=True))
    assert len(key(one(8).forward)) == 32


def test_key_is_stable_across_processes_and_hash_seeds(tmp_path: Path) -> None:
    """A restart (another process, another PYTHONHASHSEED) computes the same key, even for
    code with frozenset constants; and it reads back a verdict written before it."""
    module = tmp_path / "usercode.py"
    module.write_text(
        textwrap.dedent(
            """
            import torch

            def score(x, kind="a"):
                if kind in {"alpha", "beta", "gamma", "delta"}:
                    return x * 2
                return torch.relu(x)
            """
        )
    )
    script = textwrap.dedent(
        f"""
        import sys, warnings
        warnings.filterwarnings("ignore")
        sys.path[:0] = [{str(tmp_path)!r}, {str(REPO)!r}]
        import usercode
        from safecompile.persist.cache import VerdictStore, artifact_key
        key = artifact_key(usercode.score, backend="inductor", device="cpu")
        verdict = VerdictStore({str(tmp_path)!r}).get(key)
        print(key, verdict.kind if verdict else None)
        """
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import usercode  # type: ignore[import-not-found]

        here = artifact_key(usercode.score, backend="inductor", device="cpu")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("usercode", None)
    VerdictStore(tmp_path).put(here, Verdict(kind="compile_failed", time=1.0))
    # this process's hash seed is random, the restart's fixed: set order (almost surely) differs
    env = {**os.environ, "PYTHONHASHSEED": "1"}
    after = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert [here, "compile_failed"] == after.stdout.split()


def test_code_fingerprint_never_raises() -> None:
    """An object whose introspection fails still gets a (deterministic) fingerprint."""

    class Broken(torch.nn.Module):
        def named_modules(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("no introspection here")

    assert code_fingerprint(Broken()) == code_fingerprint(Broken())
    assert code_fingerprint(Broken()) != code_fingerprint(torch.nn.Identity())


# ---------------------------------------------------------------- verdicts

KEY = "0123456789abcdef0123456789abcdef"


def failed(message: str = "boom", when: float = 1000.0) -> Verdict:
    return Verdict(
        kind="compile_failed",
        time=when,
        name="ranker.score",
        reason="compile_error",
        error_type="torch._dynamo.exc.BackendCompilerFailed",
        message=message,
        details={"bucket": 128, "duration_s": 9.5},
    )


def test_verdict_round_trip_across_restart(tmp_path: Path) -> None:
    """put() then a new store on the same root (a restart) reads the same verdict."""
    assert VerdictStore(tmp_path).put(KEY, failed())
    assert VerdictStore(tmp_path).put(KEY, failed("bucket"), scope="bucket=128")
    again = VerdictStore(tmp_path)
    assert again.get(KEY) == failed()
    assert again.get(KEY, "bucket=128") == failed("bucket")
    assert again.get(KEY, "bucket=64") is None
    assert again.get("f" * 32) is None
    assert again.all(KEY) == {"": failed(), "bucket=128": failed("bucket")}


def test_verdict_file_is_plain_json(tmp_path: Path) -> None:
    """The file is readable JSON with a schema tag, the key and the scope."""
    store = VerdictStore(tmp_path)
    store.put(KEY, failed())
    doc = json.loads(store.path(KEY).read_text())
    assert (doc["schema"], doc["version"], doc["key"], doc["scope"]) == (
        "safecompile.verdict",
        1,
        KEY,
        "",
    )
    assert doc["verdict"]["message"] == "boom"
    assert store.path(KEY).parent == tmp_path / "verdicts" / KEY


def test_max_age(tmp_path: Path) -> None:
    """A verdict older than max_age is not returned."""
    store = VerdictStore(tmp_path)
    store.put(KEY, failed(when=1000.0))
    assert store.get(KEY, max_age=100.0, now=1050.0) is not None
    assert store.get(KEY, max_age=100.0, now=1200.0) is None


def test_clear(tmp_path: Path) -> None:
    """clear() removes one verdict, a key's, or all, and says how many."""
    store = VerdictStore(tmp_path)
    other = "f" * 32
    store.put(KEY, failed())
    store.put(KEY, failed(), scope="bucket=128")
    store.put(other, failed())
    assert store.clear(KEY, "bucket=128") == 1
    assert store.get(KEY, "bucket=128") is None
    assert store.get(KEY) is not None
    assert store.clear(KEY) == 1
    assert store.clear() == 1
    assert store.get(other) is None
    assert store.clear() == 0


def test_odd_keys_are_hashed_into_safe_names(tmp_path: Path) -> None:
    """A key that is not hex never escapes the directory."""
    store = VerdictStore(tmp_path)
    store.put("../../etc/passwd", failed())
    assert store.path("../../etc/passwd").is_relative_to(tmp_path / "verdicts")
    assert store.get("../../etc/passwd") == failed()


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    """A write replaces the file whole; no temporary file is left behind."""
    store = VerdictStore(tmp_path)
    store.put(KEY, failed("first"))
    store.put(KEY, failed("second"))
    assert [p.name for p in store.path(KEY).parent.iterdir()] == [store.path(KEY).name]
    verdict = store.get(KEY)
    assert verdict is not None
    assert verdict.message == "second"


def test_failed_write_keeps_old_file_and_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the final rename fails, the old verdict stays whole, the temp file is removed,
    put() returns False with a warning, and nothing raises."""
    store = VerdictStore(tmp_path)
    store.put(KEY, failed("old"))

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with structlog.testing.capture_logs() as logs:
        assert not store.put(KEY, failed("new"))
    monkeypatch.undo()
    verdict = store.get(KEY)
    assert verdict is not None
    assert verdict.message == "old"
    assert [p.name for p in store.path(KEY).parent.iterdir()] == [store.path(KEY).name]
    (event,) = ignored_events(logs)
    assert event["log_level"] == "warning"
    assert "cannot write" in event["reason"]


def test_unwritable_root_is_not_fatal(tmp_path: Path) -> None:
    """A root that is a file: put() returns False, get() None."""
    root = tmp_path / "file"
    root.write_text("not a directory")
    store = VerdictStore(root)
    with structlog.testing.capture_logs():
        assert not store.put(KEY, failed())
        assert store.get(KEY) is None


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"\x00\xff garbage", "corrupt"),
        (b'{"schema": "safecompile.verdict", "version": 1, "key": "', "corrupt"),  # truncated
        (b"", "corrupt"),
        (b"[1, 2, 3]", "foreign"),
        (b'{"schema": "other.tool", "version": 1}', "foreign"),
        (b'{"schema": "safecompile.verdict", "version": 2}', "foreign"),
    ],
)
def test_corrupt_or_foreign_file_is_ignored_with_a_warning(
    tmp_path: Path, content: bytes, why: str
) -> None:
    """Garbage, a truncated write, another tool's or a future version's file: ignored,
    one warning, never raised."""
    store = VerdictStore(tmp_path)
    path = store.path(KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with structlog.testing.capture_logs() as logs:
        assert store.get(KEY) is None
        assert store.get(KEY) is None  # warned once per file and reason
        assert store.all(KEY) == {}
    (event,) = ignored_events(logs)
    assert event["log_level"] == "warning"
    assert event["path"] == str(path)
    assert event["reason"].startswith(why)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(key="f" * 32),  # copied from another key
        lambda d: d.update(scope="bucket=1"),  # another scope's file
        lambda d: d["verdict"].update(time="yesterday"),
        lambda d: d["verdict"].update(kind=""),
        lambda d: d["verdict"].update(message=42),
        lambda d: d["verdict"].update(details=[1]),
        lambda d: d.update(verdict="compile_failed"),
    ],
)
def test_tampered_file_is_not_trusted(tmp_path: Path, mutate: Any) -> None:
    """Valid JSON that does not hold a verdict for this key and scope is ignored."""
    store = VerdictStore(tmp_path)
    store.put(KEY, failed())
    doc = json.loads(store.path(KEY).read_text())
    mutate(doc)
    store.path(KEY).write_text(json.dumps(doc))
    with structlog.testing.capture_logs() as logs:
        assert store.get(KEY) is None
    (event,) = ignored_events(logs)
    assert event["reason"].startswith("foreign or invalid")


def test_concurrent_writers_never_corrupt(tmp_path: Path) -> None:
    """Threads writing one verdict at once: the file is always whole and readable."""
    store = VerdictStore(tmp_path)
    store.put(KEY, failed("start"))
    errors: list[str] = []
    stop = threading.Event()

    def write(n: int) -> None:
        for i in range(25):
            store.put(KEY, failed(f"writer {n} #{i}", when=float(i)))

    def read() -> None:
        while not stop.is_set():
            raw = store.path(KEY).read_bytes()
            try:
                json.loads(raw)
            except ValueError as exc:  # pragma: no cover - the failure being tested
                errors.append(str(exc))

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(n,)) for n in range(6)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert errors == []
    verdict = store.get(KEY)
    assert verdict is not None
    assert verdict.message is not None
    assert verdict.message.startswith("writer")
    assert len(list(store.path(KEY).parent.iterdir())) == 1


# ---------------------------------------------------------------- torch's caches


@pytest.fixture
def clean_torch_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Whatever a test does to torch's cache variables is undone after it."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    return monkeypatch


def test_use_torch_caches_sets_env_idempotently(
    clean_torch_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """TORCHINDUCTOR_CACHE_DIR points under root/torch; a second call changes nothing."""
    used = use_torch_caches(tmp_path)
    assert used == tmp_path / "torch"
    assert used.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(used)
    assert use_torch_caches(tmp_path) == used
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(used)


def test_use_torch_caches_respects_the_users_choice(
    clean_torch_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A TORCHINDUCTOR_CACHE_DIR the user set is kept (and returned)."""
    mine = tmp_path / "mine"
    clean_torch_env.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    assert use_torch_caches(tmp_path / "sc") == mine
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine)
    assert not (tmp_path / "sc").exists()


def test_use_torch_caches_moves_off_torchs_default(
    clean_torch_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch writes its default dir into the environment at first use; that is replaced,
    and a Triton dir derived from it follows."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()
    clean_torch_env.setenv("TORCHINDUCTOR_CACHE_DIR", default)
    clean_torch_env.setenv("TRITON_CACHE_DIR", os.path.join(default, "triton", "0"))
    used = use_torch_caches(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(used)
    assert os.environ["TRITON_CACHE_DIR"] == str(used / "triton" / "0")


def test_default_dir_rule_matches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy of torch's default-dir rule (used to avoid a slow import) agrees."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()
    monkeypatch.delitem(sys.modules, "torch._inductor.runtime.cache_dir_utils")
    assert _cache._is_torch_default(default)
    assert not _cache._is_torch_default("/elsewhere")


@pytest.mark.skipif(  # both absent in 2.9.1 and 2.11, present in 2.13: one check for both
    not torchcompat.per_function_limit(1),
    reason="torch's config is process-wide in a torch without per-function recompile limits",
)
def test_cache_settings_are_thread_local_in_torch(clean_torch_env: pytest.MonkeyPatch) -> None:
    """Switching the FX-graph cache off in one thread leaves other threads' default on:
    why use_torch_caches works through the environment, not torch's config."""
    from torch._inductor import config

    seen: list[dict[str, object]] = []
    with config.patch(fx_graph_cache=False):
        here = torchcompat.config_settings()
        worker = threading.Thread(target=lambda: seen.append(torchcompat.config_settings()))
        worker.start()
        worker.join()
    assert here["fx_graph_cache"] is False
    assert seen[0]["fx_graph_cache"] is True
    assert seen[0]["autograd_cache"] is True


def test_a_call_key_is_made_once_for_the_first_calls_device() -> None:
    """The persisted-verdict key of a callable: artifact_key for the first call's device,
    the same string for every later call whatever it is given."""

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    key = CallKey(double, {"backend": "eager"})
    assert key.value is None
    first = key.get((torch.ones(2),), {})
    assert first == artifact_key(double, backend="eager", device=torch.device("cpu"))
    assert key.get(("not a tensor",), {"y": 3}) == first == key.value
    assert CallKey(double, {"backend": "aot_eager"}).get(()) != first


def test_a_key_that_cannot_be_made_is_said_once_and_never_fails_a_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A key that fails (an odd option, an odd device) leaves the call eager's and the cache
    unused; one ``cache_file_ignored`` warning however many buckets and calls ask for it."""
    from safecompile import Buckets, pow2, safe_compile
    from safecompile.persist import signing

    def boom(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("no key for this device")

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    signing.reset()
    monkeypatch.setattr(_cache, "artifact_key", boom)
    monkeypatch.setenv(_cache.CACHE_ENV_VAR, str(tmp_path))
    buckets = Buckets(dims={"x": 0}, sizes=pow2(4, 16), strategy="pad")
    guarded = safe_compile(double, backend="eager", buckets=buckets, shadow=None)
    with structlog.testing.capture_logs() as logs:
        for size in (3, 7, 13, 3):
            x = torch.randn(size)
            assert torch.equal(guarded(x), x * 2)
    (ignored,) = ignored_events(logs)
    assert (ignored["path"], ignored["reason"]) == ("key", "RuntimeError: no key for this device")
    assert not list((tmp_path / "verdicts").rglob("*.json"))
