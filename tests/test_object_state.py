"""Shadow checks of calls that update Python objects, and a state that says what was checked.

A graph whose frame updates an object it was given or reached (a KV cache layer, a
config attribute, a list, a global) is checked like any other: the objects dynamo's
side-effect record names are copied before the compiled run, eager reruns on the copy,
and outputs and updates are compared. A passing check leaves the compiled run's state,
a breach eager's. What cannot be copied is not checked, with one event naming it, and the
callable's state reads ``unchecked`` while such a graph serves.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from safecompile import EventKind, Shadow, State, Warmup, safe_compile
from safecompile.base import torchcompat
from safecompile.checks.snapshot import Snapshot
from safecompile.testing import DriftingBackend, RecordingBackend


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def skipped(fn: Any) -> list[str | None]:
    return [e.message for e in fn.safecompile.events() if e.kind is EventKind.SHADOW_SKIPPED]


class Config:
    """A transformers-like config: a plain object with attributes."""

    def __init__(self) -> None:
        self.problem_type: str | None = None


class Classifier(torch.nn.Module):
    """The BERT classifier's pattern: the first call sets ``config.problem_type``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = Config()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None:
            self.config.problem_type = "single_label_classification"
        return self.linear(x)


class Cache:
    """A KV cache in the style of a transformers ``DynamicLayer``: tensors rebound."""

    def __init__(self) -> None:
        self.keys = torch.zeros(1, 4)


def decode(x: torch.Tensor, cache: Cache) -> torch.Tensor:
    cache.keys = torch.cat([cache.keys, x])
    return cache.keys.sum(0)


def step_argmax(x: torch.Tensor, cache: Cache) -> torch.Tensor:
    """An integer output: a drift in floats shows only in the cache it updates."""
    cache.keys = torch.cat([cache.keys, x * 2])
    return x.argmax(-1)


def append_to(x: torch.Tensor, seen: list[torch.Tensor]) -> torch.Tensor:
    seen.append(x * 2)
    return x + 1


SEEN: list[torch.Tensor] = []


def append_global(x: torch.Tensor) -> torch.Tensor:
    SEEN.append(x.sum())
    return x * 3


def test_the_config_store_of_a_classifier_is_checked_not_skipped() -> None:
    """The issue's reproducer: ``checks 0, skipped 1`` before; now every call is checked."""
    model = Classifier()
    guarded = safe_compile(model, backend="aot_eager", shadow=Shadow(canary=3, every=1))
    x = torch.randn(2, 4)
    for _ in range(3):
        torch.testing.assert_close(guarded(x), model.linear(x))
    stats = guarded.safecompile.stats()
    assert (stats.shadow_checks, stats.shadow_skipped) == (3, 0), skipped(guarded)
    assert model.config.problem_type == "single_label_classification"
    assert guarded.safecompile.state is State.COMPILED


def test_a_list_argument_is_updated_once_and_checked() -> None:
    guarded = safe_compile(append_to, backend="eager", shadow=Shadow(canary=2, every=1))
    seen: list[torch.Tensor] = []
    x = torch.randn(3)
    for n in (1, 2, 3):
        torch.testing.assert_close(guarded(x, seen), x + 1)
        assert len(seen) == n  # eager's rerun did not append a second time
    torch.testing.assert_close(seen[-1], x * 2)
    stats = guarded.safecompile.stats()
    assert (stats.shadow_checks, stats.shadow_skipped) == (3, 0), skipped(guarded)


def test_a_global_list_is_updated_once_and_checked() -> None:
    SEEN.clear()
    guarded = safe_compile(append_global, backend="eager", shadow=Shadow(canary=2, every=1))
    x = torch.randn(3)
    for n in (1, 2):
        torch.testing.assert_close(guarded(x), x * 3)
        assert len(SEEN) == n
    stats = guarded.safecompile.stats()
    assert (stats.shadow_checks, stats.shadow_skipped) == (2, 0), skipped(guarded)


