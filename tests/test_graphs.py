"""Graph identity internals: randomness and in-place updates read from the ops, slots."""

from __future__ import annotations

import functools
import gc
import re
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from safecompile import Rollback, Shadow, Warmup, safe_compile
from safecompile.base.torchcompat import undisabled
from safecompile.guard.facts import mutates_in_place, random_op


def traced(fn: Callable[..., Any]) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(fn)


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda x: F.dropout(x, 0.1, False, False), None),  # nn.Dropout in eval()
        (lambda x: F.dropout(x, 0.0, True), None),
        (lambda x: F.dropout(x, p=0.5, training=True), "dropout"),
        (lambda x: F.dropout(x, 0.5), "dropout"),  # training defaults to True
        (lambda x: F.normalize(x, dim=-1), None),  # "normal" in a name is no random draw
        (lambda x: F.layer_norm(x, (4,)), None),
        (lambda x: x + torch.randn_like(x), "randn_like"),
        (lambda x: x.bernoulli_(0.5), "bernoulli_"),
        (lambda x: F.rrelu(x, training=False), None),
        (lambda x: F.rrelu(x, training=True), "rrelu"),
        (lambda q: F.scaled_dot_product_attention(q, q, q), None),
        (
            lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1),
            "scaled_dot_product_attention",
        ),
    ],
)
def test_random_op_reads_the_ops_and_their_arguments(
    fn: Callable[..., Any], expected: str | None
) -> None:
    """A graph draws random numbers by ATen's own tag; dropout only with p > 0 in training."""
    assert random_op(traced(fn)) == expected


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda x: x * 2 + 1, False),
        (lambda x: x.add_(1), True),
        (lambda x: F.relu(x, inplace=True), True),
        (lambda x, m, v: F.batch_norm(x, m, v, training=True), True),
        (lambda x, m, v: F.batch_norm(x, m, v, training=False), False),
    ],
)
def test_mutates_in_place_spots_in_place_updates(fn: Callable[..., Any], expected: bool) -> None:
    """In-place ops (and batch norm's running statistics while training) are updates."""
    assert mutates_in_place(traced(fn)) is expected


def test_ended_threads_fold_their_counts() -> None:
    """Calls from many short-lived threads are all counted, and their slots do not pile up."""
    g = safe_compile(lambda x: x + 1, backend="eager", shadow=None)
    x = torch.ones(2)
    g(x)
    ended: list[weakref.ref[threading.Thread]] = []
    for _ in range(20):
        t = threading.Thread(target=g, args=(x,))
        t.start()
        t.join()
        ended.append(weakref.ref(t))
    del t
    stats = g.safecompile.stats()
    assert stats.calls == 21 == stats.compiled_calls + stats.eager_calls
    gc.collect()
    assert [ref for ref in ended if ref() is not None] == []  # the guard holds none of them


def test_background_inductor_warmup_closes_the_symbolic_trace_window() -> None:
    """inductor's one-time symbolic_trace (which patches nn.Module.__call__ process-wide)
    runs before a background warmup starts, never beside a live eager call."""
    from torch._inductor.loop_body import InterpreterShim

    InterpreterShim._dummy_gm.cache_clear()
    g = safe_compile(lambda x: x + 1, backend="inductor", warmup=Warmup(inputs=[], background=True))
    assert g.safecompile.wait_warm(10)
    assert InterpreterShim._dummy_gm.cache_info().currsize == 1


