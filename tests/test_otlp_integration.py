"""A rollback span travels over real OTLP/HTTP (protobuf) to a receiver on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch._dynamo
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from otlp_receiver import OTLPReceiver, attributes_of

from safecompile.base.model import Event, EventKind, Reason
from safecompile.observe.source import error_type_name, location_of_error, safe_message
from safecompile.observe.telemetry import Telemetry

HERE = str(Path(__file__).resolve())


def marked(marker: str) -> int:
    lines = Path(HERE).read_text().splitlines()
    (line,) = [n for n, t in enumerate(lines, 1) if t.rstrip().endswith(f"# <- {marker}")]
    return line


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    y = x.exp()
    return y[index]  # <- fails at run time


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver(max_seconds=60) as running:
        yield running


def test_rollback_span_arrives_over_otlp_http(receiver: OTLPReceiver) -> None:
    """The rollback span and its code.* attributes arrive decoded at the receiver."""
    torch._dynamo.reset()
    compiled = torch.compile(gather, backend="eager")
    with pytest.raises(IndexError) as info:
        compiled(torch.randn(4), torch.tensor([11]))
    where, generated = location_of_error(info.value, gather)
    assert where is not None
    event = Event(  # as the controller builds it
        kind=EventKind.ROLLBACK,
        reason=Reason.RUNTIME_ERROR,
        time=time.time(),
        bucket="x:4",
        error_type=error_type_name(info.value),
        message=safe_message(info.value),
        file=where.file,
        line=where.line,
        function=where.function,
        details={"generated_file": generated},
    )

    provider = TracerProvider(
        resource=Resource.create({"service.name": "safecompile-tests"}), shutdown_on_exit=False
    )
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.traces_endpoint, timeout=5))
    )
    try:
        Telemetry(function="tests.gather", backend="eager", tracer_provider=provider).event(event)
        spans = receiver.wait_for_spans(1, timeout=10)
    finally:
        provider.shutdown()
        torch._dynamo.reset()

    assert receiver.errors == []
    assert [s.name for s in spans] == ["safecompile.rollback"]
    assert receiver.scopes == ["safecompile"]
    (span,) = spans
    attributes = attributes_of(span)
    assert attributes["safecompile.function"] == "tests.gather"
    assert attributes["safecompile.reason"] == "runtime_error"
    assert attributes["error.type"] == "IndexError"
    assert attributes["code.file.path"] == HERE
    assert attributes["code.line.number"] == marked("fails at run time")
    assert attributes["code.function.name"] == "gather"
    assert str(attributes["safecompile.generated.file"]).startswith("<eval_with_key>")
    assert span.status.code == span.status.STATUS_CODE_ERROR
    (exception,) = [e for e in span.events if e.name == "exception"]
    assert attributes_of(exception)["exception.type"] == "IndexError"
    resource = receiver.requests[0].resource_spans[0].resource
    assert attributes_of(resource)["service.name"] == "safecompile-tests"


def test_receiver_stops_by_itself() -> None:
    """Left running, the receiver shuts itself down after its bound."""
    receiver = OTLPReceiver(max_seconds=0.2).start()
    deadline = time.monotonic() + 5
    while receiver._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not receiver._thread.is_alive()
    assert receiver.wait_for_spans(1, timeout=0.1) == []
