"""The breaker: tripped or not, when to try again, and the one-call half-open trial.

A trip sends every call to eager. With ``Rollback(retry_after=...)`` a trip schedules a
trial: after the wait, exactly one call (on one thread) tries the compiled path while
every other call keeps running eager; its success closes the breaker, its failure trips
it again with a longer wait (the policy decides: :meth:`Rollback.next_wait`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from safecompile.base.policies import Rollback

__all__ = ["Breaker"]


class Breaker:
    """Trip state of one guarded callable; thread-safe."""

    def __init__(self, policy: Rollback, clock: Callable[[], float]) -> None:
        self._policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self.tripped = False
        self.retry_at: float | None = None
        self.wait: float | None = None
        self._trial: int | None = None  # the thread running the trial
        self._recovered_at: float | None = None
        self._trial_failed = False

    def trip(self) -> bool:
        """Trip now; ``False`` if already tripped (nothing new to report)."""
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
            return True

    def claim_trial(self) -> bool:
        """Whether this call is the half-open trial (one at a time, once the wait is over)."""
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

    def end_trial(self) -> bool:
        """The trial call finished; returns whether the breaker closed (nothing tripped
        it again during the trial)."""
        with self._lock:
            self._trial = None
            if self._trial_failed:
                return False
            self.tripped = False
            self.retry_at = None
            self._recovered_at = self._clock()
            return True

    def end_trial_unserved(self) -> None:
        """The trial call was served eagerly (its shape or bucket runs eager): nothing was
        learnt, so the next call is the trial again."""
        with self._lock:
            self._trial = None

    def reset(self) -> None:
        with self._lock:
            self.tripped = False
            self.retry_at = None
            self.wait = None
            self._trial = None
            self._recovered_at = None
