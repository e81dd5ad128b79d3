"""Latency percentiles: the A/B figures of shadow-checked calls and the doctor's timings
(figures only; the speed verdict lives in :mod:`safecompile.checks.speed`)."""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque

__all__ = ["LatencyWindow"]


class LatencyWindow:
    """The last ``size`` latencies of one path, in seconds; thread-safe. Values that are not
    finite or are negative are ignored (a broken clock must not poison the figures)."""

    def __init__(self, size: int = 1024) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"LatencyWindow(size=...) must be an int >= 1, got {size!r}")
        self._lock = threading.Lock()
        self._samples: deque[float] = deque(maxlen=size)
        self._count = 0

    def record(self, seconds: float) -> None:
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
        """``{"p50", "p90", "p99", "mean"}`` over the window, in seconds (linear between
        ranks, as numpy's default); ``{}`` when empty."""
        samples = self.samples()
        if not samples:
            return {}
        if len(samples) == 1:  # statistics.quantiles wants two
            cuts = samples * 99
        else:
            cuts = statistics.quantiles(samples, n=100, method="inclusive")
        mean = statistics.fmean(samples)
        return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98], "mean": mean}
