"""Per-thread call slots with lock-free counters, and the record of one slow call.

Every thread that calls a guarded callable gets one :class:`Slot` (a thread-local): the
hot path counts in its own slot, without a lock, and the graph wrappers
(:mod:`safecompile.guard.graphs`) note there which graph served the call and whether a
check is due. A call that takes the slow path is one :class:`CallState`, handed along
that path (:mod:`safecompile.guard._paths`).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from safecompile.checks.snapshot import Snapshot
    from safecompile.shapes.buckets import Plan
    from safecompile.shapes.table import BucketEntry

__all__ = ["CallState", "Slot", "Slots"]

G = TypeVar("G")  # the graph record (:class:`safecompile.guard.graphs.GraphRecord`)


class Slot(Generic[G]):
    """One thread's view of its current call, and its counters."""

    __slots__ = (
        "call",
        "compiled",
        "due",
        "eager",
        "first",
        "force",
        "fresh",
        "held",
        "mark",
        "new",
        "seen",
        "snapshot",
        "started",
        "timer",
        "why",
    )

    def __init__(self) -> None:
        self.compiled = 0  # calls served by compiled graphs
        self.eager = 0  # calls served eagerly
        # of those, the ones counted off the hot path, by why (``Stats.eager_by_reason``);
        # the hot path's own eager calls (kill switch, rolled back) are the rest
        self.why: Counter[str] = Counter()
        self.first: G | None = None  # the first graph that ran in this call
        self.due: list[G] | None = None  # graphs whose check is due
        self.force = False  # check this call whatever the countdowns say (trials, warmup)
        self.held = False  # a frame of this call ran eagerly instead of making a new graph
        self.snapshot: Snapshot | None = None  # state before the first graph ran
        self.new: list[G] | None = None  # graphs compiled during this call
        self.fresh: list[Any] | None = None  # graphs' first runs in this call (graphs.FirstRun)
        self.started = 0.0  # clock when the first graph of a checked call started
        self.call: CallState[G] | None = None  # the slow call in progress, if any
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
        self.fresh = None


@dataclass(slots=True, eq=False)
class CallState(Generic[G]):
    """One call down the slow path: its arguments, its thread's slot, and its bucket.

    A warmup call (:meth:`Controller.warmup`) is checked like any other but not counted,
    and its result is discarded.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    slot: Slot[G]
    warmup: bool = False
    plan: Plan | None = None  # its bucket's plan (``None``: not bucketed)
    entry: BucketEntry | None = None  # what is known of that bucket

    @property
    def bucket(self) -> str | None:
        return self.entry.label if self.entry is not None else None

    def count_eager(self, why: str) -> None:
        """Count the call as served eager, for ``why`` (a key of ``EAGER_REASONS``)."""
        if not self.warmup:
            self.slot.eager += 1
            self.slot.why[why] += 1


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

    def bucket(self) -> str | None:
        """The bucket of this thread's slow call in progress (``None``: none)."""
        slot: Slot[G] | None = getattr(self.local, "slot", None)
        call = slot.call if slot is not None else None
        return call.bucket if call is not None else None

    def totals(self) -> tuple[int, int, int]:
        """``(compiled, eager, limited)`` calls over every thread (see :meth:`counts`)."""
        compiled, eager, why = self.counts()
        return compiled, eager, why["recompile_limit"]

    def counts(self) -> tuple[int, int, Counter[str]]:
        """``(compiled, eager, eager by why)`` calls over every thread; the slots of threads
        that have ended fold into one, so a thread per request does not grow the list."""
        with self._lock:
            living = []
            gone = self._gone
            for thread, slot in self._all:
                if thread.is_alive():
                    living.append((thread, slot))
                    continue
                gone.compiled += slot.compiled
                gone.eager += slot.eager
                gone.why.update(slot.why)
            self._all = living
            slots = [gone, *(slot for _, slot in living)]
            why: Counter[str] = Counter()
            for s in slots:
                why.update(s.why)
        return sum(s.compiled for s in slots), sum(s.eager for s in slots), why

    def remark(self) -> None:
        """Have every thread report to the speed verdict on its next call."""
        with self._lock:
            for _, slot in self._all:
                slot.mark = 0

    def clear(self) -> None:
        """Zero every counter (``reset()``)."""
        with self._lock:
            for slot in (self._gone, *(slot for _, slot in self._all)):
                slot.compiled = slot.eager = 0
                slot.why.clear()
                slot.mark = slot.seen = 0
