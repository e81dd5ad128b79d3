"""Compile errors, runtime errors, user errors, recompile limits and retries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import safecompile
from safecompile import Buckets, EventKind, Reason, Rollback, State, safe_compile
from safecompile.testing import (
    FailingBackend,
    FakeClock,
    InjectedRuntimeError,
    RecordingBackend,
    RuntimeFailingBackend,
)


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


def test_compile_error_returns_eager_and_trips(x: torch.Tensor) -> None:
    """An exception while compiling is answered with eager's result; the callable trips."""
    g = safe_compile(affine, backend=FailingBackend(), shadow=None)
    torch.testing.assert_close(g(x), affine(x))
    c = g.safecompile
    assert c.state == State.ROLLED_BACK
    stats = c.stats()
    assert (stats.calls, stats.compiled_calls, stats.eager_calls) == (1, 0, 1)
    assert stats.compile_errors == 1
    assert stats.rollbacks == 1
    assert stats.last_rollback is not None
    assert stats.last_rollback.reason == Reason.COMPILE_ERROR
    assert stats.last_rollback.error_type == "torch._dynamo.exc.BackendCompilerFailed"
    assert "injected compile failure" in (stats.last_rollback.message or "")
    kinds = [e.kind for e in c.events()]
    assert kinds == [EventKind.COMPILE_FAILED, EventKind.ROLLBACK]
    torch.testing.assert_close(g(x), affine(x))  # later calls: eager, no new compile
    assert c.stats().eager_calls == 2


def test_compile_error_on_a_later_shape(x: torch.Tensor) -> None:
    """A failure compiling a second shape trips too, after the first shape served compiled."""
    backend = FailingBackend(after=1)
    g = safe_compile(affine, backend=backend, shadow=None, dynamic=False)
    g(x)
    assert g.safecompile.state == State.COMPILED
    torch.testing.assert_close(g(torch.ones(2, 3)), affine(torch.ones(2, 3)))
    assert g.safecompile.state == State.ROLLED_BACK
    assert g.safecompile.stats().last_rollback.reason == Reason.COMPILE_ERROR  # type: ignore[union-attr]


def test_runtime_error_reruns_eager_and_trips(x: torch.Tensor) -> None:
    """Compiled code raising at run time: eager answers, the callable trips with runtime_error."""
    g = safe_compile(affine, backend=RuntimeFailingBackend(on_run=3), shadow=None)
    g(x)
    g(x)
    torch.testing.assert_close(g(x), affine(x))
    c = g.safecompile
    assert c.state == State.ROLLED_BACK
    last = c.stats().last_rollback
    assert last is not None
    assert last.reason == Reason.RUNTIME_ERROR
    assert last.error_type == "safecompile.testing.InjectedRuntimeError"
    stats = c.stats()
    assert (stats.calls, stats.compiled_calls, stats.eager_calls) == (3, 2, 1)


def bad_matmul(x: torch.Tensor) -> torch.Tensor:
    return x @ torch.ones(3, 3)


def test_user_error_propagates_unchanged_at_compile_time() -> None:
    """The user's own bug (eager raises too) is raised as eager raises it, and trips nothing."""
    x = torch.randn(2, 5)
    with pytest.raises(RuntimeError) as eager_info:
        bad_matmul(x)
    g = safe_compile(bad_matmul, backend="eager", shadow=None)
    with pytest.raises(RuntimeError) as info:
        g(x)
    assert type(info.value) is type(eager_info.value)
    assert str(info.value) == str(eager_info.value)
    assert info.value.__context__ is None
    assert info.value.__cause__ is None
    assert g.safecompile.state == State.PENDING
    assert g.safecompile.stats().rollbacks == 0
    assert g.safecompile.stats().compile_errors == 0
    torch.testing.assert_close(g(torch.randn(2, 3)).shape, torch.Size([2, 3]))


