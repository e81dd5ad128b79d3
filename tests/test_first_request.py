"""No live request waits for a compile (``Warmup(background=True)``), and ``reset()``
warms up again off the request path.

The backend here holds every compile after the first ``free`` ones until the test lets
it go, so a test proves a live call returned while a compile was still in progress; a
live call that waited for it would hang, so such calls run on a thread joined with a
timeout (a bug fails the test instead of hanging it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from safecompile import Buckets, ConfigError, State, Warmup, safe_compile
from safecompile.testing import RecordingBackend

WAIT = 120.0  # seconds a bounded wait allows before the test fails (a loaded machine)


class HeldBackend(RecordingBackend):
    """Records graphs and the threads that compiled them; every compile past the first
    ``free`` waits for ``go``."""

    def __init__(self, free: int = 0) -> None:
        super().__init__()
        self.free = free
        self.threads: list[int] = []
        self.entered = threading.Event()
        self.go = threading.Event()

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.threads.append(threading.get_ident())
        if len(self.threads) > self.free:
            self.entered.set()
            if not self.go.wait(WAIT):
                raise TimeoutError("the test never let the compile finish")
        return gm.forward


def returns_in_time(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a thread: its result, or a failure if it is still running after
    30 s (it waits for a held compile, which waits up to WAIT)."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(30.0)
    assert not thread.is_alive(), "the live call waited for a compile"
    return out[0]


def settle(g: Any) -> None:
    """Wait (bounded) until no deferred compile is queued or running, as
    ``stats().extra["deferred"]["pending"]`` says (no public call waits for them)."""
    deadline = time.monotonic() + WAIT
    while g.safecompile.stats().extra["deferred"]["pending"]:
        assert time.monotonic() < deadline, "a deferred compile never finished"
        time.sleep(0.005)


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def in_background(backend: RecordingBackend, *inputs: tuple[Any, ...], **warmup: Any) -> Any:
    """``double`` guarded, static shapes, warmed up in the background on ``inputs``."""
    return safe_compile(
        double,
        backend=backend,
        dynamic=False,
        shadow=None,
        warmup=Warmup(inputs=list(inputs), background=True, **warmup),
    )


def test_a_live_call_with_a_new_shape_is_served_eager_while_its_graph_compiles() -> None:
    backend = HeldBackend(free=1)  # the warmup's graph compiles at once
    g = in_background(backend, (torch.randn(4),))
    assert g.safecompile.wait_warm(WAIT)
    x = torch.randn(7)
    torch.testing.assert_close(returns_in_time(g, x), x * 2 + 1)
    assert backend.entered.wait(WAIT)  # its graph is compiling now, held, on a worker
    assert backend.threads[-1] != threading.get_ident()
    torch.testing.assert_close(returns_in_time(g, x), x * 2 + 1)  # still compiling: eager
    stats = g.safecompile.stats()
    assert (stats.eager_calls, stats.compiled_calls) == (2, 0)
    assert stats.extra["deferred"]["queued"] == 1  # the second call queued nothing more
    backend.go.set()
    settle(g)
    assert backend.compiles == 2
    torch.testing.assert_close(g(x), x * 2 + 1)
    assert g.safecompile.stats().compiled_calls == 1  # the new graph serves now
    assert g.safecompile.state is State.COMPILED


def test_without_background_warmup_the_live_call_compiles_as_before() -> None:
    backend = RecordingBackend()
    g = safe_compile(
        double,
        backend=backend,
        dynamic=False,
        shadow=None,
        warmup=Warmup(inputs=[(torch.randn(4),)]),
    )
    assert g.safecompile.stats().extra["deferred"] is None  # nothing deferred: no queue
    g(torch.randn(7))
    assert backend.compiles == 2
    assert g.safecompile.stats().compiled_calls == 1


def test_the_lazy_first_call_is_served_eager_with_an_empty_background_warmup() -> None:
    backend = HeldBackend()
    g = safe_compile(
        double, backend=backend, shadow=None, warmup=Warmup(inputs=[], background=True)
    )
    assert g.safecompile.wait_warm(WAIT)
    x = torch.randn(5)
    torch.testing.assert_close(returns_in_time(g, x), x * 2 + 1)
    assert backend.entered.wait(WAIT)
    assert g.safecompile.state is State.WARMING  # the first graph compiles; eager serves
    backend.go.set()
    settle(g)
    torch.testing.assert_close(g(x), x * 2 + 1)
    assert g.safecompile.stats().compiled_calls == 1


def test_the_compile_runs_on_a_copy_of_the_inputs() -> None:
    """The deferred compile's own run changes nothing the caller holds."""

    def bump(x: torch.Tensor, seen: list[int]) -> torch.Tensor:
        seen.append(1)
        return x.add_(1)

    backend = HeldBackend(free=1)
    g = safe_compile(
        bump,
        backend=backend,
        dynamic=False,
        shadow=None,
        warmup=Warmup(inputs=[(torch.zeros(2), [])], background=True),
    )
    assert g.safecompile.wait_warm(WAIT)
    x, seen = torch.zeros(3), []
    returns_in_time(g, x, seen)
    backend.go.set()
    settle(g)
    assert backend.compiles >= 2
    torch.testing.assert_close(x, torch.ones(3))  # once, by the live call
    assert seen == [1]


