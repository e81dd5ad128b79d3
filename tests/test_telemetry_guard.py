"""Telemetry end to end: guarded calls, through ``safe_compile``, into real OpenTelemetry SDKs.

Every provider is built in a fixture and passed to the decorator (OpenTelemetry's globals are
never touched). Failures are mapped to lines of this file marked ``# <- ...``: the line
numbers are read from the file, never written down.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import structlog.testing
import torch
import torch._dynamo
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import safecompile
from safecompile import Event, EventKind, Reason, Shadow, State, safe_compile
from safecompile.testing import DriftingBackend, FailingBackend, RuntimeFailingBackend

HERE = str(Path(__file__).resolve())
SECRET = 123456.789  # a distinctive tensor value: it must never leave the process
# How SECRET may be written out: plainly, as float32 rounds it, or as torch prints it.
NEEDLES = ("123456", "1.2346e+05", "1.2345e+05", "1.23457e+05", "1.23456e+05")


def marked(marker: str) -> int:
    """The number of the one line of this file that ends with ``# <- marker``."""
    lines = Path(HERE).read_text(encoding="utf-8").splitlines()
    found = [n for n, text in enumerate(lines, 1) if text.rstrip().endswith(f"# <- {marker}")]
    assert len(found) == 1, f"marker {marker!r} found {len(found)} times"
    return found[0]


# ---------------------------------------------------------------------------- user code


