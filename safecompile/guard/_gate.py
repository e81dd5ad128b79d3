"""The gate: the one prepared value the hot path reads, and the one predicate of who may go
compiled, read by the gate and by the slow path (``_paths._admit``).

The hot path reads plain attributes only (:mod:`._hot`): ``fast`` (compiled may serve
without the slow path), ``eager`` and ``eager_until`` (eager serves, decision-free),
``token`` (the kill switch's value last read) and ``compiled`` (the compiled function).
:meth:`Gate.update` recomputes them from the parts whenever one changes; a compile that
starts only closes ``fast`` (:class:`~._compiles.CompileTracker`), with no recompute.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._compiles import CompileTracker
    from ._serving import Serving
    from ._speed import SpeedArm
    from ._trips import Trips
    from .graphs import GraphTable

__all__ = ["Gate"]


class Gate:
    """Who may go compiled now (see the module doc)."""

    __slots__ = (
        "__weakref__",
        "_backgrounds",
        "_compiles",
        "_rollout_acc",
        "_serving",
        "_speed",
        "_table",
        "_trips",
        "background",
        "compiled",
        "deferred",
        "disabled",
        "eager",
        "eager_until",
        "fast",
        "lock",
        "rollout",
        "token",
        "warmups",
    )

    def __init__(
        self,
        compiled: Callable[..., Any],
        *,
        rollout: float,
        deferred: bool,
        trips: Trips,
        compiles: CompileTracker,
        table: GraphTable,
        speed: SpeedArm,
        serving: Serving,
    ) -> None:
        # read by the hot path
        self.token: object = object()  # the kill switch's environment value last read
        self.disabled = False
        self.fast = False
        self.eager_until = -math.inf  # tripped: eager serves, decision-free, until this clock
        self.eager = False  # eager serves every call, no clock read: disabled, or no trial due
        self.compiled = compiled
        # the parts it is computed from
        self.lock = threading.RLock()
        self.rollout = rollout
        self._rollout_acc = 0.0
        self.deferred = deferred  # a live call that would compile is served eager instead
        self.warmups = 0  # blocking warmups in progress
        self._backgrounds = 0  # background warmups pending (a reset() can start another)
        self.background = threading.Event()  # set while no background warmup is pending
        self.background.set()
        self._trips = trips
        self._compiles = compiles
        self._table = table
        self._speed = speed
        self._serving = serving

    @property
    def warming_up(self) -> bool:
        """Whether a warmup (blocking or background) is compiling now."""
        return bool(self.warmups) or bool(self._backgrounds)

    def blocked(self, *, here: bool = False) -> str | None:
        """Why calls may not go compiled now (a key of ``Stats.eager_by_reason``), or
        ``None``. ``here``: for a call on this thread, which a compile of its own does not
        block."""
        if self.disabled:
            return "disabled"
        if self._trips.tripped:
            return "rolled_back"
        if self.warmups or self._backgrounds:
            return "warming"
        # a compile elsewhere: eager meanwhile, unless a live call cannot compile (a
        # miss is served eager: ._deferred), so the race it avoids is harmless
        compiles = self._compiles
        if not self.deferred and (compiles.busy_elsewhere() if here else compiles.busy):
            return "warming"
        return None

    def update(self) -> None:
        """Recompute what the hot path reads: ``fast`` only when nothing needs the slow
        path."""
        with self.lock:
            self.fast = (
                self.blocked() is None
                and self.rollout >= 1.0
                and self._table.size > 0
                and not (self._speed.verdict is not None and self._speed.verdict.wants)
            )
            self.eager_until = until = self._trips.until
            self.eager = self.disabled or until == math.inf
            mode = "disabled" if self.disabled else "rolled_back" if self._trips.tripped else None
            if mode != self._serving.mode:
                self._serving.gate_mode(mode)

    def pick(self) -> bool:
        """Staged rollout: route exactly a ``rollout`` share of calls to compiled."""
        with self.lock:
            self._rollout_acc += self.rollout
            if self._rollout_acc >= 1.0:
                self._rollout_acc -= 1.0
                return True
            return False

    def warming(self, *, background: bool, pending: bool) -> None:
        """A warmup starts (``pending``) or ends (a background one: live calls run eager
        until the last one pending ends)."""
        with self.lock:
            step = 1 if pending else -1
            if background:
                self._backgrounds = max(0, self._backgrounds + step)
                if self._backgrounds:
                    self.background.clear()
                else:
                    self.background.set()
            else:
                self.warmups += step
            self.update()
