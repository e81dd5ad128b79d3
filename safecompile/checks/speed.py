"""The speed verdict: is the compiled path slower than eager, for the call the user makes?

It pairs live calls of a group, one on the whole compiled path, one on the original
function (a *probe*: its caller gets eager's values, side effects and gradients), and reads
the sign test's intervals for the median ``compiled / eager`` of runs of pairs (the time of
the traffic) and of single pairs (the median call) at few looks per round, with a bounded
share of probes and a backoff between rounds (the rules and their error rates:
docs/speed.md). Pure: the caller times, with :func:`call_clock`.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import random
import statistics
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CallSpeed", "Decision", "SpeedPolicy", "Step", "call_clock", "decide"]


def call_clock() -> float:
    """The verdict's clock: the calling thread's CPU time while torch runs a call's kernels
    on this thread (one intra-op thread, no CUDA device), so that time spent waiting for a
    core on a loaded machine is not counted; wall time otherwise (see docs/speed.md)."""
    if torch.get_num_threads() == 1 and not _cuda():
        return time.thread_time()
    return time.perf_counter()


@functools.cache
def _cuda() -> bool:
    return torch.cuda.is_available()  # 1.5 us a call, and it cannot change in a process


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeedPolicy:
    """How the verdict measures and decides (built from ``Rollback``; see the module doc)."""

    ratio: float  # compiled / eager above this: eager wins
    min_pairs: int = 16
    max_pairs: int = 128  # the last read, unless it leans eager: then on to most_pairs
    most_pairs: int = 512
    warm_calls: int = 128  # first calls never timed (warm-up, canary)
    stride: int = 8  # calls from one pair's start to the next within a round
    settle: int = 1  # a timed call follows this many calls of its own arm (docs/speed.md)
    budget: float = 0.01  # share of calls on the arm that is not serving, at steady state
    max_backoff: int = 64  # the gap between rounds grows up to this many times
    confidence: float = 0.99  # per look

    def __post_init__(self) -> None:  # Rollback checks what users pass; this, the defaults
        counts = (self.min_pairs, self.max_pairs, self.most_pairs, self.stride, self.max_backoff)
        if not all(type(v) is int and v >= 1 for v in counts) or not (
            self.min_pairs <= self.max_pairs <= self.most_pairs
        ):
            raise ValueError(f"min <= max <= most_pairs, stride, max_backoff: ints >= 1: {self}")
        if not all(type(v) is int and v >= 0 for v in (self.warm_calls, self.settle)):
            raise ValueError(f"warm_calls, settle must be ints >= 0: {self}")
        if not (math.isfinite(self.ratio) and self.ratio > 0):
            raise ValueError(f"ratio must be a finite number > 0: {self}")
        if not (0.0 < self.budget <= 1.0 and 0.5 <= self.confidence < 1.0):
            raise ValueError(f"budget must be in (0, 1], confidence in [0.5, 1): {self}")


def median_interval(
    values: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """``(low, median, high)``: the median of ``values`` and the sign test's interval
    ``[x_(k), x_(n-k+1)]`` that covers the true median with at least ``confidence``.
    Too few values for an interval: ``low``/``high`` are infinite; empty: all NaN."""
    if not values:
        return math.nan, math.nan, math.nan
    ordered = sorted(values)
    n = len(ordered)
    middle = float(statistics.median(ordered))
    cdf = itertools.accumulate(math.comb(n, j) / 2.0**n for j in range((n + 1) // 2))
    k = sum(p <= (1.0 - confidence) / 2.0 for p in cdf)  # P(Bin(n, 1/2) < k) within the tail
    if k == 0:
        return -math.inf, middle, math.inf
    return ordered[k - 1], middle, ordered[n - k]


@dataclass(frozen=True, slots=True)
class Decision:
    """A round's verdict: ``eager`` True (eager wins), False (compiled stays) or None; the
    median summed ``compiled / eager`` of 16 runs of pairs, its interval, pairs, median pair."""

    eager: bool | None
    ratio: float
    low: float
    high: float
    pairs: int
    median: float

    def to_dict(self) -> dict[str, Any]:
        verdict = None if self.eager is None else ("eager" if self.eager else "compiled")
        figures = {name: _round(getattr(self, name)) for name in ("ratio", "low", "high")}
        return {"verdict": verdict, **figures, "pairs": self.pairs, "median": _round(self.median)}


def ratios(pairs: Sequence[tuple[float, float]]) -> list[float]:
    """``compiled / eager`` of each valid pair (a negative or non-finite time is dropped;
    eager at zero reads as infinitely faster, both at zero as equal)."""
    return [c / e if e else (1.0 if c == 0 else math.inf) for c, e in _valid(pairs)]


def _valid(pairs: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    return [p for p in pairs if all(math.isfinite(t) and t >= 0 for t in p)]


def runs(pairs: Sequence[tuple[float, float]], count: int) -> list[tuple[float, float]]:
    """The pairs cut into ``count`` runs of consecutive pairs, near-equal in length (one
    pair each when there are fewer), each run's two times summed."""
    n, count = len(pairs), min(count, len(pairs))
    cut = (pairs[i * n // count : (i + 1) * n // count] for i in range(count))
    return [(math.fsum(c for c, _ in run), math.fsum(e for _, e in run)) for run in cut]


def decide(
    pairs: Sequence[tuple[float, float]], policy: SpeedPolicy, *, current_eager: bool = False
) -> Decision:
    """The verdict of a round's ``(compiled_s, eager_s)`` pairs (see the module doc)."""
    valid = _valid(pairs)
    n = len(valid)
    multiple, rest = divmod(n, policy.min_pairs)  # looks: min_pairs, its doublings, max_pairs
    doubling = multiple > 0 and rest == 0 and multiple & (multiple - 1) == 0
    if not (doubling or n == policy.max_pairs or n >= policy.most_pairs):
        return Decision(None, math.nan, math.nan, math.nan, n, math.nan)  # not read
    found = ratios(valid)
    low, middle, high = median_interval(ratios(runs(valid, 16)), policy.confidence)
    median = statistics.median(found)
    last = n >= policy.max_pairs
    more = n < policy.most_pairs  # a last read that leans eager reads on
    by_time = _read((low, middle, high), policy, last, more)
    by_call = _read(median_interval(found, policy.confidence), policy, last, more)
    # either may roll back (past max_pairs: both), unless runs of 8 pairs say compiled is
    # not slower at all
    says = (by_time and by_call) if n > policy.max_pairs else (by_time or by_call)
    slower = statistics.median(ratios(runs(valid, max(1, n // 8)))) > 1.0
    verdict: bool | None = None
    if (says and slower) or (last and current_eager):
        verdict = True
    elif (last and None not in (by_time, by_call)) or (by_time is False and by_call is False):
        verdict = False
    return Decision(verdict, middle, low, high, n, median)


def _read(
    interval: tuple[float, float, float], policy: SpeedPolicy, last: bool, more: bool
) -> bool | None:
    low, middle, high = interval  # one interval's verdict: "How it decides" in docs/speed.md
    if low > policy.ratio:
        return True
    if high <= policy.ratio:
        return False
    if not last or (more and middle > policy.ratio and low <= 1.0):
        return None  # measuring on: before the last read, or a last read that leans eager
    return middle > policy.ratio and low > 1.0  # no rollback unless eager is faster at all


class Step(enum.Enum):
    """What one call does, as the verdict plans it."""

    UNTIMED = "untimed"  # the serving path, untimed
    EAGER = "eager"  # the original function, untimed: it settles the eager arm for a probe
    TIME_COMPILED = "time_compiled"  # the compiled path, timed
    TIME_EAGER = "time_eager"  # a probe: the original function, timed


@dataclass(slots=True)
class _Half:
    """The first call of a pair: its group, its arm, its time (``None`` while it runs)."""

    key: Hashable
    eager: bool
    at: int  # the call count when it was planned
    seconds: float | None = None


class CallSpeed:
    """The speed verdict of one guarded callable; thread-safe. The caller counts calls with
    :meth:`add` (in batches), asks :meth:`plan` while :attr:`wants` is true, and reports
    each timed call with :meth:`record` (or :meth:`abandon`)."""

    def __init__(self, policy: SpeedPolicy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self.calls = 0  # calls counted so far
        self.measuring = False
        self.wants = False  # the next call should come to plan()
        self._round_at = policy.warm_calls
        self._open_at = 0  # within a round: the call count that may open the next pair
        self._half: _Half | None = None
        self._in_flight = False  # a timed call is out (one at a time, across threads)
        self._eager_first = False  # which arm opens the next pair (alternates)
        self._random = random.Random(0)  # the gaps between pairs: reproducible
        self._eager_at = -1  # the count of the last call sent to eager
        self._eager_run = 0  # eager calls in a row up to it
        self._sent = 0  # calls sent to eager in this round (the gap to the next)
        self._pairs: list[tuple[float, float]] = []
        self._agreeing = 0  # rounds in a row with the same verdict (the backoff)
        self.rounds = 0
        self.probes = 0  # calls routed to eager
        self.timed = 0
        self.last: Decision | None = None

    def add(self, calls: int) -> int:
        """Count ``calls`` more calls; returns how many more may pass before :meth:`plan`."""
        with self._lock:
            self.calls += calls
            if not self.measuring and self.calls >= self._round_at:
                self.measuring = True
                self._pairs = []
                self._half = None
                self._sent = 0
                self._open_at = self.calls
            return self._left()

    def _left(self) -> int:
        if not self.measuring:
            self.wants = False
            return self._round_at - self.calls
        if self._half is not None:
            if self.calls - self._half.at <= 4 * self.policy.stride:
                self.wants = True
                return 0
            self._half = None  # its partner did not come in time: drop it
        left = self._open_at - self.calls
        self.wants = left <= 0
        return max(left, 0)

    def plan(self, key: Hashable) -> Step:
        """What this call (already counted) does; a pair's two calls share ``key``. A call
        is timed only after ``settle`` calls of its arm in a row: for a probe, untimed eager
        calls (:attr:`Step.EAGER`, any group) run first; a compiled one waits for them."""
        with self._lock:
            if not self.measuring or self._in_flight or self._left() > 0:
                return Step.UNTIMED
            half = self._half
            eager = self._eager_first if half is None else not half.eager
            before = self.calls - 1 - self._eager_at  # compiled calls in a row before this one
            run = (self._eager_run if before == 0 else 0) if eager else before
            if run < self.policy.settle or (half is not None and half.key != key):
                return self._send(Step.EAGER) if eager and self.policy.settle else Step.UNTIMED
            if half is None:
                self._eager_first = not eager
                self._half = _Half(key, eager, self.calls)
            self._in_flight = True
            return self._send(Step.TIME_EAGER) if eager else Step.TIME_COMPILED

    def _send(self, step: Step) -> Step:
        """A call sent to eager (under the lock): it extends the run of eager calls."""
        self._eager_run = self._eager_run + 1 if self._eager_at == self.calls - 1 else 1
        self._eager_at = self.calls
        self.probes += 1
        self._sent += 1
        return step

    def abandon(self) -> None:
        """A timed call could not be timed (it raised, compiled, ran eagerly): drop its pair."""
        with self._lock:
            self._in_flight = False
            self._half = None
            self._left()

    def record(self, step: Step, seconds: float) -> Decision | None:
        """A timed call took ``seconds``; returns the round's verdict, if it has one."""
        with self._lock:
            self._in_flight = False
            self.timed += 1
            half = self._half
            decision = None
            if half is not None and step is not Step.UNTIMED:
                if half.seconds is None:  # the first call of the pair
                    half.seconds = seconds
                else:
                    self._half = None
                    pair = (seconds, half.seconds) if half.eager else (half.seconds, seconds)
                    self._pairs.append(pair)
                    # the next pair a random 1 to 2 strides - 1 on: no pairing locked to a
                    # cycle in the traffic (a schedule that repeats pairs the same calls)
                    self._open_at = half.at + self._random.randrange(1, 2 * self.policy.stride)
                    verdict = decide(self._pairs, self.policy)
                    if verdict.eager is not None:
                        self._conclude(verdict)
                        decision = verdict
            self._left()
            return decision

    def _conclude(self, decision: Decision) -> None:
        same = self.last is not None and decision.eager == self.last.eager
        self._agreeing = self._agreeing + 1 if same else 0
        self.measuring = False
        self._pairs = []
        self.rounds += 1
        self.last = decision
        backoff = min(2 ** min(self._agreeing, 62), self.policy.max_backoff)
        self._round_at = self.calls + math.ceil(self._sent / self.policy.budget) * backoff

    def restart(self) -> None:
        """Measure from scratch after the warm-up (the compiled path serves again)."""
        with self._lock:
            self.measuring = False
            self._half = None
            self._in_flight = False
            self._pairs = []
            self._agreeing = 0
            self.last = None
            self._round_at = self.calls + self.policy.warm_calls
            self._left()

    def to_dict(self) -> dict[str, Any]:
        """For ``report()``: the round in progress, the last verdict, what it cost."""
        with self._lock:
            return {
                "measuring": self.measuring,
                "pairs": len(self._pairs),
                "rounds": self.rounds,
                "probes": self.probes,
                "timed": self.timed,
                "calls": self.calls,
                "next_round_at_call": None if self.measuring else self._round_at,
                "last": self.last.to_dict() if self.last is not None else None,
            }


def _round(value: float) -> float | None:
    """JSON-safe: NaN and infinities become ``None``."""
    return round(value, 4) if math.isfinite(value) else None
