"""Telemetry: span, metric and log names exactly as API.md §4; never breaks; never leaks values."""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
import structlog.testing
import torch
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import safecompile.observe.telemetry as telemetry_module
from safecompile._version import __version__
from safecompile.base.model import Event, EventKind, Reason
from safecompile.observe.source import safe_message
from safecompile.observe.telemetry import SCHEMA_URL, Telemetry, configure

FUNCTION = "ranker.score"
SECRET = 8675309.25  # a distinctive tensor value that must never leave the process


@pytest.fixture
def tel(tracer_provider: TracerProvider, meter_provider: MeterProvider) -> Telemetry:
    return Telemetry(
        function=FUNCTION,
        backend="inductor",
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
    )


@pytest.fixture(autouse=True)
def _reset_configure() -> Iterator[None]:
    yield
    configure()


@pytest.fixture
def unconfigured_structlog() -> Iterator[None]:
    structlog.reset_defaults()
    assert not structlog.is_configured()
    yield
    structlog.reset_defaults()


def metrics_by_name(reader: InMemoryMetricReader) -> dict[str, Any]:
    data = reader.get_metrics_data()
    out: dict[str, Any] = {}
    if data is None:
        return out
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            assert scope_metrics.scope.name == "safecompile"
            assert scope_metrics.scope.version == __version__
            assert scope_metrics.scope.schema_url == SCHEMA_URL
            for metric in scope_metrics.metrics:
                out[metric.name] = metric
    return out


def points(metric: Any) -> dict[tuple[tuple[str, Any], ...], Any]:
    return {tuple(sorted(p.attributes.items())): p for p in metric.data.data_points}


def compiled_event(**kwargs: Any) -> Event:
    base: dict[str, Any] = {
        "kind": EventKind.COMPILED,
        "time": 1_700_000_010.0,
        "duration_s": 2.5,
        "bucket": "x:64",
        "file": "/srv/app/model.py",
        "line": 12,
        "function": "score",
        "details": {
            "graphs": 2,
            "graph_breaks": [
                {
                    "reason": "Failed to trace builtin operator print",
                    "file": "/srv/app/model.py",
                    "line": 14,
                    "function": "score",
                }
            ],
        },
    }
    base.update(kwargs)
    return Event(**base)


def failed_compile_event() -> Event:
    return Event(
        kind=EventKind.COMPILE_FAILED,
        reason=Reason.COMPILE_ERROR,
        time=1_700_000_020.0,
        duration_s=0.75,
        bucket="x:128",
        error_type="torch._dynamo.exc.BackendCompilerFailed",
        message="backend='inductor' raised: LoweringException: no lowering",
        file="/srv/app/model.py",
        line=20,
        function="score",
    )


def rollback_event(**kwargs: Any) -> Event:
    base: dict[str, Any] = {
        "kind": EventKind.ROLLBACK,
        "reason": Reason.RUNTIME_ERROR,
        "time": 1_700_000_030.0,
        "bucket": "x:64",
        "error_type": "IndexError",
        "message": "index 7 is out of bounds for dimension 0 with size 3",
        "file": "/srv/app/model.py",
        "line": 33,
        "function": "score",
        "details": {"generated_file": "<eval_with_key>.4"},
    }
    base.update(kwargs)
    return Event(**base)


