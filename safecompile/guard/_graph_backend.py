"""The guard's backend: :class:`GuardBackend` is what ``torch.compile`` is handed. It
records each graph torch compiles (:mod:`.graphs`), compiles it with the user's compiler,
and hands torch back the compiled graph wrapped in a small function that tells the
calling thread's :class:`~._slots.Slot` which graph served the call and whether its check
is due. A graph's first run is protected (:mod:`._first_run`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from safecompile.base import torchcompat
from safecompile.base.options import CompilerFn
from safecompile.checks.snapshot import Snapshot
from safecompile.observe.log import torch_missing
from safecompile.observe.progress import watch_compile
from safecompile.observe.source import graph_breaks_of

from ._effects import find_effects
from ._first_run import Pending, prepare, protected
from .facts import GraphFacts, read_graph
from .graphs import GraphRecord, GraphTable

if TYPE_CHECKING:
    from ._compiles import CompileTracker
    from ._events import EventLog
    from ._slots import Slot, Slots
    from .shadow import ShadowRunner

__all__ = [
    "PROTECT_FIRST_RUNS",
    "GuardBackend",
    "compile_seconds",
    "time_tracing",
    "trace_started",
]


_Made = tuple[GraphRecord, Callable[..., Any], Pending | None]  # a graph, compiled and wrapped


class GuardBackend:
    """The backend handed to ``torch.compile``: records each graph, then compiles it, and
    hands torch back the compiled graph wrapped in a small function that tells the calling
    thread's :class:`~._slots.Slot` which graph served the call and whether its check is
    due (:func:`_instrument`)."""

    def __init__(
        self,
        compiler: CompilerFn,
        label: str,
        *,
        table: GraphTable,
        slots: Slots,
        compiles: CompileTracker,
        events: EventLog,
        shadow: ShadowRunner,
        limit: int,
        clock: Callable[[], float],
        costs: Callable[[], float],
        module: torch.nn.Module | None,
        cudagraphs: bool,
    ) -> None:
        self._compiler = compiler
        self._table = table
        self._slots = slots
        self._compiles = compiles
        self._events = events
        self._shadow = shadow
        self._tolerances = table.tolerances()  # the shadow policy's (a first run compares)
        self._limit = limit  # graphs compiled per code object at most (max_recompiles)
        self._clock = clock  # compile seconds (from the trace's start: ``trace_started``)
        self._costs = costs  # a checked call's start stamp (see ``Slot.started``)
        self._module = module
        self.cudagraphs = cudagraphs  # compiled graphs run under CUDA graphs (pool outputs)
        self._made: dict[
            tuple[Any, ...], tuple[GraphRecord, Callable[..., Any], Pending | None]
        ] = {}
        # every code object it made graphs for: the function, and its resume functions
        self._codes: weakref.WeakSet[types.CodeType] = weakref.WeakSet()
        self.__name__ = f"safecompile[{label}]"

    def restart(self) -> list[types.CodeType]:
        """Forget every graph made (``reset()``): the code objects whose cache entries the
        caller drops. One backend serves on, so nothing torch keeps per backend piles up."""
        self._made.clear()
        codes = list(self._codes)
        self._codes.clear()
        return codes

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        started = self._started()
        slot: Slot | None = getattr(self._slots.local, "slot", None)
        bucket = slot.bucket if slot is not None else None
        with self._compiles.claim(), contextlib.ExitStack() as announced:
            read = read_graph(gm, example_inputs)
            facts = read.facts
            events = self._events
            name = bucket or facts.label
            # a compile that takes a while is said (an event, then log lines)
            ended = watch_compile(
                events.name, name, started, events.compiling, on_still=events.still
            )
            announced.callback(ended)
            if read.frame is not None:
                self._codes.add(read.frame)
            made = self._made.get(read.twin)
            if made is not None:
                # Threads racing on one new input signature each made dynamo trace it;
                # torch does not de-duplicate: the first compile serves them all.
                return self._instrument(*made)
            # the recompile limit counts the graphs compiled per code object
            compiled = self._table.compiled_for(facts.code) < self._limit
            pending: Pending | None = None
            if compiled:
                if PROTECT_FIRST_RUNS:  # its traced code, kept before the compiler sees it
                    pending = prepare(gm, read.random, read.written)
                # Compile the backward graph now, not lazily at .backward(): a failure
                # then surfaces here, on the guarded call, where eager can answer it.
                with _eager_backward():
                    inner = self._compiler(gm, example_inputs)
            else:
                inner = gm.forward  # past the recompile limit: the traced graph, eagerly
            record = self._table.add(facts, compiled=compiled, bucket=bucket)
            record.compile_s = self._clock() - started
            record.breaks = graph_breaks_of(gm, include_resumed=True)
            record.frame = read.frame_key  # as its running frame will show it
            record.prep = pending is not None  # its first run leaves the common path
            self._made[read.twin] = (record, inner, pending)
            if slot is not None:
                slot.new = [record] if slot.new is None else [*slot.new, record]
            events.graph_made(record)
            if record.unchecked is not None and self._shadow.policy is not None:
                self._shadow.skip_graph(record, record.unchecked)
        return self._instrument(record, inner, pending)

    def _started(self) -> float:
        """When this compile started: dynamo's trace start, on the wall clock this backend
        uses (an injected clock: its own reading now)."""
        started = trace_started()
        if started is None or self._clock is not time.perf_counter:
            return self._clock()
        return started

    def adopt(self, inner: Callable[..., Any], facts: GraphFacts) -> Callable[..., Any]:
        """A graph an earlier process saved, loaded instead of traced: recorded and wrapped
        like one made here (checks, counts, timing)."""
        record = self._table.add(facts, compiled=True, bucket=None)
        return self._instrument(record, inner, None)

    def _snapshot(self, args: tuple[Any, ...], graph: GraphRecord) -> Snapshot:
        """State before the first graph of a checked call runs (on the calling thread)."""
        snapshot = Snapshot.take(args, self._module, copy=graph.mutates, by_value=self.cudagraphs)
        if graph.effects:
            snapshot.add_objects(*find_effects(graph.frame, graph.effects, graph.code))
        return snapshot

    def _instrument(
        self, record: GraphRecord, inner: Callable[..., Any], pending: Pending | None
    ) -> Callable[..., Any]:
        """The compiled graph as torch will run it: first note the run in the caller's
        slot. Its first run is protected (:mod:`._first_run`) while ``pending`` holds its
        traced code."""
        inner = torchcompat.undisabled(inner)  # dynamo disables around this wrapper
        if self.cudagraphs:
            inner = _launched_live(inner)
        local = self._slots.local
        snapshot = self._snapshot
        costs = self._costs
        tolerances = self._tolerances

        def run(*args: Any) -> Any:
            try:
                slot: Slot = local.slot
            except AttributeError:  # not called through the guard (torch internals): just run
                return inner(*args)
            if slot.first is None and record.countdown > 0 and not slot.force and not record.prep:
                slot.first = record  # the common case: the call's first graph, nothing due
                slot.snapshot = None
                record.countdown -= 1
                return inner(*args)
            due = record.countdown <= 0 or slot.force
            if slot.first is None:
                slot.first = record
                if due or record.prep:
                    slot.snapshot = snapshot(args, record)
                    slot.started = costs()
                else:
                    slot.snapshot = None
            elif record.effects and slot.snapshot is not None:  # a later graph's objects
                slot.snapshot.add_objects(*find_effects(record.frame, record.effects, record.code))
            if due:
                record.runs += 1
                if slot.due is None:
                    slot.due = [record]
                else:
                    slot.due.append(record)
            else:
                record.countdown -= 1
            if pending is None or pending.traced is None:
                return inner(*args)
            out, first_run = protected(record, inner, pending.traced, pending, tolerances, args)
            slot.fresh = [first_run] if slot.fresh is None else [*slot.fresh, first_run]
            if slot.due is None:
                slot.due = []  # the hot path hands the call to finish(), which reads it
            return out

        run.__name__ = f"safecompile_graph_{record.id}"
        if record.compiled:
            return run

        def limited(*args: Any) -> Any:  # past the recompile limit: a due list, even empty,
            out = run(*args)  # sends the call to the slow path, which counts it as eager
            slot: Slot | None = getattr(local, "slot", None)
            if slot is not None and slot.due is None:
                slot.due = []
            return out

        limited.__name__ = run.__name__
        return limited


def _launched_live(inner: Callable[..., Any]) -> Callable[..., Any]:
    """Under CUDA graphs: the compiled graph, run only on tensors whose memory torch still
    lets be read. torch frees a CUDA-graph output that a later replay overwrote and marks
    its storage so that reading its address raises (``RuntimeError: accessing tensor
    output of CUDAGraphs that has been overwritten``); Triton's kernel launcher reads each
    argument's address with ``data_ptr()`` and does not check for that error: the process
    dies in the launch (docs/design.md, "Known limits"). Reading the addresses first
    raises torch's error on our path instead, where eager answers or raises it too.
    Parameters are left out: they are never a graph's output."""

    def launched(*args: Any) -> Any:
        for a in args:
            if type(a) is torch.Tensor:
                a.data_ptr()  # raises torch's error for an output overwritten since
        return inner(*args)

    return launched


