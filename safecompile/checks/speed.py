"""The speed verdict: per graph, is the compiled run slower than the same graph run eagerly?

A graph's wrapper (:mod:`._graphs`) serves most calls without looking here: it compares
the graph's call count with :attr:`GraphSpeed.next_at` (one integer compare). When the
count reaches it, :func:`serve` asks the graph's :class:`GraphSpeed` what this call does:

- run the serving arm untimed (compiled, or eager once eager won);
- time the compiled run, or route this live call to eager and time it (a *probe*: the
  caller gets eager's result, with eager's side effects and gradients).

Measuring happens in *rounds*. A round times *pairs*: a compiled run and an eager run
of the same graph on two consecutive calls (which arm goes first alternates), one pair
every ``stride`` calls, so the two arms see the same traffic, close in time. At
``min_pairs`` pairs, at each doubling of it and at ``max_pairs`` (few looks, so that
looking often does not multiply the false verdicts), :func:`decide` reads the ratios
``compiled / eager`` of the pairs: a distribution-free confidence interval for their
median (order statistics of the sign test) decides "eager wins" when its lower end is
above ``ratio``, "compiled stays" when its upper end is at most ``ratio``; undecided at
``max_pairs``, the serving arm is kept. One outlier on either arm moves one ratio, never
the median. The first ``warm_calls`` calls of a graph are never timed
(warm-up), nor any call whose shadow check is due.

After a verdict the next round waits ``pairs / budget`` calls, doubled for each round
that agreed with the last one (up to ``max_backoff`` times): each round routes ``pairs``
calls to the arm that is not serving, so at steady state at most ``budget`` of the
calls (1%) run on the slower arm. A round is a bounded burst: at most ``max_pairs``
probes, one every ``stride`` calls.

Everything here is pure: no torch, no real clock. The caller passes the clock.
"""

from __future__ import annotations

import enum
import math
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Decision",
    "GraphSpeed",
    "SpeedPolicy",
    "Step",
    "decide",
    "median_interval",
    "serve",
]

_FOREVER = 1 << 62


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeedPolicy:
    """How the verdict measures and decides (built from ``Rollback``; see the module doc)."""

    ratio: float  # compiled / eager above this: eager wins
    min_pairs: int = 16
    max_pairs: int = 128
    warm_calls: int = 128  # calls of a new graph never timed (warm-up, canary)
    stride: int = 8  # calls from one pair to the next within a round
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


# ---------------------------------------------------------------- per-graph state


class Step(enum.Enum):
    """What one call of a graph does."""

    COMPILED = "compiled"  # the compiled run, untimed
    EAGER = "eager"  # the graph's traced code run eagerly, untimed
    TIME_COMPILED = "time_compiled"
    TIME_EAGER = "time_eager"


