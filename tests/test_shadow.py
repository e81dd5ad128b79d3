"""Shadow checks: drift trips in the canary, sampling, async, side effects, A/B timings."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from safecompile import EventKind, Reason, Rollback, Shadow, State, safe_compile
from safecompile.testing import (
    DriftingBackend,
    FakeClock,
    RecordingBackend,
    SlowBackend,
    drain_shadow_checks,
)


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


def test_drift_trips_in_canary_and_caller_never_sees_it() -> None:
    """A 1% drift from the 4th compiled run trips during the canary; every result is eager's."""
    backend = DriftingBackend(scale=1.01, from_run=4)
    g = safe_compile(affine, backend=backend, shadow=Shadow(canary=8, every=0))
    for _ in range(10):
        x = torch.randn(16)
        out = g(x)  # one call each: a second call would run another compiled run
        torch.testing.assert_close(out, affine(x), rtol=1e-6, atol=1e-6)
    c = g.safecompile
    assert c.state == State.ROLLED_BACK
    last = c.stats().last_rollback
    assert last is not None
    assert last.reason == Reason.DRIFT
    assert last.max_rel_diff is not None
    assert last.max_rel_diff > 1e-3
    assert c.stats().shadow_breaches == 1
    assert backend.runs == 4  # no compiled call after the trip


def test_drifted_result_is_never_returned_in_sync_mode() -> None:
    """The breaching call itself returns eager's result (exactly), not the drifted one."""
    g = safe_compile(affine, backend=DriftingBackend(scale=1.01), shadow=Shadow(canary=1))
    x = torch.randn(32)
    assert torch.equal(g(x), affine(x))
    assert g.safecompile.state == State.ROLLED_BACK
    assert g.safecompile.stats().compiled_calls == 0


def test_single_nan_trips() -> None:
    """One NaN in the compiled output where eager is finite is a breach."""
    g = safe_compile(affine, backend=DriftingBackend(scale=1.0, nan=True))
    x = torch.randn(32)
    out = g(x)
    assert not out.isnan().any()
    assert g.safecompile.stats().last_rollback.reason == Reason.DRIFT  # type: ignore[union-attr]


def logs(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x)


def test_nan_on_both_sides_is_not_a_breach() -> None:
    """NaN where eager has NaN too is agreement."""
    g = safe_compile(logs, backend="aot_eager", shadow=Shadow(canary=4))
    for _ in range(4):
        g(torch.tensor([-1.0, 1.0, 2.0]))
    assert g.safecompile.state == State.COMPILED
    assert g.safecompile.stats().shadow_checks == 4
    assert g.safecompile.stats().shadow_breaches == 0


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: dict[str, torch.Tensor]


def structured(x: torch.Tensor) -> tuple[Out, list[torch.Tensor], None, int]:
    return (Out(logits=x * 2, extra={"h": x + 1}), [x.sum(), x.mean()], None, 3)


