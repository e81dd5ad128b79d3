"""A warm restart does not learn again what an earlier process learnt (safecompile.persist.restart).

The round trips run the guarded code in fresh subprocesses sharing one
``SAFECOMPILE_CACHE_DIR``; what each process did is read from its ``report()`` and
``stats()`` (bucket verdicts restored, padding checks run, graphs compiled), never from
timings.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from children import child_env, run_json

from safecompile import Buckets, Shadow, Warmup, pow2, safe_compile
from safecompile.persist.cache import VerdictStore

REPO = Path(__file__).resolve().parents[1]
SIZES = (4, 8, 16, 32)  # pow2(4, 32): four buckets

# The child: guards ``usercode.fn`` with padded buckets and a warmup, serves one call of
# every length 1..32 checked against eager, and prints what it learnt as JSON.
CHILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path[:0] = [{here!r}, {repo!r}]
import torch
import usercode
from safecompile import Buckets, Warmup, pow2, safe_compile

g = safe_compile(
    usercode.fn,
    backend={backend!r},
    shadow=None,
    name="restart.fn",
    buckets=Buckets(dims={{"x": 1}}, sizes=pow2(4, 32), strategy="pad"),
    warmup=Warmup(inputs=[(torch.randn(2, 5, 8),)]),
)
after_warmup = g.safecompile.report()
for n in range(1, 33):
    x = torch.randn(2, n, 8)
    torch.testing.assert_close(g(x), usercode.fn(x))
stats = g.safecompile.stats()
from torch._dynamo.utils import counters
print(json.dumps({{
    "restored": sorted(str(b["restored"]) for b in after_warmup["buckets"].values()),
    "status": sorted(b["status"] for b in after_warmup["buckets"].values()),
    "padding_checks": stats.shadow_checks,
    "graphs": after_warmup["stats"]["graphs"],
    "compiled_calls": stats.compiled_calls,
    "fx_hits": counters["inductor"].get("fxgraph_cache_hit", 0),
}}))
"""

TOKENWISE = """
import torch

def fn(x):
    return torch.nn.functional.gelu(x @ torch.ones(8, 8)) * 2
"""


def run_child(
    tmp_path: Path, body: str, cache: Path, *, backend: str = "aot_eager", **env: str
) -> dict[str, Any]:
    """Run the guarded ``body`` in a fresh process; what it learnt."""
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "usercode.py").write_text(textwrap.dedent(body))
    script = CHILD.format(here=str(code), repo=str(REPO), backend=backend)
    return run_json(script, child_env(cache, **env), timeout=None)


def test_restart_reuses_bucket_verdicts(tmp_path: Path) -> None:
    """The second process restores every bucket's verdict and verifies no padding."""
    cache = tmp_path / "cache"
    cold = run_child(tmp_path, TOKENWISE, cache)
    assert cold["restored"] == ["None"] * 4
    assert cold["padding_checks"] == 4  # one padding check per bucket, against eager
    assert cold["status"] == ["ready"] * 4

    warm = run_child(tmp_path, TOKENWISE, cache)
    assert warm["restored"] == ["verified"] * 4
    assert warm["padding_checks"] == 0  # cut rebuilt from the verdict, no eager run
    assert warm["status"] == ["ready"] * 4
    assert warm["graphs"] == cold["graphs"] == 4
    assert warm["compiled_calls"] == 32  # every live call compiled, outputs cut right


def tokenwise(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ torch.ones(8, 8)) * 2


def guard(fn: Any = tokenwise, **changes: Any) -> Any:
    """``fn`` guarded with four padded buckets and a warmup (``changes`` override)."""
    options: dict[str, Any] = {
        "backend": "eager",
        "shadow": None,
        "buckets": Buckets(dims={"x": 1}, sizes=pow2(4, 32), strategy="pad"),
        "warmup": Warmup(inputs=[(torch.randn(2, 5, 8),)]),
    }
    options.update(changes)
    return safe_compile(fn, **options)


