"""Traces and logs from guarded models, sent to any OpenTelemetry backend.

    python examples/tracing.py                           # spans printed (stderr)
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:6006 \\
    OTEL_SERVICE_NAME=ranker \\
    OTEL_RESOURCE_ATTRIBUTES=openinference.project.name=safecompile \\
    python examples/tracing.py                           # sent over OTLP/HTTP (Phoenix here)

Needs the ``otel`` extra (``pip install -e '.[otel]'``). The backend is ``aot_eager``
unless ``--backend`` (or ``$SAFECOMPILE_EXAMPLE_BACKEND``) names another, e.g. ``inductor``.
``_common.py`` beside this file holds what the examples share (the ``--backend`` option,
a one-line summary of a guarded callable); it uses safecompile's public API only.

The exporter is configured by the standard ``OTEL_*`` variables only
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``...).
With no endpoint set, spans are printed to stderr instead.

Two guarded callables serve twelve requests, each request in a span of its own:

1. ``featurize`` compiles with a graph break (a ``safecompile.compile`` span with one
   ``safecompile.graph_break`` event that names the line) and is shadow-checked against
   eager for its first calls (``safecompile.shadow_check`` spans);
2. ``Ranker`` is compiled with ``fullgraph=True`` but branches on a tensor's value: its
   compile fails on purpose. The caller still gets eager's answer; the compile span and a
   ``safecompile.rollback`` span carry ``error.type`` and the line that failed.

structlog prints safecompile's events as JSON on stdout (indented here, to read; a log
pipeline would take one object a line), each with the ``trace_id`` and ``span_id`` of its
span: search the trace view for the ``trace_id`` of a log event. Printed spans show each
long text (torch's messages) up to its first line; the exporter sends it whole. No tensor
values are in either.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import structlog
import torch
from _common import add_backend_option, needs_extra, summary
from torch import nn

with needs_extra("otel"):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
        SpanProcessor,
    )

import safecompile
from safecompile import Shadow, safe_compile


def make_tracer_provider() -> tuple[TracerProvider, str]:
    """An SDK provider exporting over OTLP/HTTP when an endpoint is set, else to stderr."""
    resource = Resource.create()  # reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "safecompile-example"}))
    provider = TracerProvider(resource=resource)
    processor: SpanProcessor
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if endpoint:
        # Endpoint (``/v1/traces`` appended to OTEL_EXPORTER_OTLP_ENDPOINT), headers,
        # timeout, compression: all read from the OTEL_* variables by the exporter itself.
        processor = BatchSpanProcessor(OTLPSpanExporter())
        where = f"OTLP/HTTP, endpoint {endpoint}"
    else:
        processor = SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr, formatter=_shown))
        where = "console (stderr): set OTEL_EXPORTER_OTLP_ENDPOINT to export"
    provider.add_span_processor(processor)
    return provider, where


_SHOWN_LIMIT = 120  # characters of a long text value a printed span shows


def _shortened(value: object) -> object:
    if isinstance(value, str) and len(value) > _SHOWN_LIMIT:
        return value.splitlines()[0][: _SHOWN_LIMIT - 1] + "\u2026"
    if isinstance(value, dict):
        return {k: _shortened(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shortened(v) for v in value]
    return value


def _shown(span: ReadableSpan) -> str:
    """A span as the console shows it: indented JSON, long texts cut at their first line."""
    return json.dumps(_shortened(json.loads(span.to_json())), indent=4) + os.linesep


def configure_logging() -> None:
    """JSON on stdout: the application's choice, which safecompile then follows."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(sort_keys=False, indent=2),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )


# ---------------------------------------------------------------------------- the models


def featurize(x: torch.Tensor) -> torch.Tensor:
    """Normalised log features."""
    y = x.abs().log1p()
    torch._dynamo.graph_break()  # a graph break: two graphs, one break reported at this line
    return y / y.norm(dim=-1, keepdim=True)


class Ranker(nn.Module):
    """A two-layer scorer with a data-dependent branch (which ``fullgraph=True`` refuses)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.hidden = nn.Linear(dim, 32)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(x))
        if h.mean() > 0.5:  # data-dependent control flow: the compile fails here
            h = h * 0.5
        out: torch.Tensor = self.out(h)
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_backend_option(parser, "aot_eager")
    parser.add_argument("--requests", type=int, default=12, help="requests to serve")
    args = parser.parse_args(argv)

    configure_logging()
    provider, where = make_tracer_provider()
    print(f"# traces: {where}", file=sys.stderr)
    # Every guarded callable without providers of its own uses this one (the
    # decorator's tracer_provider= would set it for one callable only).
    safecompile.configure(tracer_provider=provider)
    app_tracer = provider.get_tracer("examples.tracing")

    torch.manual_seed(0)
    features = safe_compile(
        featurize,
        name="example.featurize",
        backend=args.backend,
        shadow=Shadow(canary=3, every=0),
    )
    ranker = safe_compile(
        Ranker().eval(), name="example.ranker", backend=args.backend, fullgraph=True
    )

    with torch.no_grad():
        for request in range(args.requests):
            # The application's own span: safecompile's spans become its children.
            with app_tracer.start_as_current_span("example.request") as span:
                span.set_attribute("example.request", request)
                x = torch.randn(8, 16)
                scores = ranker(features(x))
                span.set_attribute("example.batch", int(scores.shape[0]))

    for guarded in (features, ranker):
        print(f"# {summary(guarded)}", file=sys.stderr)
    provider.shutdown()  # flush what is still batched
    return 0


if __name__ == "__main__":
    sys.exit(main())