def only_span(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    spans = [s for s in exporter.get_finished_spans() if s.name == name]
    assert len(spans) == 1, [s.name for s in exporter.get_finished_spans()]
    return spans[0]


# ---------------------------------------------------------------- spans


def test_compile_span(tel: Telemetry, exporter: InMemorySpanExporter) -> None:
    """A compile: its span, made after the fact, with its graph breaks as span events."""
    tel.event(compiled_event())
    span = only_span(exporter, "safecompile.compile")
    assert span.instrumentation_scope is not None
    assert span.instrumentation_scope.name == "safecompile"
    assert span.instrumentation_scope.schema_url == SCHEMA_URL
    assert span.end_time == 1_700_000_010 * 10**9
    assert span.start_time == span.end_time - int(2.5e9)
    assert span.status.status_code is StatusCode.UNSET
    attributes = dict(span.attributes or {})
    assert attributes["safecompile.function"] == FUNCTION
    assert attributes["safecompile.bucket"] == "x:64"
    assert attributes["safecompile.backend"] == "inductor"
    assert "error.type" not in attributes
    (event,) = span.events
    assert event.name == "safecompile.graph_break"
    assert dict(event.attributes or {}) == {
        "safecompile.graph_break.reason": "Failed to trace builtin operator print",
        "code.file.path": "/srv/app/model.py",
        "code.line.number": 14,
        "code.function.name": "score",
    }


def test_failed_compile_span(tel: Telemetry, exporter: InMemorySpanExporter) -> None:
    """A failed compile: status ERROR, error.type, an exception event, the user's code.*."""
    tel.event(failed_compile_event())
    span = only_span(exporter, "safecompile.compile")
    assert span.status.status_code is StatusCode.ERROR
    attributes = dict(span.attributes or {})
    assert attributes["error.type"] == "torch._dynamo.exc.BackendCompilerFailed"
    assert attributes["code.file.path"] == "/srv/app/model.py"
    assert attributes["code.line.number"] == 20
    assert attributes["code.function.name"] == "score"
    assert attributes["safecompile.bucket"] == "x:128"
    assert "code.filepath" not in attributes
    assert "code.lineno" not in attributes
    (exception,) = [e for e in span.events if e.name == "exception"]
    assert dict(exception.attributes or {}) == {
        "exception.type": "torch._dynamo.exc.BackendCompilerFailed",
        "exception.message": "backend='inductor' raised: LoweringException: no lowering",
    }


def test_rollback_span_for_an_error(tel: Telemetry, exporter: InMemorySpanExporter) -> None:
    """A rollback on an error: reason, error.type, code.* and the generated file."""
    tel.event(rollback_event())
    span = only_span(exporter, "safecompile.rollback")
    attributes = dict(span.attributes or {})
    assert attributes["safecompile.function"] == FUNCTION
    assert attributes["safecompile.reason"] == "runtime_error"
    assert attributes["error.type"] == "IndexError"
    assert attributes["code.file.path"] == "/srv/app/model.py"
    assert attributes["code.line.number"] == 33
    assert attributes["code.function.name"] == "score"
    assert attributes["safecompile.generated.file"] == "<eval_with_key>.4"
    assert span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]


def test_rollback_span_for_drift(tel: Telemetry, exporter: InMemorySpanExporter) -> None:
    """A drift rollback carries the figures of difference, and no error.type."""
    tel.event(
        rollback_event(
            reason=Reason.DRIFT,
            error_type=None,
            message="max rel diff 0.2 beyond tolerance",
            max_abs_diff=0.5,
            max_rel_diff=0.2,
            details={},
        )
    )
    attributes = dict(only_span(exporter, "safecompile.rollback").attributes or {})
    assert attributes["safecompile.reason"] == "drift"
    assert attributes["safecompile.drift.max_abs"] == 0.5
    assert attributes["safecompile.drift.max_rel"] == 0.2
    assert "error.type" not in attributes


def test_manual_rollback_is_not_an_error(tel: Telemetry, exporter: InMemorySpanExporter) -> None:
    """A manual trip is recorded, not marked as an error."""
    tel.event(rollback_event(reason=Reason.MANUAL, error_type=None, message=None, details={}))
    span = only_span(exporter, "safecompile.rollback")
    assert span.status.status_code is StatusCode.UNSET
    assert dict(span.attributes or {})["safecompile.reason"] == "manual"


def test_other_events_make_no_span(tel: Telemetry, exporter: InMemorySpanExporter) -> None:
    """Only compiles, rollbacks and shadow checks make spans."""
    for kind in (EventKind.RETRY, EventKind.RECOVERED, EventKind.RESET, EventKind.DISABLED):
        tel.event(Event(kind=kind, time=1_700_000_000.0))
    assert exporter.get_finished_spans() == ()


