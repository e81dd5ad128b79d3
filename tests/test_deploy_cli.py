"""``safecompile prebuild`` and ``safecompile cache`` through the command line.

The commands run in-process through ``main([...])`` (docs/deploying.md's commands run as
a shell would, in tests/test_doc_snippets.py). Targets are small modules written to a
temporary folder; entries of other code or another torch are signed verdicts written
here, as a process of that code or torch would have written them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import itertools
import json
import os
import textwrap
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from safecompile.__main__ import main
from safecompile.base import torchcompat
from safecompile.guard import _precompile
from safecompile.persist import inventory
from safecompile.persist import remote as _remote
from safecompile.persist.cache import code_fingerprint, provenance
from safecompile.persist.signing import signer

needs_precompile = pytest.mark.skipif(
    not torchcompat.compiled_function_loader(),
    reason="this torch cannot precompile (torchcompat.compiled_function_loader is Missing)",
)
_names = itertools.count()

TARGET = """\
import torch
from safecompile import Shadow, Warmup, safe_compile

X = torch.randn(8, 8)


def score(x):
    return torch.relu(x) * 2


def broken_backend(gm, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def targets():
    return [safe_compile(score, backend="aot_eager", shadow=Shadow(canary=1, every=0),
                         warmup=Warmup(inputs=[(X,)]))]


def no_warmup():
    return {"score": safe_compile(score, backend="aot_eager")}


def broken():
    return safe_compile(score, backend=broken_backend, warmup=Warmup(inputs=[(X,)]))


def unguarded():
    return [score]
"""


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``SAFECOMPILE_CACHE_DIR`` (the operator's key is conftest's)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SAFECOMPILE_CACHE_DIR", str(root))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "torch"))
    monkeypatch.delenv("SAFECOMPILE_REMOTE_CACHE", raising=False)
    return root


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """A target module of its own (a name no other test imported)."""
    path = tmp_path / f"deploy_target_{next(_names)}_{tmp_path.name[-8:]}.py"
    path.write_text(TARGET)
    return path


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def listed(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, _ = cli(capsys, "cache", "list", "--json", *argv)
    assert code == 0
    doc: dict[str, Any] = json.loads(out)
    return doc


def entry(
    root: Path,
    key: str,
    *,
    name: str = "app.score",
    made: dict[str, str] | None = None,
    age_s: float = 0.0,
    scope: str = "",
) -> Path:
    """A signed verdict under ``key`` as a process of ``made``'s code and versions wrote it."""
    signing = signer()
    assert signing is not None
    verdict = {"kind": "compile_failed", "time": time.time() - age_s, "name": name}
    doc = {"schema": "safecompile.verdict", "version": 1, "key": key, "scope": scope}
    doc |= {"made": provenance(key) | (made or {}), "verdict": verdict}
    path = root / "verdicts" / key / f"{hashlib.sha256(scope.encode()).hexdigest()[:24]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(signing.sign_doc("verdict", f"{key}\0{scope}", doc)))
    return path


def test_inventory_reads_what_precompile_writes() -> None:
    """The inventory's names for the precompiled index and blobs are the writer's."""
    assert inventory.PRECOMPILED_SCOPE == _precompile.SCOPE
    assert inventory.PRECOMPILED_PURPOSE == _precompile.PURPOSE
    assert inventory.PRECOMPILED_POINTER == _precompile.LAST_KEY


# ---------------------------------------------------------------- prebuild


@needs_precompile
def test_prebuild_builds_every_warmup_and_list_shows_it(
    store: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 0; it says what it built and where; the entry is listed signed and current."""
    code, out, _ = cli(capsys, "prebuild", f"{target}:targets")
    assert code == 0, out
    name = f"{target.stem}.score"
    assert f"built {name}: 1 graph(s) [8x8:float32]" in out
    assert f"prebuild: 1 of 1 built into {store}" in out
    assert len(list((store / "precompiled").rglob("*.bin"))) == 1

    (row,) = [r for r in listed(capsys)["entries"] if r["graphs"]]
    assert (row["function"], row["graphs"], row["labels"]) == (name, 1, ["8x8:float32"])
    assert (row["signature"], row["current"], row["foreign"]) == (True, True, None)
    assert row["torch"] == torch.__version__
    assert row["problems"] == []
    code, out, _ = cli(capsys, "cache", "list")
    assert code == 0
    assert name in out
    assert "ok" in out
    assert "yes" in out

    code, out, _ = cli(capsys, "cache", "verify")
    assert (code, out.strip().splitlines()[-1]) == (0, f"verify: 1 of 1 entry good in {store}")


@needs_precompile
def test_verify_names_an_edited_helper_reached_as_a_module_attribute(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry built from ``import helpers; helpers.act(x)`` turns stale when ``act`` is
    edited, and ``verify`` names the file and function (the check a restart makes)."""
    tag = f"{next(_names)}_{tmp_path.name[-8:]}"
    helpers = tmp_path / f"deploy_helpers_{tag}.py"
    helpers.write_text("def act(x):\n    return x * 2\n")
    target = tmp_path / f"deploy_reach_{tag}.py"
    target.write_text(
        TARGET.replace(
            "import torch\n", f"import torch\nimport {helpers.stem} as helpers\n", 1
        ).replace("return torch.relu(x) * 2", "return helpers.act(torch.relu(x))")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = cli(capsys, "prebuild", f"{target}:targets")
    assert code == 0, out
    code, out, _ = cli(capsys, "cache", "verify")
    assert code == 0, out

    helpers.write_text("def act(x):\n    return x * 3\n")
    code, out, _ = cli(capsys, "cache", "verify")
    assert code == 1, out
    assert f"stale: {helpers}: act changed" in out


@needs_precompile
def test_prebuild_json_to_stdout(
    store: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli(capsys, "prebuild", f"{target}:targets", "--json", "-")
    assert code == 0
    (built,) = json.loads(out)["built"]
    assert built["ok"] is True
    assert built["graphs"] == ["8x8:float32"]
    assert built["bytes"] > 0


@needs_precompile
def test_prebuild_into_a_redis_that_does_not_answer_fails(
    store: Path, target: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With only SAFECOMPILE_REMOTE_CACHE it builds through a temporary directory, and what
    did not reach Redis is not built."""
    url = "redis://127.0.0.1:1/0"  # nothing listens on port 1: refused at once
    monkeypatch.delenv("SAFECOMPILE_CACHE_DIR")
    monkeypatch.setenv("SAFECOMPILE_REMOTE_CACHE", url)
    try:
        code, out, _ = cli(capsys, "prebuild", f"{target}:targets")
    finally:
        _remote.reset()  # torch's remote-cache flags as they were
    assert code == 1
    assert f"FAILED {target.stem}.score: not written to {url} (it did not answer" in out
    assert f"prebuild: 0 of 1 built into {url}" in out
    assert not (store / "precompiled").exists()


def test_prebuild_fails_when_nothing_compiles(
    store: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A callable without warmup inputs has nothing to build: exit 1, and why."""
    code, out, _ = cli(capsys, "prebuild", f"{target}:no_warmup")
    assert code == 1
    assert f"FAILED {target.stem}.score: nothing compiled: give it Warmup" in out
    assert "prebuild: 0 of 1 built" in out


def test_prebuild_fails_when_the_compile_fails(
    store: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli(capsys, "prebuild", f"{target}:broken")
    assert code == 1
    assert "rolled back at warmup (compile_error: " in out
    assert "cannot compile anything" in out


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({"SAFECOMPILE_CACHE_DIR": None}, ["{t}:targets"], "nowhere to build: set SAFECOMPILE"),
        ({"SAFECOMPILE_CACHE_KEY": None}, ["{t}:targets"], "entries are signed: set SAFECOMPILE"),
        ({}, ["{t}"], "expected MODULE:FACTORY"),
        ({}, ["{t}:nope"], "has no attribute 'nope'"),
        ({}, ["{t}:unguarded"], "'score' is not guarded by safe_compile"),
        ({"SAFECOMPILE_REMOTE_CACHE": "http://x"}, ["{t}:targets"], "SAFECOMPILE_REMOTE_CACHE"),
    ],
)
def test_prebuild_usage_errors(
    store: Path,
    target: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str | None],
    argv: list[str],
    message: str,
) -> None:
    """Exit 2 with one line saying what is wrong, before anything compiles."""
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    code, out, err = cli(capsys, "prebuild", *(a.format(t=target) for a in argv))
    assert code == 2
    assert out == ""
    assert err.startswith("safecompile prebuild: error: ")
    assert message in err


# ---------------------------------------------------------------- cache


def test_list_says_torch_age_and_foreign(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entry(store, "a" * 32, age_s=7200)
    entry(store, "b" * 32, name="app.old", made={"torch": "1.13.0"})
    rows = {r["function"]: r for r in listed(capsys, "--no-import")["entries"]}
    assert rows["app.score"]["torch"] == torch.__version__
    assert rows["app.score"]["age_s"] == pytest.approx(7200, abs=60)
    assert rows["app.score"]["foreign"] is None
    assert rows["app.old"]["foreign"] == f"made by torch 1.13.0, this is {torch.__version__}"
    code, out, _ = cli(capsys, "cache", "list", "--no-import")
    assert code == 0
    assert "1.13.0 (foreign)" in out
    assert "2h" in out


@pytest.mark.parametrize("fault", ["blob", "verdict", "unsigned"])
def test_verify_names_a_tampered_entry(
    store: Path, fault: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 1, naming the entry and the file whose signature fails."""
    good, bad = entry(store, "a" * 32), entry(store, "b" * 32, name="app.other")
    if fault == "blob":
        signing = signer()
        assert signing is not None
        blob = store / "precompiled" / ("b" * 32) / "f.bin"
        blob.parent.mkdir(parents=True)
        blob.write_bytes(signing.seal("precompiled", f"{'b' * 32}/f.bin", b"data") + b"!")
        broken = blob
    elif fault == "verdict":
        doc = json.loads(bad.read_text())
        doc["verdict"]["kind"] = "bucket_verified"
        bad.write_text(json.dumps(doc))
        broken = bad
    else:
        doc = json.loads(bad.read_text())
        del doc["hmac"]
        bad.write_text(json.dumps(doc))
        broken = bad
    code, out, _ = cli(capsys, "cache", "verify", "--no-import")
    assert code == 1
    (line, summary) = out.strip().splitlines()
    shown = "app.other" if fault == "blob" else "app.other (unverified)"  # a name it claims
    assert line.startswith(f"{'b' * 12} {shown}: invalid signature: ")
    assert str(broken.relative_to(store)) in line
    assert summary == f"verify: 1 of 2 entries good in {store}"
    assert good.exists()

    code, out, _ = cli(capsys, "cache", "verify", "--no-import", "--json")
    doc = json.loads(out)
    assert (code, doc["ok"]) == (1, False)
    assert [r["signature"] for r in doc["entries"]] == [True, False]


def test_verify_fails_on_stale_and_foreign(
    store: Path, target: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built from other code than the module importable here: stale; another torch: foreign."""
    module = target.stem
    monkeypatch.syspath_prepend(str(target.parent))
    current = _origin(module, target)
    entry(store, "a" * 32, made=current)
    entry(store, "b" * 32, made=current | {"code": "0" * 64})
    entry(store, "c" * 32, made={"torch": "1.13.0"})
    code, out, _ = cli(capsys, "cache", "verify")
    assert code == 1
    assert f"{'b' * 12} app.score: stale: {module}.score or the code it reaches changed" in out
    assert f"{'c' * 12} app.score: foreign: made by torch 1.13.0" in out
    assert f"verify: 1 of 3 entries good in {store}" in out


def _origin(module: str, path: Path) -> dict[str, str]:
    """What a process that guarded ``module.score`` recorded."""
    loaded = importlib.import_module(module)
    assert loaded.__file__ == str(path)
    return {"module": module, "qualname": "score", "code": code_fingerprint(loaded.score)}


def test_prune_removes_stale_foreign_and_old_and_keeps_the_rest(
    store: Path, target: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(target.parent))
    current = _origin(target.stem, target)
    keep = entry(store, "a" * 32, made=current)
    keep_unknown = entry(store, "e" * 32, name="app.method")  # no origin: cannot tell
    stale = entry(store, "b" * 32, made=current | {"code": "0" * 64})
    foreign = entry(store, "c" * 32, made={"python": "3.9.0"})
    old = entry(store, "d" * 32, age_s=8 * 86400)
    blob = store / "artifacts" / f"{'d' * 32}.bin"
    blob.parent.mkdir()
    blob.write_bytes(b"x")
    argv = ["cache", "prune", "--stale", "--foreign", "--older-than", "7d"]

    code, out, _ = cli(capsys, *argv, "--dry-run")
    assert code == 0
    assert "prune: would remove 3 of 5 entries" in out
    assert all(p.exists() for p in (stale, foreign, old, blob))

    code, out, _ = cli(capsys, *argv)
    assert code == 0
    assert f"removed {'b' * 12} app.score (stale)" in out
    assert f"removed {'c' * 12} app.score (foreign: made by python 3.9.0" in out
    assert f"removed {'d' * 12} app.score (older than 7d): 2 file(s)" in out
    assert not any(p.exists() for p in (stale, foreign, old, blob))
    assert not (store / "verdicts" / ("b" * 32)).exists()
    assert keep.exists()
    assert keep_unknown.exists()


def test_prune_one_function_or_key_and_invalid(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rolling one artifact back: by function name (a glob), by key prefix, or the invalid."""
    a = entry(store, "a" * 32, name="ranker.score")
    b = entry(store, "b" * 32, name="ranker.embed")
    c = entry(store, "c" * 32, name="search.rank")
    d = entry(store, "d" * 32, name="search.other")
    d.write_text(d.read_text().replace("search.other", "search.evil"))
    code, out, _ = cli(capsys, "cache", "prune", "--function", "ranker.s*", "--json")
    assert code == 0
    assert [r["key"] for r in json.loads(out)["removed"]] == ["a" * 32]
    assert not a.exists()
    assert b.exists()
    code, _, _ = cli(capsys, "cache", "prune", "--key", "cccccc", "--no-import")
    assert code == 0
    assert not c.exists()
    code, out, _ = cli(capsys, "cache", "prune", "--invalid", "--no-import")
    assert (code, d.exists(), b.exists()) == (0, False, True)
    assert "(invalid signature)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["cache"], "safecompile cache: error: say which: safecompile cache list, verify"),
        (["cache", "prune"], "cache prune: error: say what to prune: --stale"),
        (["cache", "prune", "--key", "xyz"], "--key: expected 6 or more hex digits"),
        (["cache", "prune", "--stale", "--no-import"], "--stale needs the modules imported"),
        (["cache", "list", "--dir", "/nonexistent/cache"], "no cache directory at /nonexistent"),
        (["cache", "prune", "--older-than", "3x"], "e.g. 7d or 12h, got '3x'"),
        (["cache", "lst"], "invalid choice: 'lst'"),
    ],
)
def test_cache_usage_errors(
    store: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store.mkdir()
    code, out, err = cli(capsys, *argv)
    assert (code, out) == (2, "")
    assert message in err


def test_cache_needs_a_directory_and_verify_a_key(
    store: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store.mkdir()
    entry(store, "a" * 32)
    monkeypatch.delenv("SAFECOMPILE_CACHE_KEY")
    code, _, err = cli(capsys, "cache", "verify")
    assert code == 2
    assert "checking signatures needs the operator's key: set SAFECOMPILE_CACHE_KEY" in err
    code, out, _ = cli(capsys, "cache", "list", "--no-import")  # listing needs no key
    assert code == 0
    assert "unchecked" in out
    monkeypatch.delenv("SAFECOMPILE_CACHE_DIR")
    code, _, err = cli(capsys, "cache", "list")
    assert code == 2
    assert "which cache? set SAFECOMPILE_CACHE_DIR or give --dir DIR" in err


def test_listing_imports_with_the_kill_switch_on(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A module whose import would warm up compiles nothing while the cache looks at it,
    and the kill switch is as it was afterwards."""
    module = tmp_path / "importing_warms_up.py"
    module.write_text(
        textwrap.dedent(
            """\
            import os
            SWITCH = os.environ.get("SAFECOMPILE_DISABLE")

            def score(x):
                return x
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    entry(store, "a" * 32, made={"module": "importing_warms_up", "qualname": "score", "code": "0"})
    row = listed(capsys)["entries"][0]
    import importing_warms_up  # type: ignore[import-not-found]

    assert importing_warms_up.SWITCH == "1"
    assert row["current"] is False
    assert "SAFECOMPILE_DISABLE" not in os.environ


class FakeRedis:
    """The redis-py calls ``cache --remote`` makes, over a dict (no server needed)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def scan_iter(self, match: str, count: int = 0) -> list[bytes]:
        return [k.encode() for k in sorted(self.data) if fnmatch.fnmatchcase(k, match)]

    def hgetall(self, name: str) -> dict[bytes, bytes]:
        return {k.encode(): v for k, v in self.data.get(name, {}).items()}

    def get(self, name: str) -> bytes | None:
        value = self.data.get(name)
        return value if isinstance(value, bytes) else None

    def delete(self, *names: str | bytes) -> int:
        keys = [n.decode() if isinstance(n, bytes) else n for n in names]
        return sum(self.data.pop(k, None) is not None for k in keys)


@pytest.fixture
def fake_redis(monkeypatch: pytest.MonkeyPatch) -> FakeRedis:
    fake = FakeRedis()
    redis = types.SimpleNamespace(
        Redis=types.SimpleNamespace(from_url=lambda url, **options: fake),
        retry=types.SimpleNamespace(Retry=lambda *args: None),
        backoff=types.SimpleNamespace(NoBackoff=lambda: None),
        connection=types.SimpleNamespace(
            Connection=object, SSLConnection=object, UnixDomainSocketConnection=object
        ),
    )
    monkeypatch.setattr(_remote, "_import_redis", lambda: redis)
    return fake


def test_cache_looks_inside_redis(
    store: Path, fake_redis: FakeRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    """--remote: the same listing, verify and prune over what Redis holds."""
    signing = signer()
    assert signing is not None
    for key, name in (("a" * 32, "app.score"), ("b" * 32, "app.rank")):
        path = entry(store, key, name=name, scope=_precompile.SCOPE)
        fields = {_precompile.SCOPE: path.read_bytes()}
        fake_redis.data[f"{_remote.VERDICT_PREFIX}{key}"] = fields
        sealed = signing.seal("precompiled", f"{key}/f.bin", b"compiled code")
        fake_redis.data[f"{_remote.BLOB_PREFIX}{key}:f.bin"] = sealed
    fake_redis.data[f"{_remote.BLOB_PREFIX}{'b' * 32}:f.bin"] += b"tampered"
    url = "redis://cache.internal:6379/0"

    rows = listed(capsys, "--remote", url, "--no-import")["entries"]
    assert [(r["function"], r["signature"]) for r in rows] == [
        ("app.score", True),
        ("app.rank", False),
    ]
    code, out, _ = cli(capsys, "cache", "verify", "--remote", url, "--no-import")
    assert code == 1
    assert f"{'b' * 12} app.rank: invalid signature: safecompile:v1:blobs:{'b' * 32}:f.bin" in out
    assert f"verify: 1 of 2 entries good in {url}" in out

    code, out, _ = cli(capsys, "cache", "prune", "--remote", url, "--invalid", "--no-import")
    assert code == 0
    assert sorted(fake_redis.data) == [
        f"{_remote.BLOB_PREFIX}{'a' * 32}:f.bin",
        f"{_remote.VERDICT_PREFIX}{'a' * 32}",
    ]


def test_cache_remote_usage_errors(
    store: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "cache", "list", "--remote")
    assert code == 2
    assert "which Redis? set SAFECOMPILE_REMOTE_CACHE or give --remote URL" in err
    code, _, err = cli(capsys, "cache", "list", "--remote", "http://x")
    assert code == 2
    assert "--remote: 'http://x': expected redis://" in err
    code, _, err = cli(capsys, "cache", "list", "--remote", "redis://x", "--dir", str(store))
    assert code == 2
    assert "give --dir or --remote, not both" in err
    code, _, err = cli(capsys, "cache", "list", "--remote", "redis://127.0.0.1:1/0")
    assert code == 2  # nothing listens on port 1
    assert "cannot read redis://127.0.0.1:1/0: " in err


def test_cache_lists_a_real_redis_with_a_blob_larger_than_a_verdict(
    store: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real Redis: every read is a bounded command of its own, so a precompiled function
    of a few MiB is read and verified (not refused as a verdict-sized reply)."""
    import redis

    signing = signer()
    assert signing is not None
    key = "c" * 32
    sealed = signing.seal("precompiled", f"{key}/f.bin", b"x" * (3 << 20))
    redis.Redis.from_url(redis_url).set(f"{_remote.BLOB_PREFIX}{key}:f.bin", sealed)
    (row,) = listed(capsys, "--remote", redis_url, "--no-import")["entries"]
    assert (row["key"], row["signature"]) == (key, True)
    code, out, _ = cli(capsys, "cache", "verify", "--remote", redis_url, "--no-import")
    assert (code, out.strip().splitlines()[-1]) == (0, f"verify: 1 of 1 entry good in {redis_url}")
