"""Prometheus for the examples: an OpenTelemetry meter provider read by a Prometheus registry.

Needs the ``prometheus`` extra (``pip install -e '.[prometheus]'``): the OpenTelemetry
SDK, ``opentelemetry-exporter-prometheus`` and ``prometheus-client``.
"""

from __future__ import annotations

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import REGISTRY, generate_latest


def prometheus_meter_provider() -> MeterProvider:
    """A meter provider whose metrics prometheus_client's default registry serves (its
    ``start_http_server``, or :func:`exposition`): hand it to
    ``safe_compile(meter_provider=...)``. One per process. The ``otel_scope_*`` labels
    (the instrumentation scope, the same on every safecompile series) are left out, so
    each series is one short line."""
    return MeterProvider(metric_readers=[PrometheusMetricReader(scope_info_enabled=False)])


def exposition() -> str:
    """What a Prometheus scrape of this process reads, in the text format."""
    return generate_latest(REGISTRY).decode("utf-8")


def safecompile_lines(exposition: str, *, buckets: bool = False) -> list[str]:
    """The ``safecompile_*`` samples of a Prometheus text exposition (``/metrics``);
    histogram ``_bucket`` lines only with ``buckets=True``."""
    lines = [line for line in exposition.splitlines() if line.startswith("safecompile_")]
    return lines if buckets else [line for line in lines if "_bucket{" not in line]
