"""``reset()`` forgets everything it made: repeated resets hold no more objects."""

from __future__ import annotations

import gc
import sys
import types
from collections import Counter
from typing import Any

import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

from safecompile import State, disable, enable, safe_compile
from safecompile.base import torchcompat
from safecompile.guard._graph_backend import GuardBackend
from safecompile.guard.graphs import GraphRecord


def _held() -> Counter[str]:
    """The objects a reset must not pile up: graph modules, our backends and graph
    records. (Collected twice: a dropped cache entry frees its compiled graph in a weak
    reference's callback, during the first collection.) Fake tensors are left out:
    torch's own caches keep a few per compile, plain ``torch.compile`` with
    ``reset_code`` as many as the guard."""
    gc.collect()
    gc.collect()
    kinds = (torch.fx.GraphModule, GuardBackend, GraphRecord)
    return Counter(
        "GraphModule" if isinstance(o, torch.fx.GraphModule) else type(o).__name__
        for o in gc.get_objects()
        if isinstance(o, kinds)
    )


class CodesSeen:
    """A backend like ``"eager"`` that notes the code object torch compiled each graph
    for (the function, or a resume function past a graph break): where torch caches it."""

    def __init__(self) -> None:
        self.codes: set[types.CodeType] = set()
        self.__name__ = "codes_seen"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        code = torchcompat.frame_code()
        assert code is not None
        self.codes.add(code)
        return gm.forward


def _entries(*codes: Any) -> int:
    return sum(len(_debug_get_cache_entry_list(code)) for code in codes)


def test_repeated_resets_hold_no_more_objects() -> None:
    """A guarded MLP on variable shapes, reset over and over: the graphs, backends,
    graph records and dynamo cache entries it holds stay flat."""
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    backend = CodesSeen()
    guarded = safe_compile(mlp, backend=backend, name="reset.mlp")

    def traffic() -> None:
        for size in (1, 2, 3, 5, 2, 1):
            x = torch.randn(size, 8)
            torch.testing.assert_close(guarded(x), mlp[2](mlp[1](mlp[0](x))))

    for _ in range(3):
        traffic()
        guarded.safecompile.reset()
    held = _held()
    for _ in range(8):
        backend.codes.clear()
        traffic()
        codes = list(backend.codes)  # compiled afresh after the reset
        assert _entries(*codes) > 0
        guarded.safecompile.reset()
        assert _entries(*codes) == 0
    after = _held()  # no more of any kind (other tests' objects may be freed meanwhile)
    assert all(after[kind] <= held[kind] for kind in after), (after, held)
    traffic()  # it still compiles and serves after all those resets
    assert guarded.safecompile.stats().compiled_calls == 6


def _with_a_break(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    torch._dynamo.graph_break()  # the rest runs in a resume function: its own code object
    return y + 1


def test_reset_drops_the_graphs_of_resume_functions_too() -> None:
    """After a graph break, the graphs torch caches on the resume function are ours too:
    reset() drops them as well as the function's own."""
    guarded = safe_compile(_with_a_break, backend="eager", name="reset.break")
    for size in (1, 2, 3):
        guarded(torch.randn(size))
    scope = vars(sys.modules[__name__])
    resumes = {v.__code__ for k, v in scope.items() if k.startswith("__resume_at")}
    assert resumes
    assert _entries(*resumes) > 0
    guarded.safecompile.reset()
    assert _entries(_with_a_break.__code__, *resumes) == 0
    torch.testing.assert_close(guarded(torch.ones(2)), torch.full((2,), 3.0))
    assert guarded.safecompile.stats().compiled_calls == 1


def test_enable_updates_state_at_once() -> None:
    """``disable()`` and ``enable()`` show in ``state`` before the next call."""
    guarded = safe_compile(lambda x: x + 1, backend="eager", name="reset.switch")
    guarded(torch.ones(2))
    assert guarded.safecompile.state is not State.DISABLED
    disable("reset.switch")
    assert guarded.safecompile.state is State.DISABLED
    enable()
    assert guarded.safecompile.state is not State.DISABLED


def test_a_reset_leaves_other_compiled_modules_alone() -> None:
    """Two guarded modules of one class: resetting one drops its graphs only (each has
    a top frame of its own; torch's shared frame would take the other's too)."""
    one, two = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    backend = CodesSeen()
    first = safe_compile(one, backend="eager", name="reset.one")
    second = safe_compile(two, backend=backend, name="reset.two")
    x = torch.randn(2, 4)
    first(x)
    second(x)
    kept = list(backend.codes)
    assert _entries(*kept) == 1
    first.safecompile.reset()
    assert _entries(*kept) == 1
    second(x)
    assert second.safecompile.stats().compiles == 1  # nothing was compiled again
