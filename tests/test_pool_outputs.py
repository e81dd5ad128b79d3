"""Ready for CUDA graphs: no check reads a compiled output after a later run rewrote it.

Under CUDA graphs a replay writes its outputs into a static pool, the same memory every
time. :class:`~safecompile.testing.PoolBackend` does the same on CPU (each run writes its
outputs into the same tensors), so these tests run without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from safecompile import Shadow, State, Warmup, safe_compile
from safecompile.shapes.buckets import uses_cudagraphs
from safecompile.testing import (
    DriftingBackend,
    PoolBackend,
    RecordingBackend,
    drain_shadow_checks,
)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


def test_the_pool_backend_rewrites_its_outputs_in_place() -> None:
    """The imitation itself: a second run overwrites what the first returned."""
    compiled = torch.compile(affine, backend=PoolBackend())
    first = compiled(torch.zeros(4))
    torch.testing.assert_close(first, torch.ones(4))
    second = compiled(torch.ones(4))
    assert second is first
    torch.testing.assert_close(first, torch.full((4,), 4.0))


class Recurrent(torch.nn.Module):
    """A recurrent state kept in a buffer, rebound each call; the output aliases it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h = torch.tanh(self.h + x)
        return self.h


class State_:
    def __init__(self) -> None:
        self.h = torch.zeros(4)


def recur(x: torch.Tensor, state: State_) -> torch.Tensor:
    state.h = torch.tanh(state.h + x)
    return state.h * 2


def test_a_recurrent_buffer_in_the_pool_is_checked_without_false_drift() -> None:
    """The buffer the compiled run rebinds is the pool's own tensor, rewritten in place
    by the next run: each check compares the compiled run's values, not what putting
    the state back left in that tensor, and the state stays eager's."""
    model = Recurrent()
    reference = Recurrent()
    guarded = safe_compile(model, backend=PoolBackend(), shadow=Shadow(canary=6, every=1))
    with torch.no_grad():
        for step in range(6):
            x = torch.full((4,), 0.1 * (step + 1))
            torch.testing.assert_close(guarded(x).clone(), reference(x), msg=f"step {step}")
            torch.testing.assert_close(model.h, reference.h, msg=f"step {step}")
    stats = guarded.safecompile.stats()
    assert stats.shadow_breaches == 0, stats.last_rollback
    assert stats.shadow_checks >= 5  # one may be skipped: the in-place update is learnt
    assert guarded.safecompile.state is not State.ROLLED_BACK


def test_a_recurrent_object_in_the_pool_is_checked_without_false_drift() -> None:
    guarded = safe_compile(recur, backend=PoolBackend(), shadow=Shadow(canary=6, every=1))
    state, reference = State_(), State_()
    for step in range(6):
        x = torch.full((4,), 0.1 * (step + 1))
        torch.testing.assert_close(guarded(x, state), recur(x, reference), msg=f"step {step}")
        torch.testing.assert_close(state.h, reference.h, msg=f"step {step}")
    stats = guarded.safecompile.stats()
    assert stats.shadow_breaches == 0, stats.last_rollback
    assert stats.shadow_checks >= 5


class _Hold:
    """Once armed, keeps the async worker busy until released: the check's eager run of
    the guarded function, off the caller's thread, waits in :meth:`block`."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.running = threading.Event()
        self.armed = False
        self.caller = threading.get_ident()

    def block(self) -> None:
        if self.armed and threading.get_ident() != self.caller:
            self.running.set()
            self.release.wait(30)


def test_async_checks_compare_the_output_of_their_own_call() -> None:
    """The async worker runs later, after the next call has rewritten the pool: each
    check still compares the output its own call returned (copied before returning)."""
    hold = _Hold()

    def held_affine(x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # an eager run; traced, left out of the graph
            hold.block()
        return affine(x)

    guarded = safe_compile(
        held_affine, backend=PoolBackend(), shadow=Shadow(canary=4, every=1, mode="async")
    )
    guarded(torch.zeros(4))  # compile
    drain_shadow_checks()
    hold.armed = True
    # the first call's check holds the worker; the others queue behind it
    outs = [guarded(torch.full((4,), float(i))) for i in range(3)]
    assert hold.running.wait(10)
    assert all(o is outs[0] for o in outs)  # one pool tensor, rewritten by every call
    hold.release.set()
    drain_shadow_checks()
    stats = guarded.safecompile.stats()
    assert (stats.shadow_checks, stats.shadow_breaches) == (4, 0)
    assert guarded.safecompile.state is State.COMPILED


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every torch.compiler.cudagraph_mark_step_begin() call, counted."""
    calls: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append(1))
    return calls


