"""Shared fixtures: every test starts with the kill switch off and a fresh fake clock."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import safecompile
from safecompile.testing import FakeClock

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


@pytest.fixture(autouse=True)
def _clean_switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test leaks a kill-switch setting into the next."""
    monkeypatch.delenv(safecompile.ENV_VAR, raising=False)
    safecompile.enable()
    yield
    safecompile.enable()


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when the test says so."""
    return FakeClock()


@pytest.fixture
def x() -> torch.Tensor:
    """A small input."""
    return torch.randn(4, 8)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    """Spans finished in a test, kept in memory."""
    return InMemorySpanExporter()


@pytest.fixture
def tracer_provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    """An SDK tracer provider for one test (never the global one)."""
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


@pytest.fixture
def reader() -> InMemoryMetricReader:
    """Metrics collected in a test, read on demand."""
    return InMemoryMetricReader()


@pytest.fixture
def meter_provider(reader: InMemoryMetricReader) -> Iterator[MeterProvider]:
    """An SDK meter provider for one test (never the global one)."""
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    yield provider
    provider.shutdown()