def test_the_queue_is_bounded_and_counts_what_it_turned_away() -> None:
    backend = HeldBackend(free=1)
    g = in_background(backend, (torch.randn(4),), queue_size=1)
    assert g.safecompile.wait_warm(WAIT)
    returns_in_time(g, torch.randn(5))  # compiling (held)
    assert backend.entered.wait(WAIT)
    returns_in_time(g, torch.randn(6))  # waits in the queue
    returns_in_time(g, torch.randn(7))  # the queue is full: eager, not compiled later
    deferred = g.safecompile.stats().extra["deferred"]
    assert (deferred["queued"], deferred["full"], deferred["pending"]) == (2, 1, 2)
    backend.go.set()
    settle(g)
    assert backend.compiles == 3
    assert g.safecompile.stats().extra["deferred"]["compiled"] == 2


def test_a_resume_function_past_a_graph_break_is_deferred_too() -> None:
    def broken(x: torch.Tensor, n: int) -> torch.Tensor:
        y = x.sin()
        torch._dynamo.graph_break()
        return y * n

    backend = HeldBackend(free=2)  # the warmup's two graphs
    g = safe_compile(
        broken,
        backend=backend,
        dynamic=False,
        shadow=None,
        warmup=Warmup(inputs=[(torch.randn(4), 2)], background=True),
    )
    assert g.safecompile.wait_warm(WAIT)
    x = torch.randn(4)
    torch.testing.assert_close(returns_in_time(g, x, 3), x.sin() * 3)
    assert backend.entered.wait(WAIT)
    backend.go.set()
    settle(g)
    compiles = backend.compiles
    torch.testing.assert_close(g(x, 3), x.sin() * 3)
    assert backend.compiles == compiles  # its graphs are made: nothing compiles live


def test_a_new_bucket_is_compiled_and_verified_off_the_request_path() -> None:
    backend = HeldBackend(free=1)
    g = safe_compile(
        double,
        backend=backend,
        shadow=None,
        buckets=Buckets(dims={"x": 0}, sizes=(8, 16), strategy="pad"),
        warmup=Warmup(inputs=[], background=True),
    )
    assert g.safecompile.wait_warm(WAIT)
    small = torch.randn(5)
    torch.testing.assert_close(returns_in_time(g, small), small * 2 + 1)
    settle(g)  # the first bucket's graph was free
    big = torch.randn(12)
    torch.testing.assert_close(returns_in_time(g, big), big * 2 + 1)
    assert backend.entered.wait(WAIT)
    backend.go.set()
    settle(g)
    before = g.safecompile.stats().compiled_calls
    torch.testing.assert_close(g(big), big * 2 + 1)
    torch.testing.assert_close(g(small), small * 2 + 1)
    assert g.safecompile.stats().compiled_calls == before + 2


def test_warmup_queue_size_is_validated() -> None:
    with pytest.raises(ConfigError, match="queue_size"):
        Warmup(inputs=[], background=True, queue_size=0)


# ---------------------------------------------------------------- reset()