PROTECT_FIRST_RUNS = True
"""Whether a compiled graph's first run is protected (:mod:`._first_run`). Only
``bench/first_call.py`` turns it off, to measure what the protection costs."""


class _Trace(threading.local):
    started: float | None = None  # when dynamo started tracing on this thread


_TRACE = _Trace()


def _on_trace_start(_args: object) -> None:
    _TRACE.started = time.perf_counter()


def trace_started() -> float | None:
    """When dynamo started tracing the frame now being compiled on this thread (once)."""
    started = _TRACE.started
    _TRACE.started = None
    return started


def compile_seconds(clock: Callable[[], float]) -> float | None:
    """How long the compile now failing on this thread ran, from dynamo's trace start
    (``None``: not known, or ``clock`` is not the wall clock it was stamped on)."""
    started = trace_started()
    if started is None or clock is not time.perf_counter:
        return None
    return time.perf_counter() - started


def time_tracing() -> None:
    """Have dynamo's compile callbacks time tracing too, not only the backend (again
    after ``torch._dynamo.reset()``, which clears them)."""
    handler = torchcompat.compile_callbacks()
    if handler is not None and _on_trace_start not in handler.start_callbacks:
        handler.register_start_callback(_on_trace_start)


def _eager_backward() -> contextlib.AbstractContextManager[Any]:
    """Where torch allows it, compile the backward graph with the forward one."""
    lowering = torchcompat.eager_backward()
    if isinstance(lowering, torchcompat.Missing):
        torch_missing(lowering)
        return contextlib.nullcontext()
    return lowering
