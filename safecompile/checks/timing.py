"""Latency bookkeeping: the A/B percentiles of shadow-checked calls (figures only; the
speed verdict lives in :mod:`safecompile.checks.speed`)."""

from __future__ import annotations

import math
import threading
from collections import deque

__all__ = ["LatencyWindow"]


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


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), of sorted data."""
    if len(ordered) == 1:
        return ordered[0]
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
