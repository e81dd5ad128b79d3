"""Graph identity: one record per graph torch compiles, and the table of them.

The backend (:mod:`.backend`) gives each graph torch compiles a :class:`GraphRecord`
(its id, its canary countdown and counters), kept in the callable's :class:`GraphTable`.
Nothing is keyed by input shapes: memory is bounded by the graphs (docs/design.md,
"Graphs, not shapes"). :class:`Recorder` is the tools' backend: it notes what the guard
would read of each graph.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from safecompile.base.policies import FOREVER, Shadow
from safecompile.observe.source import graph_breaks_of

from ._effects import Effect
from .facts import GraphFacts, random_op, read_facts

__all__ = ["GraphRecord", "GraphTable", "RecordedGraph", "Recorder"]


@dataclass(slots=True, eq=False)
class GraphRecord:
    """What the guard knows about one graph torch compiled (see the module doc)."""

    id: int
    label: str  # its inputs as text: shapes (``s0`` for a dynamic dim) and dtypes
    code: str  # the function (or resume function, after a graph break) it belongs to
    compiled: bool  # False: past max_recompiles, the traced graph runs eagerly
    bucket: str | None = None
    watched: bool = False  # compiled, with shadow checks on: its checks count
    canary_left: int = 0
    countdown: int = FOREVER  # runs left before its next check is due (0: due now)
    counted_from: int = FOREVER  # the countdown when last set (runs since: the difference)
    runs: int = 0  # runs before the countdown was last set, and runs with a check due
    checks: int = 0
    compile_s: float = 0.0
    breaks: list[dict[str, Any]] = field(default_factory=list)
    unchecked: str | None = None  # why this graph is never checked (random numbers...)
    mutates: bool = False  # seen to update its inputs or module state in place
    prep: bool = False  # not the common path next run: a later graph of its calls is due
    # (snapshot state at this one), or its protected first run is to come
    effects: tuple[Effect, ...] = ()  # Python objects its frame updates (snapshotted)
    frame: tuple[str, str, int] | None = None  # its frame's code: name, file, first line

    @property
    def calls(self) -> int:
        """How many times it ran (the wrapper counts down, and counts only due runs)."""
        return self.runs + self.counted_from - self.countdown

    def set_countdown(self, value: int) -> None:
        """Runs left before its next check; the runs counted down so far are kept."""
        self.runs += self.counted_from - self.countdown
        self.countdown = self.counted_from = value

    def check(self) -> str:
        """Where its shadow checks stand: ``"checked"`` (its canary passed),
        ``"unchecked"`` (it cannot be checked: :attr:`unchecked` says why), ``"not_yet"``
        (canary checks left) or ``"off"`` (not watched: shadow checks off, or it runs
        eagerly past the recompile limit)."""
        if not self.watched:
            return "off"
        if self.unchecked is not None:
            return "unchecked"
        return "checked" if self.canary_left == 0 and self.checks > 0 else "not_yet"

    def to_dict(self) -> dict[str, Any]:
        """The record for ``report()``: counters and labels only, never values."""
        return {
            "id": self.id,
            "check": self.check(),
            "inputs": self.label,
            "code": self.code,
            "compiled": self.compiled,
            "bucket": self.bucket,
            "calls": self.calls,
            "checks": self.checks,
            "canary_left": self.canary_left,
            "compile_s": round(self.compile_s, 6),
            "graph_breaks": len(self.breaks),
            "unchecked": self.unchecked,
            "mutates_state": self.mutates,
            "updates_objects": [e.name for e in self.effects],
        }


class GraphTable:
    """Every graph of one guarded callable, in compile order (bounded by the graphs)."""

    def __init__(self, shadow: Shadow | None) -> None:
        self._shadow = shadow
        self._lock = threading.Lock()
        self._records: list[GraphRecord] = []
        self._ids = itertools.count(1)
        self.size = 0  # how many graphs it holds (read without a call: the gate)

    def add(self, facts: GraphFacts, *, compiled: bool, bucket: str | None) -> GraphRecord:
        canary = self._shadow.canary if self._shadow is not None and compiled else 0
        record = GraphRecord(
            id=next(self._ids),
            label=facts.label,
            code=facts.code,
            compiled=compiled,
            bucket=bucket,
            watched=self._shadow is not None and compiled,
            canary_left=canary if facts.unchecked is None else 0,
            unchecked=facts.unchecked,
            mutates=facts.mutates,
            effects=facts.effects,
        )
        record.set_countdown(self.countdown(record))
        with self._lock:
            self._records.append(record)
            self.size = len(self._records)
        return record

    def compiled_for(self, code: str) -> int:
        """How many graphs were compiled for the function (or resume function) ``code``."""
        with self._lock:
            return sum(1 for r in self._records if r.compiled and r.code == code)

    def checks(self) -> dict[str, int]:
        """How many graphs stand where (see :meth:`GraphRecord.check`)."""
        statuses = [record.check() for record in self]
        return {status: statuses.count(status) for status in ("checked", "unchecked", "not_yet")}

    def tolerances(self) -> tuple[float | None, float | None]:
        """The shadow policy's ``(rtol, atol)`` (``None``: the per-dtype defaults)."""
        shadow = self._shadow
        return (shadow.rtol, shadow.atol) if shadow is not None else (None, None)

    def countdown(self, record: GraphRecord) -> int:
        """The record's next countdown, as the shadow policy decides."""
        if self._shadow is None or record.unchecked is not None or not record.compiled:
            return FOREVER
        return self._shadow.countdown(record.canary_left)

    def clear(self) -> None:
        """Forget every graph (``reset()``): ids start again from 1."""
        with self._lock:
            self._records.clear()
            self._ids = itertools.count(1)
            self.size = 0

    def __iter__(self) -> Iterator[GraphRecord]:
        with self._lock:
            return iter(list(self._records))

    def __len__(self) -> int:
        return self.size


@dataclass(frozen=True, slots=True)
class RecordedGraph:
    """What a :class:`Recorder` noted about one graph."""

    breaks: tuple[dict[str, object], ...]  # its graph breaks, the resumed side included
    random_op: str | None  # an op that draws random numbers, if any
    compile_s: float  # time in the wrapped compiler
    unchecked: str | None = None  # why safe_compile's shadow checks would skip it


class Recorder:
    """A backend for the tools (the doctor, ``assert_compiles``): notes each graph, then
    compiles it with ``compiler``. The guard's own backend is :class:`GuardBackend`."""

    def __init__(self, compiler: Callable[..., Any], label: str = "recorder") -> None:
        self.graphs: list[RecordedGraph] = []
        self._compiler = compiler
        self.__name__ = label

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        breaks = tuple(graph_breaks_of(gm, include_resumed=True))
        unchecked = read_facts(gm).unchecked  # the guard's own words
        started = time.perf_counter()
        try:
            return self._compiler(gm, example_inputs)
        finally:
            elapsed = time.perf_counter() - started
            self.graphs.append(RecordedGraph(breaks, random_op(gm), elapsed, unchecked))