def restored(g: Any) -> list[str | None]:
    return [b["restored"] for b in g.safecompile.report()["buckets"].values()]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """SAFECOMPILE_CACHE_DIR in a temp folder; torch's cache env var restored after."""
    monkeypatch.setenv("SAFECOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))
    return tmp_path


@pytest.mark.parametrize(
    "change",
    [
        {"buckets": Buckets(dims={"x": 1}, sizes=pow2(4, 32), strategy="pad", pad_value=1)},
        {"shadow": Shadow(rtol=1e-2, atol=1e-3)},
        {"backend": "aot_eager"},
        {"options": {"guard_filter_fn": None}},
    ],
    ids=["pad_value", "tolerances", "backend", "options"],
)
def test_verdicts_are_keyed_by_policy_tolerances_and_options(
    cache_dir: Path, change: dict[str, Any]
) -> None:
    """A verdict holds only for the options it was learnt under: another pad value,
    tolerance or compile option learns afresh (in one process: a second guard is a
    restart as far as the verdicts go)."""
    first = guard()
    assert restored(first) == [None] * 4
    assert restored(guard()) == ["verified"] * 4  # the same options: restored
    assert restored(guard(**change)) == [None] * 4


def defined(source: str) -> Any:
    """``fn`` defined from ``source``: same module, name and file, whatever the body."""
    namespace: dict[str, Any] = {"__name__": __name__}
    exec(compile(textwrap.dedent(source), __file__, "exec"), namespace)
    return namespace["fn"]


def test_a_changed_function_body_learns_afresh(cache_dir: Path) -> None:
    """The same code (redefined) restores its verdicts; a changed body does not."""
    guard(fn=defined(TOKENWISE))
    assert restored(guard(fn=defined(TOKENWISE))) == ["verified"] * 4
    changed = defined(TOKENWISE.replace("* 2", "* 3"))
    assert restored(guard(fn=changed)) == [None] * 4


def test_verdicts_are_keyed_by_torch_version(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch upgrade learns afresh."""
    guard()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert restored(guard()) == [None] * 4


def test_a_saved_cut_that_no_longer_fits_is_verified_again(cache_dir: Path) -> None:
    """A verdict whose recorded output shapes do not match the output is not trusted:
    the bucket is verified against eager as if new, and its outputs stay right."""
    first = guard()
    store = VerdictStore(cache_dir)
    keys = [p.parent.name for p in (cache_dir / "verdicts").rglob("*.json")]
    key = max(set(keys), key=keys.count)
    for scope, verdict in store.all(key).items():
        if verdict.kind == "bucket_verified":
            cut = [
                [path, [n + 1 for n in shape], dims, c]
                for path, shape, dims, c in verdict.details["cut"]
            ]
            store.put(key, type(verdict)(**{**verdict.to_dict(), "details": {"cut": cut}}), scope)
    assert first.safecompile.stats().shadow_checks == 4
    second = guard()
    assert restored(second) == [None] * 4
    assert second.safecompile.stats().shadow_checks == 4  # each bucket verified again
    x = torch.randn(2, 7, 8)
    torch.testing.assert_close(second(x), tokenwise(x))


def centered(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(dim=1, keepdim=True)  # zero padding moves the mean


def test_rejected_buckets_are_not_compiled_after_restart(cache_dir: Path) -> None:
    """A bucket whose padding changed results is rejected once; a restart runs it eager
    without compiling it, and says why."""
    cold = guard(fn=centered)
    statuses = [b["status"] for b in cold.safecompile.report()["buckets"].values()]
    assert statuses == ["rejected"] * 4
    assert cold.safecompile.stats().graphs == 4  # compiled, then found wrong

    warm = guard(fn=centered)
    buckets = warm.safecompile.report()["buckets"].values()
    assert [(b["status"], b["restored"]) for b in buckets] == [("rejected", "rejected")] * 4
    assert all("padding changed the result" in (b["why"] or "") for b in buckets)
    assert warm.safecompile.stats().graphs == 0  # never compiled
    x = torch.randn(2, 7, 8)
    torch.testing.assert_close(warm(x), centered(x))


def test_reset_forgets_the_persisted_verdicts(cache_dir: Path) -> None:
    """``reset()`` forgets verdicts, persisted ones included."""
    guard()
    g = guard()
    assert restored(g) == ["verified"] * 4
    g.safecompile.reset()  # its warmup runs again: on nothing persisted, verified afresh
    assert restored(g) == [None] * 4


# Reads a global tensor: no precompiled function is saved for it (no record checks a
# tensor's value at load), so its restart traces, and torch's artifacts are what make that
# cheap.
SCALED = """
import torch

SCALE = torch.full((8,), 2.0)

def fn(x):
    return torch.nn.functional.gelu(x @ torch.ones(8, 8)) * SCALE
"""


@pytest.mark.inductor
def test_compile_artifacts_travel_with_the_cache_dir(tmp_path: Path) -> None:
    """torch's portable artifacts are saved after a warmup and loaded by a restart whose
    own torch cache is cold (another TORCHINDUCTOR_CACHE_DIR): a restart that traces (no
    precompiled function covers its graph) hits the FX graph cache."""
    cache = tmp_path / "cache"
    cold = run_child(tmp_path, SCALED, cache, backend="inductor")
    assert cold["fx_hits"] == 0
    assert list((cache / "artifacts").glob("*.bin"))
    elsewhere = run_child(
        tmp_path,
        SCALED,
        cache,
        backend="inductor",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "fresh-torch-cache"),
    )
    assert elsewhere["fx_hits"] == 4
    assert elsewhere["restored"] == ["verified"] * 4
