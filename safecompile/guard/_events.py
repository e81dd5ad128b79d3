"""The events of one guarded callable, and what they count: every event is made here
(at the user's line, errors explained), kept (the last 256) and sent to telemetry.

Compile progress is said here too: a compile that takes a while once as an event, then as
log lines (:meth:`EventLog.compiling`, :meth:`EventLog.still`, called by
:func:`safecompile.observe.progress.watch_compile`), and a graph the backend made as
``compiled`` (with its graph breaks, each said once) or ``recompile_limit``.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from safecompile.base.model import Event, EventKind, Reason
from safecompile.observe.explain import Explanation, explain
from safecompile.observe.log import log_event
from safecompile.observe.progress import Compiling
from safecompile.observe.source import (
    SourceLocation,
    dedupe_graph_breaks,
    error_type_name,
    location_fields,
    location_of_error,
    safe_message,
    truncate,
)
from safecompile.observe.telemetry import Telemetry

from .graphs import GraphRecord

__all__ = ["EventLog", "Tally"]

_MAX_EVENTS = 256


@dataclass
class Tally:
    """What ``stats()`` counts beyond the slots and the graphs (zeroed by ``reset()``)."""

    compile_errors: int = 0
    graph_breaks: int = 0
    rollbacks: int = 0
    last_rollback: Event | None = None
    limit_said: bool = False  # the recompile_limit event is out
    seen_breaks: set[tuple[object, object]] = field(default_factory=set)


class EventLog:
    """The events of one guarded callable (see the module doc); thread-safe."""

    def __init__(
        self,
        name: str,
        location: SourceLocation | None,
        target: object,
        sink: Telemetry,
        recompile_limit: int,
    ) -> None:
        self.name = name
        self.location = location  # the user's function
        self._target = target  # the function or module, to find the user's line of an error
        self.sink = sink
        self._limit = recompile_limit
        self.lock = threading.Lock()
        self.events: collections.deque[Event] = collections.deque(maxlen=_MAX_EVENTS)
        self.tally = Tally()

    def record(self, event: Event, *, rollback: bool = False) -> None:
        """Keep and publish an event (``rollback``: a trip's, counted as a rollback)."""
        with self.lock:
            self.events.append(event)
            if rollback:
                self.tally.rollbacks += 1
                self.tally.last_rollback = event
        self.sink.event(event)

    def say(self, kind: EventKind, message: str, *, here: bool = False, **fields: Any) -> None:
        """Record an event of ``kind`` now (``here``: at the user's function)."""
        where = location_fields(self.location) if here else {}
        self.record(Event(kind=kind, time=time.time(), message=message, **where, **fields))

    def warn(self, kind: EventKind, message: str, *, here: bool = False) -> None:
        """A mistake of the user's: an event, and a Python warning (seen where no logging is
        set up); each is said once per process by its caller."""
        self.say(kind, message, here=here)
        warnings.warn(message, UserWarning, stacklevel=3)

    def say_error(self, kind: EventKind, error: BaseException, **fields: Any) -> None:
        """An event of ``kind`` about ``error``, at the user's line that raised it."""
        where, details, explained = self.describe_error(error)
        error_type = error_type_name(error)
        self.say(kind, explained.text, error_type=error_type, details=details, **where, **fields)

    def describe_error(
        self, error: BaseException
    ) -> tuple[dict[str, Any], dict[str, Any], Explanation]:
        """The user's line of an error (and where generated code raised it), and the
        error in plain words; the raw text in ``details["error_message"]``."""
        at, generated = location_of_error(error, self._target)
        details: dict[str, Any] = {"generated_file": generated} if generated is not None else {}
        explained = explain(error, at or self.location)
        details["error_kind"] = explained.kind
        details["error_message"] = safe_message(error)
        return location_fields(at or self.location), details, explained

    def rollback(
        self,
        reason: Reason,
        *,
        error: BaseException | None = None,
        message: str | None = None,
        bucket: str | None = None,
        graph: GraphRecord | None = None,
        max_abs: float | None = None,
        max_rel: float | None = None,
    ) -> Event:
        """The ``rollback`` event of a trip for ``reason`` (see ``Engine.trip``)."""
        text = ""
        if error is not None:
            where, details, explained = self.describe_error(error)
            text = explained.text
            if reason is Reason.COMPILE_ERROR:
                # the compile_failed event just before says it in full: refer to it
                del details["error_message"]
                text = f"compile failed: {explained.summary} (see compile_failed)"
        else:
            where, details = location_fields(self.location), {}
        if graph is not None:
            details["graph"] = graph.id
            details["graph_inputs"] = graph.label
        return Event(
            kind=EventKind.ROLLBACK,
            reason=reason,
            time=time.time(),
            bucket=bucket if bucket is not None else (graph.bucket if graph else None),
            error_type=error_type_name(error) if error is not None else None,
            message=truncate(message) if message is not None else text,
            max_abs_diff=max_abs,
            max_rel_diff=max_rel,
            details=details,
            **where,
        )

    def compile_failed(
        self, error: BaseException, bucket: str | None, duration_s: float | None
    ) -> None:
        """A compile raised (not the user's own error): count it and say so."""
        with self.lock:
            self.tally.compile_errors += 1
        self.say_error(
            EventKind.COMPILE_FAILED,
            error,
            reason=Reason.COMPILE_ERROR,
            bucket=bucket,
            duration_s=duration_s,
        )

    def reset(self) -> None:
        """``reset()``: the counts start from zero (the events stay)."""
        with self.lock:
            self.tally = Tally()

    # ------------------------------------------------------------------ compiles

    def compiling(self, compiling: Compiling) -> None:
        """A compile is still running after ~2 s (on the timer's thread)."""
        self.say(
            EventKind.COMPILING,
            f"still compiling after {compiling.elapsed():.0f} s: {compiling.graph}",
            here=True,
            bucket=compiling.graph,
        )

    def still(self, compiling: Compiling) -> None:
        """A slow compile goes on: a log line, not an event (events keep changes)."""
        log_event(
            "safecompile.still_compiling",
            function=self.name,
            bucket=compiling.graph,
            duration_s=round(compiling.elapsed(), 1),
            description=compiling.graph,
        )

    def graph_made(self, graph: GraphRecord) -> None:
        """The backend made a graph (on the compiling thread, inside the call)."""
        with self.lock:
            # A break is seen from both sides (the graph it ends, the one resuming after
            # it): each is told once, on the graph where it first shows.
            breaks = []
            for found in dedupe_graph_breaks(graph.breaks):
                at = (found.get("file"), found.get("line"))
                if at == (None, None) or at not in self.tally.seen_breaks:
                    self.tally.seen_breaks.add(at)
                    breaks.append(dict(found))
            graph.breaks = breaks
            self.tally.graph_breaks += len(breaks)
            first_limit = not graph.compiled and not self.tally.limit_said
            if first_limit:
                self.tally.limit_said = True
        where = graph.bucket if graph.bucket is not None else f"graph {graph.id}"
        if graph.compiled:
            self.say(
                EventKind.COMPILED,
                f"compiled graph {graph.id} ({graph.label}) with {len(breaks)} graph break(s)",
                here=True,
                bucket=where,
                duration_s=graph.compile_s,
                details={"graph": graph.id, "graphs": 1, "graph_breaks": breaks},
            )
        elif first_limit:
            limit = self._limit
            self.say(
                EventKind.RECOMPILE_LIMIT,
                f"{limit} graphs compiled for {graph.code.split('@')[0]} reached "
                f"max_recompiles={limit}: new graphs run eager from now on; "
                "compiled graphs keep serving",
                here=True,
                reason=Reason.RECOMPILE_LIMIT,
                bucket=where,
                details={"graph": graph.id},
            )