def test_compile_span_parent_is_the_current_span(
    tel: Telemetry, tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A compile on a request's path shows up inside the request's trace."""
    request_tracer = tracer_provider.get_tracer("app")
    with request_tracer.start_as_current_span("request") as request:
        tel.event(compiled_event())
    span = only_span(exporter, "safecompile.compile")
    assert span.parent is not None
    assert span.parent.span_id == request.get_span_context().span_id


def test_shadow_check_spans_only_for_canaries_and_breaches(
    tel: Telemetry, exporter: InMemorySpanExporter
) -> None:
    """No span for a routine passing check; one for a canary check and one for a breach."""
    tel.shadow_check(passed=True, max_abs=1e-7, max_rel=1e-6, bucket="x:64", log_span=False)
    assert exporter.get_finished_spans() == ()
    tel.shadow_check(passed=True, max_abs=1e-7, max_rel=1e-6, bucket="x:64", log_span=True)
    tel.shadow_check(passed=False, max_abs=0.5, max_rel=0.25, bucket=None, log_span=False)
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["safecompile.shadow_check"] * 2
    canary, breach = (dict(s.attributes or {}) for s in spans)
    assert canary == {
        "safecompile.function": FUNCTION,
        "safecompile.result": "pass",
        "safecompile.drift.max_abs": 1e-7,
        "safecompile.drift.max_rel": 1e-6,
        "safecompile.bucket": "x:64",
    }
    assert breach["safecompile.result"] == "breach"
    assert breach["safecompile.drift.max_rel"] == 0.25
    assert spans[1].status.status_code is StatusCode.ERROR


# ---------------------------------------------------------------- metrics


def test_metrics_names_units_and_attributes(tel: Telemetry, reader: InMemoryMetricReader) -> None:
    """Counters and histograms per API.md §4, with their units and attributes."""
    tel.event(compiled_event())
    tel.event(failed_compile_event())
    tel.event(rollback_event())
    tel.event(rollback_event(reason=Reason.DRIFT, error_type=None))
    tel.event(rollback_event())
    for _ in range(3):
        tel.shadow_check(passed=True, max_abs=0.0, max_rel=0.001, bucket=None, log_span=False)
    tel.shadow_check(passed=False, max_abs=1.0, max_rel=0.5, bucket=None, log_span=False)
    tel.shadow_check(passed=False, max_abs=1.0, max_rel=float("nan"), bucket=None, log_span=False)

    found = metrics_by_name(reader)
    duration = found["safecompile.compile.duration"]
    assert duration.unit == "s"
    by_attributes = points(duration)
    ok = by_attributes[(("safecompile.function", FUNCTION),)]
    failed = by_attributes[
        (
            ("error.type", "torch._dynamo.exc.BackendCompilerFailed"),
            ("safecompile.function", FUNCTION),
        )
    ]
    assert (ok.count, ok.sum) == (1, 2.5)
    assert (failed.count, failed.sum) == (1, 0.75)

    rollbacks = found["safecompile.rollbacks"]
    assert rollbacks.unit == "{rollback}"
    assert {k: p.value for k, p in points(rollbacks).items()} == {
        (("safecompile.function", FUNCTION), ("safecompile.reason", "runtime_error")): 2,
        (("safecompile.function", FUNCTION), ("safecompile.reason", "drift")): 1,
    }

    checks = found["safecompile.shadow.checks"]
    assert checks.unit == "{check}"
    assert {k: p.value for k, p in points(checks).items()} == {
        (("safecompile.function", FUNCTION), ("safecompile.result", "pass")): 3,
        (("safecompile.function", FUNCTION), ("safecompile.result", "breach")): 2,
    }

    drift = found["safecompile.drift"]
    assert drift.unit == "1"
    (point,) = drift.data.data_points
    assert dict(point.attributes) == {"safecompile.function": FUNCTION}
    assert point.count == 4  # the NaN check is counted above, not recorded here
    assert point.max == 0.5


class Counts:
    """Stands in for a controller: call counts read through a bound method."""

    def __init__(self, compiled: int, eager: int) -> None:
        self.compiled = compiled
        self.eager = eager

    def read(self) -> tuple[int, int]:
        return self.compiled, self.eager


def calls_points(reader: InMemoryMetricReader) -> dict[tuple[str, str], int]:
    metric = metrics_by_name(reader)["safecompile.calls"]
    assert metric.unit == "{call}"
    assert metric.data.is_monotonic
    return {
        (p.attributes["safecompile.function"], p.attributes["safecompile.path"]): p.value
        for p in metric.data.data_points
    }


def test_observable_calls_counter(
    tracer_provider: TracerProvider, meter_provider: MeterProvider, reader: InMemoryMetricReader
) -> None:
    """Call counts are read at collection; callables sharing a name are summed."""
    first = Telemetry(
        function=FUNCTION, tracer_provider=tracer_provider, meter_provider=meter_provider
    )
    second = Telemetry(
        function=FUNCTION, tracer_provider=tracer_provider, meter_provider=meter_provider
    )
    other = Telemetry(
        function="embed.forward", tracer_provider=tracer_provider, meter_provider=meter_provider
    )
    a, b, c = Counts(5, 2), Counts(1, 1), Counts(0, 4)
    first.observe_calls(a.read)
    second.observe_calls(b.read)
    other.observe_calls(c.read)
    assert calls_points(reader) == {
        (FUNCTION, "compiled"): 6,
        (FUNCTION, "eager"): 3,
        ("embed.forward", "compiled"): 0,
        ("embed.forward", "eager"): 4,
    }
    a.compiled += 10
    assert calls_points(reader)[(FUNCTION, "compiled")] == 16


def test_observed_source_vanishes_when_collected(
    tracer_provider: TracerProvider, meter_provider: MeterProvider, reader: InMemoryMetricReader
) -> None:
    """A collected callable is not kept alive, its callback never raises, and the counter
    keeps the counts last read (it never goes down)."""
    tel = Telemetry(
        function="gone.fn", tracer_provider=tracer_provider, meter_provider=meter_provider
    )
    counts = Counts(3, 1)
    tel.observe_calls(counts.read)
    assert calls_points(reader)[("gone.fn", "compiled")] == 3
    counts.compiled = 4
    del counts
    gc.collect()
    assert calls_points(reader) == {("gone.fn", "compiled"): 3, ("gone.fn", "eager"): 1}
    assert not any(entry.function == "gone.fn" for entry in telemetry_module._live_entries())


def test_observed_telemetry_collected_with_its_owner(
    tracer_provider: TracerProvider, meter_provider: MeterProvider, reader: InMemoryMetricReader
) -> None:
    """A guarded callable and its Telemetry referencing each other are both collected."""

    class Owner:
        def __init__(self) -> None:
            self.tel = Telemetry(
                function="owned.fn", tracer_provider=tracer_provider, meter_provider=meter_provider
            )
            self.tel.observe_calls(self.read)

        def read(self) -> tuple[int, int]:
            return 2, 0

    owner = Owner()
    assert calls_points(reader)[("owned.fn", "compiled")] == 2
    del owner
    gc.collect()
    assert calls_points(reader)[("owned.fn", "compiled")] == 2
    assert not any(e.function == "owned.fn" for e in telemetry_module._live_entries())


def test_a_raising_source_is_skipped(
    tel: Telemetry, reader: InMemoryMetricReader, caplog: pytest.LogCaptureFixture
) -> None:
    """A source that raises keeps its last counts; the reader sees no error."""
    state = {"fail": False}

    class Flaky:
        def read(self) -> tuple[int, int]:
            if state["fail"]:
                raise RuntimeError("count failed")
            return 7, 1

    flaky = Flaky()
    tel.observe_calls(flaky.read)
    assert calls_points(reader)[(FUNCTION, "compiled")] == 7
    state["fail"] = True
    assert calls_points(reader)[(FUNCTION, "compiled")] == 7


# ---------------------------------------------------------------- configure and globals


def test_configure_applies_to_callables_made_before(
    tracer_provider: TracerProvider,
    meter_provider: MeterProvider,
    exporter: InMemorySpanExporter,
    reader: InMemoryMetricReader,
) -> None:
    """``configure()`` after decoration reaches existing callables; globals are untouched."""
    tel = Telemetry(function="late.fn")
    counts = Counts(1, 2)
    tel.observe_calls(counts.read)
    configure(tracer_provider=tracer_provider, meter_provider=meter_provider)
    tel.event(rollback_event())
    assert only_span(exporter, "safecompile.rollback").attributes is not None
    assert calls_points(reader)[("late.fn", "eager")] == 2
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


# ---------------------------------------------------------------- never breaks


class RaisingTracer(trace.Tracer):
    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        raise RuntimeError("tracer broken")

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tracer broken")


class RaisingTracerProvider(trace.TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return RaisingTracer()


class BrokenTracerProvider(trace.TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        raise RuntimeError("provider broken")


class BrokenMeterProvider(MeterProvider):
    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("meter provider broken")


@pytest.mark.parametrize("tracer_provider_cls", [RaisingTracerProvider, BrokenTracerProvider])
def test_broken_providers_never_break_anything(
    tracer_provider_cls: type[trace.TracerProvider], meter_provider: MeterProvider
) -> None:
    """A tracer or meter that raises: every telemetry call returns quietly, logs still flow."""
    with structlog.testing.capture_logs() as logs:
        for meter in (meter_provider, BrokenMeterProvider(shutdown_on_exit=False)):
            tel = Telemetry(
                function=FUNCTION, tracer_provider=tracer_provider_cls(), meter_provider=meter
            )
            tel.event(compiled_event())
            tel.event(failed_compile_event())
            tel.event(rollback_event())
            tel.shadow_check(passed=False, max_abs=1.0, max_rel=1.0, bucket=None, log_span=True)
            tel.observe_calls(Counts(1, 1).read)
    assert [e["event"] for e in logs] == [
        "safecompile.compiled",
        "safecompile.compile_failed",
        "safecompile.rollback",
    ] * 2


def test_a_broken_meter_leaves_spans_alone(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """Each sink fails on its own: a meter provider that raises does not cost the spans."""
    tel = Telemetry(
        function=FUNCTION,
        tracer_provider=tracer_provider,
        meter_provider=BrokenMeterProvider(shutdown_on_exit=False),
    )
    tel.event(rollback_event())
    tel.shadow_check(passed=False, max_abs=1.0, max_rel=1.0, bucket=None, log_span=False)
    assert only_span(exporter, "safecompile.rollback") is not None
    assert only_span(exporter, "safecompile.shadow_check") is not None


def test_a_malformed_event_is_still_reported(
    tel: Telemetry,
    exporter: InMemorySpanExporter,
    reader: InMemoryMetricReader,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Odd details (not dicts, wrong types) are tolerated: every sink still reports the
    event, and no sink fails (``event()`` swallows failures, so they are watched here)."""
    failures: list[str] = []
    monkeypatch.setattr(
        telemetry_module, "report_internal_error", lambda where, exc: failures.append(where)
    )
    with structlog.testing.capture_logs() as logs:
        tel.event(
            compiled_event(details={"graph_breaks": ["not a dict", {"line": "x"}], "graphs": 1})
        )
        tel.event(Event(kind=EventKind.ROLLBACK))
        tel.shadow_check(passed=True, max_abs=float("inf"), max_rel=float("inf"))
    assert failures == []
    assert [e["event"] for e in logs] == ["safecompile.compiled", "safecompile.rollback"]
    assert logs[0]["graph_breaks"] == 2
    compile_span = only_span(exporter, "safecompile.compile")
    assert compile_span.attributes is not None
    assert compile_span.attributes["safecompile.graph_breaks"] == 2
    assert [e.name for e in compile_span.events] == ["safecompile.graph_break"] * 2
    assert only_span(exporter, "safecompile.rollback").attributes is not None
    found = metrics_by_name(reader)
    assert {k: p.value for k, p in points(found["safecompile.rollbacks"]).items()} == {
        (("safecompile.function", FUNCTION), ("safecompile.reason", "unknown")): 1
    }
    (check,) = found["safecompile.shadow.checks"].data.data_points
    assert check.value == 1


# ---------------------------------------------------------------- no tensor values


def test_a_tensor_value_never_leaves_the_process(
    tel: Telemetry,
    exporter: InMemorySpanExporter,
    reader: InMemoryMetricReader,
    caplog: pytest.LogCaptureFixture,
    unconfigured_structlog: None,
) -> None:
    """A distinctive value in the failing input is absent from every span, metric and log."""
    x = torch.full((2, 2), SECRET)
    error = RuntimeError(f"kernel failed on {x}")
    assert "8675309" in str(error)
    message = safe_message(error)  # what the controller puts on the Event
    caplog.set_level(logging.DEBUG, logger="safecompile")
    with structlog.testing.capture_logs() as logs:
        tel.event(dataclasses.replace(failed_compile_event(), message=message))
        tel.event(rollback_event(message=str(error)))  # even a raw message is scrubbed
        tel.shadow_check(passed=False, max_abs=0.5, max_rel=0.1, bucket="x:2", log_span=True)
    structlog.reset_defaults()
    tel.event(rollback_event(message=str(error)))  # through stdlib logging too

    texts = [repr(logs), repr(metrics_by_name(reader))]
    for span in exporter.get_finished_spans():
        texts.append(span.to_json())
    for record in caplog.records:
        texts.append(repr(vars(record)))
        texts.append(record.getMessage())
    assert len(exporter.get_finished_spans()) == 4
    assert any("description" in vars(r) for r in caplog.records)
    for text in texts:
        assert "8675309" not in text
        assert "8.6753e+06" not in text


# ---------------------------------------------------------------- logs


def test_capture_logs_sees_one_event_per_state_change(
    tel: Telemetry, exporter: InMemorySpanExporter
) -> None:
    """Every event is one structlog event named ``safecompile.<kind>``; shadow checks none."""
    with structlog.testing.capture_logs() as logs:
        tel.event(compiled_event())
        for _ in range(5):
            tel.shadow_check(passed=True, max_abs=0.0, max_rel=0.0, bucket=None, log_span=True)
        tel.event(rollback_event())
        tel.event(Event(kind=EventKind.RESET, time=1.0))
    assert [e["event"] for e in logs] == [
        "safecompile.compiled",
        "safecompile.rollback",
        "safecompile.reset",
    ]
    compiled, rollback, reset = logs
    assert compiled["log_level"] == "info"
    assert compiled["function"] == FUNCTION
    assert compiled["bucket"] == "x:64"
    assert compiled["duration_s"] == 2.5
    assert compiled["graph_breaks"] == 1
    assert compiled["graph_break_lines"] == ["/srv/app/model.py:14"]
    span = only_span(exporter, "safecompile.compile")
    context = span.get_span_context()
    assert context is not None
    assert compiled["trace_id"] == trace.format_trace_id(context.trace_id)
    assert compiled["span_id"] == trace.format_span_id(context.span_id)
    assert rollback["log_level"] == "warning"
    assert rollback["reason"] == "runtime_error"
    assert rollback["error_type"] == "IndexError"
    assert rollback["code_file"] == "/srv/app/model.py"
    assert rollback["code_line"] == 33
    assert rollback["code_function"] == "score"
    assert rollback["generated_file"] == "<eval_with_key>.4"
    assert "trace_id" not in reset  # no span current, none made


def test_log_carries_the_current_span(tel: Telemetry, tracer_provider: TracerProvider) -> None:
    """An event without a span of its own is logged with the current span's ids."""
    with (
        structlog.testing.capture_logs() as logs,
        tracer_provider.get_tracer("app").start_as_current_span("request") as request,
    ):
        tel.event(Event(kind=EventKind.RECOMPILE_LIMIT, time=1.0))
    (entry,) = logs
    assert entry["span_id"] == trace.format_span_id(request.get_span_context().span_id)


def test_silent_when_nothing_is_configured(
    tel: Telemetry, capsys: pytest.CaptureFixture[str], unconfigured_structlog: None
) -> None:
    """Unconfigured structlog and logging: nothing on stdout or stderr."""
    tel.event(compiled_event())
    tel.event(failed_compile_event())
    tel.event(rollback_event())
    assert not structlog.is_configured()
    out, err = capsys.readouterr()
    assert (out, err) == ("", "")


def test_stdlib_logging_gets_fields_as_extra(
    tel: Telemetry, caplog: pytest.LogCaptureFixture, unconfigured_structlog: None
) -> None:
    """Without structlog configured, events reach stdlib logging with fields as ``extra``
    and one readable line as the message."""
    caplog.set_level(logging.INFO, logger="safecompile")
    tel.event(rollback_event())
    (record,) = [r for r in caplog.records if r.name == "safecompile"]
    assert record.getMessage() == (
        "rollback ranker.score [runtime_error]: "
        "index 7 is out of bounds for dimension 0 with size 3 (at model.py:33)"
    )
    assert record.levelno == logging.WARNING
    fields = vars(record)
    assert fields["safecompile_event"] == "safecompile.rollback"
    assert fields["reason"] == "runtime_error"
    assert fields["code_line"] == 33
    assert fields["function"] == FUNCTION


def test_stdlib_logging_respects_levels(
    tel: Telemetry, caplog: pytest.LogCaptureFixture, unconfigured_structlog: None
) -> None:
    """At WARNING, a successful compile (INFO) is filtered out before any work."""
    caplog.set_level(logging.WARNING, logger="safecompile")
    tel.event(compiled_event())
    tel.event(rollback_event())
    assert [r.safecompile_event for r in caplog.records if r.name == "safecompile"] == [
        "safecompile.rollback"
    ]
