"""A graph's first run: eager's result, inputs, views and gradients, whatever its compiled
code writes (docs/design.md, "A graph's first run").

Until a graph has run once nothing is known of what its compiled code writes: its first
run runs that code on copies of the tensors it is given and its traced graph eagerly on
the caller's own, and the caller gets the eager run's outputs. The backends here write
into their inputs, as a compiler bug would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from safecompile import Buckets, EventKind, Shadow, State, safe_compile
from safecompile.guard import _graph_backend as graphs
from safecompile.guard import facts
from safecompile.testing import DriftingBackend, RecordingBackend


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


Backend = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]


def add_before(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """Writes into its first input, then runs the graph."""

    def run(*args: Any) -> Any:
        args[0].add_(1)
        return gm.forward(*args)

    return run


def add_after(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """Runs the graph, then writes into its first input (one the graph saved for backward)."""

    def run(*args: Any) -> Any:
        out = gm.forward(*args)
        args[0].add_(1)
        return out

    return run


def copy_into(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """Runs the graph, then overwrites every tensor input with ``copy_`` (no gradients)."""

    def run(*args: Any) -> Any:
        out = gm.forward(*args)
        with torch.no_grad():
            for a in args:
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    a.copy_(torch.full_like(a, 7.0))
        return out

    return run


def honest(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    return gm.forward


WRITERS: dict[str, Backend] = {
    "add_before": add_before,
    "add_after": add_after,
    "copy_into": copy_into,
}


def sin_and_view(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An output computed from the input, and a view of it."""
    return x.sin() * 2, x[1:]


def leaf_and_input(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A leaf and a tensor made from it whose value ``exp``'s backward needs (an input
    written in place makes that backward raise)."""
    w = torch.randn(4, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    return w, w.exp()


def eager_reference() -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    w, x = leaf_and_input()
    out, view = sin_and_view(x)
    (out.sum() + view.sum()).backward()
    assert w.grad is not None
    return x.detach(), (out.detach(), view.detach()), w.grad


@pytest.mark.parametrize("shadow", [Shadow(every=1, mode="sync"), None], ids=["sync", "off"])
@pytest.mark.parametrize("name", sorted(WRITERS))
def test_the_first_call_keeps_eagers_input_view_and_gradients(
    name: str, shadow: Shadow | None
) -> None:
    ref_x, (ref_out, ref_view), ref_grad = eager_reference()
    guarded = safe_compile(sin_and_view, backend=WRITERS[name], shadow=shadow)
    w, x = leaf_and_input()
    out, view = guarded(x)
    torch.testing.assert_close(x.detach(), ref_x, rtol=0, atol=0)  # the input as it was
    torch.testing.assert_close(out.detach(), ref_out, rtol=0, atol=0)
    torch.testing.assert_close(view.detach(), ref_view, rtol=0, atol=0)
    assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # x's view
    (out.sum() + view.sum()).backward()  # eager's backward: nothing it saved was written
    torch.testing.assert_close(w.grad, ref_grad, rtol=0, atol=0)
    assert guarded.safecompile.state is State.ROLLED_BACK  # checked even with shadow=None


def test_a_write_seen_on_the_first_run_trips_with_a_breach_that_says_so() -> None:
    guarded = safe_compile(
        sin_and_view, backend=copy_into, shadow=Shadow(canary=2, every=1), name="writer"
    )
    x = torch.randn(4)
    guarded(x)
    assert guarded.safecompile.state is State.ROLLED_BACK
    stats = guarded.safecompile.stats()
    # the first run's check breached; the call's due canary check still ran (and passed:
    # the traced graph is eager's), as a peer rank checking the same call would
    assert (stats.shadow_checks, stats.shadow_breaches, stats.rollbacks) == (2, 1, 1)
    events = guarded.safecompile.events()
    breach = next(e for e in events if e.kind is EventKind.BREACH)
    assert breach.details.get("graph") == 1
    rollback = next(e for e in events if e.kind is EventKind.ROLLBACK)
    assert str(rollback.message).startswith("first run:")


def test_a_write_into_an_input_alone_is_a_breach() -> None:
    """The outputs agree; only what the compiled run left in its input differs."""

    def writes_after(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            out = [t.clone() for t in gm.forward(*args)]
            with torch.no_grad():
                args[0].mul_(3)
            return out

        return run

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    guarded = safe_compile(double, backend=writes_after, shadow=Shadow(every=1))
    x = torch.randn(4)
    before = x.clone()
    torch.testing.assert_close(guarded(x), before * 2)
    torch.testing.assert_close(x, before, rtol=0, atol=0)
    assert guarded.safecompile.state is State.ROLLED_BACK
    breach = next(e for e in guarded.safecompile.events() if e.kind is EventKind.BREACH)
    assert "inputs after the run differ" in str(breach.message)


def accumulate(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    total.add_(x)
    return total * 2


@pytest.mark.parametrize("shadow", [Shadow(every=1, mode="sync"), None], ids=["sync", "off"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_in_place_update_of_the_users_own_is_made_once(
    backend: str, shadow: Shadow | None
) -> None:
    guarded = safe_compile(accumulate, backend=backend, shadow=shadow)
    total = torch.zeros(4)
    x = torch.ones(4)
    for n in (1, 2, 3):
        out = guarded(x, total)
        torch.testing.assert_close(total, torch.full((4,), float(n)))
        torch.testing.assert_close(out, torch.full((4,), 2.0 * n))
    assert guarded.safecompile.state in (State.CANARY, State.COMPILED)
    assert guarded.safecompile.stats().rollbacks == 0


def test_drift_on_the_first_run_is_caught_and_eagers_state_kept() -> None:
    """A graph's first run is compared with its eager run: the drift shows in the
    tensor the frame stores into a Python object, and the object holds eager's."""

    class Cache:
        def __init__(self) -> None:
            self.keys = torch.zeros(1, 4)

    def step(x: torch.Tensor, cache: Cache) -> torch.Tensor:
        cache.keys = torch.cat([cache.keys, x * 2])
        return x.argmax(-1)

    guarded = safe_compile(step, backend=DriftingBackend(scale=1.05), shadow=Shadow(every=1))
    cache = Cache()
    x = torch.randn(1, 4)
    torch.testing.assert_close(guarded(x, cache), x.argmax(-1))
    torch.testing.assert_close(cache.keys, torch.cat([torch.zeros(1, 4), x * 2]), rtol=0, atol=0)
    assert guarded.safecompile.state is State.ROLLED_BACK