def test_a_comparison_that_fails_answers_with_eager() -> None:
    """An error while comparing (here from the declared comparison) never reaches the
    caller: eager's answer stands."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("cannot compare")

    g = safe_compile(lambda x: x * 3, backend="eager", shadow=Shadow(compare=broken))
    x = torch.ones(3)
    torch.testing.assert_close(g(x), x * 3)
    stats = g.safecompile.stats()
    assert stats.calls == stats.eager_calls == 1
    assert stats.rollbacks == 0
    assert any("could not be compared" in (e.message or "") for e in g.safecompile.events())


def _scale(x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    return (x * n).sum(1) + y.sum(1)


def test_graph_inputs_read_without_torchs_symbol_names() -> None:
    """A dim that varies reads as a letter (equal dims the same letter), the sizes dynamo
    lifts out of tensors are not listed, and an int that varies reads ``int``."""
    g = safe_compile(_scale, backend="eager", shadow=None, name="tests.scale")
    for rows, cols in ((3, 4), (5, 6), (7, 8)):
        g(torch.randn(rows, cols), torch.randn(rows, 2), rows)
    texts = [graph["inputs"] for graph in g.safecompile.report()["graphs"]]
    assert texts[0] == "3x4:float32, 3x2:float32"
    assert sorted(texts[-1].split(", ")) == ["Nx2:float32", "NxM:float32", "int"]
    assert not any(re.search(r"\bs\d+|SymInt", t) for t in texts), texts


def test_a_graphs_calls_count_every_run_across_its_checks() -> None:
    """The wrapper counts runs down between checks: the calls a graph reports are every
    run, checked or not, and recompile-limited graphs count too."""
    g = safe_compile(
        lambda x: x * 2,
        backend="eager",
        shadow=Shadow(canary=2, every=3),
        rollback=Rollback(slower_ratio=None, max_recompiles=1),
        dynamic=False,
    )
    for _ in range(20):
        g(torch.randn(4))
    for _ in range(5):
        g(torch.randn(5))  # a second shape, past max_recompiles: its traced graph, eagerly
    graphs = g.safecompile.report()["graphs"]
    assert [(r["compiled"], r["calls"]) for r in graphs] == [(True, 20), (False, 5)]
    assert graphs[0]["checks"] >= 2 + 5
    stats = g.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls, stats.recompile_limit_calls) == (20, 5, 5)


_WRAPPER_IDS = hasattr(torch._dynamo.disable(lambda: None), "_torchdynamo_wrapper_id")


@pytest.mark.skipif(not _WRAPPER_IDS, reason="torch 2.9: disable wrappers carry no id")
def test_the_graph_wrapper_calls_a_disabled_artifact_without_its_own_disable_wrapper() -> None:
    # Inductor hands back its artifact inside torch._dynamo.disable; dynamo wraps the
    # backend's callable in another one, so the inner one is left out of the hot path.
    callers: list[str] = []
    tracing: list[bool] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        def artifact(*args: Any) -> Any:
            callers.append(sys._getframe(1).f_code.co_name)
            tracing.append(torch.compiler.is_compiling())
            return gm.forward(*args)

        return torch._dynamo.disable(artifact, reason="like inductor's artifact")

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    guarded = safe_compile(f, backend=backend, shadow=None, name="undisabled")
    x = torch.arange(4.0)
    for _ in range(3):
        torch.testing.assert_close(guarded(x), f(x))
    stats = guarded.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls) == (3, 0), stats
    # called by the graph wrapper itself (its first run on copies, then the common path)
    assert callers == ["_first_run", "run", "run"], callers
    assert not any(tracing)  # dynamo's own disable still covers it


@pytest.mark.skipif(not _WRAPPER_IDS, reason="torch 2.9: disable wrappers carry no id")
def test_undisabled_takes_off_only_recursive_disable_wrappers() -> None:
    def plain(x: int) -> int:
        return x

    once = torch._dynamo.disable(plain)
    assert undisabled(torch._dynamo.disable(once)) is plain
    assert undisabled(plain) is plain
    shallow = torch._dynamo.disable(plain, recursive=False)  # skips only its own frame
    assert undisabled(shallow) is shallow

    @functools.wraps(once)
    def users(x: int) -> int:  # a user's wrapper copies the attributes: it is kept
        return once(x) + 1

    assert undisabled(users) is users


def test_undisabled_keeps_a_wrapper_it_cannot_tell_is_torchs() -> None:
    # torch 2.9 sets no wrapper id: nothing is taken off there (correct, only not faster)
    def plain(x: int) -> int:
        return x

    def look_alike(x: int) -> int:
        return plain(x)

    look_alike._torchdynamo_disable = True  # type: ignore[attr-defined]
    look_alike._torchdynamo_orig_callable = plain  # type: ignore[attr-defined]
    assert undisabled(look_alike) is look_alike
