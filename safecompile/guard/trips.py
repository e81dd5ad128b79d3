"""Trips: the breaker, this rank's side of the agreement, and the one way back.

Everything that sends a guarded callable to eager and brings it back goes through one
:class:`Trips`:

- :meth:`Trips.trip` applies a verdict (the breaker trips, the event is counted) or,
  with a process group, holds it for the next safe point;
- :meth:`Trips.claim_trial` / :meth:`Trips.end_trial`: the half-open trial after
  ``retry_after`` (without a process group);
- :meth:`Trips.safe_point`: this rank's side of the agreement with its peers
  (:class:`.peers.Peers` carries the verdicts); an agreed recovery;
- :meth:`Trips._retrying` and :meth:`Trips._recovered`: the one recovery routine both
  use. A trial first restarts the speed verdict, so the call that tries the compiled
  path runs it and is measured afresh (a verdict that had found eager faster would
  otherwise keep serving the trial eagerly, and the trial would never end); once the
  compiled path serves again, the canary and the speed verdict both start afresh.

With a process group, a drift or a compile error trips this rank at once (it serves
eager from that call on: a drifting path is never served knowingly, and a failed
compile has nothing to run); its peers follow at the next safe point. Other verdicts
are held, and every rank switches together there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from safecompile.base.model import Event, EventKind, Reason
from safecompile.base.policies import Rollback
from safecompile.observe.source import SourceLocation, location_fields

from .breaker import Breaker
from .peers import Local, Outcome, Peers

__all__ = ["TripHooks", "Trips"]

# Verdicts a rank of a process group applies at once, before the peers agree.
_AT_ONCE = frozenset({Reason.COMPILE_ERROR, Reason.DRIFT})


@dataclass(frozen=True, slots=True)
class TripHooks:
    """What the trips need from the callable they guard."""

    record: Callable[[Event], None]  # keep and publish an event
    counted: Callable[[Event], None]  # the breaker just tripped: count the rollback
    update_gate: Callable[[], None]  # the hot path's flag may change
    restart_canary: Callable[[], None]  # every compiled graph is watched again
    restart_speed: Callable[[], None]  # the speed verdict starts afresh
    last_reason: Callable[[], Reason | None]  # the reason of the trip in force
    location: SourceLocation | None  # the user's function, for peer events


class Trips:
    """The trips of one guarded callable (see the module doc); thread-safe."""

    def __init__(
        self,
        policy: Rollback,
        clock: Callable[[], float],
        hooks: TripHooks,
        ranks: Peers | None = None,
    ) -> None:
        self.breaker = Breaker(policy, clock)
        self.ranks = ranks
        self._clock = clock
        self._hooks = hooks
        self._retry_said = False  # the retry event of this trip is out (said once)

    @property
    def tripped(self) -> bool:
        return self.breaker.tripped

    # ------------------------------------------------------------------ trips

    def trip(self, reason: Reason, event: Callable[[], Event]) -> None:
        """A verdict against the compiled path; ``event`` makes its event (if needed).

        Without a process group (or once the agreement has ended) it applies now. With
        one, a drift or a compile error applies now too and the peers follow at the next
        safe point; any other verdict is held until then.
        """
        ranks = self.ranks
        if ranks is not None and reason not in _AT_ONCE and ranks.holds():
            if not self.breaker.tripped:
                ranks.hold(event())
            return
        if self.breaker.trip():
            self._retry_said = False
        elif reason is not Reason.MANUAL:
            return
        self._hooks.counted(event())

    def apply(self, event: Event) -> None:
        """Trip now with this event (nothing is recorded when already tripped)."""
        if self.breaker.trip():
            self._retry_said = False
            self._hooks.counted(event)

    def reset(self) -> None:
        """Forget every trip (``reset()``); the agreement itself goes on."""
        self.breaker.reset()
        self._retry_said = False
        if self.ranks is not None:
            self.ranks.take_held()

    # ------------------------------------------------------------------ the way back

    def claim_trial(self) -> bool:
        """Whether this call is the half-open trial (tripped, the wait over, no other
        trial running). With a process group, trials are agreed at safe points instead."""
        if self.ranks is not None or not self.breaker.claim_trial():
            return False
        self._retrying("trying the compiled path again", {})
        return True

    def end_trial(self, *, served: bool) -> None:
        """The trial call ended. Served by compiled and not tripped again: the compiled
        path serves again. Served eagerly (its shape or bucket runs eager): nothing was
        learnt, the next call tries again."""
        if not served:
            self.breaker.end_trial_unserved()
            return
        if self.breaker.end_trial():
            self._recovered("compiled path serves again", {})

    def _retrying(self, message: str, details: dict[str, Any]) -> None:
        """A trial starts: it measures the compiled path it tries. Said once per trip: a
        trial served eagerly (its input runs eager) leaves the next call to try, silently."""
        self._hooks.restart_speed()
        if self._retry_said:
            return
        self._retry_said = True
        self._hooks.record(
            Event(kind=EventKind.RETRY, time=time.time(), message=message, details=details)
        )

    def _recovered(self, message: str, details: dict[str, Any]) -> None:
        """The compiled path serves again: its checks and its speed start afresh."""
        self._hooks.restart_canary()
        self._hooks.restart_speed()
        self._hooks.update_gate()
        self._hooks.record(
            Event(kind=EventKind.RECOVERED, time=time.time(), message=message, details=details)
        )

    # ------------------------------------------------------------------ safe points

    def safe_point(self, call: int) -> None:
        """Agree with the peers before call ``call`` and switch with them. Never raises."""
        ranks = self.ranks
        if ranks is None:
            return
        try:
            self._safe_point(ranks, call)
        except Exception as exc:  # pragma: no cover - a bug here must not break the call
            ranks.broken = f"the safe point failed: {type(exc).__name__}"
            with contextlib.suppress(Exception):  # the peers will time out: go eager too
                self.apply(self._peer_event(ranks.broken))

    def _local(self, held: Event | None) -> Local:
        """This rank's side of a safe point."""
        breaker = self.breaker
        if held is not None:
            return Local(tripped=True, reason=held.reason, ready=False)
        if not breaker.tripped:
            return Local(tripped=False, reason=None, ready=False)
        retry_at = breaker.retry_at
        return Local(
            tripped=True,
            reason=self._hooks.last_reason() or Reason.MANUAL,
            ready=retry_at is not None and self._clock() >= retry_at,
        )

    def _safe_point(self, ranks: Peers, call: int) -> None:
        held = ranks.take_held()
        outcome = ranks.agree(self._local(held), call)
        if outcome is None:  # no agreement (ended, or no group yet): a held trip applies alone
            if held is not None:
                self.apply(held)
            return
        where = {"call": call, "rank": outcome.rank, "ranks": outcome.world}
        if outcome.failure is not None:
            event = held if held is not None else self._peer_event(outcome.failure)
            event.details.update(where, sync_error=outcome.failure)
            self.apply(event)
        elif outcome.recover:
            self._agreed_recovery(call)
        elif outcome.trip and held is not None:  # this rank's own verdict, agreed
            self.apply(replace(held, time=time.time(), details={**held.details, **where}))
        elif outcome.trip:
            self.apply(self._followed(outcome, where))

    def _followed(self, outcome: Outcome, where: dict[str, Any]) -> Event:
        """The event of a rank that follows a peer's trip."""
        reason = outcome.origin_reason.value if outcome.origin_reason else "unknown"
        event = self._peer_event(
            f"rank {outcome.origin} of {outcome.world} tripped ({reason}): every rank "
            f"leaves the compiled path at call {outcome.call}"
        )
        event.details.update(where, peer_rank=outcome.origin, peer_reason=reason)
        return event

    def _agreed_recovery(self, call: int) -> None:
        """Every rank is tripped and its wait is over: all try the compiled path again."""
        if not self.breaker.claim_trial():
            return
        details = {"call": call}
        self._retrying(f"every rank tries the compiled path again at call {call}", details)
        if self.breaker.end_trial():
            self._recovered("compiled path serves again on every rank", details)

    def _peer_event(self, message: str) -> Event:
        return Event(
            kind=EventKind.ROLLBACK,
            reason=Reason.PEER,
            time=time.time(),
            message=message,
            **location_fields(self._hooks.location),
        )
