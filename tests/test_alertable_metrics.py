"""Metrics an on-call engineer can alert on: the state and the kill switch are series, the
graphs gauge counts graphs that serve, and counters never go down (``reset()`` included).

Scraped both ways a deployment reads them: the SDK's in-memory reader and a Prometheus
exposition, across a rollback, a kill-switch flip and a ``reset()``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

import safecompile
from safecompile import State, safe_compile

NAME = "alerts.scorer"


def scorer(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


class Scrape:
    """One collection of both readers."""

    def __init__(self, memory: InMemoryMetricReader, registry: CollectorRegistry) -> None:
        self.points: dict[str, list[Any]] = {}
        data = memory.get_metrics_data()
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    self.points.setdefault(metric.name, []).extend(metric.data.data_points)
        self.exposition = generate_latest(registry).decode()

    def values(self, metric: str, key: str | None = None) -> dict[Any, float]:
        """This callable's points of ``metric``, by the attribute ``key``."""
        return {
            (p.attributes[key] if key else None): p.value
            for p in self.points.get(metric, [])
            if p.attributes["safecompile.function"] == NAME
        }

    def state(self) -> str:
        """The state the gauge says: the one series at 1 (and every other at 0)."""
        states = self.values("safecompile.state", "safecompile.state")
        assert set(states) == {s.value for s in State}
        on = [s for s, v in states.items() if v == 1]
        assert len(on) == 1, states
        assert sum(states.values()) == 1
        return on[0]

    def calls(self) -> dict[str, float]:
        return self.values("safecompile.calls", "safecompile.path")

    def serving_graphs(self) -> float:
        return sum(self.values("safecompile.graphs", "safecompile.check").values())


def _expect(
    now: Scrape, value: Callable[..., float], state: str, disabled: int, graphs: int
) -> None:
    """Both readers say the same: the state, the switch and the serving graphs."""
    assert now.state() == state
    assert now.values("safecompile.disabled") == {None: disabled}
    assert now.serving_graphs() == graphs
    text = now.exposition
    assert value(text, "safecompile_state", function=NAME, state=state) == 1
    assert value(text, "safecompile_state", function=NAME) == 1  # the others are 0
    assert value(text, "safecompile_disabled", function=NAME) == disabled
    assert value(text, "safecompile_graphs", function=NAME) == graphs


def test_state_switch_graphs_and_monotonic_calls_across_rollback_switch_and_reset(
    prometheus_value: Callable[..., float],
) -> None:
    """A dashboard reads who serves from the series alone, and ``rate()`` over the calls
    counter never sees a drop (Prometheus would read one as a restart)."""
    memory = InMemoryMetricReader()
    registry = CollectorRegistry()
    provider = MeterProvider(
        metric_readers=[memory, PrometheusMetricReader(scope_info_enabled=False, registry=registry)]
    )
    g: Any = safe_compile(scorer, backend="eager", shadow=None, meter_provider=provider, name=NAME)
    x = torch.ones(4)
    history: list[dict[str, float]] = []

    def scrape(calls: int = 1) -> Scrape:
        for _ in range(calls):
            g(x)
        now = Scrape(memory, registry)
        history.append(now.calls())
        return now

    _expect(scrape(calls=0), prometheus_value, "pending", disabled=0, graphs=0)
    serving = scrape(calls=5)
    _expect(serving, prometheus_value, "compiled", disabled=0, graphs=1)
    assert serving.calls() == {"compiled": 5, "eager": 0}

    safecompile.disable(NAME)
    # the graph is kept, but it serves nothing
    _expect(scrape(calls=3), prometheus_value, "disabled", disabled=1, graphs=0)
    safecompile.enable()
    _expect(scrape(), prometheus_value, "compiled", disabled=0, graphs=1)

    g.safecompile.rollback()
    _expect(scrape(calls=2), prometheus_value, "rolled_back", disabled=0, graphs=0)

    g.safecompile.reset()
    assert g.safecompile.stats().calls == 0  # the snapshot starts again ...
    after = scrape(calls=0)
    _expect(after, prometheus_value, "pending", disabled=0, graphs=0)
    assert after.calls() == {"compiled": 6, "eager": 5}  # ... the counter does not
    later = scrape()
    _expect(later, prometheus_value, "compiled", disabled=0, graphs=1)
    assert later.calls() == {"compiled": 7, "eager": 5}
    eager = prometheus_value(
        later.exposition, "safecompile_calls_total", function=NAME, path="eager"
    )
    assert eager == 5

    for before, now in itertools.pairwise(history):
        assert all(now[path] >= before[path] for path in ("compiled", "eager")), history


@pytest.mark.parametrize("shadow", [None, safecompile.Shadow(canary=1, every=0)])
def test_the_graphs_gauge_counts_serving_graphs_with_checks_on_or_off(shadow: Any) -> None:
    """With ``shadow=None`` a serving graph is counted too (``safecompile.check="off"``)."""
    memory = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[memory])
    g: Any = safe_compile(
        scorer, backend="eager", shadow=shadow, meter_provider=provider, name=NAME
    )
    g(torch.ones(4))
    g(torch.ones(4))
    graphs = Scrape(memory, CollectorRegistry()).values("safecompile.graphs", "safecompile.check")
    assert sum(graphs.values()) == 1
    assert graphs["off" if shadow is None else "checked"] == 1