class GraphSpeed:
    """The speed verdict of one graph; thread-safe. ``n`` is the graph's call count."""

    def __init__(self, policy: SpeedPolicy, *, calls: int = 0) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self.eager = False  # the arm that serves: False compiled, True eager
        self.next_at = calls + policy.warm_calls  # the hot path comes here from this call
        self._round_at = self.next_at
        self._block_at = 0
        self._measuring = False
        self._in_flight = False  # a timed run is out (one at a time, across threads)
        self._half: tuple[bool, float] | None = None  # (eager arm?, seconds) of a pair
        self._eager_first = False  # which arm opens the next pair (alternates)
        self._pairs: list[tuple[float, float]] = []
        self._agreeing = 0  # rounds in a row with the same verdict (the backoff)
        self.rounds = 0
        self.probes = 0  # calls routed to the arm that was not serving
        self.timed = 0
        self.last: Decision | None = None

    def restart(self, calls: int) -> None:
        """Forget the verdict (the callable recovered after a trip): compiled serves, and
        a new round starts after the warm-up."""
        with self._lock:
            self.eager = False
            self._measuring = False
            self._half = None
            self._in_flight = False
            self._agreeing = 0
            self._round_at = self.next_at = calls + self.policy.warm_calls

    def plan(self, n: int, *, due: bool = False) -> Step:
        """What call number ``n`` of the graph does (asked once ``n >= next_at``).

        ``due``: a shadow check is due on this call; it is served by the serving arm,
        untimed.
        """
        with self._lock:
            serving = Step.EAGER if self.eager else Step.COMPILED
            if due or self._in_flight:
                return serving
            if not self._measuring:
                if n < self._round_at:
                    return serving
                self._measuring = True
                self._pairs = []
                self._half = None
                self._block_at = n
            if self._half is None and n < self._block_at:
                return serving
            if self._half is None:
                eager = self._eager_first
                self._eager_first = not eager
            else:
                eager = not self._half[0]
            self._in_flight = True
            if eager != self.eager:
                self.probes += 1
            return Step.TIME_EAGER if eager else Step.TIME_COMPILED

    def abandon(self) -> None:
        """A timed run raised: forget it (and the half pair it belonged to)."""
        with self._lock:
            self._in_flight = False
            self._half = None
            self._set_next(self._block_at)

    def record(self, step: Step, seconds: float, n: int) -> Decision | None:
        """A timed run of call ``n`` took ``seconds``; returns a new verdict, if any."""
        eager = step is Step.TIME_EAGER
        with self._lock:
            self._in_flight = False
            self.timed += 1
            if self._half is None:
                self._half = (eager, seconds)
                self._set_next(n + 1)  # its partner: the graph's next call
                return None
            first_eager, first_s = self._half
            self._half = None
            if first_eager == eager:  # cannot happen; never pair an arm with itself
                self._set_next(n + 1)
                return None
            compiled_s, eager_s = (seconds, first_s) if first_eager else (first_s, seconds)
            self._pairs.append((compiled_s, eager_s))
            self._block_at = n - 1 + self.policy.stride  # from the pair's first call
            decision = decide(self._pairs, self.policy, current_eager=self.eager)
            if decision.eager is None:
                self._set_next(self._block_at)
                return None
            self._conclude(decision, n)
            return decision

    def _conclude(self, decision: Decision, n: int) -> None:
        assert decision.eager is not None
        policy = self.policy
        same = self.rounds > 0 and decision.eager == self.eager
        self._agreeing = self._agreeing + 1 if same else 0
        self.eager = decision.eager
        self._measuring = False
        self._pairs = []
        self.rounds += 1
        self.last = decision
        backoff = min(2 ** min(self._agreeing, 62), policy.max_backoff)
        gap = math.ceil(decision.pairs / policy.budget) * backoff
        self._round_at = n + gap
        self._set_next(self._round_at)

    def _set_next(self, at: int) -> None:
        # An eager-serving graph comes here on every call: the wrapper runs its eager arm.
        self.next_at = 0 if self.eager else at

    def to_dict(self) -> dict[str, Any]:
        """For ``report()``: the arm that serves, the last verdict, what it cost."""
        with self._lock:
            return {
                "serving": "eager" if self.eager else "compiled",
                "measuring": self._measuring,
                "pairs": len(self._pairs),
                "rounds": self.rounds,
                "probes": self.probes,
                "timed": self.timed,
                "next_round_at_call": self._round_at if not self._measuring else None,
                "last": self.last.to_dict() if self.last is not None else None,
            }


def serve(
    speed: GraphSpeed,
    n: int,
    due: bool,
    compiled: Callable[..., Any],
    eager: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    clock: Callable[[], float],
    sync: Callable[[], None] | None,
    on_eager: Callable[[], None],
    on_verdict: Callable[[Decision], None],
) -> Any:
    """Run call ``n`` of a graph as its :class:`GraphSpeed` says, timing it if asked.

    ``on_eager`` is told when the eager arm serves the call (so it is counted as eager);
    ``on_verdict`` when a round reaches a verdict. ``sync`` waits for queued device work
    (``None`` on CPU), so a timing covers the work and not its launch.
    """
    step = speed.plan(n, due=due)
    if step is Step.COMPILED:
        return compiled(*args)
    if step is Step.EAGER:
        on_eager()
        return eager(*args)
    run = eager if step is Step.TIME_EAGER else compiled
    if step is Step.TIME_EAGER:
        on_eager()
    try:
        if sync is not None:
            sync()
        started = clock()
        out = run(*args)
        if sync is not None:
            sync()
        elapsed = clock() - started
    except BaseException:
        speed.abandon()
        raise
    decision = speed.record(step, elapsed, n)
    if decision is not None:
        on_verdict(decision)
    return out


def _round(value: float) -> float | None:
    """JSON-safe: NaN and infinities become ``None``."""
    return round(value, 4) if math.isfinite(value) else None
