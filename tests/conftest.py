"""Shared fixtures: every test starts with the kill switch off and a fresh fake clock."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer, require_redis_server

import safecompile
from safecompile.base import torchcompat
from safecompile.testing import FakeClock

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped where no CUDA GPU is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none available)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test leaks a kill-switch setting into the next."""
    monkeypatch.delenv(safecompile.ENV_VAR, raising=False)
    safecompile.enable()
    yield
    safecompile.enable()


# The operator's key for signed cache entries (docs/security.md), the same in every test
# and in the processes tests start; tests of keyless behaviour delete it.
TEST_CACHE_KEY = "safecompile-tests-key-0123456789"


@pytest.fixture(autouse=True)
def _cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache entries are signed and verified under ``TEST_CACHE_KEY`` in every test."""
    monkeypatch.setenv("SAFECOMPILE_CACHE_KEY", TEST_CACHE_KEY)
    monkeypatch.delenv("SAFECOMPILE_CACHE_KEY_FILE", raising=False)


# torch before 2.13 has no per-function recompile limit: every torch.compile of one code
# object (a test module's shared function) counts against dynamo's global limit of 8.
_SHARED_LIMIT = isinstance(torchcompat.per_function_limit(8), torchcompat.Missing)


@pytest.fixture(autouse=True)
def _fresh_dynamo_where_limits_are_shared() -> None:
    """There, each test starts with dynamo's caches empty, as it does in its own process."""
    if _SHARED_LIMIT:
        torch.compiler.reset()


@pytest.fixture(scope="session")
def example_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment an example runs in as a subprocess: the cheap ``aot_eager`` backend
    (``SAFECOMPILE_EXAMPLE_BACKEND``), a fresh cache directory, the kill switch off, and no
    ``OTEL_*`` exporter settings (spans go to the console)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.pop(safecompile.ENV_VAR, None)
    env.update(
        SAFECOMPILE_EXAMPLE_BACKEND="aot_eager",
        SAFECOMPILE_CACHE_DIR=str(tmp_path_factory.mktemp("example-cache")),
        SAFECOMPILE_CACHE_KEY=TEST_CACHE_KEY,
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture(scope="session")
def prometheus_value() -> Callable[..., float]:
    """``value(exposition, name, **labels)``: the sum of the samples called ``name`` in a
    Prometheus text exposition whose labels include ``safecompile_<label>=<value>`` for
    each keyword (0 when there is none)."""

    def value(exposition: str, name: str, **labels: str) -> float:
        wanted = {f"safecompile_{k}": v for k, v in labels.items()}
        return sum(
            sample.value
            for family in text_string_to_metric_families(exposition)
            for sample in family.samples
            if sample.name == name and wanted.items() <= sample.labels.items()
        )

    return value


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real ``redis-server`` on 127.0.0.1 for the session: skipped when none is installed,
    a failure then under ``SAFECOMPILE_REQUIRE_REDIS=1`` (see ``tests/redis_server.py``)."""
    server = RedisServer.start(require_redis_server())
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied for this test."""
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


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