class KeepOutputs(RecordingBackend):
    """Runs graphs as captured and keeps the tensors each run returned."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[Any] = []

    def run(self, inner: Any, args: tuple[Any, ...]) -> Any:
        out = inner(*args)
        self.outputs.append(out)
        return out


def test_a_passing_check_leaves_the_compiled_runs_state() -> None:
    """After a passing check the cache holds the tensor the compiled run made, the one its
    outputs came with, not eager's copy of it."""
    backend = KeepOutputs()
    guarded = safe_compile(decode, backend=backend, shadow=Shadow(canary=4, every=1))
    cache = Cache()
    x = torch.randn(1, 4)
    for length in (2, 3, 4):
        guarded(x, cache)
        assert cache.keys.shape == (length, 4)
        if length < 4:  # a graph's first run (a static one, then a dynamic one) is eager's
            continue
        produced = [t for t in backend.outputs[-1] if isinstance(t, torch.Tensor)]
        assert any(cache.keys is t for t in produced)
    assert guarded.safecompile.stats().shadow_checks == 3


def test_drift_in_the_updated_object_alone_is_caught_and_eager_state_kept() -> None:
    """The output is an integer (unchanged by the drift); the cache update drifts: the
    check compares the update, trips, and the caller's cache holds eager's values."""
    # runs 1 and 2 are the first runs of a static graph, then a dynamic one (the cache
    # grows), checked on their own; the third is the dynamic graph's second run
    backend = DriftingBackend(scale=1.05, from_run=3)
    guarded = safe_compile(step_argmax, backend=backend, shadow=Shadow(canary=3, every=1))
    cache = Cache()
    x = torch.randn(1, 4)
    for _ in range(3):
        out = guarded(x, cache)
    torch.testing.assert_close(out, x.argmax(-1))
    torch.testing.assert_close(cache.keys, torch.cat([torch.zeros(1, 4), x * 2, x * 2, x * 2]))
    stats = guarded.safecompile.stats()
    assert stats.shadow_breaches == 1
    assert guarded.safecompile.state is State.ROLLED_BACK
    breach = [e.message for e in guarded.safecompile.events() if e.kind is EventKind.BREACH]
    assert "Python objects it updates differ" in str(breach[0])
    assert "L['cache']" in str(breach[0])


def test_an_object_that_cannot_be_found_is_unchecked_with_one_event_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def lost(*args: Any) -> Any:
        """torch's reading of a named object back from the running frame fails."""
        raise KeyError("cache")

    monkeypatch.setattr(torchcompat, "source_value", lost)
    guarded = safe_compile(decode, backend="eager", shadow=Shadow(canary=3, every=1))
    cache = Cache()
    x = torch.randn(1, 4)
    for length in (2, 3, 4):
        guarded(x, cache)
        assert cache.keys.shape == (length, 4)  # never applied twice
    stats = guarded.safecompile.stats()
    assert stats.shadow_checks == 0
    messages = skipped(guarded)  # one per graph (a static one, then a dynamic one)
    assert len(messages) == stats.graphs == 2
    assert all("L['cache']" in str(m) for m in messages)
    assert guarded.safecompile.state is State.UNCHECKED
    assert (stats.graphs_unchecked, stats.graphs_checked) == (2, 0)
    graph = guarded.safecompile.report()["graphs"][0]
    assert graph["check"] == "unchecked"
    assert "cannot be copied" in graph["unchecked"]


# ---------------------------------------------------------------------------- the state


class DropoutNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.linear(x))


