"""The decorator's options are declared once (``Options``): the signature, the checks,
the persisted-verdict key and the configuration table all follow the record."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import traceback
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from safecompile import (
    Buckets,
    ConfigError,
    EventKind,
    Rollback,
    Shadow,
    Warmup,
    pow2,
    safe_compile,
)
from safecompile.base.options import Options
from safecompile.testing import FakeClock, RecordingBackend

CONFIGURATION = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def total(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0)


def test_the_signature_is_the_record() -> None:
    """Every keyword of safe_compile is a field of Options, with the field's default."""
    params = {
        p.name: p.default
        for p in inspect.signature(safe_compile).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert tuple(params) == Options.names()
    defaults = {f.name: f.default for f in dataclasses.fields(Options)}
    assert params == defaults


def test_the_configuration_table_lists_exactly_the_options() -> None:
    """docs/configuration.md's tables for safe_compile name every option, once."""
    text = CONFIGURATION.read_text()
    section = text.split("## `safe_compile(fn, *, ...)`", 1)[1].split("\n## ", 1)[0]
    listed: list[str] = []
    for row in re.findall(r"^\| (`[^|]+) \|", section, flags=re.MULTILINE):
        listed += re.findall(r"`(\w+)`", row)
    assert sorted(listed) == sorted(Options.names())


def test_the_verdict_key_is_the_keyed_fields() -> None:
    """Persisted verdicts are keyed as before (old verdicts stay valid): torch.compile's
    options, and for bucket verdicts the Buckets policy and the tolerances."""
    buckets = Buckets(dims={"x": 0}, sizes=pow2(4, 16))
    shadow = Shadow(rtol=1e-3, atol=None)
    opts = Options(backend="eager", dynamic=False, buckets=buckets, shadow=shadow)
    compile_part = {"backend": "eager", "mode": None, "options": None, "dynamic": False}
    assert opts.verdict_key(checks=False) == compile_part | {"extra": {"fullgraph": False}}
    assert opts.verdict_key(checks=True) == compile_part | {
        "extra": {"fullgraph": False, "buckets": repr(buckets), "tolerances": "(0.001, None)"}
    }
    assert Options(shadow=None).verdict_key(checks=True)["extra"]["tolerances"] is None


def test_a_misspelled_option_gets_a_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"unknown option\(s\) shaddow \(did you mean shadow\?\)"):
        safe_compile(total, shaddow=None)


def test_config_error_shows_as_safecompile_config_error() -> None:
    with pytest.raises(ConfigError) as caught:
        safe_compile(total, rollout=2)
    assert ConfigError.__module__ == "safecompile"
    shown = "".join(traceback.format_exception_only(caught.type, caught.value))
    assert shown.startswith("safecompile.ConfigError: safe_compile(rollout=...)")


@pytest.mark.parametrize(
    ("clock", "match"),
    [
        (lambda: None, r"clock=\.\.\.\) must return monotonic seconds.*got None"),
        (lambda: "now", r"clock=\.\.\.\) must return.*got 'now'"),
        (lambda: float("nan"), r"clock=\.\.\.\) must return.*finite"),
        (lambda: 1 / 0, r"clock=\.\.\.\) raised ZeroDivisionError"),
    ],
)
def test_a_clock_that_returns_no_seconds_is_refused(clock: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        safe_compile(total, backend="eager", clock=clock)  # type: ignore[arg-type]


def test_sync_timeout_is_bounded() -> None:
    with pytest.raises(ConfigError, match=r"Rollback\(sync_timeout=\.\.\.\) .* <= 604800"):
        Rollback(sync_timeout=1e15)
    assert Rollback(sync_timeout=604800).sync_timeout == 604800


def test_slower_min_samples_is_checked_where_the_user_sets_it() -> None:
    """Past what the speed verdict reads, the error names the Rollback field (not an
    internal one); the largest accepted value builds a guard."""
    with pytest.raises(ConfigError, match=r"Rollback\(slower_min_samples=\.\.\.\).*1 to 128"):
        Rollback(slower_min_samples=200)
    guarded = safe_compile(total, backend="eager", rollback=Rollback(slower_min_samples=128))
    assert guarded(torch.ones(3, 2)).tolist() == [3.0, 3.0]


def test_a_partial_is_guarded_under_its_function_name() -> None:
    def scale(x: torch.Tensor, k: float) -> torch.Tensor:
        return x * k + 1

    backend = RecordingBackend()
    guarded = safe_compile(functools.partial(scale, k=2.0), backend=backend, shadow=None)
    x = torch.ones(3)
    assert torch.equal(guarded(x), scale(x, 2.0))
    assert guarded.safecompile.name == f"{__name__}.{scale.__qualname__}"
    assert len(backend.graphs) == 1
    assert guarded.safecompile.stats().compiled_calls == 1


def test_a_callable_object_is_guarded_under_its_class_name() -> None:
    class Scorer:
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x * 3

    backend = RecordingBackend()
    guarded = safe_compile(Scorer(), backend=backend, shadow=None)
    assert torch.equal(guarded(torch.ones(2)), torch.full((2,), 3.0))
    assert guarded.safecompile.name == f"{__name__}.{Scorer.__qualname__}"
    assert guarded.safecompile.stats().compiled_calls == 1


def test_a_nan_pad_value_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"pad_value=\.\.\.\) must be a number \(not NaN"):
        Buckets(dims={"x": 0}, sizes=(8,), pad_value=float("nan"))
    with pytest.raises(ConfigError, match="not NaN"):
        Buckets(dims={"x": 0}, sizes=(8,), pad_value={"x": float("nan")})
    assert Buckets(dims={"x": 0}, sizes=(8,), pad_value=float("-inf")).pad_for("x") < 0


