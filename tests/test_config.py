"""Bad options are refused when decorating, naming the option and the allowed values."""

from __future__ import annotations

import pytest
import torch

from safecompile import Buckets, ConfigError, Rollback, Shadow, Warmup, pow2, safe_compile


def f(x: torch.Tensor) -> torch.Tensor:
    return x


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"backend": "no-such-backend"}, r"backend='no-such-backend'.*allowed: .*inductor"),
        ({"backend": 3}, r"backend=\.\.\..*callable"),
        ({"mode": "turbo"}, r"mode='turbo'.*max-autotune"),
        ({"backend": "eager", "mode": "max-autotune"}, r"only applies to backend='inductor'"),
        ({"mode": "default", "options": {}}, r"not both"),
        ({"options": {"no_such_option": 1}}, r"unknown inductor options: no_such_option"),
        ({"options": ["a"]}, r"options=\.\.\..*dict"),
        ({"dynamic": "yes"}, r"dynamic=\.\.\..*None, True or False"),
        ({"fullgraph": 1}, r"fullgraph=\.\.\..*True or False"),
        ({"name": ""}, r"name=\.\.\..*non-empty"),
        ({"shadow": {"canary": 1}}, r"shadow=\.\.\..*Shadow"),
        ({"rollback": None}, r"rollback=None"),
        ({"rollout": 1.5}, r"rollout=\.\.\..*0.0 to 1.0"),
        ({"rollout": True}, r"rollout"),
        ({"clock": 5}, r"clock"),
        ({"group": "world"}, r"group=\.\.\..*ProcessGroup.*True.*None"),
        ({"speed": "fast"}, r"unknown option\(s\) speed"),
    ],
)
def test_bad_decorator_options(options: dict[str, object], match: str) -> None:
    """Each bad decorator option raises ConfigError naming it."""
    with pytest.raises(ConfigError, match=match):
        safe_compile(f, **options)


def test_inductor_is_accepted_without_listing_every_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """backend="inductor" (the default) does not import every registered backend to be
    checked: a replica that loads its compiled functions never needs them."""

    def listed(*args: object, **kwargs: object) -> list[str]:
        raise AssertionError("list_backends imports every backend")

    monkeypatch.setattr(torch.compiler, "list_backends", listed)
    safe_compile(f, backend="inductor")
    with pytest.raises(AssertionError, match="imports every backend"):
        safe_compile(f, backend="aot_eager")


def test_config_error_is_value_error() -> None:
    """ConfigError is a ValueError, so generic handlers catch it."""
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Shadow(canary=-1), r"Shadow\(canary=\.\.\.\) must be an int >= 0"),
        (lambda: Shadow(every=1.5), r"Shadow\(every=\.\.\.\)"),
        (lambda: Shadow(mode="later"), r"Shadow\(mode=\.\.\.\) must be one of 'sync', 'async'"),
        (lambda: Shadow(rtol=-1.0), r"Shadow\(rtol=\.\.\.\)"),
        (lambda: Shadow(atol=float("nan")), r"Shadow\(atol=\.\.\.\)"),
        (lambda: Shadow(queue_size=0), r"Shadow\(queue_size=\.\.\.\)"),
        (
            lambda: Rollback(max_recompiles=0),
            r"Rollback\(max_recompiles=\.\.\.\) must be an int >= 1",
        ),
        (lambda: Rollback(slower_ratio=0.5), r"Rollback\(slower_ratio=\.\.\.\)"),
        (lambda: Rollback(retry_after=-1), r"Rollback\(retry_after=\.\.\.\)"),
        (lambda: Rollback(retry_after=10, max_retry_after=5), r"max_retry_after"),
        (lambda: Rollback(sync_every=0), r"Rollback\(sync_every=\.\.\.\) must be an int >= 1"),
        (lambda: Rollback(sync_timeout=0), r"Rollback\(sync_timeout=\.\.\.\)"),
        (lambda: Warmup(inputs="x"), r"Warmup\(inputs=\.\.\.\)"),
        (lambda: Warmup(inputs=[torch.randn(2)]), r"items must be tuples"),
        (lambda: Warmup(inputs=[], background="yes"), r"Warmup\(background=\.\.\.\)"),
        (lambda: Buckets(dims={}, sizes=(8,)), r"Buckets\(dims=\.\.\.\)"),
        (lambda: Buckets(dims={"x": "1"}, sizes=(8,)), r"Buckets\(dims=\.\.\.\)"),
        (lambda: Buckets(dims={"x": 1}, sizes=(8, 4)), r"Buckets\(sizes=\.\.\.\)"),
        (
            lambda: Buckets(dims={"x": 1}, sizes=(8,), oversize="drop"),
            r"Buckets\(oversize=\.\.\.\)",
        ),
        (lambda: Buckets(dims={"x": 1}, sizes=(8,), pad_value={"y": 0}), r"pad_value"),
        (lambda: pow2(0, 8), r"pow2\(lo=\.\.\.\)"),
        (lambda: pow2(16, 8), r"pow2\(hi=\.\.\.\)"),
    ],
)
def test_bad_policies(build, match: str) -> None:  # type: ignore[no-untyped-def]
    """Each policy validates itself when built."""
    with pytest.raises(ConfigError, match=match):
        build()


def test_policies_are_frozen_and_keyword_only() -> None:
    """Policies are immutable and take keywords only."""
    s = Shadow()
    with pytest.raises(AttributeError):
        s.canary = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        Shadow(3)  # type: ignore[misc]


def test_pow2() -> None:
    """pow2 lists the powers of two between its bounds."""
    assert pow2(16, 2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert pow2(1, 1) == (1,)
    assert pow2(3, 100) == (4, 8, 16, 32, 64, 128)
