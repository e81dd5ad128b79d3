"""The speed verdict: is the compiled path slower than eager, for the call the user makes?

It judges the *whole call*: on the compiled path, dynamo's frame evaluation and guards,
the guard's wrappers, every graph and the eager code between them, bucket padding and
cutting back; against the same call run eagerly (the original function, no dynamo).
Both arms are live calls: a call routed to eager (a *probe*) gives its caller eager's
values, side effects and gradients, so a probe is always a correct call.

Measuring happens in *rounds*. A round times *pairs*: two live calls of the same group
(the caller's key: the same bucket, shapes, dtypes and grad mode, so the same graphs
serve them), one on each arm, close in time (the partner must come within
``4 * stride`` calls, or the half pair is dropped); which arm opens a pair alternates,
and a pair opens at most every ``stride`` calls. At ``min_pairs`` pairs, at each
doubling of it and at ``max_pairs`` (few looks, so that looking often does not multiply
the false verdicts), :func:`decide` reads the ratios ``compiled / eager`` of the pairs:
a distribution-free confidence interval for their median (order statistics of the sign
test) decides "eager wins" when its lower end is above ``ratio``, "compiled stays" when
its upper end is at most ``ratio``; undecided at ``max_pairs``, compiled keeps serving.
One outlier on either arm moves one ratio, never the median. Ratios are scale-free, so
pairs of different groups pool into one verdict. The first ``warm_calls`` calls are
never timed (warm-up).

After a verdict for compiled, the next round waits ``pairs / budget`` calls, doubled for
each round that agreed with the last one (up to ``max_backoff`` times): each round routes
at most ``pairs`` calls to eager, so at steady state at most ``budget`` of the calls
(1%) are probes. A verdict for eager is the caller's to act on (the guard rolls back,
reason ``slower``); :meth:`CallSpeed.restart` measures from scratch when the compiled
path serves again.

Everything here is pure: no torch, no clock. The caller times the calls.
"""

from __future__ import annotations

import enum
import math
import statistics
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CallSpeed",
    "Decision",
    "SpeedPolicy",
    "Step",
    "decide",
    "median_interval",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeedPolicy:
    """How the verdict measures and decides (built from ``Rollback``; see the module doc)."""

    ratio: float  # compiled / eager above this: eager wins
    min_pairs: int = 16
    max_pairs: int = 128
    warm_calls: int = 128  # first calls never timed (warm-up, canary)
    stride: int = 8  # calls from one pair's start to the next within a round
    budget: float = 0.01  # share of calls on the arm that is not serving, at steady state
    max_backoff: int = 64  # the gap between rounds grows up to this many times
    confidence: float = 0.99  # per look; looks at min_pairs, 2x, 4x ... and max_pairs

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ratio) and self.ratio > 0):
            raise ValueError(f"ratio must be a finite number > 0, got {self.ratio!r}")
        for name in ("min_pairs", "max_pairs", "stride", "max_backoff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_pairs < self.min_pairs:
            raise ValueError(f"max_pairs must be >= min_pairs, got {self.max_pairs!r}")
        if isinstance(self.warm_calls, bool) or self.warm_calls < 0:
            raise ValueError(f"warm_calls must be an int >= 0, got {self.warm_calls!r}")
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget must be in (0, 1], got {self.budget!r}")
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"confidence must be in [0.5, 1), got {self.confidence!r}")


# ---------------------------------------------------------------- statistics


def _rank(n: int, confidence: float) -> int:
    """The 1-based rank ``k`` such that ``[x_(k), x_(n-k+1)]`` covers the median of ``n``
    samples with at least ``confidence`` (the sign test's interval); 0 when ``n`` is
    too small for any interval."""
    alpha = (1.0 - confidence) / 2.0
    total = 2.0**n
    cumulative = 0.0
    k = 0
    while k < (n + 1) // 2:
        cumulative += math.comb(n, k) / total
        if cumulative > alpha:
            break
        k += 1
    return k


def median_interval(
    values: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """``(low, median, high)``: the median of ``values`` and a distribution-free interval
    that covers the true median with at least ``confidence``. With too few values for an
    interval, ``low``/``high`` are ``-inf``/``inf``; empty: all NaN."""
    if not values:
        return math.nan, math.nan, math.nan
    ordered = sorted(values)
    n = len(ordered)
    middle = float(statistics.median(ordered))
    k = _rank(n, confidence)
    if k == 0:
        return -math.inf, middle, math.inf
    return ordered[k - 1], middle, ordered[n - k]


@dataclass(frozen=True, slots=True)
class Decision:
    """What the pairs of a round say. ``eager``: ``True`` eager wins, ``False`` compiled
    stays, ``None`` not decided yet. ``ratio`` is the median of ``compiled / eager``,
    ``low``/``high`` its confidence interval, ``pairs`` how many pairs it read."""

    eager: bool | None
    ratio: float
    low: float
    high: float
    pairs: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": None if self.eager is None else ("eager" if self.eager else "compiled"),
            "ratio": _round(self.ratio),
            "low": _round(self.low),
            "high": _round(self.high),
            "pairs": self.pairs,
        }


