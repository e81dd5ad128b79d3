"""Latency windows (the A/B figures): exact figures, no clocks, no sleeps.

The speed verdict's statistics are tested in test_speed_verdict.py."""

from __future__ import annotations

import math
import threading

import pytest

from safecompile.checks.timing import LatencyWindow


def test_empty_window_has_no_percentiles() -> None:
    """An empty window reports {} and a count of 0."""
    w = LatencyWindow()
    assert w.percentiles() == {}
    assert w.count() == 0
    assert w.samples() == []


def test_percentiles_interpolate_linearly() -> None:
    """Percentiles of 1..100 follow linear interpolation between ranks (numpy's default)."""
    w = LatencyWindow()
    for v in range(100, 0, -1):  # recorded out of order
        w.record(float(v))
    p = w.percentiles()
    assert p == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01, "mean": 50.5})


def test_single_sample_is_every_percentile() -> None:
    """One sample is the median, the tail and the mean."""
    w = LatencyWindow()
    w.record(0.25)
    assert w.percentiles() == {"p50": 0.25, "p90": 0.25, "p99": 0.25, "mean": 0.25}


def test_window_keeps_the_newest_samples_but_counts_all() -> None:
    """The window is bounded to its size; count() is the total ever recorded."""
    w = LatencyWindow(size=3)
    for v in (1.0, 2.0, 3.0, 4.0, 5.0):
        w.record(v)
    assert w.samples() == [3.0, 4.0, 5.0]
    assert w.count() == 5
    assert w.percentiles()["p50"] == 4.0


def test_samples_is_a_copy() -> None:
    """Mutating the returned list does not touch the window."""
    w = LatencyWindow()
    w.record(1.0)
    w.samples().append(9.0)
    assert w.samples() == [1.0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1e-9])
def test_invalid_samples_are_ignored(bad: float) -> None:
    """A broken clock (NaN, infinite or negative time) does not poison the figures."""
    w = LatencyWindow()
    w.record(bad)
    w.record(2.0)
    assert w.samples() == [2.0]
    assert w.count() == 1


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_window_size_is_validated(size: object) -> None:
    """A window holds at least one sample."""
    with pytest.raises(ValueError, match="size"):
        LatencyWindow(size=size)  # type: ignore[arg-type]


def test_concurrent_records_are_all_counted() -> None:
    """record() is safe from many threads: no sample lost, the window stays bounded."""
    w = LatencyWindow(size=100)
    per_thread, threads = 2_000, 4

    def work() -> None:
        for _ in range(per_thread):
            w.record(0.001)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert w.count() == per_thread * threads
    assert len(w.samples()) == 100