def test_a_random_graphs_first_run_leaves_eagers_random_stream() -> None:
    """The compiled run on copies draws too: the random state is put back before the
    eager run, so the caller's stream moves as eager's does."""

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, p=0.5, training=True) + torch.rand_like(x)

    guarded = safe_compile(noisy, backend="aot_eager", shadow=Shadow(every=1))
    x = torch.randn(16)
    torch.manual_seed(3)
    out = guarded(x)
    after = torch.rand(4)
    torch.manual_seed(3)
    torch.testing.assert_close(out, noisy(x), rtol=0, atol=0)
    torch.testing.assert_close(after, torch.rand(4), rtol=0, atol=0)


def test_a_write_into_a_parameter_is_seen_on_the_first_run() -> None:
    """Parameters are not copied for a graph without in-place ops (a model's weights
    twice may not fit): a compiled write into one is seen by its version and trips."""

    def into_weights(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            out = gm.forward(*args)
            with torch.no_grad():
                for a in args:
                    if isinstance(a, torch.nn.Parameter):
                        a.mul_(1.0)  # a write, even of the same values
            return out

        return run

    model = torch.nn.Linear(4, 2)
    guarded = safe_compile(model, backend=into_weights, shadow=Shadow(every=1))
    guarded(torch.randn(3, 4))
    assert guarded.safecompile.state is State.ROLLED_BACK
    breach = next(e for e in guarded.safecompile.events() if e.kind is EventKind.BREACH)
    assert "parameter" in str(breach.message)


def test_later_runs_take_the_common_path() -> None:
    """Once a graph's first run showed nothing wrong, its compiled code runs on the
    caller's tensors, and the protection is never paid again."""
    backend = RecordingBackend()
    guarded = safe_compile(sin_and_view, backend=backend, shadow=None)
    x = torch.randn(4)
    for _ in range(3):
        guarded(x)
    stats = guarded.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls, backend.runs) == (3, 0, 3)


