"""Latency bookkeeping: A/B percentiles and the slower-than-eager verdict."""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Sequence

__all__ = ["LatencyWindow", "slower_verdict"]


class LatencyWindow:
    """The last ``size`` latencies of one path, in seconds; thread-safe.

    Values that are not finite or are negative are ignored (a broken clock must not
    poison the figures).
    """

    def __init__(self, size: int = 1024) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"LatencyWindow(size=...) must be an int >= 1, got {size!r}")
        self._lock = threading.Lock()
        self._samples: deque[float] = deque(maxlen=size)
        self._count = 0

    def record(self, seconds: float) -> None:
        """Add one latency."""
        if not (math.isfinite(seconds) and seconds >= 0.0):
            return
        with self._lock:
            self._samples.append(float(seconds))
            self._count += 1

    def count(self) -> int:
        """How many latencies were ever recorded (not only those still in the window)."""
        with self._lock:
            return self._count

    def samples(self) -> list[float]:
        """The latencies in the window, oldest first."""
        with self._lock:
            return list(self._samples)

    def percentiles(self) -> dict[str, float]:
        """``{"p50", "p90", "p99", "mean"}`` over the window, in seconds; ``{}`` when empty."""
        ordered = sorted(self.samples())
        if not ordered:
            return {}
        return {
            "p50": _quantile(ordered, 0.50),
            "p90": _quantile(ordered, 0.90),
            "p99": _quantile(ordered, 0.99),
            "mean": math.fsum(ordered) / len(ordered),
        }


def slower_verdict(
    compiled: Sequence[float], eager: Sequence[float], *, ratio: float, min_samples: int
) -> tuple[bool, float]:
    """Is the compiled path slower than eager's by more than ``ratio``?

    ``compiled[i]`` and ``eager[i]`` are a pair: the same inputs, timed back to back.
    The most recent pairs count (when the sequences differ in length, the newest
    ``min(len)`` of each). Returns ``(slower, median(compiled) / median(eager))``, or
    ``(False, nan)`` with fewer than ``min_samples`` valid pairs. Pairs with a
    non-finite or negative time are dropped.
    """
    if not (math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"ratio must be a finite number > 0, got {ratio!r}")
    if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
        raise ValueError(f"min_samples must be an int >= 1, got {min_samples!r}")
    n = min(len(compiled), len(eager))
    pairs = [
        (c, e)
        for c, e in zip(compiled[len(compiled) - n :], eager[len(eager) - n :], strict=True)
        if math.isfinite(c) and math.isfinite(e) and c >= 0 and e >= 0
    ]
    if len(pairs) < min_samples:
        return False, math.nan
    compiled_median = statistics.median(c for c, _ in pairs)
    eager_median = statistics.median(e for _, e in pairs)
    if eager_median <= 0:
        if compiled_median <= 0:
            return False, math.nan
        return True, math.inf
    measured = compiled_median / eager_median
    return measured > ratio, measured


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), of sorted data."""
    if len(ordered) == 1:
        return ordered[0]
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
