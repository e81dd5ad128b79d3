"""Many threads on one guarded callable: single-flight compiles, consistent stats, no deadlock."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from safecompile import Reason, State, safe_compile
from safecompile.testing import BlockingBackend, RecordingBackend, RuntimeFailingBackend


def mlp(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ x.T).sum(0)


def test_single_flight_compile_others_run_eager() -> None:
    """While one thread compiles a shape, others run eager instead of compiling it again."""
    backend = BlockingBackend()
    g = safe_compile(mlp, backend=backend, shadow=None)
    x = torch.randn(8, 8)
    first = threading.Thread(target=g, args=(x,))
    first.start()
    assert backend.started.wait(30)
    assert g.safecompile.state == State.WARMING
    for _ in range(5):  # served eager, not blocked behind the compile
        torch.testing.assert_close(g(x), mlp(x))
    assert g.safecompile.stats().eager_calls == 5
    backend.release()
    first.join(30)
    assert backend.compiles == 1
    g(x)
    stats = g.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls, stats.compiles) == (2, 5, 1)


def test_eight_threads_with_injected_failures_stay_consistent() -> None:
    """8 threads, compiled code failing at run 20: every answer is right, stats add up."""
    backend = RuntimeFailingBackend(on_run=20)
    g = safe_compile(mlp, backend=backend, shadow=None)
    inputs = [torch.randn(8, 8) for _ in range(8)]

    def worker(i: int) -> int:
        bad = 0
        for _ in range(50):
            x = inputs[i]
            if not torch.allclose(g(x), mlp(x)):
                bad += 1
        return bad

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(worker, range(8))) == 0
    stats = g.safecompile.stats()
    assert stats.calls == 400
    assert stats.calls == stats.compiled_calls + stats.eager_calls
    assert g.safecompile.state == State.ROLLED_BACK
    assert stats.rollbacks == 1
    assert stats.last_rollback is not None
    assert stats.last_rollback.reason == Reason.RUNTIME_ERROR


def test_threads_compiling_many_shapes_compile_each_once() -> None:
    """Threads racing on new shapes never compile one shape twice.

    torch does not de-duplicate concurrent compiles of one new signature (and 2.13 can
    miss its own cache under concurrent calls): the guard's backend hands every such
    twin the graph compiled first.
    """
    backend = RecordingBackend()
    g = safe_compile(mlp, backend=backend, shadow=None, dynamic=False)
    shapes = [torch.randn(n, 4) for n in (2, 3, 4)]

    def worker(_: int) -> None:
        for _ in range(30):
            for x in shapes:
                g(x)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(worker, range(8)))
    stats = g.safecompile.stats()
    assert stats.compiles == 3
    assert backend.compiles == stats.graphs == 3
    assert stats.calls == 8 * 30 * 3  # no call lost or counted twice across threads
    # each compiled call ran exactly one compiled graph: the guard's count is the backend's
    assert stats.compiled_calls == backend.runs
    assert stats.compiled_calls > 0


def picky(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 3:
        raise ValueError("no threes")
    return x + 1


def test_eager_from_the_hot_path_counts_every_threads_calls() -> None:
    """Rolled back, eager serves from the hot path: each thread counts in a slot of its own,
    made at its first call there, and a call whose eager run raises is counted too."""
    g = safe_compile(picky, backend="eager", shadow=None)
    x = torch.randn(4)
    g(x)
    g.safecompile.rollback()

    def worker(_: int) -> None:
        for _ in range(25):
            torch.testing.assert_close(g(x), x + 1)
        with pytest.raises(ValueError, match="no threes"):
            g(torch.randn(3))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(worker, range(4)))  # a worker's failure is raised here
    stats = g.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls) == (1, 4 * 26)