def test_without_protection_the_first_call_is_corrupted() -> None:
    """What the protection prevents (``PROTECT_FIRST_RUNS`` off, as bench/first_call.py
    sets it for its baseline): the caller's input is written."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graphs, "PROTECT_FIRST_RUNS", False)
        guarded = safe_compile(sin_and_view, backend=add_before, shadow=Shadow(every=1))
        x = torch.zeros(4)
        guarded(x)
    assert not torch.equal(x, torch.zeros(4))


# ---------------------------------------------------------------- fuzz-like


def with_break(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = (x * y).relu_()
    torch._dynamo.graph_break()
    return a + x, y[::2]


def in_place_and_view(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y.mul_(2)
    return (x * y).sum(0), y.view(-1)


def aliased(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.tanh() + y.cos()


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "with_break": with_break,
    "in_place_and_view": in_place_and_view,
    "aliased": aliased,
}


def make_inputs(name: str, seed: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A leaf and the function's arguments made from it (``aliased`` gets one tensor's
    two views, so a copy must keep them aliased)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 4, generator=g).requires_grad_()
    if name == "aliased":
        base = w.detach().clone()
        return w, (base[0], base[:, 0])
    return w, (w * 1.5, torch.randn(4, 4, generator=g))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("backend", [*sorted(WRITERS), "honest"])
@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_fuzz_the_first_call_matches_eager(function: str, backend: str, seed: int) -> None:
    fn = FUNCTIONS[function]
    ref_w, ref_args = make_inputs(function, seed)
    ref_out = fn(*ref_args)
    ref_leaves = [t for t in torch.utils._pytree.tree_leaves(ref_out) if t.requires_grad]
    if ref_leaves:
        sum(t.sum() for t in ref_leaves).backward()  # type: ignore[union-attr]

    guarded = safe_compile(
        fn, backend=WRITERS.get(backend, honest), shadow=Shadow(every=1, mode="sync")
    )
    w, args = make_inputs(function, seed)
    out = guarded(*args)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for got, want in zip(args, ref_args, strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=0)
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if t.requires_grad]
    assert len(leaves) == len(ref_leaves)
    if leaves:
        sum(t.sum() for t in leaves).backward()  # type: ignore[union-attr]
        torch.testing.assert_close(w.grad, ref_w.grad, rtol=0, atol=0)
    if function == "aliased":  # still two views of one tensor
        assert args[0].untyped_storage().data_ptr() == args[1].untyped_storage().data_ptr()


@pytest.mark.inductor
def test_inductors_first_run_on_copies_keeps_eagers_input_and_update() -> None:
    """Inductor's code runs on the storage copies (offsets, strides and aliasing kept):
    an in-place update of the user's own is made once, on the caller's tensor."""

    def update(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        total[1:].add_(x.t()[0])
        return (total * 2).sum()

    guarded = safe_compile(update, backend="inductor", shadow=Shadow(every=1))
    base = torch.zeros(6)
    total = base[1:]  # a view with an offset
    x = torch.arange(16.0).reshape(4, 4)
    for n in (1, 2):
        out = guarded(x, total)
        torch.testing.assert_close(total[1:], n * x.t()[0])
        torch.testing.assert_close(out, (2 * n * x.t()[0]).sum())
    assert guarded.safecompile.stats().rollbacks == 0


def test_the_inputs_a_graph_writes_are_read_from_its_code() -> None:
    """An in-place op on an input or a view of one counts; one on a tensor the graph made
    does not (an activation's ``relu_``): a parameter is copied only when written."""

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = torch.relu_(x @ w)
        x[0].add_(1)
        b.t().mul_(2)
        return y

    gm = torch.fx.symbolic_trace(f)
    assert facts.written_inputs(gm) == frozenset({0, 2})
    assert facts.written_inputs(torch.fx.symbolic_trace(sin_and_view)) == frozenset()


def test_a_parameter_the_users_code_updates_is_updated_once() -> None:
    """An optimizer-like step: the parameter it updates is copied for the compiled run,
    and the eager run updates the caller's once."""

    def sgd(p: torch.nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p.sub_(0.5 * grad)
        return p.sum()

    p = torch.nn.Parameter(torch.ones(4))
    guarded = safe_compile(sgd, backend="aot_eager", shadow=None)
    for n in (1, 2):
        guarded(p, torch.ones(4))
        torch.testing.assert_close(p.detach(), torch.full((4,), 1 - 0.5 * n))
    assert guarded.safecompile.stats().rollbacks == 0


def test_drift_on_a_buckets_first_padded_call_trips() -> None:
    """A bucket's first padded call is verified against unpadded eager on what it served
    (its graph's first run: eager's); the compiled run's drift shows in the first-run
    comparison, which trips there too."""

    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    guarded = safe_compile(
        scale,
        backend=DriftingBackend(scale=1.05),
        buckets=Buckets(dims={"x": 0}, sizes=[8]),
        dynamic=False,
        shadow=None,
    )
    x = torch.randn(5, 4)
    torch.testing.assert_close(guarded(x), x * 3, rtol=0, atol=0)
    assert guarded.safecompile.state is State.ROLLED_BACK