@pytest.mark.parametrize("scale", [1.0, 1.01])
def test_structured_outputs(scale: float) -> None:
    """Tuples, lists, dicts, dataclasses, None and scalars are compared leaf by leaf."""
    g = safe_compile(structured, backend=DriftingBackend(scale=scale), shadow=Shadow(canary=2))
    x = torch.randn(8)
    out = g(x)
    expected_state = State.CANARY if scale == 1.0 else State.ROLLED_BACK
    assert g.safecompile.state == expected_state
    # the values returned are eager's, leaf by leaf (a drifted leaf never reaches the caller)
    first, pair, nothing, three = out
    assert isinstance(first, Out)
    torch.testing.assert_close(first.logits, x * 2, rtol=0, atol=0)
    assert list(first.extra) == ["h"]
    torch.testing.assert_close(first.extra["h"], x + 1, rtol=0, atol=0)
    assert isinstance(pair, list)
    assert len(pair) == 2
    torch.testing.assert_close(pair[0], x.sum(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pair[1], x.mean(), rtol=1e-6, atol=1e-6)
    assert (nothing, three) == (None, 3)


def bump(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x * 2


def test_input_mutation_is_applied_once() -> None:
    """A function that mutates its input: the shadow run works on a copy, never the caller's."""
    g = safe_compile(bump, backend="aot_eager", shadow=Shadow(canary=3, every=1))
    x = torch.zeros(4)
    for i in range(1, 6):
        out = g(x)
        torch.testing.assert_close(x, torch.full((4,), float(i)))
        torch.testing.assert_close(out, torch.full((4,), 2.0 * i))
    assert g.safecompile.stats().shadow_checks == 5
    assert g.safecompile.state == State.COMPILED


def test_mutation_breach_leaves_eager_side_effects() -> None:
    """When a mutating function drifts, the caller's tensor holds eager's update."""

    def scale_in_place(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x.sum()

    g = safe_compile(scale_in_place, backend=DriftingBackend(scale=1.01), shadow=Shadow(canary=1))
    x = torch.ones(4)
    out = g(x)
    assert g.safecompile.state == State.ROLLED_BACK
    torch.testing.assert_close(out, torch.tensor(8.0))
    # eager's update, applied once: not the compiled run's on top of it (4.0), not none (1.0)
    torch.testing.assert_close(x, torch.full((4,), 2.0), rtol=0, atol=0)


def test_sampling_counts_are_exact() -> None:
    """canary checks every call, then one call in `every`."""
    g = safe_compile(affine, backend="eager", shadow=Shadow(canary=3, every=4))
    x = torch.randn(4)
    for _ in range(15):
        g(x)
    stats = g.safecompile.stats()
    assert stats.shadow_checks == 3 + 3  # calls 1-3, then 7, 11, 15
    assert stats.calls == stats.compiled_calls == 15
    assert g.safecompile.state == State.COMPILED


def test_every_zero_stops_after_canary() -> None:
    """every=0: nothing is checked after the canary."""
    g = safe_compile(affine, backend="eager", shadow=Shadow(canary=2, every=0))
    x = torch.randn(4)
    for _ in range(20):
        g(x)
    assert g.safecompile.stats().shadow_checks == 2


def test_each_new_shape_starts_its_own_canary() -> None:
    """A new shape (a new graph) is checked from its first call."""
    g = safe_compile(affine, backend="eager", dynamic=False, shadow=Shadow(canary=2, every=0))
    for n in (4, 4, 4, 5, 5, 5):
        g(torch.randn(n))
    assert g.safecompile.stats().shadow_checks == 4


def test_bf16_transformer_block_no_false_trip() -> None:
    """A bf16 transformer block under aot_eager, every call checked: no breach."""
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
    block = block.to(torch.bfloat16).eval()
    g = safe_compile(block, backend="aot_eager", shadow=Shadow(canary=4, every=1))
    with torch.no_grad():
        for seed in range(6):
            torch.manual_seed(seed)
            g(torch.randn(2, 16, 64, dtype=torch.bfloat16))
    stats = g.safecompile.stats()
    assert stats.shadow_checks == 6
    assert stats.shadow_breaches == 0, g.safecompile.events()
    assert g.safecompile.state == State.COMPILED


def test_training_mode_module_skips_and_says_so_once() -> None:
    """Modules in training mode are not shadow-checked (dropout, batch-norm statistics)."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    g = safe_compile(net, backend="eager", shadow=Shadow(canary=4))
    for _ in range(3):
        g(torch.randn(2, 4))
    skipped = [e for e in g.safecompile.events() if e.kind == EventKind.SHADOW_SKIPPED]
    assert len(skipped) == 1
    assert g.safecompile.stats().shadow_checks == 0
    assert g.safecompile.state != State.ROLLED_BACK


def noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand_like(x)


def test_random_functions_skip_checks() -> None:
    """A function drawing random numbers is not compared (compiled RNG differs from eager's)."""
    g = safe_compile(noisy, backend="aot_eager", shadow=Shadow(canary=4))
    for _ in range(5):
        g(torch.randn(8))
    assert g.safecompile.stats().shadow_checks == 0
    assert g.safecompile.state == State.UNCHECKED  # API.md §2: compiled, but never checked
    messages = [e.message or "" for e in g.safecompile.events()]
    assert any("random" in m for m in messages)


def test_async_trips_later_and_never_returns_eager_twice() -> None:
    """Async mode: the caller gets the compiled result at once; a breach trips later calls."""
    g = safe_compile(affine, backend=DriftingBackend(scale=1.01), shadow=Shadow(mode="async"))
    x = torch.randn(16)
    g(x)
    drain_shadow_checks()
    assert g.safecompile.state == State.ROLLED_BACK
    assert torch.equal(g(x), affine(x))
    assert g.safecompile.stats().shadow_breaches >= 1


def test_async_never_checks_a_call_that_updates_its_input() -> None:
    """Async mode cannot isolate state: a call that updates its input is never checked,
    one event says why and names sync mode, and the update is applied once."""
    g = safe_compile(bump, backend="aot_eager", shadow=Shadow(mode="async", every=1))
    x = torch.zeros(4)
    for i in range(1, 4):
        torch.testing.assert_close(g(x), torch.full((4,), 2.0 * i))
    drain_shadow_checks()
    torch.testing.assert_close(x, torch.full((4,), 3.0))
    stats = g.safecompile.stats()
    assert (stats.shadow_checks, stats.shadow_breaches) == (0, 0)
    said = [e.message or "" for e in g.safecompile.events() if e.kind == EventKind.SHADOW_SKIPPED]
    assert len(said) == 1, said
    assert "an async check cannot isolate" in said[0]
    assert "Shadow(mode='sync') can check it" in said[0]


def test_async_never_blocks_and_full_queue_skips() -> None:
    """With the worker stuck, calls still return; checks past the queue are skipped and counted."""
    gate = threading.Event()
    entered = threading.Event()
    caller = threading.get_ident()

    def blocking_eager(x: torch.Tensor) -> torch.Tensor:
        # run eagerly off the caller's thread (the check's eager run, on the worker), it
        # blocks until the gate opens; traced, the branch is left out of the graph
        if not torch.compiler.is_compiling() and threading.get_ident() != caller:
            entered.set()
            gate.wait(30)
        return affine(x)

    g = safe_compile(
        blocking_eager, backend="eager", shadow=Shadow(mode="async", every=1, queue_size=2)
    )
    x = torch.randn(4)
    for _ in range(10):
        torch.testing.assert_close(g(x), affine(x))
    assert entered.wait(30)
    stats = g.safecompile.stats()
    assert stats.extra["shadow_queue_full"] >= 7
    gate.set()
    drain_shadow_checks()
    assert (
        g.safecompile.stats().shadow_checks + g.safecompile.stats().extra["shadow_queue_full"] == 10
    )


def test_shadow_timings_are_figures_not_a_verdict(clock: FakeClock) -> None:
    """Checked calls time both paths for the A/B figures; a compiled path slower in those
    pairs does not roll back (the speed verdict times live calls: test_speed_verdict.py)."""
    backend = SlowBackend(delay=0.01, sleep=clock.advance)
    g = safe_compile(
        affine,
        backend=backend,
        shadow=Shadow(canary=2, every=1),
        rollback=Rollback(slower_ratio=1.2, slower_min_samples=5),
        clock=clock,
    )
    x = torch.randn(4)
    for _ in range(10):
        g(x)
    assert g.safecompile.stats().last_rollback is None
    assert g.safecompile.state == State.COMPILED
    latency = g.safecompile.stats().extra["latency"]
    assert latency["pairs"] == 9  # the first call compiled: its time is not a run's
    assert latency["compiled"]["p50"] == pytest.approx(0.01)


def test_rollout_routes_exact_share_to_compiled() -> None:
    """rollout=0.25 sends exactly one call in four to the compiled path."""
    backend = RecordingBackend()
    g = safe_compile(affine, backend=backend, shadow=None, rollout=0.25)
    x = torch.randn(4)
    for _ in range(100):
        torch.testing.assert_close(g(x), affine(x))
    stats = g.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls) == (25, 75)