def ratios(pairs: Sequence[tuple[float, float]]) -> list[float]:
    """``compiled / eager`` of each valid pair (a negative or non-finite time is dropped;
    eager at zero reads as infinitely faster, both at zero as equal)."""
    out = []
    for compiled, eager in pairs:
        if not (math.isfinite(compiled) and math.isfinite(eager)):
            continue
        if compiled < 0 or eager < 0:
            continue
        if eager == 0:
            out.append(1.0 if compiled == 0 else math.inf)
        else:
            out.append(compiled / eager)
    return out


def decide(
    pairs: Sequence[tuple[float, float]], policy: SpeedPolicy, *, current_eager: bool = False
) -> Decision:
    """The verdict of a round's ``(compiled_s, eager_s)`` pairs (see the module doc)."""
    found = ratios(pairs)
    n = len(found)
    low, middle, high = median_interval(found, policy.confidence)
    if not _is_look(n, policy):
        return Decision(None, middle, low, high, n)
    if low > policy.ratio:
        verdict: bool | None = True
    elif high <= policy.ratio:
        verdict = False
    elif n >= policy.max_pairs:
        verdict = current_eager  # not conclusive: keep the arm that serves
    else:
        verdict = None
    return Decision(verdict, middle, low, high, n)


def _is_look(n: int, policy: SpeedPolicy) -> bool:
    """Whether a round reads its pairs at ``n``: at ``min_pairs`` and each doubling of
    it, and at ``max_pairs`` (few looks keep the false-verdict rate near one look's)."""
    if n >= policy.max_pairs:
        return True
    if n < policy.min_pairs or n % policy.min_pairs:
        return False
    multiple = n // policy.min_pairs
    return multiple & (multiple - 1) == 0


# ---------------------------------------------------------------- the callable's verdict


class Step(enum.Enum):
    """What one call does, as the verdict plans it."""

    UNTIMED = "untimed"  # the serving path, untimed
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
    """The speed verdict of one guarded callable (see the module doc); thread-safe.

    The caller counts calls with :meth:`add` (cheaply, in batches), asks :meth:`plan`
    on the calls it routes here while :attr:`wants` is true, and reports each timed call
    with :meth:`record` (or :meth:`abandon`).
    """

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
        self._pairs: list[tuple[float, float]] = []
        self._agreeing = 0  # rounds in a row with the same verdict (the backoff)
        self.rounds = 0
        self.probes = 0  # calls routed to eager
        self.timed = 0
        self.last: Decision | None = None

    def add(self, calls: int) -> int:
        """Count ``calls`` more calls; returns how many more may pass before a call
        should come to :meth:`plan` (0: now, :attr:`wants` is true)."""
        with self._lock:
            self.calls += calls
            if not self.measuring and self.calls >= self._round_at:
                self.measuring = True
                self._pairs = []
                self._half = None
                self._open_at = self.calls
            return self._left()

    def _left(self) -> int:
        if not self.measuring:
            self.wants = False
            return self._round_at - self.calls
        if self._half is not None:
            if self.calls - self._half.at > self._horizon():
                self._half = None  # its partner did not come in time: drop it
            else:
                self.wants = True
                return 0
        left = self._open_at - self.calls
        self.wants = left <= 0
        return max(left, 0)

    def _horizon(self) -> int:
        return self.policy.stride * 4

    def plan(self, key: Hashable) -> Step:
        """What this call (already counted) does. ``key`` groups like calls (the same
        graphs, bucket, shapes): a pair's two calls share it."""
        with self._lock:
            if not self.measuring or self._in_flight or self._left() > 0:
                return Step.UNTIMED
            half = self._half
            if half is not None and half.key != key:
                return Step.UNTIMED  # waiting for the partner of the open half
            if half is None:
                eager = self._eager_first
                self._eager_first = not eager
                self._half = _Half(key, eager, self.calls)
            else:
                eager = not half.eager
            self._in_flight = True
            if eager:
                self.probes += 1
            return Step.TIME_EAGER if eager else Step.TIME_COMPILED

    def abandon(self) -> None:
        """A timed call could not be timed (it raised, compiled, or ran eagerly): forget
        it, and the pair it belonged to."""
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
            if half is None or step is Step.UNTIMED:
                self._left()
                return None
            if half.seconds is None:  # the first call of the pair
                half.seconds = seconds
                self._left()
                return None
            self._half = None
            first_s = half.seconds
            pair = (first_s, seconds) if not half.eager else (seconds, first_s)
            self._pairs.append(pair)
            self._open_at = half.at + self.policy.stride
            decision = decide(self._pairs, self.policy)
            if decision.eager is not None:
                self._conclude(decision)
            self._left()
            return decision if decision.eager is not None else None

    def _conclude(self, decision: Decision) -> None:
        policy = self.policy
        same = self.last is not None and decision.eager == self.last.eager
        self._agreeing = self._agreeing + 1 if same else 0
        self.measuring = False
        self._pairs = []
        self.rounds += 1
        self.last = decision
        backoff = min(2 ** min(self._agreeing, 62), policy.max_backoff)
        self._round_at = self.calls + math.ceil(decision.pairs / policy.budget) * backoff

    def restart(self) -> None:
        """Measure from scratch (the compiled path serves again after a trip): a new
        round starts after the warm-up."""
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
