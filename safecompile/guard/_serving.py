"""Who served the calls: eager calls by why, and the share compiled served recently.

Derived from the counters the calls already keep, so the hot path does no more work:
the slow paths count each eager call under its why (``Slot.why``); the hot path's own
eager calls (the kill switch on, or rolled back) are the rest, split between
``disabled`` and ``rolled_back`` by the gate's mode when they ran — the engine tells
:meth:`Serving.gate_mode` each change of mode, where the rest so far is folded into the
mode that is ending. The recent window is read from samples of the totals taken when
someone looks (``state``, ``stats()``, a metric reader).
"""

from __future__ import annotations

import collections
import threading
from collections import Counter
from dataclasses import dataclass

from safecompile.base.model import EAGER_REASONS
from safecompile.base.options import Clock

from ._slots import Slots

__all__ = ["Counts", "Serving"]

#: How far back "recent" looks, in seconds of the callable's clock.
WINDOW_S = 60.0
#: Calls a window holds at least before it can say "mostly eager".
MIN_CALLS = 8
# Eager calls that mean live traffic is not covered by a serving graph (the others have
# states of their own, or are the speed verdict's measurement).
_UNCOVERED = ("recompile_limit", "no_graph", "bucket", "rollout", "check", "error")


@dataclass(frozen=True)
class Counts:
    """The totals since the start (or ``reset()``)."""

    compiled: int
    eager: int
    by_reason: dict[str, int]  # every key of EAGER_REASONS; they sum to ``eager``

    @property
    def uncovered(self) -> int:
        return sum(self.by_reason[why] for why in _UNCOVERED)


@dataclass(frozen=True)
class Recent:
    """The calls of the recent window."""

    calls: int
    compiled_share: float | None
    mostly_eager: bool  # most of them ran eager where no serving graph covered them


class Serving:
    """The counts of one guarded callable by who served them (see the module doc)."""

    def __init__(self, slots: Slots, clock: Clock) -> None:
        self._slots = slots
        self._clock = clock
        self._lock = threading.Lock()
        self.mode: str | None = None  # the gate's eager mode (see gate_mode)
        self._before = (0, 0)  # compiled and eager calls before the last reset()
        self._forget()

    def restart(self) -> None:
        """``reset()``: the counts start from zero, but what they counted stays in
        :meth:`lifetime` (a metric counter never goes down)."""
        compiled, eager, _ = self._slots.counts()
        with self._lock:
            self._before = (self._before[0] + compiled, self._before[1] + eager)
        self._slots.clear()
        self._forget()

    def lifetime(self) -> tuple[int, int]:
        """Compiled and eager calls since the callable was made, resets included."""
        compiled, eager, _ = self._slots.counts()
        return self._before[0] + compiled, self._before[1] + eager

    def _forget(self) -> None:
        with self._lock:
            self._base = 0  # the hot path's eager calls at the last change of mode
            self._folded: Counter[str] = Counter()
            # (clock, compiled, eager calls of live traffic no serving graph covered)
            self._samples: collections.deque[tuple[float, int, int, int]] = collections.deque(
                [(self._clock(), 0, 0, 0)], maxlen=16
            )

    def gate_mode(self, mode: str | None) -> None:
        """The gate's eager mode now (``"disabled"``, ``"rolled_back"`` or ``None``: open);
        on a change, the hot path's eager calls so far go to the mode that ends."""
        if mode == self.mode:  # unlocked first read: a change of mode is rare
            return
        with self._lock:
            if mode == self.mode:
                return
            _, eager, why = self._slots.counts()
            rest = eager - sum(why.values())
            self._folded[self.mode or "other"] += rest - self._base
            self._base = rest
            self.mode = mode

    def counts(self) -> Counts:
        """The totals now, eager calls by why."""
        compiled, eager, why = self._slots.counts()
        with self._lock:
            rest = eager - sum(why.values())
            by_reason = dict.fromkeys(EAGER_REASONS, 0)
            for key, n in (why + self._folded).items():
                by_reason[key] = by_reason.get(key, 0) + n
            by_reason[self.mode or "other"] += rest - self._base
        return Counts(compiled, eager, by_reason)

    def recent(self, counts: Counts) -> Recent:
        """The recent window ending now (a sample of ``counts`` is kept for later looks)."""
        now = self._clock()
        covered_eager = counts.eager - counts.uncovered
        with self._lock:
            samples = self._samples
            if now - samples[-1][0] >= WINDOW_S / 8:
                samples.append((now, counts.compiled, counts.uncovered, covered_eager))
            # the newest sample at least a window old is where the window starts
            while len(samples) > 1 and samples[1][0] <= now - WINDOW_S:
                samples.popleft()
            _, compiled0, uncovered0, covered0 = samples[0]
        compiled = counts.compiled - compiled0
        uncovered = counts.uncovered - uncovered0
        calls = compiled + uncovered + covered_eager - covered0
        return Recent(
            calls=calls,
            compiled_share=compiled / calls if calls > 0 else None,
            mostly_eager=compiled + uncovered >= MIN_CALLS and uncovered > compiled,
        )
