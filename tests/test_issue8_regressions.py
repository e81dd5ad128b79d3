"""Issue 8: bookkeeping per graph torch compiles, not per input shape.

Canary, sampling, verdicts and stats follow what dynamo compiles and caches (one graph
per shape, dynamic range, Python value, grad mode, requires_grad or train/eval), the
caller's module state and inputs are written once, the eager fallback keeps autograd
working, and no failure leaves the guard stuck.
"""

from __future__ import annotations

import copy
import json
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from safecompile import (
    Buckets,
    EventKind,
    Reason,
    Rollback,
    Shadow,
    State,
    safe_compile,
)
from safecompile.testing import (
    DriftingBackend,
    FakeClock,
    RecordingBackend,
    RuntimeFailingBackend,
)

# ---------------------------------------------------------------- shared helpers


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


def kinds(guarded: Any) -> list[EventKind]:
    """The kinds of a guarded callable's events, oldest first."""
    return [e.kind for e in guarded.safecompile.events()]


def events_of(guarded: Any, kind: EventKind) -> list[Any]:
    """A guarded callable's events of one kind."""
    return [e for e in guarded.safecompile.events() if e.kind == kind]


def run_in_thread(fn: Callable[..., Any], *args: Any, timeout: float = 10.0) -> Any:
    """Run ``fn(*args)`` on a daemon thread; fail if it is not done within ``timeout``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # handed back to the test, KeyboardInterrupt included
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn!r} did not return within {timeout} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


class LaterGraphsDrift(RecordingBackend):
    """Correct for its first graph; every later graph adds 1.5 to each float output."""

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if len(self.graphs) == 1:
            return gm.forward

        def drifting(*args: Any) -> Any:
            return pytree.tree_map_only(
                torch.Tensor, lambda t: t + 1.5 if t.is_floating_point() else t, gm(*args)
            )

        return drifting


class FailsFirstCompile(RecordingBackend):
    """Raises while compiling its first graph only (``error`` picks the exception)."""

    def __init__(self, error: Callable[[], BaseException] | None = None) -> None:
        super().__init__()
        self._error = error or (lambda: RuntimeError("injected first-compile failure"))

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if len(self.graphs) == 1:
            raise self._error()
        return gm.forward


# ---------------------------------------------------------------- 1. dropout and randomness


class DropoutNet(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))


class NormalizeNet(nn.Module):
    """LayerNorm and F.normalize: "normal" in an op's name is not randomness."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.norm(self.lin(x)), dim=-1)


class PlainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


@pytest.mark.parametrize(
    "make", [lambda: DropoutNet(0.1), NormalizeNet], ids=["dropout", "normalize"]
)
def test_1_eval_dropout_and_normalize_are_checked(make: Callable[[], nn.Module]) -> None:
    """In eval mode dropout is the identity and normalize is not random: every call is checked."""
    torch.manual_seed(0)
    net = make().eval()
    ref = copy.deepcopy(net)
    safe_compile(net, backend="aot_eager", shadow=Shadow(canary=3, every=1))
    for _ in range(5):
        x = torch.randn(2, 8)
        torch.testing.assert_close(net(x), ref(x))
    stats = net.safecompile.stats()
    assert stats.shadow_checks >= 5, net.safecompile.events()
    assert stats.shadow_skipped == 0, net.safecompile.events()
    assert net.safecompile.state == State.COMPILED


def test_1_train_dropout_skips_checks_with_one_event() -> None:
    """Training-mode dropout draws random numbers: checks skipped, said once, no rollback."""
    net = DropoutNet(0.5).train()
    safe_compile(net, backend="aot_eager", shadow=Shadow(canary=3, every=1))
    for _ in range(10):
        assert net(torch.randn(2, 8)).shape == (2, 8)
    c = net.safecompile
    assert c.stats().shadow_checks == 0
    skipped = events_of(net, EventKind.SHADOW_SKIPPED)
    assert len(skipped) == 1, skipped
    assert "random" in (skipped[0].message or "")
    assert c.state != State.ROLLED_BACK
    assert c.stats().rollbacks == 0


