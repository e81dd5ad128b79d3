"""Latency windows and the slower-than-eager verdict: exact figures, no clocks, no sleeps."""

from __future__ import annotations

import math
import threading

import pytest

from safecompile._timing import LatencyWindow, slower_verdict


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


def test_verdict_needs_enough_samples() -> None:
    """Below min_samples pairs there is no verdict: (False, nan)."""
    slower, ratio = slower_verdict([2.0] * 7, [1.0] * 7, ratio=1.1, min_samples=8)
    assert slower is False
    assert math.isnan(ratio)


def test_verdict_compares_medians() -> None:
    """Compiled twice as slow as eager: slower, ratio 2.0 (medians, robust to an outlier)."""
    compiled = [2.0] * 15 + [500.0]
    eager = [1.0] * 15 + [0.001]
    assert slower_verdict(compiled, eager, ratio=1.1, min_samples=16) == (True, 2.0)


def test_faster_compiled_is_not_slower() -> None:
    """A faster compiled path is never slower, whatever the ratio."""
    slower, ratio = slower_verdict([0.9] * 16, [1.0] * 16, ratio=1.0, min_samples=16)
    assert slower is False
    assert ratio == pytest.approx(0.9)


def test_ratio_is_a_strict_bound() -> None:
    """Exactly ratio times slower is not slower than ratio."""
    assert slower_verdict([1.5] * 4, [1.0] * 4, ratio=1.5, min_samples=4) == (False, 1.5)
    assert slower_verdict([1.5] * 4, [1.0] * 4, ratio=1.49, min_samples=4)[0] is True


def test_unequal_lengths_use_the_newest_pairs() -> None:
    """With one sequence longer, only the newest min(len) samples of each are paired."""
    compiled = [100.0] * 10 + [1.0] * 4  # old slow samples fall outside the pairs
    eager = [1.0] * 4
    assert slower_verdict(compiled, eager, ratio=1.1, min_samples=4) == (False, 1.0)


def test_pairs_with_invalid_times_are_dropped() -> None:
    """A pair with a NaN or negative time does not count towards min_samples."""
    compiled = [2.0, math.nan, 2.0, 2.0]
    eager = [1.0, 1.0, -1.0, 1.0]
    assert math.isnan(slower_verdict(compiled, eager, ratio=1.1, min_samples=3)[1])
    assert slower_verdict(compiled, eager, ratio=1.1, min_samples=2) == (True, 2.0)


def test_zero_eager_time() -> None:
    """Eager's median at zero: compiled is infinitely slower, or no verdict if zero too."""
    assert slower_verdict([1e-6] * 2, [0.0] * 2, ratio=1.1, min_samples=2) == (True, math.inf)
    slower, ratio = slower_verdict([0.0] * 2, [0.0] * 2, ratio=1.1, min_samples=2)
    assert (slower, math.isnan(ratio)) == (False, True)


@pytest.mark.parametrize(
    ("ratio", "min_samples"), [(0.0, 1), (math.nan, 1), (math.inf, 1), (1.1, 0), (1.1, True)]
)
def test_verdict_arguments_are_validated(ratio: float, min_samples: int) -> None:
    """A ratio must be finite and positive; min_samples an int >= 1."""
    with pytest.raises(ValueError, match=r"ratio|min_samples"):
        slower_verdict([1.0], [1.0], ratio=ratio, min_samples=min_samples)