def test_reset_warms_up_again_in_the_background_while_eager_serves() -> None:
    backend = HeldBackend(free=1)
    x = torch.randn(4)
    g = in_background(backend, (x,))
    assert g.safecompile.wait_warm(WAIT)
    g.safecompile.reset()
    assert backend.entered.wait(WAIT)  # the warmup compiles again, held, on its worker
    assert backend.threads[-1] != threading.get_ident()
    assert g.safecompile.state is State.WARMING
    torch.testing.assert_close(returns_in_time(g, x), x * 2 + 1)
    assert not g.safecompile.wait_warm(0)
    backend.go.set()
    assert g.safecompile.wait_warm(WAIT)
    compiles = backend.compiles
    torch.testing.assert_close(g(x), x * 2 + 1)
    assert backend.compiles == compiles == 2
    assert g.safecompile.stats().compiled_calls == 1


def test_reset_runs_a_blocking_warmup_again_before_it_returns() -> None:
    backend = RecordingBackend()
    x = torch.randn(4)
    g = safe_compile(double, backend=backend, shadow=None, warmup=Warmup(inputs=[(x,)]))
    g.safecompile.reset()
    assert backend.compiles == 2
    g(x)
    assert backend.compiles == 2
    assert g.safecompile.stats().compiled_calls == 1


def test_a_reset_during_a_compile_on_a_worker_waits_for_it_then_warms_up_again() -> None:
    """torch cannot drop a code object's graphs while a compile of it is in flight on
    another thread (dropping them then crashed the process): reset() waits for it."""
    backend = HeldBackend()
    x = torch.randn(4)
    g = in_background(backend, (x,))
    assert backend.entered.wait(WAIT)  # the warmup's compile is held
    resetting = threading.Thread(target=g.safecompile.reset, daemon=True)
    resetting.start()
    backend.go.set()
    resetting.join(WAIT)
    assert not resetting.is_alive()
    assert g.safecompile.wait_warm(WAIT)
    torch.testing.assert_close(g(x), x * 2 + 1)
    assert g.safecompile.stats().compiled_calls == 1


def test_reset_warms_up_under_the_grad_mode_of_the_decoration() -> None:
    """A reset() called with gradients on (an admin endpoint) warms up the graphs that
    no_grad traffic uses, as the decoration did."""
    backend = RecordingBackend()
    x = torch.randn(4)
    with torch.no_grad():
        g = safe_compile(
            double, backend=backend, dynamic=False, shadow=None, warmup=Warmup(inputs=[(x,)])
        )
    g.safecompile.reset()
    with torch.no_grad():
        g(x)
    assert backend.compiles == 2  # the decoration's and the reset's: none for the call
    assert g.safecompile.stats().compiled_calls == 1


_EXIT_WITH_A_QUEUE = """
import atexit, json, threading
import torch
counts = {}


def after_safecompiles_exit_hook():
    # registered before safecompile is imported, so it runs after safecompile's own hook:
    # the worker must end (starting no queued compile) instead of working down the queue
    # (it may have ended already: it starts no queued compile once the exit began)
    before = counts["g"]()["compiled"]
    name = "safecompile-deferred-compiles"
    worker = next((t for t in threading.enumerate() if t.name == name), None)
    if worker is not None:
        worker.join(60)
    alive = worker is not None and worker.is_alive()
    print("AT EXIT", json.dumps({"alive": alive, "before": before,
                                 "after": counts["g"]()["compiled"]}), flush=True)


atexit.register(after_safecompiles_exit_hook)
from safecompile import Warmup, safe_compile

m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).eval()
g = safe_compile(m, backend="eager", dynamic=False, shadow=None,
                 warmup=Warmup(inputs=[(torch.randn(4, 16),)], background=True, queue_size=100))
assert g.safecompile.wait_warm(60)
counts["g"] = lambda: g.safecompile.stats().extra["deferred"]
with torch.no_grad():
    for b in range(5, 45):
        g(torch.randn(b, 16))
"""


def test_an_exit_starts_no_queued_compile(tmp_path: Any) -> None:
    """A process that exits with deferred compiles queued waits for the one running, not
    for the queue: the worker starts no other (a compile left inside torch at
    finalisation aborts the process)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "exit_with_a_queue.py"
    script.write_text(_EXIT_WITH_A_QUEUE)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("AT EXIT ")]
    seen = json.loads(line.removeprefix("AT EXIT "))
    assert seen["alive"] is False  # it ended rather than waiting for more work
    assert seen["after"] - seen["before"] == 0  # and ran no compile once the exit began
    assert seen["after"] < 40  # the queue was not worked down