def test_a_graph_that_cannot_be_checked_makes_the_state_unchecked_not_compiled() -> None:
    """Dropout while training: compiled and eager draw different numbers, so its graph is
    never checked; the state says so instead of ``compiled``, until it stops serving."""
    net = DropoutNet().train()
    guarded = safe_compile(net, backend="eager", shadow=Shadow(canary=2, every=0))
    x = torch.randn(2, 4)
    guarded(x)
    assert guarded.safecompile.state is State.UNCHECKED
    report = guarded.safecompile.report()
    assert report["state"] == "unchecked"
    assert [g["check"] for g in report["graphs"]] == ["unchecked"]
    assert report["stats"]["graphs_unchecked"] == 1
    net.eval()  # a second graph, checkable; the first still serves training calls
    for _ in range(2):
        guarded(x)
    stats = guarded.safecompile.stats()
    assert (stats.graphs_checked, stats.graphs_unchecked, stats.graphs_not_yet_checked) == (1, 1, 0)
    assert guarded.safecompile.state is State.UNCHECKED
    guarded.safecompile.reset()
    guarded(x)  # eval only now: canary, then compiled
    assert guarded.safecompile.state is State.CANARY
    guarded(x)
    assert guarded.safecompile.state is State.COMPILED


def test_without_shadow_checks_nothing_reads_unchecked() -> None:
    """``shadow=None`` is the user's choice: no graph is counted as unchecked."""
    net = DropoutNet().train()
    guarded = safe_compile(net, backend="eager", shadow=None)
    guarded(torch.randn(2, 4))
    assert guarded.safecompile.state is State.COMPILED
    assert guarded.safecompile.report()["graphs"][0]["check"] == "off"


class HeldBackend(RecordingBackend):
    """Every compile after the first waits for ``go`` (a background warmup held mid-way)."""

    def __init__(self) -> None:
        super().__init__()
        self.held = threading.Event()
        self.go = threading.Event()

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        if len(self.graphs) > 1:
            self.held.set()
            if not self.go.wait(30):
                raise TimeoutError("the test never let the compile finish")
        return gm.forward


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_the_state_flips_when_live_calls_take_the_compiled_path() -> None:
    """A background warmup has compiled one graph and is compiling the next: live calls
    still run eager, so the state is still ``warming``; once the warmup is done, the very
    next call runs compiled, and the state says so."""
    backend = HeldBackend()
    guarded = safe_compile(
        double,
        backend=backend,
        shadow=Shadow(canary=1, every=0),
        dynamic=False,
        warmup=Warmup(inputs=[(torch.randn(2),), (torch.randn(3),)], background=True),
    )
    assert backend.held.wait(60)  # one graph compiled, the second held
    assert guarded.safecompile.report()["stats"]["graphs"] == 1
    x = torch.randn(2)
    torch.testing.assert_close(guarded(x), x * 2)
    assert guarded.safecompile.stats().eager_calls == 1  # live calls run eager ...
    assert guarded.safecompile.state is State.WARMING  # ... and the state says so
    backend.go.set()
    assert guarded.safecompile.wait_warm(60)
    state = guarded.safecompile.state
    assert state is State.COMPILED  # the warmup checked both graphs' canaries
    runs = backend.runs
    torch.testing.assert_close(guarded(x), x * 2)
    assert backend.runs == runs + 1  # the first call after the flip ran compiled
    assert guarded.safecompile.stats().compiled_calls == 1


def test_a_side_effect_record_that_cannot_be_read_leaves_the_graph_unchecked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If torch's record of side effects cannot be read, nothing says what a check must
    put back: the graph is not checked (one event), never rerun on doubled state."""

    real = torchcompat.side_effects

    def unreadable() -> Any:
        """dynamo's record, its entries in a shape the guard cannot read (a torch that
        changed them)."""
        record = real()
        if isinstance(record, torchcompat.SideEffects) and record.modified:
            return record._replace(modified=[object() for _ in record.modified])
        return record

    monkeypatch.setattr(torchcompat, "side_effects", unreadable)
    seen: list[torch.Tensor] = []
    guarded = safe_compile(append_to, backend="eager", shadow=Shadow(canary=2, every=1))
    guarded(torch.randn(3), seen)
    assert len(seen) == 1
    assert guarded.safecompile.stats().shadow_checks == 0
    assert guarded.safecompile.state is State.UNCHECKED
    assert "record of side effects" in str(skipped(guarded)[0])


# ---------------------------------------------------------------- module attributes


class Tracker(torch.nn.Module):
    """Keeps plain attributes: a call counter, a cached tensor and a text it rebinds."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.last: torch.Tensor | None = None
        self.mode = "fresh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last = x * 2
        self.mode = "seen"
        return x.argmax(-1)