@pytest.mark.parametrize(
    "make",
    [lambda: DropoutNet(0.0), PlainNet, NormalizeNet],
    ids=["dropout-p0", "no-dropout", "normalize"],
)
def test_1_train_without_randomness_is_checked_and_leaves_canary(
    make: Callable[[], nn.Module],
) -> None:
    """Training mode with nothing random is checked like eval, and the canary ends."""
    torch.manual_seed(0)
    net = make().train()
    ref = copy.deepcopy(net)
    safe_compile(net, backend="aot_eager", shadow=Shadow(canary=2, every=0))
    for _ in range(5):
        x = torch.randn(2, 8)
        torch.testing.assert_close(net(x), ref(x))
    c = net.safecompile
    assert c.stats().shadow_checks > 0, c.events()
    assert c.stats().shadow_skipped == 0, c.events()
    assert c.state == State.COMPILED


# ---------------------------------------------------------------- 2. variable-shape traffic


def test_2_variable_shapes_bounded_checks_graphs_and_report() -> None:
    """200 random (batch, seq) shapes: checks follow graphs, not shapes; report stays small."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU()).eval()  # over the last dim only
    ref = copy.deepcopy(net)
    safe_compile(net, backend="aot_eager", shadow=Shadow(canary=4, every=64))
    rng = random.Random(0)
    with torch.no_grad():
        for _ in range(200):
            x = torch.randn(rng.randint(1, 8), rng.randint(1, 64), 16)
            torch.testing.assert_close(net(x), ref(x))
    c = net.safecompile
    stats = c.stats()
    assert stats.calls == 200
    assert 1 <= stats.graphs <= 6, stats
    assert stats.shadow_checks <= 4 * stats.graphs + 200 // 64 + 4, stats
    assert len(json.dumps(c.report())) < 30_000


# ---------------------------------------------------------------- 3. graphs the shape key misses


def flagged(x: torch.Tensor, flag: bool) -> torch.Tensor:
    return x * 2 if flag else x + 1


class ModeNet(nn.Module):
    """Its forward reads ``self.training``, so dynamo compiles one graph per mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * 2 if self.training else h + 1


@dataclass
class TwoGraphs:
    """A callable and two ways of calling it that dynamo compiles as two graphs."""

    target: Callable[..., Any]  # what gets guarded
    reference: Callable[..., Any]  # an unguarded equivalent
    first: Callable[[Callable[..., Any]], Any]  # call it the first way
    second: Callable[[Callable[..., Any]], Any]  # call it the way that makes a new graph


def _python_value() -> TwoGraphs:
    x = torch.randn(3, 4)
    return TwoGraphs(flagged, flagged, lambda f: f(x, False), lambda f: f(x, True))


def _grad_mode() -> TwoGraphs:
    x = torch.randn(3, 4)

    def without_grad(f: Callable[..., Any]) -> Any:
        with torch.no_grad():
            return f(x)

    return TwoGraphs(affine, affine, lambda f: f(x), without_grad)


def _requires_grad() -> TwoGraphs:
    x = torch.randn(3, 4)
    xg = x.clone().requires_grad_()
    return TwoGraphs(affine, affine, lambda f: f(x), lambda f: f(xg))


def _train_eval() -> TwoGraphs:
    torch.manual_seed(0)
    net = ModeNet().eval()
    ref = copy.deepcopy(net)
    x = torch.randn(3, 4)

    def in_training(f: Callable[..., Any]) -> Any:
        net.train()
        ref.train()
        return f(x)

    return TwoGraphs(net, ref, lambda f: f(x), in_training)


