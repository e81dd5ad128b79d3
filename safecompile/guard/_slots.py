"""Per-thread call slots with lock-free counters, and the record of one slow call.

Every thread that calls a guarded callable gets one :class:`Slot` (a thread-local): the
hot path counts in its own slot, without a lock, and the graph wrappers
(:mod:`safecompile.guard.backend`) note there which graph served the call and whether a
check is due. A call that takes the slow path is one :class:`Call`, handed along that
path (:mod:`safecompile.guard._paths`); the slot knows nothing of it.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .graphs import GraphRecord

if TYPE_CHECKING:
    from safecompile.checks.snapshot import Snapshot
    from safecompile.shapes.buckets import Plan
    from safecompile.shapes.table import BucketEntry

    from ._first_run import FirstRun

__all__ = ["Call", "Slot", "Slots"]


class Slot:
    """One thread's view of its current call, and its counters."""

    __slots__ = (
        "bucket",
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
        "why",
    )

    def __init__(self) -> None:
        self.compiled = 0  # calls served by compiled graphs
        self.eager = 0  # calls served eagerly
        # of those, the ones counted off the hot path, by why (``Stats.eager_by_reason``);
        # the hot path's own eager calls (kill switch, rolled back) are the rest
        self.why: Counter[str] = Counter()
        # What the slow path tells the wrappers and the backend about its call in progress:
        self.force = False  # check this call whatever the countdowns say (trials, warmup)
        self.bucket: str | None = None  # its bucket's label (a new graph is recorded in it)
        # What the wrappers (and torch's frame hook) note during a call:
        self.first: GraphRecord | None = None  # the first graph that ran in this call
        self.due: list[GraphRecord] | None = None  # graphs whose check is due
        self.held = False  # a frame of this call ran eagerly instead of making a new graph
        self.snapshot: Snapshot | None = None  # state before the first graph ran
        self.new: list[GraphRecord] | None = None  # graphs compiled during this call
        self.fresh: list[FirstRun] | None = None  # graphs' first runs in this call
        # when the first graph of a checked call started, on the cost clock (-1.0: none)
        self.started = -1.0
        # The speed verdict (safecompile.checks.speed): the hot path reports to it when
        # ``compiled`` reaches ``mark``; ``seen`` is what it was told so far. The first
        # call is told with the second (0: the next call reports: Slots.remark).
        self.mark = 1
        self.seen = 0

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
        self.started = -1.0


@dataclass(slots=True, eq=False)
class Call:
    """One call down the slow path: its arguments, its thread's slot, and its bucket.

    A warmup call (:meth:`Controller.warmup`) is checked like any other but not counted,
    and its result is discarded.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    slot: Slot
    warmup: bool = False
    plan: Plan | None = None  # its bucket's plan (``None``: not bucketed)
    entry: BucketEntry | None = None  # what is known of that bucket
    # when the call started, on the cost clock, if the speed verdict times it (-1.0: not)
    started: float = -1.0

    @property
    def bucket(self) -> str | None:
        return self.entry.label if self.entry is not None else None


class Slots:
    """The slots of one guarded callable, one per calling thread."""

    def __init__(self) -> None:
        self.local: Any = threading.local()
        self._lock = threading.Lock()
        self._all: list[tuple[threading.Thread, Slot]] = []
        self._gone: Slot = Slot()  # the counts of threads that have ended

    def get(self) -> Slot:
        """This thread's slot (made on its first call)."""
        try:
            slot: Slot = self.local.slot
        except AttributeError:
            slot = Slot()
            self.local.slot = slot
            with self._lock:
                self._all.append((threading.current_thread(), slot))
        return slot

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
