"""Every form of safe_compile: decorator, call, module in place, methods."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

import safecompile
from safecompile import Guarded, State, safe_compile
from safecompile.testing import RecordingBackend


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_bare_decorator_compiles_with_default_name(x: torch.Tensor) -> None:
    """@safe_compile with no arguments guards the function under its qualified name."""

    @safe_compile
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    assert isinstance(f, Guarded)
    assert (
        f.safecompile.name
        == f"{__name__}.test_bare_decorator_compiles_with_default_name.<locals>.f"
    )
    assert f.safecompile.state == State.PENDING
    assert f.__name__ == "f"


def test_decorator_with_options_and_call_form(x: torch.Tensor) -> None:
    """@safe_compile(...) and safe_compile(fn, ...) both guard and pass torch.compile's options."""
    backend = RecordingBackend()
    g = safe_compile(double, backend=backend, shadow=None, name="ranker.double")
    torch.testing.assert_close(g(x), x * 2)
    assert backend.compiles == 1
    assert g.safecompile.name == "ranker.double"
    assert g.safecompile.state == State.COMPILED

    @safe_compile(backend="eager", shadow=None)
    def h(x: torch.Tensor) -> torch.Tensor:
        return x - 1

    torch.testing.assert_close(h(x), x - 1)
    assert h.safecompile.stats().compiled_calls == 1


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)
        self.register_buffer("scale", torch.ones(3))
        self.tag = "kept"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_module_is_guarded_in_place(x: torch.Tensor) -> None:
    """A module keeps identity, type, attributes and state_dict keys; calls go through the guard."""
    net = Net()
    keys = list(net.state_dict())
    backend = RecordingBackend()
    out = safe_compile(net, backend=backend, shadow=None)
    assert out is net
    assert type(net) is Net
    assert net.tag == "kept"
    assert list(net.state_dict()) == keys
    assert not any(k.startswith("_orig_mod") for k in net.state_dict())
    torch.testing.assert_close(net(x), Net.forward(net, x))
    assert backend.compiles == 1
    assert net.safecompile.name == f"{Net.__module__}.Net.forward"
    assert net.safecompile.stats().compiled_calls == 1
    net.load_state_dict(net.state_dict())  # checkpoints round-trip


def test_module_hooks_still_run(x: torch.Tensor) -> None:
    """Forward hooks registered on a guarded module still fire."""
    net = safe_compile(Net(), backend="eager", shadow=None)
    seen: list[tuple[int, ...]] = []
    net.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    net(x)
    assert seen == [(4, 3)]


def test_method_in_class_body(x: torch.Tensor) -> None:
    """On a method, the guard binds like a function and serves every instance."""

    class Scorer:
        def __init__(self, k: float) -> None:
            self.k = k

        @safe_compile(backend="eager", shadow=None)
        def score(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.k

    a, b = Scorer(2.0), Scorer(3.0)
    torch.testing.assert_close(a.score(x), x * 2)
    torch.testing.assert_close(b.score(x), x * 3)
    assert a.score.safecompile is Scorer.score.safecompile
    assert Scorer.score.safecompile.name.endswith("Scorer.score")
    assert Scorer.score.safecompile.stats().calls == 2


def test_module_class_with_guarded_forward(x: torch.Tensor) -> None:
    """@safe_compile on forward in the class body guards module(x)."""

    class Tiny(torch.nn.Module):
        @safe_compile(backend="eager", shadow=None)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.relu()

    m = Tiny()
    torch.testing.assert_close(m(x), x.relu())
    assert Tiny.forward.safecompile.stats().compiled_calls == 1


def test_double_guard_refused() -> None:
    """Guarding twice is a mistake and says so."""
    g = safe_compile(double, backend="eager")
    with pytest.raises(TypeError, match="already guarded"):
        safe_compile(g)
    net = safe_compile(Net(), backend="eager")
    with pytest.raises(TypeError, match="already guarded"):
        safe_compile(net)


def test_async_and_generator_refused() -> None:
    """Async functions and generators get a clear TypeError at decoration time."""

    async def coro(x: torch.Tensor) -> torch.Tensor:
        return x

    def gen(x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield x

    async def agen(x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield x

    with pytest.raises(TypeError, match="async function"):
        safe_compile(coro)
    with pytest.raises(TypeError, match="generator function"):
        safe_compile(gen)
    with pytest.raises(TypeError, match="async function"):
        safe_compile(agen)


def test_report_is_json_serialisable(x: torch.Tensor) -> None:
    """report() is plain JSON: state, stats, events, graphs."""
    g = safe_compile(double, backend="eager", shadow=None, name="r")
    g(x)
    g.safecompile.rollback()
    report = json.loads(json.dumps(g.safecompile.report()))
    assert report["name"] == "r"
    assert report["state"] == "rolled_back"
    assert report["stats"]["calls"] == 1
    assert report["events"][-1]["reason"] == "manual"
    assert len(report["graphs"]) == 1
    assert report["graphs"][0]["calls"] == 1


def test_stats_are_frozen_snapshots(x: torch.Tensor) -> None:
    """stats() hands out a frozen snapshot that does not change under later calls."""
    g = safe_compile(double, backend="eager", shadow=None)
    g(x)
    snap = g.safecompile.stats()
    g(x)
    assert snap.calls == 1
    assert g.safecompile.stats().calls == 2
    with pytest.raises(AttributeError):
        snap.calls = 5  # type: ignore[misc]


def test_deepcopy_and_pickle_of_a_guarded_module_are_plain_modules(x: torch.Tensor) -> None:
    """A deep copy (EMA, export) or pickle of a guarded module is an unguarded module of
    the same class, computing with its own weights; it can be guarded again."""
    import copy
    import io

    net = safe_compile(Net(), backend="eager", shadow=None)
    net(x)
    twin = copy.deepcopy(net)
    assert type(twin) is Net
    assert twin.safecompile is None
    with torch.no_grad():
        twin.lin.weight.add_(1.0)
    torch.testing.assert_close(twin(x), Net.forward(twin, x))
    assert not torch.allclose(twin(x), net(x))
    assert net.safecompile.stats().calls == 2  # the copy never went through the original's guard
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), net(x))
    again = safe_compile(twin, backend="eager", shadow=None)
    torch.testing.assert_close(again(x), Net.forward(twin, x))
    assert again.safecompile.stats().calls == 1


class FrameProbe(torch.nn.Module):
    """Notes which of safecompile's frames are on the stack when ``forward`` runs."""

    ours: list[str]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        package = str(Path(safecompile.__file__).parent)
        frame = sys._getframe(1)
        self.ours = []
        while frame is not None:
            if frame.f_code.co_filename.startswith(package):
                self.ours.append(frame.f_code.co_name)
            frame = frame.f_back
        return x + 1


def test_a_guarded_module_served_eager_adds_one_frame(x: torch.Tensor) -> None:
    """``Module.__call__`` reaches the guarded function with no frame of ours in between:
    switched off, a guarded module's call has the guarded function's frame alone."""
    net = safe_compile(FrameProbe(), backend="eager", shadow=None)
    safecompile.disable()
    torch.testing.assert_close(net(x), x + 1)
    assert net.ours == ["guarded"]
    assert inspect.signature(net.forward) == inspect.signature(FrameProbe.forward.__get__(net))