@pytest.mark.parametrize(
    "setup",
    [_python_value, _grad_mode, _requires_grad, _train_eval],
    ids=["python-value", "grad-mode", "requires-grad", "train-eval"],
)
def test_3_graph_the_shape_key_misses_is_checked(setup: Callable[[], TwoGraphs]) -> None:
    """A second graph from something other than shape starts its own canary and trips on drift."""
    case = setup()
    backend = LaterGraphsDrift()
    guarded = safe_compile(case.target, backend=backend, shadow=Shadow(canary=2, every=0))
    c = guarded.safecompile
    for _ in range(3):  # past the first graph's canary
        torch.testing.assert_close(case.first(guarded), case.first(case.reference))
    assert c.state == State.COMPILED
    torch.testing.assert_close(case.second(guarded), case.second(case.reference))
    assert backend.compiles == 2  # the setup really made a second graph
    assert c.state == State.ROLLED_BACK
    last = c.stats().last_rollback
    assert last is not None
    assert last.reason == Reason.DRIFT
    assert c.stats().compiles >= 2


# ---------------------------------------------------------------- 4. state written once


class StepCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return x * 2


class GrowingCache(nn.Module):
    """Like a KV cache: each call rebinds the buffer to a longer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache = torch.cat([self.cache, x[:1]])
        return x + self.cache.sum(0)


def test_4_in_place_buffer_update_applied_once() -> None:
    """A forward that does ``self.steps += 1`` counts each call once, checked or not."""
    net = StepCounter().eval()
    safe_compile(net, backend="aot_eager", shadow=Shadow(canary=8, every=1))
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(net(x), x * 2)
    assert int(net.steps) == 3
    assert net.safecompile.stats().shadow_checks > 0, net.safecompile.events()


def test_4_rebound_buffer_matches_unguarded_copy() -> None:
    """A KV-cache-like buffer grows by exactly one row per call, as in an unguarded copy."""
    net = GrowingCache().eval()
    ref = copy.deepcopy(net)
    safe_compile(net, backend="aot_eager", shadow=Shadow(canary=8, every=1))
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(net(x), ref(x))
    assert net.cache.shape == (3, 4)
    torch.testing.assert_close(net.cache, ref.cache)
    c = net.safecompile
    assert c.stats().shadow_checks > 0 or events_of(net, EventKind.SHADOW_SKIPPED)


def bump(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x * 2


def test_4_input_mutated_in_place_exactly_once() -> None:
    """A function that increments its input does so once per guarded call."""
    g = safe_compile(bump, backend="aot_eager", shadow=Shadow(canary=8, every=1))
    x = torch.zeros(4)
    torch.testing.assert_close(g(x), torch.full((4,), 2.0))
    torch.testing.assert_close(x, torch.ones(4))
    assert g.safecompile.stats().shadow_checks > 0 or events_of(g, EventKind.SHADOW_SKIPPED)


# ---------------------------------------------------------------- 5. autograd-safe fallback


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out * out).sum()  # not a plain sum: x - x.mean(0) would give zero gradients


@pytest.mark.parametrize(
    "backend",
    [lambda: DriftingBackend(scale=1.5), lambda: RuntimeFailingBackend(on_run=1)],
    ids=["drift", "runtime-error"],
)
def test_5_eager_fallback_keeps_autograd_for_modules(backend: Callable[[], Any]) -> None:
    """The eager result returned after a breach or runtime error backpropagates like eager."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).eval()  # eval: checked today too; autograd still records
    ref = copy.deepcopy(lin)
    safe_compile(lin, backend=backend())
    x = torch.randn(5, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out = lin(x)
    expected = ref(x_ref)
    torch.testing.assert_close(out, expected)
    _loss(out).backward()
    _loss(expected).backward()
    assert lin.safecompile.state == State.ROLLED_BACK
    assert x.grad is not None
    assert lin.weight.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


def centered(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(0)


def test_5_rejected_bucket_keeps_autograd() -> None:
    """A bucket whose padding changes the result answers with eager's, gradients included."""
    pad = Buckets(dims={"x": 0}, sizes=[8], strategy="pad")  # padding is what is rejected
    g = safe_compile(centered, backend="aot_eager", buckets=pad)
    x = torch.randn(5, 3, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out = g(x)
    expected = centered(x_ref)
    torch.testing.assert_close(out, expected)
    _loss(out).backward()
    _loss(expected).backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert events_of(g, EventKind.BUCKET_REJECTED)


# ---------------------------------------------------------------- 6. no stuck states


def test_6a_retry_after_zero_tries_the_next_call(clock: FakeClock) -> None:
    """retry_after=0 is allowed: the call right after a trip is a compiled trial."""
    g = safe_compile(
        affine, backend="eager", shadow=None, rollback=Rollback(retry_after=0), clock=clock
    )
    x = torch.randn(4)
    g(x)
    c = g.safecompile
    c.rollback()
    before = c.stats().compiled_calls
    torch.testing.assert_close(g(x), affine(x))
    assert c.stats().compiled_calls == before + 1
    after_trip = kinds(g)[kinds(g).index(EventKind.ROLLBACK) :]
    assert EventKind.RECOVERED in after_trip
    assert c.state != State.ROLLED_BACK


@pytest.mark.parametrize(
    "buckets",
    [None, Buckets(dims={"x": 0}, sizes=[4, 8])],
    ids=["no-buckets", "buckets"],
)
def test_6b_compile_failure_is_retried(clock: FakeClock, buckets: Buckets | None) -> None:
    """After a compile error, retry_after recompiles, serves compiled, and only then recovers."""
    backend = FailsFirstCompile()
    g = safe_compile(
        affine,
        backend=backend,
        shadow=None,
        buckets=buckets,
        rollback=Rollback(retry_after=10),
        clock=clock,
    )
    c = g.safecompile
    x = torch.randn(3, 5)
    torch.testing.assert_close(g(x), affine(x))
    assert c.state == State.ROLLED_BACK
    last = c.stats().last_rollback
    assert last is not None
    assert last.reason == Reason.COMPILE_ERROR
    assert EventKind.RECOVERED not in kinds(g)
    compiles_before = backend.compiles
    clock.advance(11)
    for _ in range(3):  # a bucket's first padded call may be spent verifying the padding
        torch.testing.assert_close(g(x), affine(x))
        if c.stats().compiled_calls:
            break
        assert EventKind.RECOVERED not in kinds(g), "recovered before any compiled call"
    assert backend.compiles > compiles_before
    assert c.stats().compiled_calls >= 1
    assert c.state != State.ROLLED_BACK
    assert EventKind.RECOVERED in kinds(g)


def test_6c_keyboard_interrupt_in_compile_leaves_nothing_stuck() -> None:
    """Ctrl-C while compiling reaches the caller; then warmup and calls still work."""
    backend = FailsFirstCompile(error=KeyboardInterrupt)
    g = safe_compile(affine, backend=backend, shadow=None)
    x = torch.randn(4)
    with pytest.raises(KeyboardInterrupt):
        g(x)
    assert g.safecompile.state != State.WARMING
    run_in_thread(g.safecompile.warmup, x, timeout=10)
    out = run_in_thread(g, x, timeout=10)
    torch.testing.assert_close(out, affine(x))


class GateOnTrial(RecordingBackend):
    """Once armed, the first compiled run blocks until released; later runs are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.entered = threading.Event()
        self.released = threading.Event()
        self.entries_while_armed = 0

    def run(self, inner: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if self.armed:
            self.entries_while_armed += 1
            if self.entries_while_armed == 1:
                self.entered.set()
                self.released.wait(10)
        return inner(*args)


def test_6d_half_open_trial_is_one_call(clock: FakeClock) -> None:
    """While the trial call runs compiled, a concurrent call runs eager, not a second trial."""
    backend = GateOnTrial()
    g = safe_compile(
        affine, backend=backend, shadow=None, rollback=Rollback(retry_after=10), clock=clock
    )
    x = torch.randn(4)
    g(x)
    g.safecompile.rollback()
    clock.advance(11)
    backend.armed = True
    box: dict[str, torch.Tensor] = {}
    trial = threading.Thread(target=lambda: box.setdefault("trial", g(x)), daemon=True)
    trial.start()
    try:
        assert backend.entered.wait(10), "the trial never reached the compiled path"
        concurrent = run_in_thread(g, x, timeout=5)
        assert backend.entries_while_armed == 1  # the concurrent call did not run compiled
    finally:
        backend.released.set()
        trial.join(10)
    assert not trial.is_alive()
    torch.testing.assert_close(concurrent, affine(x))
    torch.testing.assert_close(box["trial"], affine(x))


class FailsLongRange(RecordingBackend):
    """Raises while compiling any graph whose example tensor has a dim 0 in 17..64."""

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        for t in example_inputs:
            if isinstance(t, torch.Tensor) and t.dim() and 17 <= int(t.shape[0]) <= 64:
                raise RuntimeError("injected failure for the 17..64 range")
        return gm.forward


def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_6e_dynamic_range_failure_rejects_only_that_range() -> None:
    """A compile failure in one dynamic range leaves the other ranges compiled."""
    g = safe_compile(
        doubled,
        backend=FailsLongRange(),
        shadow=None,
        buckets=Buckets(dims={"x": 0}, sizes=[4, 16, 64], strategy="dynamic"),
    )
    c = g.safecompile
    for length in (3, 10, 20):
        x = torch.randn(length)
        torch.testing.assert_close(g(x), doubled(x))
    before = c.stats().compiled_calls
    for length in (2, 12, 30):
        x = torch.randn(length)
        torch.testing.assert_close(g(x), doubled(x))
    assert c.stats().compiled_calls >= before + 2  # lengths 2 and 12 still compiled
    assert c.state != State.ROLLED_BACK
    named = [
        e
        for e in c.events()
        if e.kind in (EventKind.BUCKET_REJECTED, EventKind.COMPILE_FAILED) and e.bucket
    ]
    assert named, c.events()
    assert all("64" in (e.bucket or "") for e in named), named


def cache_entries(fn: Callable[..., Any]) -> int:
    """How many compiled graphs dynamo holds for ``fn``'s code."""
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


def _reset_target(x: torch.Tensor) -> torch.Tensor:
    return x.sin() + 1


def test_6f_reset_frees_the_old_graphs() -> None:
    """Each reset() drops the graphs compiled before it: dynamo's cache does not grow."""
    g = safe_compile(_reset_target, backend="eager", shadow=Shadow(canary=2, every=1))
    x = torch.randn(4)
    counts = []
    for _ in range(3):
        for _ in range(3):
            torch.testing.assert_close(g(x), _reset_target(x))
        counts.append(cache_entries(_reset_target))
        g.safecompile.reset()
    assert counts[0] >= 1
    assert max(counts) <= counts[0], counts


def _zeroes_target(x: torch.Tensor) -> torch.Tensor:
    return x.cos() - 1


def test_6f_reset_zeroes_every_counter() -> None:
    """Right after reset(), every counter is zero together and the state is pending."""
    g = safe_compile(_zeroes_target, backend="eager", shadow=Shadow(canary=2, every=1))
    c = g.safecompile
    x = torch.randn(4)
    for _ in range(3):
        for _ in range(3):
            torch.testing.assert_close(g(x), _zeroes_target(x))
        c.rollback()
        c.reset()
        stats = c.stats()
        counters = {
            name: getattr(stats, name)
            for name in (
                "calls",
                "compiled_calls",
                "eager_calls",
                "compiles",
                "graphs",
                "shadow_checks",
                "rollbacks",
            )
        }
        assert counters == dict.fromkeys(counters, 0)
        assert c.state == State.PENDING
