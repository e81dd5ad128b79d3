"""Per-thread call slots: what one call saw, and lock-free call counters.

Every thread that calls a guarded callable gets one :class:`Slot` (a thread-local).
The hot path writes into its own slot only, so counting a call takes no lock; the
graph wrappers (:mod:`safecompile.guard.graphs`) note there which graph served the call and
whether a check is due. :meth:`Slots.totals` sums the slots of every thread, living or
dead, for ``stats()``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from safecompile.checks.snapshot import Snapshot

__all__ = ["Slot", "Slots"]

G = TypeVar("G")  # the graph record (:class:`safecompile.guard.graphs.GraphRecord`)


class Slot(Generic[G]):
    """One thread's view of its current call, and its counters."""

    __slots__ = (
        "compiled",
        "due",
        "eager",
        "first",
        "force",
        "limited",
        "mark",
        "new",
        "seen",
        "snapshot",
        "started",
        "timer",
    )

    def __init__(self) -> None:
        self.compiled = 0  # calls served by compiled graphs
        self.eager = 0  # calls served eagerly
        self.limited = 0  # of those, eager because of the recompile limit
        self.first: G | None = None  # the first graph that ran in this call
        self.due: list[G] | None = None  # graphs whose check is due
        self.force = False  # check this call whatever the countdowns say (trials, warmup)
        self.snapshot: Snapshot | None = None  # state before the first graph ran
        self.new: list[G] | None = None  # graphs compiled during this call
        self.started = 0.0  # clock when the first graph of a checked call started
        # The speed verdict (safecompile.checks.speed): the hot path reports to it when
        # ``compiled`` reaches ``mark``; ``seen`` is what it was told so far; ``timer``
        # is the clock at the start of a timed compiled call (-1.0: not timed).
        self.mark = 0
        self.seen = 0
        self.timer = -1.0

    def begin(self) -> None:
        """Forget the previous call (the slow path's form of the hot path's two writes)."""
        self.first = None
        self.end()

    def end(self) -> None:
        """Drop what the call noted for its check (and the references it held)."""
        self.due = None
        self.snapshot = None
        self.new = None


class Slots(Generic[G]):
    """The slots of one guarded callable, one per calling thread."""

    def __init__(self) -> None:
        self.local: Any = threading.local()
        self._lock = threading.Lock()
        self._all: list[tuple[threading.Thread, Slot[G]]] = []
        self._gone: Slot[G] = Slot()  # the counts of threads that have ended

    def get(self) -> Slot[G]:
        """This thread's slot (made on its first call)."""
        try:
            slot: Slot[G] = self.local.slot
        except AttributeError:
            slot = Slot()
            self.local.slot = slot
            with self._lock:
                self._all.append((threading.current_thread(), slot))
        return slot

    def totals(self) -> tuple[int, int, int]:
        """``(compiled, eager, limited)`` calls over every thread.

        The slots of threads that have ended are folded into one, so a server that
        starts a thread per request does not grow the list.
        """
        with self._lock:
            living = []
            gone = self._gone
            for thread, slot in self._all:
                if thread.is_alive():
                    living.append((thread, slot))
                    continue
                gone.compiled += slot.compiled
                gone.eager += slot.eager
                gone.limited += slot.limited
            self._all = living
            slots = [gone, *(slot for _, slot in living)]
        return (
            sum(s.compiled for s in slots),
            sum(s.eager for s in slots),
            sum(s.limited for s in slots),
        )

    def remark(self) -> None:
        """Have every thread report to the speed verdict on its next call."""
        with self._lock:
            for _, slot in self._all:
                slot.mark = 0

    def clear(self) -> None:
        """Zero every counter (``reset()``)."""
        with self._lock:
            for slot in (self._gone, *(slot for _, slot in self._all)):
                slot.compiled = slot.eager = slot.limited = 0
                slot.mark = slot.seen = 0