def two_breaks(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    torch._dynamo.graph_break()  # <- first graph break
    y = y + 1
    if y.sum() > 0:  # <- second graph break
        return y.sin()
    return y.cos()


def branchy(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    if y.sum() > 0:  # <- fullgraph failure
        return y + 1
    return y - 1


def affine(x: torch.Tensor) -> torch.Tensor:  # <- def of affine
    return x * 3 + 1


def exp_then_add(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    z = y.exp()  # <- miscompiled exp
    return z + 1


def scale(x: torch.Tensor) -> torch.Tensor:  # <- def of scale
    return x * 0.5


class MiscompileExp:
    """A backend whose compiled code fails where the user's ``.exp()`` was: a real error
    raised by an aten op inside generated code, on a call that eager answers fine."""

    __name__ = "MiscompileExp"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        for node in gm.graph.nodes:
            if node.op == "call_method" and node.target == "exp":
                node.op = "call_function"
                node.target = torch.ops.aten.view.default
                node.args = (node.args[0], [-1, 3])  # 4 elements do not fit rows of 3
        gm.recompile()
        return gm.forward


def user_kernel(*args: Any) -> torch.Tensor:
    raise RuntimeError("user kernel failed")  # <- user kernel raises


class UserKernelBackend:
    """A backend that runs the user's own Python kernel in place of ``.exp()``."""

    __name__ = "UserKernelBackend"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        for node in gm.graph.nodes:
            if node.op == "call_method" and node.target == "exp":
                node.op = "call_function"
                node.target = user_kernel
        gm.recompile()
        return gm.forward


class LeakyBackend:
    """A backend that fails with its (real) example inputs in the message."""

    __name__ = "LeakyBackend"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        raise RuntimeError(f"cannot lower inputs {example_inputs}")


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture
def guard(tracer_provider: TracerProvider, meter_provider: MeterProvider) -> Callable[..., Any]:
    """``safe_compile`` with this test's providers (and no shadow checks unless asked)."""

    def make(fn: Callable[..., Any], **options: Any) -> Any:
        options.setdefault("backend", "eager")
        options.setdefault("shadow", None)
        return safe_compile(
            fn, tracer_provider=tracer_provider, meter_provider=meter_provider, **options
        )

    return make


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No compiled code, persisted verdict, structlog configuration or configure() leaks
    between tests: every compile here is a real one, with its span."""
    monkeypatch.delenv("SAFECOMPILE_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    structlog.reset_defaults()
    safecompile.configure()


# ---------------------------------------------------------------------------- helpers


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def only_span(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = spans_named(exporter, name)
    assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
    return found[0]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def code_of(attributes: dict[str, Any]) -> tuple[Any, Any, Any]:
    return (
        attributes.get("code.file.path"),
        attributes.get("code.line.number"),
        attributes.get("code.function.name"),
    )


def events_of(guarded: Any, kind: EventKind) -> list[Event]:
    return [e for e in guarded.safecompile.events() if e.kind is kind]


def assert_event_matches_span(event: Event, span: ReadableSpan) -> None:
    """The controller's event and the span name the same source location."""
    assert code_of(attrs(span)) == (event.file, event.line, event.function)


def data_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """Every data point collected now, by metric name."""
    out: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    if data is None:
        return out
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


def by_attribute(points: list[Any], key: str, function: str) -> dict[Any, Any]:
    return {
        p.attributes[key]: p for p in points if p.attributes["safecompile.function"] == function
    }


# ---------------------------------------------------------------------------- source mapping


def test_graph_breaks_are_span_events_at_their_lines(
    guard: Callable[..., Any], exporter: InMemorySpanExporter
) -> None:
    """Each graph break is one ``safecompile.graph_break`` event, on the compile span of
    the graph where it first shows (one span per graph), with its reason and the
    ``code.*`` location of the break; the call still succeeds."""
    g = guard(two_breaks, name="tests.two_breaks")
    x = torch.ones(4)
    torch.testing.assert_close(g(x), two_breaks(x))

    spans = spans_named(exporter, "safecompile.compile")
    assert len(spans) == 3  # two breaks: three graphs
    for span in spans:
        attributes = attrs(span)
        assert attributes["safecompile.function"] == "tests.two_breaks"
        assert attributes["safecompile.backend"] == "eager"
        assert "safecompile.bucket" in attributes
        assert span.status.status_code is StatusCode.UNSET
    assert sum(attrs(span)["safecompile.graph_breaks"] for span in spans) == 2
    breaks = [e for span in spans for e in span.events if e.name == "safecompile.graph_break"]
    located = sorted(
        (e.attributes["code.line.number"], e.attributes["code.file.path"]) for e in breaks
    )
    assert located == [
        (marked("first graph break"), HERE),
        (marked("second graph break"), HERE),
    ]
    for event in breaks:
        assert event.attributes["code.function.name"] == "two_breaks"
        assert event.attributes["safecompile.graph_break.reason"]
    first = next(
        e for e in breaks if e.attributes["code.line.number"] == marked("first graph break")
    )
    assert "graph_break()" in first.attributes["safecompile.graph_break.reason"]

    compiled = events_of(g, EventKind.COMPILED)
    assert len(compiled) == 3
    for event, span in zip(compiled, spans, strict=True):
        assert_event_matches_span(event, span)
    lines = sorted(b["line"] for e in compiled for b in e.details["graph_breaks"])
    assert lines == [marked("first graph break"), marked("second graph break")]
    assert g.safecompile.stats().graph_breaks == 2


def test_fullgraph_failure_points_at_the_offending_line(
    guard: Callable[..., Any], exporter: InMemorySpanExporter
) -> None:
    """``fullgraph=True`` with a graph break: compile span and rollback span are errors and
    both point at the line dynamo could not trace."""
    g = guard(branchy, fullgraph=True)
    x = torch.ones(3)
    torch.testing.assert_close(g(x), branchy(x))
    assert g.safecompile.state == State.ROLLED_BACK

    expected = (HERE, marked("fullgraph failure"), "branchy")
    compile_span = only_span(exporter, "safecompile.compile")
    rollback_span = only_span(exporter, "safecompile.rollback")
    for span in (compile_span, rollback_span):
        attributes = attrs(span)
        assert span.status.status_code is StatusCode.ERROR
        assert attributes["error.type"] == "torch._dynamo.exc.Unsupported"
        assert code_of(attributes) == expected
        (exception,) = [e for e in span.events if e.name == "exception"]
        assert exception.attributes["exception.type"] == "torch._dynamo.exc.Unsupported"
    assert attrs(rollback_span)["safecompile.reason"] == "compile_error"

    (failed,) = events_of(g, EventKind.COMPILE_FAILED)
    (rollback,) = events_of(g, EventKind.ROLLBACK)
    assert_event_matches_span(failed, compile_span)
    assert_event_matches_span(rollback, rollback_span)


def test_backend_failure_points_at_the_function(
    guard: Callable[..., Any], exporter: InMemorySpanExporter
) -> None:
    """A backend raising with no user frame: the guarded function's own ``def`` line."""
    g = guard(affine, backend=FailingBackend())
    x = torch.ones(4)
    torch.testing.assert_close(g(x), affine(x))

    expected = (HERE, marked("def of affine"), "affine")
    compile_span = only_span(exporter, "safecompile.compile")
    rollback_span = only_span(exporter, "safecompile.rollback")
    for span in (compile_span, rollback_span):
        assert span.status.status_code is StatusCode.ERROR
        assert attrs(span)["error.type"] == "torch._dynamo.exc.BackendCompilerFailed"
        assert attrs(span)["safecompile.backend"] == "FailingBackend"
        assert code_of(attrs(span)) == expected
    assert attrs(rollback_span)["safecompile.reason"] == "compile_error"
    assert_event_matches_span(events_of(g, EventKind.COMPILE_FAILED)[0], compile_span)
    assert_event_matches_span(events_of(g, EventKind.ROLLBACK)[0], rollback_span)


def test_injected_runtime_failure_points_at_the_function(
    guard: Callable[..., Any], exporter: InMemorySpanExporter
) -> None:
    """``RuntimeFailingBackend``: the compiled call raises from safecompile's own test code,
    never reported as the user's; the guarded function's ``def`` line is."""
    g = guard(scale, backend=RuntimeFailingBackend(on_run=2))
    x = torch.ones(4)
    g(x)
    torch.testing.assert_close(g(x), scale(x))
    assert g.safecompile.state == State.ROLLED_BACK

    assert spans_named(exporter, "safecompile.compile")[0].status.status_code is StatusCode.UNSET
    span = only_span(exporter, "safecompile.rollback")
    attributes = attrs(span)
    assert attributes["safecompile.reason"] == "runtime_error"
    assert attributes["error.type"] == "safecompile.testing.InjectedRuntimeError"
    assert code_of(attributes) == (HERE, marked("def of scale"), "scale")
    assert span.status.status_code is StatusCode.ERROR
    assert_event_matches_span(events_of(g, EventKind.ROLLBACK)[0], span)


def test_runtime_error_in_generated_code_points_at_the_user_line(
    guard: Callable[..., Any], exporter: InMemorySpanExporter
) -> None:
    """An aten op failing inside compiled code: the user's line that produced the FX node,
    and the generated file it ran in, as its own attribute."""
    g = guard(exp_then_add, backend=MiscompileExp())
    x = torch.ones(4)
    torch.testing.assert_close(g(x), exp_then_add(x))
    assert g.safecompile.state == State.ROLLED_BACK

    span = only_span(exporter, "safecompile.rollback")
    attributes = attrs(span)
    assert attributes["safecompile.reason"] == "runtime_error"
    assert attributes["error.type"] == "RuntimeError"
    assert code_of(attributes) == (HERE, marked("miscompiled exp"), "exp_then_add")
    assert str(attributes["safecompile.generated.file"]).startswith("<eval_with_key>")
    (rollback,) = events_of(g, EventKind.ROLLBACK)
    assert_event_matches_span(rollback, span)
    assert rollback.details["generated_file"] == attributes["safecompile.generated.file"]


def test_generated_file_is_kept_when_generated_code_calls_user_code(
    guard: Callable[..., Any], exporter: InMemorySpanExporter
) -> None:
    """Generated code calling a user function that raises: the user's raising line, and the
    generated file it was called from."""
    g = guard(exp_then_add, backend=UserKernelBackend())
    g(torch.ones(4))
    attributes = attrs(only_span(exporter, "safecompile.rollback"))
    assert code_of(attributes) == (HERE, marked("user kernel raises"), "user_kernel")
    assert str(attributes.get("safecompile.generated.file")).startswith("<eval_with_key>")


def test_a_compile_whose_first_run_fails_is_still_reported(
    guard: Callable[..., Any], exporter: InMemorySpanExporter, reader: InMemoryMetricReader
) -> None:
    """The compile succeeded before its code failed: it has its span and its duration."""
    g = guard(exp_then_add, name="tests.first_run_fails", backend=MiscompileExp())
    g(torch.ones(4))
    assert g.safecompile.stats().graphs == 1
    span = only_span(exporter, "safecompile.compile")
    assert span.status.status_code is StatusCode.UNSET
    (point,) = data_points(reader)["safecompile.compile.duration"]
    assert point.count == 1
    assert g.safecompile.stats().compiles == 1


def test_logs_carry_the_trace_ids_of_their_spans(
    guard: Callable[..., Any], exporter: InMemorySpanExporter
) -> None:
    """The log event of a compile failure and of its rollback name their spans' ids, and
    the same source location."""
    g = guard(branchy, fullgraph=True)
    with structlog.testing.capture_logs() as logs:
        g(torch.ones(3))
    by_name = {log["event"]: log for log in logs}
    assert set(by_name) == {"safecompile.compile_failed", "safecompile.rollback"}
    for event_name, span_name in (
        ("safecompile.compile_failed", "safecompile.compile"),
        ("safecompile.rollback", "safecompile.rollback"),
    ):
        log = by_name[event_name]
        context = only_span(exporter, span_name).get_span_context()
        assert log["trace_id"] == trace.format_trace_id(context.trace_id)
        assert log["span_id"] == trace.format_span_id(context.span_id)
        assert (log["code_file"], log["code_line"], log["code_function"]) == (
            HERE,
            marked("fullgraph failure"),
            "branchy",
        )
        assert log["log_level"] == "warning"


# ---------------------------------------------------------------------------- metrics


def test_call_counts_equal_stats(guard: Callable[..., Any], reader: InMemoryMetricReader) -> None:
    """``safecompile.calls`` by path sums to ``stats().calls``, compiled and eager each."""
    g = guard(affine, name="tests.calls")
    x = torch.ones(4)
    for _ in range(7):
        g(x)
    g.safecompile.rollback()
    for _ in range(5):
        g(x)
    stats = g.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls) == (7, 5)

    calls = by_attribute(
        data_points(reader)["safecompile.calls"], "safecompile.path", "tests.calls"
    )
    assert calls["compiled"].value == stats.compiled_calls
    assert calls["eager"].value == stats.eager_calls
    assert calls["compiled"].value + calls["eager"].value == stats.calls

    for _ in range(3):  # the counter is cumulative: read again, it has grown
        g(x)
    calls = by_attribute(
        data_points(reader)["safecompile.calls"], "safecompile.path", "tests.calls"
    )
    assert calls["eager"].value == g.safecompile.stats().eager_calls == 8


def test_graphs_gauge_counts_graphs_by_check(
    guard: Callable[..., Any], reader: InMemoryMetricReader
) -> None:
    """``safecompile.graphs``: compiled graphs by where their checks stand; a graph that
    cannot be checked (dropout while training) is counted ``unchecked``."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    g = guard(net, name="tests.graphs", shadow=Shadow(canary=2, every=0))
    x = torch.randn(2, 4)
    g(x)  # training: random numbers, unchecked
    net.eval()
    g(x)  # a second graph: one canary check of two made

    def graphs() -> dict[str, int]:
        points = data_points(reader)["safecompile.graphs"]
        return {
            k: p.value for k, p in by_attribute(points, "safecompile.check", "tests.graphs").items()
        }

    assert graphs() == {"checked": 0, "unchecked": 1, "not_yet": 1, "off": 0}
    g(x)
    assert graphs() == {"checked": 1, "unchecked": 1, "not_yet": 0, "off": 0}
    assert g.safecompile.state.value == "unchecked"


def test_rollbacks_are_counted_by_reason(
    guard: Callable[..., Any], reader: InMemoryMetricReader
) -> None:
    """``safecompile.rollbacks`` has one series per function and reason, each as many as
    the controller counted."""
    x = torch.ones(4)
    compile_error = guard(affine, name="tests.compile_error", backend=FailingBackend())
    runtime_error = guard(
        scale, name="tests.runtime_error", backend=RuntimeFailingBackend(on_run=1)
    )
    drift = guard(
        scale, name="tests.drift", backend=DriftingBackend(), shadow=Shadow(canary=2, every=0)
    )
    manual = guard(affine, name="tests.manual")
    for g in (compile_error, runtime_error, drift, manual):
        g(x)
    manual.safecompile.rollback()

    points = data_points(reader)["safecompile.rollbacks"]
    counted = {
        (p.attributes["safecompile.function"], p.attributes["safecompile.reason"]): p.value
        for p in points
    }
    assert counted == {
        ("tests.compile_error", "compile_error"): 1,
        ("tests.runtime_error", "runtime_error"): 1,
        ("tests.drift", "drift"): 1,
        ("tests.manual", "manual"): 1,
    }
    for g in (compile_error, runtime_error, drift, manual):
        assert g.safecompile.stats().rollbacks == 1


def test_compile_duration_is_recorded_per_compile(
    guard: Callable[..., Any], reader: InMemoryMetricReader, exporter: InMemorySpanExporter
) -> None:
    """One ``safecompile.compile.duration`` point per compiled shape, in seconds, matching
    the events' durations and the compile spans' lengths."""
    g = guard(affine, name="tests.durations", dynamic=False)
    for n in (2, 3, 5):
        g(torch.ones(n))
    compiled = events_of(g, EventKind.COMPILED)
    assert len(compiled) == 3

    (point,) = [
        p
        for p in data_points(reader)["safecompile.compile.duration"]
        if p.attributes == {"safecompile.function": "tests.durations"}
    ]
    assert point.count == 3
    total = sum(e.duration_s or 0.0 for e in compiled)
    assert point.sum == pytest.approx(total)
    assert 0 < point.sum < 60
    assert g.safecompile.stats().compile_seconds == pytest.approx(total)
    spans = spans_named(exporter, "safecompile.compile")
    assert len(spans) == 3
    for span in spans:
        assert span.end_time is not None
        assert span.start_time is not None
        assert span.end_time > span.start_time


def test_failed_compile_duration_is_recorded(
    guard: Callable[..., Any], reader: InMemoryMetricReader, exporter: InMemorySpanExporter
) -> None:
    """A failed compile is timed too: its histogram point is labelled with ``error.type``,
    and its compile span lasts as long."""
    g = guard(branchy, name="tests.failed_duration", fullgraph=True)
    g(torch.ones(3))
    (failed,) = events_of(g, EventKind.COMPILE_FAILED)
    assert failed.duration_s is not None
    assert failed.duration_s > 0

    points = data_points(reader)["safecompile.compile.duration"]
    (point,) = [
        p for p in points if p.attributes["safecompile.function"] == "tests.failed_duration"
    ]
    assert dict(point.attributes) == {
        "safecompile.function": "tests.failed_duration",
        "error.type": "torch._dynamo.exc.Unsupported",
    }
    assert point.count == 1
    assert point.sum == pytest.approx(failed.duration_s)
    span = only_span(exporter, "safecompile.compile")
    assert span.start_time is not None
    assert span.end_time is not None
    assert (span.end_time - span.start_time) / 1e9 == pytest.approx(failed.duration_s, abs=1e-6)


def test_error_type_only_on_failed_compiles(
    guard: Callable[..., Any], reader: InMemoryMetricReader
) -> None:
    """On one meter, a successful compile's duration point has no ``error.type`` attribute
    at all (not an empty one); a failed compile's has it."""
    ok = guard(affine, name="tests.ok")
    broken = guard(branchy, name="tests.broken", fullgraph=True)
    ok(torch.ones(3))
    broken(torch.ones(3))
    points = data_points(reader)["safecompile.compile.duration"]
    assert sorted(sorted(p.attributes.items()) for p in points) == [
        [("error.type", "torch._dynamo.exc.Unsupported"), ("safecompile.function", "tests.broken")],
        [("safecompile.function", "tests.ok")],
    ]


def test_shadow_checks_and_drift_under_a_canary(
    guard: Callable[..., Any], reader: InMemoryMetricReader, exporter: InMemorySpanExporter
) -> None:
    """Canary checks are counted by result; each records its figure in ``safecompile.drift``;
    a breach is counted, recorded and has its own error span."""
    x = torch.linspace(1, 2, 8)
    clean = guard(affine, name="tests.clean", shadow=Shadow(canary=4, every=0))
    for _ in range(10):
        clean(x)
    drifting = guard(
        scale, name="tests.drifting", backend=DriftingBackend(), shadow=Shadow(canary=4, every=0)
    )
    for _ in range(3):
        drifting(x)
    assert clean.safecompile.stats().shadow_checks == 4
    assert drifting.safecompile.stats().shadow_breaches == 1

    points = data_points(reader)
    checks = {
        (p.attributes["safecompile.function"], p.attributes["safecompile.result"]): p.value
        for p in points["safecompile.shadow.checks"]
    }
    # the drifting graph's first run breached; the canary check due on that call still made
    # its eager run (as a peer rank's call would) and compared the traced graph's outputs,
    # which are eager's: one pass
    assert checks == {
        ("tests.clean", "pass"): 4,
        ("tests.drifting", "breach"): 1,
        ("tests.drifting", "pass"): 1,
    }
    drift = {p.attributes["safecompile.function"]: p for p in points["safecompile.drift"]}
    assert drift["tests.clean"].count == 4
    assert drift["tests.clean"].max == 0.0
    assert drift["tests.drifting"].count == 2
    assert drift["tests.drifting"].max == pytest.approx(0.01, rel=1e-3)

    shadow_spans = spans_named(exporter, "safecompile.shadow_check")
    results = sorted(
        (attrs(s)["safecompile.function"], attrs(s)["safecompile.result"]) for s in shadow_spans
    )
    assert results == [("tests.clean", "pass")] * 4 + [("tests.drifting", "breach")] + [
        ("tests.drifting", "pass")
    ]
    (breach,) = [s for s in shadow_spans if attrs(s)["safecompile.result"] == "breach"]
    assert breach.status.status_code is StatusCode.ERROR
    assert attrs(breach)["safecompile.drift.max_rel"] == pytest.approx(0.01, rel=1e-3)
    assert attrs(breach)["safecompile.drift.max_abs"] > 0

    rollback = only_span(exporter, "safecompile.rollback")
    assert attrs(rollback)["safecompile.reason"] == "drift"
    assert (
        attrs(rollback)["safecompile.drift.max_rel"] == attrs(breach)["safecompile.drift.max_rel"]
    )
    assert code_of(attrs(rollback)) == (HERE, marked("def of scale"), "scale")


# ---------------------------------------------------------------------------- logs


def test_logs_are_per_state_change_never_per_call(guard: Callable[..., Any]) -> None:
    """100 calls log one ``compiled`` event; each later state change logs one more, in the
    order the controller recorded them."""
    g = guard(affine, name="tests.quiet", shadow=Shadow(canary=4, every=16))
    x = torch.ones(4)
    with structlog.testing.capture_logs() as logs:
        for _ in range(100):
            g(x)
        assert [log["event"] for log in logs] == ["safecompile.compiled"]
        safecompile.disable("tests.quiet")
        for _ in range(100):
            g(x)
        safecompile.enable()
        for _ in range(100):
            g(x)
        g.safecompile.rollback()
        for _ in range(100):
            g(x)
    assert [log["event"] for log in logs] == [
        "safecompile.compiled",
        "safecompile.disabled",
        "safecompile.enabled",
        "safecompile.rollback",
    ]
    assert [f"safecompile.{e.kind.value}" for e in g.safecompile.events()] == [
        log["event"] for log in logs
    ]
    assert g.safecompile.stats().calls == 400
    assert all(log["function"] == "tests.quiet" for log in logs)


def test_silent_without_logging_configuration(
    guard: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """With structlog and logging left as they are, a failing callable prints nothing."""
    structlog.reset_defaults()
    g = guard(affine, backend=FailingBackend())
    g(torch.ones(4))
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "")


# ---------------------------------------------------------------------------- no values out


def test_tensor_values_never_leave_the_process(
    guard: Callable[..., Any],
    exporter: InMemorySpanExporter,
    reader: InMemoryMetricReader,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A distinctive input value, run through every failure kind (some of whose error
    messages embed the tensor), is in no span, span event, metric attribute, controller
    event, report or log line."""
    x = torch.tensor([1.0, SECRET, 3.0, 4.0])
    assert any(n in repr(x) for n in NEEDLES)  # the needles would find a printed tensor

    def leaking_runtime_error() -> Exception:
        return RuntimeError(f"compiled kernel choked on {x}")

    guarded = [
        guard(two_breaks, name="leak.graph_break"),
        guard(branchy, name="leak.fullgraph", fullgraph=True),
        guard(affine, name="leak.backend", backend=LeakyBackend()),
        guard(
            affine,
            name="leak.injected_compile",
            backend=FailingBackend(error=lambda: RuntimeError(f"cannot compile {x}")),
        ),
        guard(
            scale,
            name="leak.runtime",
            backend=RuntimeFailingBackend(on_run=2, error=leaking_runtime_error),
        ),
        guard(exp_then_add, name="leak.generated", backend=MiscompileExp()),
        guard(
            scale,
            name="leak.drift",
            backend=DriftingBackend(scale=1.001),
            shadow=Shadow(canary=2, every=0),
        ),
        guard(affine, name="leak.clean", shadow=Shadow(canary=2, every=1)),
    ]
    caplog.set_level(logging.DEBUG, logger="safecompile")
    with structlog.testing.capture_logs() as logs:
        for g in guarded:
            for _ in range(3):
                g(x)
    # and through the stdlib logger, when the application has not configured structlog
    structlog.reset_defaults()
    stdlib = guard(
        scale,
        name="leak.stdlib",
        backend=RuntimeFailingBackend(on_run=1, error=leaking_runtime_error),
    )
    stdlib(x)
    guarded.append(stdlib)
    records = [r for r in caplog.records if r.name.startswith("safecompile")]
    assert "safecompile.rollback" in [getattr(r, "safecompile_event", None) for r in records]

    kinds = {e.kind for g in guarded for e in g.safecompile.events()}
    assert {EventKind.COMPILED, EventKind.COMPILE_FAILED, EventKind.ROLLBACK} <= kinds
    assert EventKind.BREACH in kinds
    rollbacks = [g.safecompile.stats().last_rollback for g in guarded]
    messages = " ".join(e.message or "" for e in rollbacks if e is not None)
    assert "tensor(...)" in messages  # the embedded tensors were there, and were redacted
    assert len(exporter.get_finished_spans()) >= 10
    assert logs

    texts: list[str] = []
    for span in exporter.get_finished_spans():
        texts.append(span.name)
        texts.append(str(span.status.description))
        texts.append(json.dumps(attrs(span), default=str))
        texts.extend(json.dumps(dict(e.attributes or {}), default=str) for e in span.events)
    for name, points in data_points(reader).items():
        texts.append(name)
        texts.extend(json.dumps(dict(p.attributes), default=str) for p in points)
    for g in guarded:
        texts.extend(json.dumps(e.to_dict(), default=str) for e in g.safecompile.events())
        texts.append(json.dumps(g.safecompile.report(), default=str))
    texts.extend(json.dumps(log, default=str) for log in logs)
    texts.extend(r.getMessage() + repr(r.__dict__) for r in records)

    leaked = [t for t in texts if any(n in t for n in NEEDLES)]
    assert leaked == []


# ---------------------------------------------------------------------------- providers


class _Broken:
    """Every attribute is a method that raises."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"broken telemetry: {name}")

        return fail


class BrokenTracerProvider(trace.TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        raise RuntimeError("tracer provider is down")


class BrokenMeterProvider(metrics.MeterProvider):
    def get_meter(self, *args: Any, **kwargs: Any) -> metrics.Meter:
        raise RuntimeError("meter provider is down")


class TracerProviderOfBrokenTracers(trace.TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        return _Broken()


class MeterProviderOfBrokenMeters(metrics.MeterProvider):
    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        return _Broken()


@pytest.mark.parametrize(
    ("tracer_provider", "meter_provider"),
    [
        (BrokenTracerProvider(), BrokenMeterProvider()),
        (TracerProviderOfBrokenTracers(), MeterProviderOfBrokenMeters()),
    ],
    ids=["providers-raise", "tracers-and-meters-raise"],
)
def test_broken_providers_never_break_a_call(
    tracer_provider: trace.TracerProvider, meter_provider: metrics.MeterProvider
) -> None:
    """Telemetry that raises everywhere: guarded calls still answer, rollbacks still happen,
    and the controller's own records are intact."""
    x = torch.linspace(1, 2, 4)
    with structlog.testing.capture_logs() as logs:
        ok = safe_compile(
            affine,
            backend="eager",
            shadow=Shadow(canary=2, every=0),
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
        )
        failing = safe_compile(
            scale,
            backend=FailingBackend(),
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
        )
        drifting = safe_compile(
            scale,
            backend=DriftingBackend(),
            shadow=Shadow(canary=2, every=0),
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
        )
        for _ in range(5):
            torch.testing.assert_close(ok(x), affine(x))
            torch.testing.assert_close(failing(x), scale(x))
            torch.testing.assert_close(drifting(x), scale(x))
    assert ok.safecompile.state == State.COMPILED
    assert ok.safecompile.stats().compiled_calls == 5
    assert failing.safecompile.state == State.ROLLED_BACK
    assert drifting.safecompile.state == State.ROLLED_BACK
    assert drifting.safecompile.stats().last_rollback.reason == Reason.DRIFT  # type: ignore[union-attr]
    # logs do not depend on the providers: they still arrive
    assert "safecompile.rollback" in [log["event"] for log in logs]


def test_configure_sets_the_default_providers(
    tracer_provider: TracerProvider,
    exporter: InMemorySpanExporter,
    meter_provider: MeterProvider,
    reader: InMemoryMetricReader,
) -> None:
    """``safecompile.configure()`` reaches callables decorated before it, without providers
    of their own; OpenTelemetry's globals are left alone."""
    g = safe_compile(affine, name="tests.configured", backend=FailingBackend(), shadow=None)
    safecompile.configure(tracer_provider=tracer_provider, meter_provider=meter_provider)
    g(torch.ones(4))
    assert attrs(only_span(exporter, "safecompile.rollback"))["safecompile.function"] == (
        "tests.configured"
    )
    calls = by_attribute(
        data_points(reader)["safecompile.calls"], "safecompile.path", "tests.configured"
    )
    assert calls["eager"].value == 1
    assert trace.get_tracer_provider() is not tracer_provider
    assert metrics.get_meter_provider() is not meter_provider