def test_a_bucketed_dim_past_the_rank_is_refused_at_warmup() -> None:
    buckets = Buckets(dims={"x": 2}, sizes=pow2(4, 16))
    with pytest.raises(ConfigError, match=r"pads dim 2 of x, which has 2 dim\(s\)"):
        safe_compile(
            total, backend="eager", buckets=buckets, warmup=Warmup(inputs=[(torch.ones(5, 2),)])
        )


def test_a_bucketed_dim_past_the_rank_is_warned_at_the_first_call() -> None:
    """A live call never raises what eager would not (API.md §1): it is served unpadded,
    and the mistake is said once per callable, naming the dim and the argument."""
    backend = RecordingBackend()
    guarded = safe_compile(
        total, backend=backend, buckets=Buckets(dims={"x": -3}, sizes=pow2(4, 16))
    )
    with capture_logs() as logs:
        for _ in range(3):
            assert torch.equal(guarded(torch.ones(5, 2)), total(torch.ones(5, 2)))
    warned = [log for log in logs if log["event"] == "safecompile.bucket_dims_wrong"]
    assert len(warned) == 1
    assert "pads dim -3 of x, which has 2 dim(s)" in warned[0]["description"]
    assert torch.equal(guarded(torch.ones(5, 2, 1)), total(torch.ones(5, 2, 1)))


def test_a_rollback_without_a_limit_is_fitted_to_the_buckets() -> None:
    """Whether a limit was given is read from the value (``max_recompiles=None``), not
    from which Rollback instance was passed: ``Rollback(retry_after=5)`` and
    ``Rollback()`` both get room for every bucket; an explicit limit is kept or refused."""
    buckets = Buckets(dims={"x": 0}, sizes=pow2(1, 1024), strategy="pad")  # 11 buckets
    for rollback in (Rollback(), Rollback(retry_after=5)):
        clock = FakeClock(now=100.0)
        guarded = safe_compile(
            total, backend="eager", shadow=None, buckets=buckets, rollback=rollback, clock=clock
        )
        assert guarded.safecompile.report()["bucketing"] is not None
        # (torch's global limit raised, for a torch without a per-function one)
        with torch._dynamo.config.patch(recompile_limit=64):
            guarded.safecompile.warmup(torch.ones(5, 2))  # every bucket: 11 graphs, all made
            stats = guarded.safecompile.stats()
            assert (stats.graphs, stats.recompile_limit_calls) == (11, 0)
            guarded(torch.ones(5, 2, dtype=torch.float64))  # a twelfth graph: past the limit
        kinds = [e.kind for e in guarded.safecompile.events()]
        assert kinds.count(EventKind.RECOMPILE_LIMIT) == 1
        assert guarded.safecompile.stats().graphs == 11
        guarded.safecompile.rollback()  # the rest of the policy is kept: the retry_after
        retry_at = guarded.safecompile.report()["retry_at"]
        assert retry_at == (None if rollback.retry_after is None else 100.0 + rollback.retry_after)
    with pytest.raises(ConfigError, match="below the number of bucket sizes"):
        safe_compile(total, backend="eager", buckets=buckets, rollback=Rollback(max_recompiles=8))
