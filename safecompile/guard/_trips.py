"""Trips: the breaker, this rank's side of the agreement, and the one way back.

Every method returns what changed as :class:`Turn` values (a trip, a trial, a recovery,
with the event to record), and the engine acts on them in one place (``Engine.act``).

A trip opens the breaker (every call runs eager) or, with a process group, is held for the
next safe point; a drift or a compile error applies at once (a drifting path is never
served knowingly, a failed compile has nothing to run). After ``retry_after`` one call is
the half-open trial (failing: a longer wait). Trials and agreed recoveries share one way
back: a trial restarts the speed verdict, so it times the path it tries; once compiled
serves again, the canary restarts too.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from safecompile.base.model import Event, EventKind, Reason
from safecompile.base.policies import Rollback
from safecompile.observe.source import SourceLocation, location_fields

from .peers import Local, Outcome, Peers

__all__ = ["Trips", "Turn"]

# Verdicts a rank of a process group applies at once, before the peers agree.
_AT_ONCE = frozenset({Reason.COMPILE_ERROR, Reason.DRIFT})


@dataclass(frozen=True, slots=True)
class Turn:
    """What a trip, a trial or a recovery changed (``Engine.act`` acts on it):
    ``tripped`` (the breaker opened: count a rollback), ``trial`` (a trial starts: the
    speed verdict times the path it tries), ``recovered`` (compiled serves again: canary
    and speed restart), ``bucket_rejected`` (one bucket runs eager from now on), ``breach``
    (a comparison failed: its event, recorded before the trip's)."""

    kind: Literal["tripped", "trial", "recovered", "bucket_rejected", "breach"]
    event: Event | None = None  # to record (``None``: nothing new to say)


class Trips:
    """The trips of one guarded callable (see the module doc); thread-safe."""

    def __init__(
        self,
        policy: Rollback,
        clock: Callable[[], float],
        location: SourceLocation | None,
        ranks: Peers | None = None,
    ) -> None:
        self.ranks = ranks
        self._policy = policy
        self._clock = clock
        self._location = location  # the user's function, for peer events
        self._lock = threading.Lock()
        self.tripped = False
        # until when every call runs eager with nothing to decide (see eager_until)
        self.until = -math.inf
        self.retry_at: float | None = None  # when the next trial may start
        self.wait: float | None = None  # the wait before it
        self._reason: Reason | None = None  # of the trip in force
        self._trial: int | None = None  # the thread running the trial
        self._trial_failed = False
        self._recovered_at: float | None = None
        self._retry_said = False  # the retry event of this trip is out (said once)

    def trip(self, reason: Reason, event: Callable[[], Event]) -> Turn | None:
        """A verdict against the compiled path; ``event`` makes its event (if needed)."""
        ranks = self.ranks
        if ranks is not None and reason not in _AT_ONCE and ranks.holds():
            if not self.tripped:
                ranks.hold(event())
            return None
        if self._open() or reason is Reason.MANUAL:
            self._reason = reason
            return self._tripped(event())
        return None

    def apply(self, event: Event) -> Turn | None:
        """Trip now with this event (nothing is recorded when already tripped)."""
        if self._open():
            self._reason = event.reason
            return self._tripped(event)
        return None

    def _tripped(self, event: Event) -> Turn:
        if self.wait is not None:
            event.details["retry_in_s"] = self.wait
        return Turn("tripped", event)

    def _open(self) -> bool:
        """Open the breaker; ``False`` if it was open already (nothing new to say)."""
        with self._lock:
            trial = self._trial is not None
            if self.tripped and not trial:
                return False
            now = self._clock()
            failing = trial or (
                self._recovered_at is not None
                and self.wait is not None
                and now - self._recovered_at < 2 * self.wait
            )
            self.tripped = True
            self._trial_failed = trial
            self.wait = self._policy.next_wait(self.wait, failing=failing)
            self.retry_at = now + self.wait if self.wait is not None else None
            self._retry_said = False
            self.until = self._eager_until()
            return True

    def reset(self) -> None:
        """Forget every trip (``reset()``); the agreement itself goes on."""
        with self._lock:
            self.tripped = False
            self.retry_at = self.wait = self._reason = None
            self._trial = self._recovered_at = None
            self._retry_said = False
            self.until = -math.inf
        if self.ranks is not None:
            self.ranks.take_held()

    # ------------------------------------------------------------------ the way back

    def _eager_until(self) -> float:
        """Until when (on the clock) every call runs eager with nothing to decide, so the
        hot path serves it: while tripped, until the next trial may start (forever with
        no trial, or with a process group, whose trials come at safe points). Under the
        lock, kept in :attr:`until`."""
        if not self.tripped:
            return -math.inf
        if self.retry_at is None or self.ranks is not None:
            return math.inf
        return self.retry_at

    def claim_trial(self) -> Turn | None:
        """The ``trial`` turn if this call is the half-open trial (tripped, the wait over,
        no other trial running), else ``None``. With a process group, trials are agreed
        at safe points instead."""
        if self.ranks is not None or not self._claim():
            return None
        return self._retrying("trying the compiled path again", {})

    def _claim(self) -> bool:
        with self._lock:
            if (
                not self.tripped
                or self._trial is not None
                or self.retry_at is None
                or self._clock() < self.retry_at
            ):
                return False
            self._trial = threading.get_ident()
            self._trial_failed = False
            return True

    def end_trial(self, *, served: bool) -> Turn | None:
        """The trial call ended. Served by compiled and not tripped again: the compiled
        path serves again (``recovered``). Served eagerly (its shape or bucket runs eager):
        nothing was learnt, the next call tries again."""
        if self._close(served=served):
            return self._recovered("compiled path serves again", {})
        return None

    def _close(self, *, served: bool) -> bool:
        """The trial is over; whether it closed the breaker."""
        with self._lock:
            self._trial = None
            if not served or self._trial_failed:
                return False
            self.tripped = False
            self.retry_at = None
            self._recovered_at = self._clock()
            self.until = -math.inf
            return True

    def _retrying(self, message: str, details: dict[str, Any]) -> Turn:
        """A trial starts: it measures the compiled path it tries. Said once per trip: a
        trial served eagerly (its input runs eager) leaves the next call to try, silently."""
        if self._retry_said:
            return Turn("trial")
        self._retry_said = True
        event = Event(kind=EventKind.RETRY, time=time.time(), message=message, details=details)
        return Turn("trial", event)

    def _recovered(self, message: str, details: dict[str, Any]) -> Turn:
        event = Event(kind=EventKind.RECOVERED, time=time.time(), message=message, details=details)
        return Turn("recovered", event)

    # ------------------------------------------------------------------ safe points

    def safe_point(self, call: int) -> list[Turn | None]:
        """Agree with the peers before call ``call`` and switch with them. Never raises."""
        ranks = self.ranks
        if ranks is None:
            return []
        try:
            return self._safe_point(ranks, call)
        except Exception as exc:  # pragma: no cover - a bug here must not break the call
            ranks.broken = f"the safe point failed: {type(exc).__name__}"
            with contextlib.suppress(Exception):  # the peers will time out: go eager too
                return [self.apply(self._peer_event(ranks.broken))]
            return []

    def _local(self, held: Event | None) -> Local:
        """This rank's side of a safe point."""
        if held is not None:
            return Local(tripped=True, reason=held.reason, ready=False)
        if not self.tripped:
            return Local(tripped=False, reason=None, ready=False)
        retry_at = self.retry_at
        return Local(
            tripped=True,
            reason=self._reason or Reason.MANUAL,
            ready=retry_at is not None and self._clock() >= retry_at,
        )

    def _safe_point(self, ranks: Peers, call: int) -> list[Turn | None]:
        held = ranks.take_held()
        outcome = ranks.agree(self._local(held), call)
        if outcome is None:  # no agreement (ended, or no group yet): a held trip applies alone
            return [self.apply(held)] if held is not None else []
        where = {"call": call, "rank": outcome.rank, "ranks": outcome.world}
        if outcome.failure is not None:
            event = held if held is not None else self._peer_event(outcome.failure)
            event.details.update(where, sync_error=outcome.failure)
            return [self.apply(event)]
        if outcome.recover:
            return self._agreed_recovery(call)
        if outcome.trip and held is not None:  # this rank's own verdict, agreed
            return [self.apply(replace(held, time=time.time(), details={**held.details, **where}))]
        if outcome.trip:
            return [self.apply(self._followed(outcome, where))]
        return []

    def _followed(self, outcome: Outcome, where: dict[str, Any]) -> Event:
        """The event of a rank that follows a peer's trip."""
        reason = outcome.origin_reason.value if outcome.origin_reason else "unknown"
        event = self._peer_event(
            f"rank {outcome.origin} of {outcome.world} tripped ({reason}): every rank "
            f"leaves the compiled path at call {outcome.call}"
        )
        event.details.update(where, peer_rank=outcome.origin, peer_reason=reason)
        return event

    def _agreed_recovery(self, call: int) -> list[Turn | None]:
        """Every rank is tripped and its wait is over: all try the compiled path again."""
        if not self._claim():
            return []
        details = {"call": call}
        message = f"every rank tries the compiled path again at call {call}"
        turns: list[Turn | None] = [self._retrying(message, details)]
        if self._close(served=True):
            turns.append(self._recovered("compiled path serves again on every rank", details))
        return turns

    def _peer_event(self, message: str) -> Event:
        return Event(
            kind=EventKind.ROLLBACK,
            reason=Reason.PEER,
            time=time.time(),
            message=message,
            **location_fields(self._location),
        )
