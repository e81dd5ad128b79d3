"""Helpers for your own test suite: assert a function compiles, rehearse rollbacks.

The fault-injecting backends are ordinary ``torch.compile`` backends (callables
``(gm, example_inputs) -> callable``): hand one to ``safe_compile(backend=...)`` to
rehearse each rollback path in a test, without a real compiler failure::

    from safecompile.testing import FailingBackend

    guarded = safe_compile(score, backend=FailingBackend())
    guarded(x)                                  # eager's result, no error
    assert guarded.safecompile.state == "rolled_back"
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import torchcompat
from .base.torchcompat import pytree
from .checks.compare import compare
from .guard.backend import compile_function
from .guard.graphs import Recorder
from .guard.shadow import drain
from .observe.source import dedupe_graph_breaks

__all__ = [
    "BlockingBackend",
    "CompileCheck",
    "CompileReport",
    "DriftingBackend",
    "FailingBackend",
    "FakeClock",
    "PoolBackend",
    "RecordingBackend",
    "RuntimeFailingBackend",
    "SlowBackend",
    "assert_compiles",
    "drain_shadow_checks",
]


class InjectedCompileError(RuntimeError):
    """Raised by :class:`FailingBackend` while compiling."""


class InjectedRuntimeError(RuntimeError):
    """Raised by :class:`RuntimeFailingBackend` from compiled code."""


class RecordingBackend:
    """Runs graphs as captured (like ``backend="eager"``) and records each one."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.runs = 0
        self._lock = threading.Lock()
        self.__name__ = type(self).__name__

    @property
    def compiles(self) -> int:
        """Graphs compiled so far."""
        return len(self.graphs)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        with self._lock:
            self.graphs.append(gm)
        inner = self.compile(gm, example_inputs)

        def run(*args: Any) -> Any:
            with self._lock:
                self.runs += 1
            return self.run(inner, args)

        return run

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """Make the callable for one graph (override to inject faults)."""
        return gm.forward

    def run(self, inner: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run one call of a compiled graph (override to inject faults)."""
        return inner(*args)


class FailingBackend(RecordingBackend):
    """Raises while compiling: from the ``after + 1``-th graph on (``after=0``: every one)."""

    def __init__(self, *, after: int = 0, error: Callable[[], Exception] | None = None) -> None:
        super().__init__()
        self.after = after
        self._error = error or (lambda: InjectedCompileError("injected compile failure"))

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if len(self.graphs) > self.after:
            raise self._error()
        return gm.forward


class RuntimeFailingBackend(RecordingBackend):
    """Compiles fine; the compiled code raises on its ``on_run``-th run (1-based) and after
    (or only that once with ``once=True``)."""

    def __init__(
        self, *, on_run: int = 1, once: bool = False, error: Callable[[], Exception] | None = None
    ) -> None:
        super().__init__()
        self.on_run = on_run
        self.once = once
        self._error = error or (lambda: InjectedRuntimeError("injected runtime failure"))

    def run(self, inner: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        n = self.runs
        if n == self.on_run or (not self.once and n > self.on_run):
            raise self._error()
        return inner(*args)


class DriftingBackend(RecordingBackend):
    """Compiled outputs drift: scaled by ``scale`` (1.01: a 1% shift), optionally a NaN."""

    def __init__(self, *, scale: float = 1.01, nan: bool = False, from_run: int = 1) -> None:
        super().__init__()
        self.scale = scale
        self.nan = nan
        self.from_run = from_run

    def run(self, inner: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        out = inner(*args)
        if self.runs < self.from_run:
            return out
        return pytree.tree_map_only(torch.Tensor, self._drift, out)

    def _drift(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        drifted = t * self.scale
        if self.nan and drifted.numel():
            drifted = drifted.clone()
            drifted.view(-1)[0] = float("nan")
        return drifted


class PoolBackend(RecordingBackend):
    """Imitates CUDA graphs' static output pool on CPU: every run of a graph writes its
    outputs into the same tensors (per output position, while shape and dtype hold), so a
    caller holding an earlier run's output sees it change. Outputs that alias an input or
    carry gradients are returned as they are, as under CUDA graphs.
    """

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        pool: dict[int, torch.Tensor] = {}

        def replay(*args: Any) -> Any:
            out = gm.forward(*args)
            if not isinstance(out, list | tuple):
                return out
            inputs = {_storage(a) for a in args if isinstance(a, torch.Tensor)}
            return type(out)(_into_pool(pool, i, o, inputs) for i, o in enumerate(out))

        return replay


def _storage(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # a tensor without storage (a subclass, a fake)
        return id(t)


def _into_pool(pool: dict[int, torch.Tensor], i: int, out: Any, inputs: set[int]) -> Any:
    if not isinstance(out, torch.Tensor) or out.requires_grad or _storage(out) in inputs:
        return out  # outputs that alias an input are not the pool's (as under CUDA graphs)
    static = pool.get(i)
    if static is None or static.shape != out.shape or static.dtype != out.dtype:
        static = pool[i] = torch.empty_like(out)
    with torch.no_grad():
        static.copy_(out)
    return static


class SlowBackend(RecordingBackend):
    """Compiled code takes ``delay`` seconds longer per run (``sleep`` is injectable)."""

    def __init__(
        self, *, delay: float = 0.001, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        super().__init__()
        self.delay = delay
        self._sleep = sleep

    def run(self, inner: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self._sleep(self.delay)
        return inner(*args)


class BlockingBackend(RecordingBackend):
    """Compiling blocks until :meth:`release` (to test what happens during a long compile)."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self._release = threading.Event()

    def release(self) -> None:
        """Let the compile finish."""
        self._release.set()

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.started.set()
        if not self._release.wait(timeout=60):
            raise TimeoutError("BlockingBackend was never released")
        return gm.forward


@dataclass
class FakeClock:
    """A monotonic clock that moves only when told: ``safe_compile(clock=FakeClock())``."""

    now: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        with self._lock:
            self.now += seconds


@dataclass(frozen=True)
class CompileReport:
    """What :func:`assert_compiles` saw."""

    graphs: int
    graph_breaks: list[dict[str, Any]]
    max_abs_diff: float
    max_rel_diff: float


@dataclass(frozen=True)
class CompileCheck:
    """:func:`assert_compiles` with another ``backend`` (default ``"aot_eager"``: dynamo and
    AOTAutograd without code generation) or without comparing outputs (``check_outputs``);
    called like it: ``CompileCheck(backend="inductor")(score, x, mask=m, max_graph_breaks=1)``.
    """

    backend: str | Callable[..., Any] = "aot_eager"
    check_outputs: bool = True

    def __call__(
        self, fn: Callable[..., Any], /, *args: Any, max_graph_breaks: int = 0, **kwargs: Any
    ) -> CompileReport:
        """:func:`assert_compiles` with this backend and output check."""
        target = _unwrap(fn)
        name = getattr(target, "__qualname__", None) or type(target).__name__
        recorder = Recorder(torchcompat.lookup_backend(self.backend))
        compiled = compile_function(
            target, backend=recorder, dynamic=None, fullgraph=False, recompile_limit=64
        )
        try:
            out = compiled(*args, **kwargs)
        except Exception as exc:
            raise AssertionError(f"{name} failed to compile: {type(exc).__name__}: {exc}") from exc
        # each break once, though seen from the graph it ends and the one resuming after it
        breaks = dedupe_graph_breaks(b for graph in recorder.graphs for b in graph.breaks)
        if len(breaks) > max_graph_breaks:
            lines = "\n".join(
                f"  - {b.get('file')}:{b.get('line')} in {b.get('function')}: {b.get('reason')}"
                for b in breaks
            )
            raise AssertionError(
                f"{name} has {len(breaks)} graph break(s), at most {max_graph_breaks} "
                f"allowed:\n{lines}"
            )
        max_abs = max_rel = 0.0
        if self.check_outputs:
            expected = target(*args, **kwargs)
            result = compare(out, expected)
            if not result.ok:
                raise AssertionError(f"{name} compiled differs from eager: {result.reason}")
            max_abs, max_rel = result.max_abs, result.max_rel
        return CompileReport(
            graphs=len(recorder.graphs),
            graph_breaks=breaks,
            max_abs_diff=max_abs,
            max_rel_diff=max_rel,
        )


def assert_compiles(
    fn: Callable[..., Any], /, *args: Any, max_graph_breaks: int = 0, **kwargs: Any
) -> CompileReport:
    """Assert that ``fn(*args, **kwargs)`` compiles with at most ``max_graph_breaks`` breaks.

    Compiles a fresh copy with ``backend="aot_eager"`` (a guarded function or module is
    unwrapped first), runs it once, and compares its output with eager's. A graph break
    counts wherever it is, before anything was compiled too (a ``print`` on the first
    line), once each. On failure the ``AssertionError`` lists each graph break with its
    reason and source line. Returns a :class:`CompileReport`.

    Every keyword but ``max_graph_breaks`` is passed to ``fn``. For another backend, or
    without comparing outputs, use :class:`CompileCheck`.
    """
    return CompileCheck()(fn, *args, max_graph_breaks=max_graph_breaks, **kwargs)


def drain_shadow_checks(timeout: float = 30.0) -> None:
    """Wait until every queued async shadow check has run (``AssertionError`` on timeout)."""
    if not drain(timeout):
        raise AssertionError(f"async shadow checks still running after {timeout} s")


def _unwrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What a guarded function or module runs eagerly (a module's own bound forward)."""
    if getattr(fn, "safecompile", None) is None:
        return fn
    inner = fn.forward if isinstance(fn, torch.nn.Module) else fn
    return inner.__wrapped__  # type: ignore[attr-defined,no-any-return]
