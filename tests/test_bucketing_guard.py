"""Buckets through the guard: bounded graphs, outputs cut back, padding verified."""

from __future__ import annotations

import random

import pytest
import torch

from safecompile import Buckets, ConfigError, EventKind, Reason, Rollback, State, pow2, safe_compile
from safecompile.testing import RecordingBackend


def masked(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = (x * mask.unsqueeze(-1)).relu() + 1
    scores = h @ h.transpose(1, 2)  # square over the bucketed dim: both dims cut back
    return h, scores


def test_many_random_lengths_bounded_graphs_and_exact_outputs() -> None:
    """60 random lengths: at most one graph per bucket, every output equals eager's."""
    backend = RecordingBackend()
    g = safe_compile(
        masked,
        backend=backend,
        buckets=Buckets(dims={"x": 1, "mask": 1}, sizes=pow2(4, 64), strategy="pad"),
        shadow=None,
    )
    rng = random.Random(0)
    for _ in range(60):
        length = rng.randint(1, 64)
        x, mask = torch.randn(2, length, 8), torch.ones(2, length)
        h, scores = g(x, mask)
        eh, escores = masked(x, mask)
        assert h.shape == eh.shape
        assert scores.shape == escores.shape == (2, length, length)
        torch.testing.assert_close(h, eh)
        torch.testing.assert_close(scores, escores)
    stats = g.safecompile.stats()
    assert stats.compiles <= len(pow2(4, 64))
    assert backend.compiles == stats.compiles
    assert stats.eager_calls <= stats.compiles  # only a bucket's first padded call is eager
    report = g.safecompile.report()
    assert all(s["status"] == "ready" for s in report["buckets"].values())
    assert any(0 < s["padding_waste"] < 1 for s in report["buckets"].values())


def test_keyword_and_positional_arguments_share_a_bucket() -> None:
    """x passed by keyword or by position lands in the same bucket."""
    backend = RecordingBackend()
    g = safe_compile(
        masked,
        backend=backend,
        buckets=Buckets(dims={"x": 1, "mask": 1}, sizes=(8, 16)),
        shadow=None,
    )
    g(torch.randn(1, 5, 4), torch.ones(1, 5))
    g(x=torch.randn(1, 6, 4), mask=torch.ones(1, 6))
    assert backend.compiles == 1


def total(x: torch.Tensor) -> torch.Tensor:
    return x.sum(1)


@pytest.mark.parametrize("shadow", [None, "default"])
def test_harmful_padding_is_caught_even_without_shadow(shadow: str | None) -> None:
    """A sum over the padded dim with pad value 1: that bucket is unused, results stay right."""
    options = {} if shadow == "default" else {"shadow": None}
    g = safe_compile(
        total,
        backend="eager",
        buckets=Buckets(dims={"x": 1}, sizes=(8, 16), pad_value=1, strategy="pad"),
        **options,
    )
    for length in (5, 6, 7):
        x = torch.randn(3, length)
        torch.testing.assert_close(g(x), total(x))
    rejected = [e for e in g.safecompile.events() if e.kind == EventKind.BUCKET_REJECTED]
    assert len(rejected) == 1
    assert rejected[0].reason == Reason.DRIFT
    assert "padding changed the result" in (rejected[0].message or "")
    assert g.safecompile.state != State.ROLLED_BACK  # the callable is fine; that bucket is not
    assert g.safecompile.stats().compiled_calls == 0


def test_oversize_runs_eager_or_compiles_its_shape() -> None:
    """Past the largest size: eager by default, its own graph with oversize='compile'."""
    backend = RecordingBackend()
    g = safe_compile(
        total, backend=backend, buckets=Buckets(dims={"x": 1}, sizes=(8,)), shadow=None
    )
    x = torch.randn(2, 20)
    torch.testing.assert_close(g(x), total(x))
    assert backend.compiles == 0
    assert g.safecompile.stats().eager_calls == 1
    backend2 = RecordingBackend()
    g2 = safe_compile(
        total,
        backend=backend2,
        buckets=Buckets(dims={"x": 1}, sizes=(8,), oversize="compile"),
        shadow=None,
    )
    torch.testing.assert_close(g2(x), total(x))
    assert backend2.compiles == 1
    assert g2.safecompile.stats().compiled_calls == 1


def test_dynamic_strategy_one_graph_per_range_no_padding() -> None:
    """strategy='dynamic': no padded work, graphs bounded by the number of ranges."""
    backend = RecordingBackend()
    seen: list[int] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    g = safe_compile(
        probe,
        backend=backend,
        buckets=Buckets(dims={"x": 0}, sizes=pow2(4, 64), strategy="dynamic"),
        shadow=None,
    )
    for length in (3, 5, 6, 7, 9, 12, 16, 20, 30, 33, 50, 64):
        x = torch.randn(length)
        out = g(x)
        seen.append(out.shape[0])
        torch.testing.assert_close(out, x * 2)
    assert seen == [3, 5, 6, 7, 9, 12, 16, 20, 30, 33, 50, 64]
    assert backend.compiles <= len(pow2(4, 64))
    assert g.safecompile.report()["buckets"]
    assert all(s["padded_calls"] == 0 for s in g.safecompile.report()["buckets"].values())


def test_recompile_limit_must_hold_the_buckets() -> None:
    """An explicit max_recompiles below the bucket count is refused; the default grows."""
    with pytest.raises(ConfigError, match="below the number of bucket sizes"):
        safe_compile(
            total,
            buckets=Buckets(dims={"x": 1}, sizes=pow2(1, 512)),
            rollback=Rollback(max_recompiles=8),
        )
    pad = Buckets(dims={"x": 1}, sizes=pow2(1, 512), strategy="pad")
    g = safe_compile(total, backend="eager", buckets=pad)
    assert g.safecompile.report()["dynamic"] is False


def test_pad_strategy_refuses_dynamic_true() -> None:
    """Padding to static sizes with dynamic=True is contradictory and refused."""
    with pytest.raises(ConfigError, match="strategy='dynamic'"):
        safe_compile(
            total, dynamic=True, buckets=Buckets(dims={"x": 1}, sizes=(8,), strategy="pad")
        )


def test_bucket_name_must_be_a_parameter() -> None:
    """Buckets naming an argument the function does not take is a ConfigError."""
    with pytest.raises(ConfigError, match="'y'"):
        safe_compile(total, buckets=Buckets(dims={"y": 1}, sizes=(8,)))