def test_module_attributes_are_updated_once_and_the_compiled_runs_are_kept() -> None:
    """A passing check reruns eager on the attributes as they were, then leaves the
    compiled run's: the counter moves once per call, the cached tensor is compiled's."""
    backend = KeepOutputs()
    model = Tracker()
    guarded = safe_compile(model, backend=backend, shadow=Shadow(canary=3, every=1))
    x = torch.randn(2, 4)
    for n in (1, 2, 3):
        torch.testing.assert_close(guarded(x), x.argmax(-1))
        assert model.calls == n
        assert model.mode == "seen"
        assert model.last is not None
        torch.testing.assert_close(model.last, x * 2)
        if n > 1:  # the graph's first run left eager's
            assert any(model.last is t for t in backend.outputs[-1])
    stats = guarded.safecompile.stats()
    assert (stats.shadow_checks, stats.shadow_breaches) == (3, 0), skipped(guarded)


def test_drift_in_a_module_attribute_alone_is_caught_and_eager_attributes_kept() -> None:
    """The output is an integer (unchanged by the drift); the cached tensor drifts: the
    check compares it, trips, and the module holds eager's attributes, on the breaching
    call and on the eager calls after the rollback."""
    model = Tracker()
    guarded = safe_compile(  # drifting from the graph's second run, past its first run
        model, backend=DriftingBackend(scale=1.05, from_run=2), shadow=Shadow(canary=2, every=1)
    )
    x = torch.randn(2, 4)
    for n in (1, 2):
        torch.testing.assert_close(guarded(x), x.argmax(-1))
        assert (model.calls, model.mode) == (n, "seen")
        assert model.last is not None
        torch.testing.assert_close(model.last, x * 2, rtol=0, atol=0)
    assert guarded.safecompile.state is State.ROLLED_BACK
    breach = [e.message for e in guarded.safecompile.events() if e.kind is EventKind.BREACH]
    assert "Python objects it updates differ" in str(breach[0])
    assert "last" in str(breach[0])


class Recorder(torch.nn.Module):
    """Keeps the last input's double in a buffer it rebinds."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(2, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x * 2
        return x.argmax(-1)


def test_drift_in_a_rebound_buffer_alone_is_caught_and_eager_buffer_kept() -> None:
    model = Recorder()
    guarded = safe_compile(  # drifting from the graph's second run, past its first run
        model, backend=DriftingBackend(scale=1.05, from_run=2), shadow=Shadow(canary=2, every=1)
    )
    x = torch.randn(2, 4)
    for _ in range(2):
        torch.testing.assert_close(guarded(x), x.argmax(-1))
    torch.testing.assert_close(model.last, x * 2, rtol=0, atol=0)
    assert "last" in dict(model.named_buffers())
    assert guarded.safecompile.state is State.ROLLED_BACK
    breach = [e.message for e in guarded.safecompile.events() if e.kind is EventKind.BREACH]
    assert "Recorder._buffers" in str(breach[0])


def test_a_buffer_eager_alone_rebinds_is_compared_and_put_back_on_a_pass() -> None:
    """Eager may take a path the compiled run did not: a buffer only eager rebound is
    compared too, and a pass leaves what the compiled run left."""
    model = Recorder()
    before = model.last
    snapshot = Snapshot.take((), model, copy=False)
    after = snapshot.swap_back()  # the compiled run changed nothing
    model.last = torch.ones(2, 4)  # eager rebinds the buffer
    after = snapshot.settle(after)
    compiled, eager = after.object_states()
    assert compiled == {"Recorder._buffers": {"last": before}}
    assert eager["Recorder._buffers"]["last"] is model.last
    after.keep_compiled()
    assert model.last is before