def checked(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 1e6:
        raise ValueError("input too large")
    return x + 1


def test_user_error_propagates_unchanged_at_run_time() -> None:
    """An error eager raises too, met on the compiled path, propagates and is not a trip."""
    g = safe_compile(checked, backend="eager", shadow=None)
    g(torch.ones(3))
    with pytest.raises(ValueError, match=r"^input too large$"):
        g(torch.full((3,), 1e7))
    assert g.safecompile.state == State.COMPILED
    assert g.safecompile.stats().rollbacks == 0


def test_recompile_limit_runs_new_shapes_eager_visibly() -> None:
    """Past max_recompiles, new shapes run eager with an event; compiled shapes keep serving."""
    backend = RecordingBackend()
    g = safe_compile(
        affine, backend=backend, shadow=None, dynamic=False, rollback=Rollback(max_recompiles=3)
    )
    for n in range(1, 7):
        torch.testing.assert_close(g(torch.ones(n)), affine(torch.ones(n)))
    c = g.safecompile
    assert backend.compiles == 3
    stats = c.stats()
    assert stats.compiles == 3
    assert stats.recompile_limit_calls == 3
    assert (stats.compiled_calls, stats.eager_calls) == (3, 3)
    limit_events = [e for e in c.events() if e.kind == EventKind.RECOMPILE_LIMIT]
    assert len(limit_events) == 1
    assert limit_events[0].reason == Reason.RECOMPILE_LIMIT
    assert c.state == State.COMPILED  # not a trip
    g(torch.ones(2))  # an already-compiled shape still runs compiled
    assert c.stats().compiled_calls == 4
    g(torch.ones(5))  # a shape past the limit keeps running eager
    assert c.stats().recompile_limit_calls == 4


def test_retry_after_half_open_trial_recovers(x: torch.Tensor, clock: FakeClock) -> None:
    """retry_after seconds after a trip, one call tries compiled again; success closes the trip."""
    backend = RuntimeFailingBackend(on_run=2, once=True)
    g = safe_compile(
        affine, backend=backend, shadow=None, rollback=Rollback(retry_after=10), clock=clock
    )
    g(x)
    g(x)  # run 2 fails -> trip
    c = g.safecompile
    assert c.state == State.ROLLED_BACK
    clock.advance(9.9)
    g(x)
    assert c.state == State.ROLLED_BACK
    assert backend.runs == 2
    clock.advance(0.2)
    torch.testing.assert_close(g(x), affine(x))  # the trial, compiled again
    assert backend.runs == 3
    assert c.state == State.COMPILED
    kinds = [e.kind for e in c.events()]
    assert kinds[-2:] == [EventKind.RETRY, EventKind.RECOVERED]


def test_retry_after_failed_trial_doubles_wait(x: torch.Tensor, clock: FakeClock) -> None:
    """A failed trial re-trips with a doubled wait, capped by max_retry_after."""
    backend = RuntimeFailingBackend(on_run=1)
    g = safe_compile(
        affine,
        backend=backend,
        shadow=None,
        rollback=Rollback(retry_after=10, max_retry_after=25),
        clock=clock,
    )
    g(x)  # fails -> trip, retry at 10
    c = g.safecompile
    waits = []
    for _ in range(3):
        waits.append(c.report()["retry_at"] - clock.now)
        clock.advance(waits[-1])
        g(x)  # trial fails again
        assert c.state == State.ROLLED_BACK
    assert waits == [10, 20, 25]
    assert c.stats().rollbacks == 4
    assert backend.runs == 4


def test_retry_after_none_keeps_eager_until_reset(x: torch.Tensor, clock: FakeClock) -> None:
    """Without retry_after, a trip lasts until reset(); reset() compiles afresh."""
    backend = RuntimeFailingBackend(on_run=1, once=True)
    g = safe_compile(affine, backend=backend, shadow=None, clock=clock)
    g(x)
    clock.advance(1e9)
    g(x)
    assert g.safecompile.state == State.ROLLED_BACK
    g.safecompile.reset()
    assert g.safecompile.state == State.PENDING
    g(x)
    assert g.safecompile.state == State.COMPILED
    assert backend.compiles == 2


def test_manual_rollback(x: torch.Tensor) -> None:
    """rollback() trips now with reason manual."""
    g = safe_compile(affine, backend="eager", shadow=None)
    g(x)
    g.safecompile.rollback()
    assert g.safecompile.state == State.ROLLED_BACK
    assert g.safecompile.stats().last_rollback.reason == Reason.MANUAL  # type: ignore[union-attr]
    g(x)
    assert g.safecompile.stats().eager_calls == 1


def test_backward_compile_failure_is_caught_on_the_forward_call() -> None:
    """A backward graph that fails to compile fails on the guarded call, not at .backward()."""
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        return gm.forward

    def bw(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        raise InjectedRuntimeError("backward compile failed")

    lin = torch.nn.Linear(4, 2)
    g = safe_compile(lin, backend=aot_autograd(fw_compiler=fw, bw_compiler=bw), shadow=None)
    x = torch.randn(3, 4, requires_grad=True)
    out = g(x)
    out.sum().backward()  # eager's graph: backward works
    assert x.grad is not None
    assert g.safecompile.state == State.ROLLED_BACK
    assert g.safecompile.stats().last_rollback.reason == Reason.COMPILE_ERROR  # type: ignore[union-attr]


def test_a_trial_served_eagerly_is_announced_once(clock: FakeClock) -> None:
    """retry_after=0 and oversize inputs (they run eager): each is a trial that learns
    nothing; the retry event is said once, and the first servable call recovers."""
    g = safe_compile(
        affine,
        backend=RuntimeFailingBackend(on_run=1, once=True),
        buckets=Buckets(dims={"x": 0}, sizes=(4, 8)),
        rollback=Rollback(retry_after=0),
        shadow=None,
        clock=clock,
    )
    small, big = torch.randn(3), torch.randn(16)
    torch.testing.assert_close(g(small), affine(small))  # the compiled run raises: trip
    assert g.safecompile.state == State.ROLLED_BACK
    for _ in range(5):  # oversize: eager serves each trial, nothing learnt
        torch.testing.assert_close(g(big), affine(big))
    assert g.safecompile.state == State.ROLLED_BACK
    torch.testing.assert_close(g(small), affine(small))  # served compiled: recovered
    assert g.safecompile.state == State.COMPILED
    kinds = [e.kind for e in g.safecompile.events()]
    assert kinds.count(EventKind.RETRY) == 1
    assert kinds[-1] == EventKind.RECOVERED


@dataclass
class CountingClock(FakeClock):
    """A fake clock that counts its reads. A rolled-back call served from the hot path
    reads it once (the trial's deadline), or never when no trial is to come; a call that
    goes down the slow path reads it more (to admit, time and record the call)."""

    reads: int = 0

    def __call__(self) -> float:
        self.reads += 1
        return super().__call__()

    def reads_of(self, call: Callable[[], object]) -> int:
        """How many times ``call()`` read the clock."""
        before = self.reads
        call()
        return self.reads - before


@pytest.mark.parametrize("bucketed", [False, True])
def test_rolled_back_serves_eager_from_the_hot_path_until_the_trial(
    x: torch.Tensor, bucketed: bool
) -> None:
    """Rolled back with no trial due, a call never enters the slow path (eager serves it
    in the hot path, counted, reading only the trial's deadline); the trial still runs
    when due, and compiled serves again."""
    clock = CountingClock()
    buckets = Buckets(dims={"x": 0}, sizes=(4, 8)) if bucketed else None
    g = safe_compile(
        affine,
        backend="eager",
        shadow=None,
        buckets=buckets,
        rollback=Rollback(retry_after=10, slower_ratio=None),
        clock=clock,
    )
    g(x)
    c = g.safecompile
    c.rollback()
    for _ in range(3):
        assert clock.reads_of(lambda: torch.testing.assert_close(g(x), affine(x))) == 1
    clock.advance(9.5)
    assert clock.reads_of(lambda: torch.testing.assert_close(g(x), affine(x))) == 1
    assert (c.stats().eager_calls, c.state) == (4, State.ROLLED_BACK)
    assert EventKind.RETRY not in [e.kind for e in c.events()]
    clock.advance(1)
    torch.testing.assert_close(g(x), affine(x))  # the trial: compiled serves again
    assert c.state == State.COMPILED
    assert [e.kind for e in c.events()][-2:] == [EventKind.RETRY, EventKind.RECOVERED]
    assert clock.reads_of(lambda: g(x)) == 0  # compiled, from the hot path
    assert (c.stats().compiled_calls, c.stats().eager_calls) == (3, 4)


def test_a_failed_trial_moves_the_hot_paths_deadline(x: torch.Tensor) -> None:
    """A failed trial trips with a longer wait: the hot path serves eager until then."""
    clock = CountingClock()
    backend = RuntimeFailingBackend(on_run=1)
    g = safe_compile(
        affine, backend=backend, shadow=None, rollback=Rollback(retry_after=10), clock=clock
    )

    def trials() -> int:
        return [e.kind for e in g.safecompile.events()].count(EventKind.RETRY)

    g(x)  # fails: rolled back, the trial at 10
    clock.advance(10)
    g(x)  # the trial fails: the next at 30
    assert (trials(), backend.runs) == (1, 2)
    clock.advance(19)
    assert clock.reads_of(lambda: g(x)) == 1  # the hot path: the deadline, nothing more
    assert (trials(), backend.runs) == (1, 2)
    clock.advance(1)
    g(x)
    assert (trials(), backend.runs) == (2, 3)


def test_reset_reopens_the_path_a_rollback_closed(x: torch.Tensor) -> None:
    """Rolled back for good (no retry_after), every call stays in the hot path; reset()
    sends the next call down the slow path, which compiles afresh."""
    clock = CountingClock()
    backend = RecordingBackend()
    g = safe_compile(affine, backend=backend, shadow=None, clock=clock)
    g(x)
    g.safecompile.rollback()
    assert clock.reads_of(lambda: g(x)) == 0  # no trial to come: not even a deadline
    assert backend.runs == 1
    g.safecompile.reset()
    g(x)
    assert backend.compiles == 2
    assert g.safecompile.state == State.COMPILED
    assert g.safecompile.stats().compiled_calls == 1


@pytest.mark.parametrize("how", ["rolled back", "kill switch"])
@pytest.mark.parametrize("bucketed", [False, True])
def test_no_clock_read_while_eager_serves_with_no_trial_to_come(
    x: torch.Tensor, how: str, bucketed: bool
) -> None:
    """Rolled back with no ``retry_after``, or switched off, nothing can send a call down
    another path until the gate changes: the hot path serves eager without reading the
    clock, and counts every call."""
    reads = 0

    def clock() -> float:
        nonlocal reads
        reads += 1
        return 0.0

    buckets = Buckets(dims={"x": 0}, sizes=(4, 8)) if bucketed else None
    g = safe_compile(affine, backend="eager", shadow=None, buckets=buckets, clock=clock)
    g(x)
    if how == "kill switch":
        safecompile.disable()
    else:
        g.safecompile.rollback()
    reads = 0
    for _ in range(5):
        torch.testing.assert_close(g(x), affine(x))
    assert reads == 0
    assert g.safecompile.stats().eager_calls == 5
