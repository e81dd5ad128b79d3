"""OpenTelemetry traces and metrics, and structlog events, for one guarded callable.

The names are a public contract (docs/telemetry.md). One frozen :class:`~safecompile.Event`
feeds every sink: a compile makes a ``safecompile.compile`` span (after the fact, one
``safecompile.graph_break`` event per break) and a ``safecompile.compile.duration`` point;
a rollback a ``safecompile.rollback`` span and a ``safecompile.rollbacks`` count; every
event one structlog event ``safecompile.<kind>``. Shadow checks feed
``safecompile.shadow.checks`` and ``safecompile.drift`` (and a span for canary checks and
breaches); ``safecompile.calls`` and ``safecompile.graphs`` are read only when a metric
reader collects. No span per call. Nothing here raises into the caller: a failure is
reported once through the ``safecompile`` stdlib logger.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from opentelemetry import metrics, trace
from opentelemetry.metrics import Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

from safecompile._version import __version__
from safecompile.base.forks import in_forked_child
from safecompile.base.model import Event, EventKind, Reason, State
from safecompile.base.options import backend_name

from .log import log_event, report_internal_error
from .source import safe_message

__all__ = ["SCHEMA_URL", "Telemetry", "configure"]

#: The semantic-conventions schema whose names are used (``code.file.path``, ``error.type``).
SCHEMA_URL = "https://opentelemetry.io/schemas/1.37.0"
_SCOPE = "safecompile"

_R = TypeVar("_R")

_COMPILE_KINDS = frozenset({EventKind.COMPILED, EventKind.COMPILE_FAILED})
_ERROR_REASONS = frozenset({Reason.COMPILE_ERROR, Reason.RUNTIME_ERROR, Reason.DRIFT})
_WARNING_KINDS = frozenset(
    {
        EventKind.COMPILE_FAILED,
        EventKind.ROLLBACK,
        EventKind.BREACH,
        EventKind.BUCKET_REJECTED,
        EventKind.RECOMPILE_LIMIT,
        EventKind.SHADOW_SKIPPED,
        EventKind.SWITCH_WARNING,
        EventKind.NAME_SHARED,
    }
)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 300.0)
_DRIFT_BUCKETS = (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


def _guarded(where: str, fn: Callable[..., _R], *args: Any) -> _R | None:
    try:
        return fn(*args)
    except Exception as exc:  # telemetry never breaks a call; one sink failing leaves the others
        report_internal_error(where, exc)
        return None


# ---------------------------------------------------------------------------- configuration


def configure(
    *,
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: metrics.MeterProvider | None = None,
) -> None:
    """Set the providers safecompile uses where a decorator passes none.

    ``None`` (the default) means OpenTelemetry's global providers. Takes effect for every
    guarded callable, including those decorated earlier. OpenTelemetry's own global
    providers are never set.
    """
    _PROCESS.defaults = (tracer_provider, meter_provider)


# ---------------------------------------------------------------------------- instruments


class _Instruments:
    """The metric instruments on one meter; one per meter provider, shared by callables."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.rollbacks = meter.create_counter(
            "safecompile.rollbacks", unit="{rollback}", description="Trips to eager."
        )
        self.compile_duration = meter.create_histogram(
            "safecompile.compile.duration",
            unit="s",
            description="Time spent compiling a shape or bucket.",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self.shadow_checks = meter.create_counter(
            "safecompile.shadow.checks",
            unit="{check}",
            description="Compiled outputs compared with eager.",
        )
        self.drift = meter.create_histogram(
            "safecompile.drift",
            unit="1",
            description="Largest relative difference from eager found by a shadow check.",
            explicit_bucket_boundaries_advisory=_DRIFT_BUCKETS,
        )
        # (function, path) -> calls of callables gone
        self.retired: Counter[tuple[str, str]] = Counter()
        self.calls = meter.create_observable_counter(
            "safecompile.calls",
            callbacks=[lambda _: _guarded("safecompile.calls", self._calls) or []],
            unit="{call}",
            description="Calls of guarded callables, by the path that served them.",
        )
        self.graphs = meter.create_observable_gauge(
            "safecompile.graphs",
            callbacks=[lambda _: _guarded("safecompile.graphs", self._graphs) or []],
            unit="{graph}",
            description="Compiled graphs serving, by where their shadow checks stand.",
        )
        self.state = meter.create_observable_gauge(
            "safecompile.state",
            callbacks=[lambda _: _guarded("safecompile.state", self._states) or []],
            unit="1",
            description="1 for the state each guarded callable is in, 0 for the others.",
        )
        self.disabled = meter.create_observable_gauge(
            "safecompile.disabled",
            callbacks=[lambda _: _guarded("safecompile.disabled", self._disabled) or []],
            unit="1",
            description="1 while the kill switch turns the guarded callable off, else 0.",
        )

    def _states(self) -> list[Observation]:
        out: list[Observation] = []
        for entry in _live_entries():
            read = entry.read_state(self)
            if read is not None:
                out.extend(
                    Observation(
                        int(state.value == read[0]),
                        {"safecompile.function": entry.function, "safecompile.state": state.value},
                    )
                    for state in State
                )
        return out

    def _disabled(self) -> list[Observation]:
        out: list[Observation] = []
        for entry in _live_entries():
            read = entry.read_state(self)
            if read is not None:
                out.append(Observation(int(read[1]), {"safecompile.function": entry.function}))
        return out

    def _graphs(self) -> list[Observation]:
        totals: Counter[tuple[str, str]] = Counter()
        for entry in _live_entries():
            for check, n in (entry.read_graphs(self) or {}).items():
                totals[entry.function, check] += int(n)
        return _observations(totals, "safecompile.check")

    def _calls(self) -> list[Observation]:
        entries = _live_entries()  # first: it retires the callables gone
        totals = Counter(self.retired)
        for entry in entries:
            counts = entry.read(self)
            if counts is not None:
                totals[entry.function, "compiled"] += counts[0]
                totals[entry.function, "eager"] += counts[1]
        return _observations(totals, "safecompile.path")


def _observations(totals: Counter[tuple[str, str]], label: str) -> list[Observation]:
    """One observation per (function, ``label``'s value)."""
    return [Observation(n, {"safecompile.function": f, label: v}) for (f, v), n in totals.items()]


def _instruments_of(provider: metrics.MeterProvider | None) -> _Instruments:
    key = metrics if provider is None else provider  # the global provider's key: its module
    with _PROCESS.instruments_lock:
        found = _PROCESS.by_provider.get(key)
        if found is None:
            meter = metrics.get_meter(_SCOPE, __version__, provider, schema_url=SCHEMA_URL)
            found = _PROCESS.by_provider[key] = _Instruments(meter)
        return found


class _CallsEntry:
    """One guarded callable's count sources, held weakly."""

    __slots__ = ("function", "graphs", "last", "last_instruments", "owner", "source", "state")

    def __init__(
        self,
        telemetry: Telemetry,
        source: Callable[[], tuple[int, int]],
        graphs: Callable[[], Mapping[str, int]] | None,
    ) -> None:
        self.function = telemetry.function
        self.owner = weakref.ref(telemetry)
        self.source = _weak(source)
        self.graphs = _weak(graphs) if graphs is not None else None
        self.state: weakref.ref[Callable[[], tuple[str, bool]]] | None = None
        self.last = (0, 0)
        self.last_instruments: _Instruments | None = None

    def _reports_to(self, instruments: _Instruments) -> bool:
        owner = self.owner()
        return owner is not None and owner._instruments() is instruments

    def read(self, instruments: _Instruments) -> tuple[int, int] | None:
        """This source's counts if it reports to ``instruments`` now; ``None`` otherwise."""
        source = self.source()
        if source is None or not self._reports_to(instruments):
            return None
        try:
            compiled, eager = source()
            self.last = (int(compiled), int(eager))
        except Exception as exc:  # keep the last counts
            report_internal_error("safecompile.calls source", exc)
        self.last_instruments = instruments
        return self.last

    def read_graphs(self, instruments: _Instruments) -> Mapping[str, int] | None:
        """This callable's graphs by check, if it reports to ``instruments`` now."""
        source = self.graphs() if self.graphs is not None else None
        if source is None or not self._reports_to(instruments):
            return None
        return source()

    def read_state(self, instruments: _Instruments) -> tuple[str, bool] | None:
        """This callable's ``(state, disabled)``, if it reports to ``instruments`` now."""
        source = self.state() if self.state is not None else None
        if source is None or not self._reports_to(instruments):
            return None
        return source()

    def retire(self) -> None:
        """Fold the last counts into the totals, so the counter never goes down."""
        instruments = self.last_instruments
        if instruments is not None and self.last != (0, 0):
            instruments.retired[self.function, "compiled"] += self.last[0]
            instruments.retired[self.function, "eager"] += self.last[1]


def _weak(fn: Callable[..., _R]) -> weakref.ref[Callable[..., _R]]:
    """A weak reference to a callable (a bound method through ``WeakMethod``)."""
    return weakref.WeakMethod(fn) if inspect.ismethod(fn) else weakref.ref(fn)


class _Process:
    """What telemetry keeps for the whole process: the providers :func:`configure` set;
    the instruments of each meter provider, held weakly (an SDK meter ignores a second
    callback on a name, so callables reporting to one provider share them); every
    call-count source (one found dead is retired when the sources are next read or added)."""

    def __init__(self) -> None:
        # (tracer provider, meter provider); None: OpenTelemetry's globals. Replaced whole,
        # so a reader never sees half of one configure().
        self.defaults: tuple[trace.TracerProvider | None, metrics.MeterProvider | None] = (
            None,
            None,
        )
        self.instruments_lock = threading.Lock()
        self.by_provider: weakref.WeakKeyDictionary[object, _Instruments] = (
            weakref.WeakKeyDictionary()
        )
        self.entries_lock = threading.Lock()
        self.entries: set[_CallsEntry] = set()

    def after_fork_in_child(self) -> None:
        self.instruments_lock = threading.Lock()  # another thread may have held them
        self.entries_lock = threading.Lock()


_PROCESS = _Process()
in_forked_child(_PROCESS.after_fork_in_child)


def _live_entries(adding: _CallsEntry | None = None) -> list[_CallsEntry]:
    entries = _PROCESS.entries
    with _PROCESS.entries_lock:
        for entry in [e for e in entries if e.owner() is None or e.source() is None]:
            entries.discard(entry)
            entry.retire()
        if adding is not None:
            entries.add(adding)
        return list(entries)


# ---------------------------------------------------------------------------- telemetry


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _code_attributes(file: str | None, line: int | None, function: str | None) -> dict[str, Any]:
    named = {"code.file.path": file, "code.line.number": line, "code.function.name": function}
    return {key: value for key, value in named.items() if value}  # lines count from 1


class Telemetry:
    """Traces, metrics and logs for one guarded callable, named ``function`` (its
    ``safecompile.function``). Providers default to those :func:`configure` set, then to
    OpenTelemetry's globals, and are looked up again after each ``configure()``."""

    def __init__(
        self,
        *,
        function: str,
        backend: object = "inductor",
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self.function = function
        self.backend = backend_name(backend)
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._entry: _CallsEntry | None = None  # what observe_calls registered

    # Looked up at each use (events are rare), each on its own: a broken meter provider
    # does not cost the spans.
    def _tracer(self) -> trace.Tracer:
        provider = self._tracer_provider or _PROCESS.defaults[0]
        return trace.get_tracer(_SCOPE, __version__, provider, schema_url=SCHEMA_URL)

    def _instruments(self) -> _Instruments:
        return _instruments_of(self._meter_provider or _PROCESS.defaults[1])

    def event(self, ev: Event) -> None:
        """Send one event to every sink: span and metrics where its kind has them, a log."""
        span: trace.Span | None = None
        if ev.kind in _COMPILE_KINDS:
            span = _guarded("safecompile.compile span", self._compile_span, ev)
            _guarded("safecompile.compile.duration", self._compile_metric, ev)
        elif ev.kind is EventKind.ROLLBACK:
            span = _guarded("safecompile.rollback span", self._rollback_span, ev)
            _guarded("safecompile.rollbacks", self._rollback_metric, ev)
        _guarded("log", self._log, ev, span)

    def _span(
        self, name: str, start_ns: int, end_ns: int, fill: Callable[[trace.Span], None]
    ) -> trace.Span:
        """A span made after the fact; ``fill`` runs only when it is recorded."""
        span = self._tracer().start_span(name, kind=SpanKind.INTERNAL, start_time=start_ns)
        try:
            if span.is_recording():
                fill(span)
        finally:
            span.end(end_time=end_ns)
        return span

    def _event_attributes(self, ev: Event) -> dict[str, Any]:
        """What compile and rollback spans share: the callable, bucket and the user's code."""
        attributes = {"safecompile.function": self.function, "safecompile.backend": self.backend}
        if ev.bucket is not None:
            attributes["safecompile.bucket"] = ev.bucket
        attributes.update(_code_attributes(ev.file, ev.line, ev.function))
        generated = ev.details.get("generated_file")
        if isinstance(generated, str):
            attributes["safecompile.generated.file"] = generated
        return attributes

    def _error_details(self, span: trace.Span, ev: Event, end_ns: int) -> None:
        """Status ERROR (described in plain words), ``error.type`` and an ``exception``
        event with torch's own text (no stack: no values)."""
        message = safe_message(ev.message) if ev.message else None
        span.set_status(Status(StatusCode.ERROR, message or ev.error_type or None))
        if ev.error_type:
            span.set_attribute("error.type", ev.error_type)
            exception: dict[str, Any] = {"exception.type": ev.error_type}
            raw = ev.details.get("error_message")
            text = safe_message(raw) if isinstance(raw, str) and raw else message
            if text:
                exception["exception.message"] = text
            span.add_event("exception", exception, timestamp=end_ns)

    def _compile_span(self, ev: Event) -> trace.Span:
        end_ns = _ns(ev.time) if ev.time > 0 else time.time_ns()
        breaks = ev.details.get("graph_breaks") or ()

        def fill(span: trace.Span) -> None:
            attributes = self._event_attributes(ev)
            graphs = ev.details.get("graphs")
            if isinstance(graphs, int):
                attributes["safecompile.graphs"] = graphs
            attributes["safecompile.graph_breaks"] = len(breaks)
            span.set_attributes(attributes)
            for entry in breaks:
                span.add_event(
                    "safecompile.graph_break", _break_attributes(entry), timestamp=end_ns
                )
            if ev.kind is EventKind.COMPILE_FAILED:
                self._error_details(span, ev, end_ns)

        start_ns = end_ns - _ns(max(ev.duration_s or 0.0, 0.0))
        return self._span("safecompile.compile", start_ns, end_ns, fill)

    def _compile_metric(self, ev: Event) -> None:
        if ev.duration_s is None or not math.isfinite(ev.duration_s):
            return
        attributes = {"safecompile.function": self.function}
        if ev.kind is EventKind.COMPILE_FAILED:
            attributes["error.type"] = ev.error_type or "_OTHER"
        self._instruments().compile_duration.record(max(ev.duration_s, 0.0), attributes)

    def _rollback_span(self, ev: Event) -> trace.Span:
        end_ns = _ns(ev.time) if ev.time > 0 else time.time_ns()

        def fill(span: trace.Span) -> None:
            attributes = self._event_attributes(ev)
            if ev.reason is not None:
                attributes["safecompile.reason"] = ev.reason.value
            if ev.max_abs_diff is not None:
                attributes["safecompile.drift.max_abs"] = float(ev.max_abs_diff)
            if ev.max_rel_diff is not None:
                attributes["safecompile.drift.max_rel"] = float(ev.max_rel_diff)
            for key in ("peer_rank", "peer_reason", "rank"):  # ranks that agree
                value = ev.details.get(key)
                if isinstance(value, int | str):
                    attributes[f"safecompile.{key.replace('_', '.')}"] = value
            span.set_attributes(attributes)
            if ev.error_type or ev.reason in _ERROR_REASONS:
                self._error_details(span, ev, end_ns)

        return self._span("safecompile.rollback", end_ns, end_ns, fill)

    def _rollback_metric(self, ev: Event) -> None:
        attributes = {
            "safecompile.function": self.function,
            "safecompile.reason": ev.reason.value if ev.reason else "unknown",
        }
        self._instruments().rollbacks.add(1, attributes)

    def _log(self, ev: Event, span: trace.Span | None) -> None:
        level = logging.WARNING if ev.kind in _WARNING_KINDS else logging.INFO
        valid_span = span if span is not None and span.get_span_context().is_valid else None
        log_event(
            f"safecompile.{ev.kind.value}", level=level, span=valid_span, **_log_fields(self, ev)
        )

    def shadow_check(
        self,
        *,
        passed: bool,
        max_abs: float,
        max_rel: float,
        bucket: str | None = None,
        log_span: bool = False,
    ) -> None:
        """Count one shadow check; a span for canary checks (``log_span``) and breaches.

        A non-finite ``max_rel`` (the compiled output was not finite) is counted but not
        recorded in the ``safecompile.drift`` histogram, whose sum it would spoil.
        """
        result = "pass" if passed else "breach"
        _guarded("safecompile.shadow.checks", self._shadow_metrics, result, max_rel)
        if log_span or not passed:
            _guarded(
                "safecompile.shadow_check span", self._shadow_span, result, max_abs, max_rel, bucket
            )

    def _shadow_metrics(self, result: str, max_rel: float) -> None:
        instruments = self._instruments()
        attributes = {"safecompile.function": self.function}
        instruments.shadow_checks.add(1, {**attributes, "safecompile.result": result})
        if math.isfinite(max_rel):
            instruments.drift.record(max(float(max_rel), 0.0), attributes)

    def _shadow_span(self, result: str, max_abs: float, max_rel: float, bucket: str | None) -> None:
        def fill(span: trace.Span) -> None:
            attributes: dict[str, Any] = {
                "safecompile.function": self.function,
                "safecompile.result": result,
                "safecompile.drift.max_abs": float(max_abs),
                "safecompile.drift.max_rel": float(max_rel),
            }
            if bucket is not None:
                attributes["safecompile.bucket"] = bucket
            span.set_attributes(attributes)
            if result == "breach":
                span.set_status(Status(StatusCode.ERROR, "compiled output drifted from eager"))

        now = time.time_ns()
        self._span("safecompile.shadow_check", now, now, fill)

    def observe_calls(
        self,
        source: Callable[[], tuple[int, int]],
        graphs: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """Report ``source()`` = ``(compiled_calls, eager_calls)`` as ``safecompile.calls``
        and ``graphs()`` (graphs by check) as ``safecompile.graphs``, read only when a metric
        reader collects; called once. Both are held weakly: pass bound methods of the object
        whose life bounds the callable's. Once one, or this ``Telemetry``, is collected, the
        last counts read stay in the totals (the counter never goes down)."""
        try:
            self._instruments()  # make sure the observable counter exists on this meter
            self._entry = _CallsEntry(self, source, graphs)
            _live_entries(adding=self._entry)
        except Exception as exc:  # telemetry never breaks a call
            report_internal_error("Telemetry.observe_calls", exc)

    def observe_state(self, source: Callable[[], tuple[str, bool]]) -> None:
        """Report ``source()`` = ``(state, disabled)`` as ``safecompile.state`` (1 for the
        state, 0 for the others) and ``safecompile.disabled``, read when a metric reader
        collects; after :meth:`observe_calls`, held weakly as its sources are."""
        if self._entry is not None:
            self._entry.state = _weak(source)


def _break_attributes(entry: object) -> dict[str, Any]:
    if not isinstance(entry, Mapping):
        return {"safecompile.graph_break.reason": safe_message(str(entry))}
    line = entry.get("line")
    return {
        "safecompile.graph_break.reason": safe_message(str(entry.get("reason") or "unknown")),
        **_code_attributes(
            str(entry["file"]) if entry.get("file") else None,
            line if isinstance(line, int) else None,
            str(entry["function"]) if entry.get("function") else None,
        ),
    }


_SCALARS = (str, int, float, bool)
# Longest ``error_message`` log field: torch's headline; its whole text is on the span.
_ERROR_HEADLINE_LIMIT = 160


def _rounded(value: Any) -> Any:
    """Floats to 4 significant digits (``0.4590475279983366`` -> ``0.459``)."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.4g}")
    return value


def _log_fields(telemetry: Telemetry, ev: Event) -> dict[str, Any]:
    """The event as log fields: names, rounded figures and source locations only;
    ``description`` in plain words, torch's own text (its headline) ``error_message``."""
    fields: dict[str, Any] = {"function": telemetry.function, "backend": telemetry.backend}
    read = {
        "reason": ev.reason.value if ev.reason is not None else None,
        "bucket": ev.bucket,
        "error_type": ev.error_type,
        "description": safe_message(ev.message) if ev.message else None,
        "code_file": ev.file,
        "code_line": ev.line,
        "code_function": ev.function,
        "max_abs_diff": ev.max_abs_diff,
        "max_rel_diff": ev.max_rel_diff,
        "duration_s": ev.duration_s,
    }
    fields.update((name, _rounded(value)) for name, value in read.items() if value is not None)
    for key, value in ev.details.items():
        if key == "graph_breaks" and isinstance(value, list | tuple):
            fields["graph_breaks"] = len(value)
            fields["graph_break_lines"] = [
                f"{b.get('file')}:{b.get('line')}" for b in value if isinstance(b, Mapping)
            ][:32]
        elif key == "error_message" and isinstance(value, str):  # its first non-empty line
            first = next((line.strip() for line in value.splitlines() if line.strip()), "")
            fields[key] = safe_message(first, limit=_ERROR_HEADLINE_LIMIT)
        elif key not in fields and isinstance(value, _SCALARS):
            fields[key] = safe_message(value) if isinstance(value, str) else _rounded(value)
    return fields