class Cudagraphs:
    """A backend that takes torch.compile's ``options`` (as a wrapper of inductor does):
    given ``{"triton.cudagraphs": True}``, the guard treats its graphs as CUDA graphs.
    It compiles with ``inner`` on CPU and leaves the options aside."""

    def __init__(self, inner: Any) -> None:
        self.inner = torch._dynamo.lookup_backend(inner)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **options: Any) -> Any:
        return self.inner(gm, example_inputs)


def under_cudagraphs(on: bool, inner: Any = "aot_eager") -> dict[str, Any]:
    """``safe_compile`` options whose backend counts as CUDA graphs (or not)."""
    return {"backend": Cudagraphs(inner), "options": {"triton.cudagraphs": on}}


def cudagraph_guard(on: bool, **options: Any) -> Any:
    """A guarded Linear whose compile options count as CUDA graphs (or not), compiled on
    CPU with aot_eager."""
    options.setdefault("shadow", Shadow(canary=2, every=0))
    return safe_compile(Linear(), **under_cudagraphs(on), **options)


def test_warmup_while_training_under_cudagraphs_starts_a_new_step(
    steps: list[int],
) -> None:
    """A warmup call's outputs are dropped, so their backward never runs: under CUDA
    graphs the guard marks a new step after each one (else the next call would wait on
    that backward and miss the fast path). Live calls are left to torch's own steps."""
    x = torch.randn(2, 4)
    guarded = cudagraph_guard(True, warmup=Warmup(inputs=[(x,), (x,)]))
    assert len(steps) == 2
    guarded(x).sum().backward()
    assert len(steps) == 2


def test_no_new_step_without_cudagraphs_or_without_gradients(
    steps: list[int],
) -> None:
    x = torch.randn(2, 4)
    cudagraph_guard(False, warmup=Warmup(inputs=[(x,)]))
    assert steps == []
    with torch.no_grad():
        cudagraph_guard(True, warmup=Warmup(inputs=[(x,)]))
    assert steps == []


def test_a_check_answered_by_eager_under_cudagraphs_starts_a_new_step(
    steps: list[int],
) -> None:
    """A breach returns eager's result: the compiled forward's outputs are dropped. (A
    graph's first run needs no new step: its compiled run, on copies, needs no gradients.)"""
    guarded = safe_compile(
        Linear(),
        **under_cudagraphs(True, DriftingBackend(scale=1.05, from_run=2)),
        shadow=Shadow(canary=2, every=0),
    )
    x = torch.randn(2, 4)
    guarded(x).sum().backward()
    assert guarded.safecompile.state is State.CANARY
    assert steps == []
    guarded(x).sum().backward()
    assert guarded.safecompile.state is State.ROLLED_BACK
    assert len(steps) == 1


def test_cudagraph_options_are_recognised() -> None:
    assert uses_cudagraphs("inductor", "reduce-overhead")
    assert uses_cudagraphs("inductor", None, {"triton.cudagraphs": True})
    assert uses_cudagraphs("cudagraphs")
    assert not uses_cudagraphs("inductor", "default")
    assert not uses_cudagraphs("aot_eager")


class HiddenWrites(RecordingBackend):
    """A CUDA graph replay writes its static inputs in place without moving their
    version counters: imitated on CPU by putting the counters back after each run."""

    def run(self, inner: Any, args: tuple[Any, ...]) -> Any:
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
        versions = tuple(t._version for t in tensors)
        out = inner(*args)
        torch._C._autograd._unsafe_set_version_counter(tensors, versions)
        return out


def accumulate(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    total.add_(x)
    return total * 2


@pytest.mark.parametrize("cudagraphs", [True, False])
def test_in_place_writes_a_replay_hides_are_found_by_value_under_cudagraphs(
    cudagraphs: bool,
) -> None:
    """Under CUDA graphs a copied input is compared by value too: the replay's write is
    found, put back, and eager applies it once. Without cudagraph options the version
    counters are trusted (and this imitation fools them: the write is applied twice).
    The graph's first run writes into a copy either way: right in both."""
    guarded = safe_compile(
        accumulate, **under_cudagraphs(cudagraphs, HiddenWrites()), shadow=Shadow(canary=3, every=1)
    )
    total = torch.zeros(4)
    x = torch.ones(4)
    out = guarded(x, total)
    torch.testing.assert_close(out, torch.full((4,), 2.0))
    torch.testing.assert_close(total, torch.ones(4))
    out = guarded(x, total)
    if not cudagraphs:
        assert guarded.safecompile.state is State.ROLLED_BACK  # what by_value prevents
        return
    torch.testing.assert_close(out, torch.full((4,), 4.0))
    torch.testing.assert_close(total, torch.full((4,), 2.0))
    guarded(x, total)
    torch.testing.assert_close(total, torch.full((4,), 3.0))
    stats = guarded.safecompile.stats()
    assert (stats.shadow_checks, stats.shadow_breaches) == (3, 0)
