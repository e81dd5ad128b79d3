"""The engine of one guarded callable: its parts, wired, and the one place that acts.

The call paths (:mod:`._hot`, :mod:`._paths`) take an :class:`Engine`, never the
controller. Its parts each keep one concern and return decisions rather than call back:
the gate (:mod:`._gate`: who may go compiled), the graph table (:mod:`.graphs`) and the
backend that fills it (:mod:`.backend`), the trips (:mod:`._trips`), compiles in flight
(:mod:`._compiles`), shadow checks (:mod:`.shadow`), the speed arm (:mod:`._speed`), the
per-thread slots (:mod:`._slots`), the buckets, the events (:mod:`._events`).
:meth:`Engine.act` is where what they decided takes effect: a trip, a trial, a
recovery, a rejected bucket. :class:`~._controller.Controller` is the public face.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from safecompile.base import killswitch as ks
from safecompile.base import torchcompat
from safecompile.base.model import Event, EventKind, Reason
from safecompile.base.options import CompilerFn, Options
from safecompile.checks.speed import Step, call_clock
from safecompile.observe.log import torch_missing, warn_once
from safecompile.observe.source import location_of_function
from safecompile.observe.telemetry import Telemetry
from safecompile.persist.restart import Persisted
from safecompile.shapes.buckets import Bucketer, uses_cudagraphs
from safecompile.shapes.table import BucketTable

from ._compiles import CompileTracker, KnownFailures
from ._deferred import Deferred
from ._events import EventLog
from ._gate import Gate
from ._graph_backend import GuardBackend, time_tracing
from ._precompile import Precompiled
from ._serving import Serving
from ._slots import Slot, Slots
from ._speed import SpeedArm
from ._trips import Trips, Turn
from .backend import compile_function, own_frame
from .graphs import GraphRecord, GraphTable
from .peers import Peers
from .shadow import ShadowRunner

__all__ = ["Engine"]


def _warn_if_precompile(name: str) -> None:
    """``TORCH_CACHING_PRECOMPILE=1`` installs cached graphs without calling any backend:
    the guard never sees them. Say so once per process."""
    # checked: 2.13.0 (``torch._dynamo.config.caching_precompile``; absent in 2.9.1: None)
    if torchcompat.lookup("torch._dynamo.config.caching_precompile") is True:
        warn_once(
            "caching_precompile",
            "safecompile.precompile_unguarded",
            function=name,
            description=(
                "TORCH_CACHING_PRECOMPILE=1: graphs torch loads from its precompile cache "
                "bypass safecompile's backend (no shadow checks, no rollback); unset it"
            ),
        )


class Engine:
    """What the calls of one guarded callable share (see the module doc)."""

    def __init__(
        self,
        *,
        name: str,
        fn: Callable[..., Any],
        opts: Options,
        compiler: CompilerFn,
        sink: Telemetry,
        module: torch.nn.Module | None = None,
        bucketer: Bucketer | None = None,
        peers: Peers | None = None,
    ) -> None:
        self.name = name
        self.fn = fn
        self.module = module
        self.opts = opts  # resolved by the decorator
        # Two clocks, one per purpose: ``clock`` schedules (retry waits, the recent
        # window) and times what a caller waits for (compiles); ``costs`` measures what a
        # call costs, compiled against eager (the speed verdict, the shadow A/B figures):
        # CPU time where it covers the call. An injected clock (tests) serves both.
        self.clock = opts.clock
        self.costs = call_clock if opts.clock is time.perf_counter else opts.clock
        target = module if module is not None else fn
        self.events = EventLog(
            name, location_of_function(target), target, sink, opts.rollback.recompile_limit
        )
        self.slots = Slots()
        self.serving = Serving(self.slots, self.clock)  # who served: eager calls by why
        self.table = GraphTable(opts.shadow)
        self.trips = Trips(opts.rollback, self.clock, self.events.location, peers)
        self.compiles = CompileTracker()
        self.speed = SpeedArm(opts.rollback, self.slots)
        self.buckets = BucketTable(bucketer) if bucketer is not None else None
        self.failures = KnownFailures(target, opts.verdict_key(checks=False))
        self.persisted = Persisted(target, opts.verdict_key(checks=True))
        self.precompiled = Precompiled(
            self.persisted,
            own_frame(fn),
            target,
            compiler,
            opts.dynamic,
            opts.backend_label == "inductor",
        )
        self.shadow = ShadowRunner(opts.shadow, fn, sink, self.events, self.costs)
        # Warmup(background=True): a live call that would make a new graph is served
        # eager, and the graph compiled later on a worker (._deferred); only threads
        # inside a warmup call (CompileTracker.here) may compile then.
        warmup = opts.warmup
        self.deferred: Deferred | None = None
        if warmup is not None and warmup.background:
            self.deferred = Deferred(name, warmup.queue_size, warmup.nice)
        # torch.compile runs on the first call that takes the compiled path, never
        # while the kill switch is on (API.md §3), not at decoration.
        self.gate = Gate(
            self._first_use,
            rollout=opts.rollout,
            deferred=self.deferred is not None,
            trips=self.trips,
            compiles=self.compiles,
            table=self.table,
            speed=self.speed,
            serving=self.serving,
        )
        self.compiles.gate = self.gate
        self._compile_lock = threading.Lock()
        time_tracing()
        # One backend for the life of the callable (torch keeps every one it is given).
        self.backend = GuardBackend(
            compiler,
            opts.backend_label,
            table=self.table,
            slots=self.slots,
            compiles=self.compiles,
            events=self.events,
            shadow=self.shadow,
            limit=opts.rollback.recompile_limit,
            clock=self.clock,
            costs=self.costs,
            module=module,
            cudagraphs=uses_cudagraphs(opts.backend_label, opts.mode, opts.options),
        )
        if ks.register(name, self):
            self.events.warn(
                EventKind.NAME_SHARED,
                f"two guarded callables are named {name!r}: the kill switch, telemetry and "
                "persisted verdicts cannot tell them apart; give each its own "
                "safe_compile(name=...)",
                here=True,
            )
        ks.watch(self.gate)
        self.refresh_switch()
        sink.observe_calls(self.serving.lifetime, self._serving_graphs)

    def reset(self) -> None:
        """Forget every verdict, count and graph (``Controller.reset`` holds the locks)."""
        self.table.clear()
        self.speed.start()
        self.events.reset()
        time_tracing()  # again after ``torch._dynamo.reset()``, which clears it
        for code in self.backend.restart():  # ours, resume functions too
            dropped = torchcompat.reset_code(code)
            if dropped is not None:
                torch_missing(dropped)
        self.trips.reset()
        self.compiles.reset()
        self.serving.restart()  # the slots' counts from zero; the metrics' go on
        self.shadow.reset()
        self.failures.forget()
        self.persisted.forget()
        self.precompiled.forget()
        if self.buckets is not None:
            self.buckets.clear()
        if self.deferred is not None:
            self.deferred.clear()
        self.gate.update()

    # ------------------------------------------------------------------ compiling

    def _first_use(self, *args: Any, **kwargs: Any) -> Any:
        """``gate.compiled`` until first taken: compiles once, whichever thread is first."""
        with self._compile_lock:
            if self.gate.compiled == self._first_use:
                self.gate.compiled = self._compile()
        return self.gate.compiled(*args, **kwargs)

    def _compile(self) -> Callable[..., Any]:
        """``torch.compile`` of the callable, through our backend."""
        _warn_if_precompile(self.name)
        # the application's guards are built by now: a pattern matching none is a typo
        token = ks.env_token()
        self._warn_switch_doubts(token if isinstance(token, str | bytes) else None, unmatched=True)
        opts = self.opts
        guard_filter = (opts.options or {}).get("guard_filter_fn")
        traced = compile_function(
            own_frame(self.fn),  # reset() drops the graphs of this callable alone
            backend=self.backend,
            dynamic=opts.dynamic,
            fullgraph=opts.fullgraph,
            # torch's own limit stays above ours: past ours, our backend serves the
            # traced graph eagerly and says so; torch never falls back silently first
            recompile_limit=max(2 * opts.rollback.recompile_limit + 2, 8),
            options={"guard_filter_fn": guard_filter} if guard_filter is not None else None,
        )
        if self.deferred is not None:  # live threads hold a new graph back (._deferred)
            missing = torchcompat.hold_new_graphs(traced, self.compiles.may_here, self._held)
            if missing is not None:
                torch_missing(missing)
                self.deferred = None
                self.gate.deferred = False
        return self.precompiled.serving(traced)  # what an earlier process saved, first

    def _held(self) -> None:
        """A live call's frame would have made a new graph and ran eagerly instead: the
        call goes to the slow path after it returns (``finish``), which defers it."""
        slot = self.slots.get()
        slot.held = True
        if slot.due is None:
            slot.due = []

    # ------------------------------------------------------------------ the kill switch

    def refresh_switch(self) -> None:
        """Re-read the kill switch (the environment, ``disable()`` or the watched source
        changed); the event names the switch that turned this callable off."""
        gate = self.gate
        with gate.lock:
            token = ks.env_token()
            generation = ks.SWITCH.generation  # before the rules: a change after is seen
            value = token if isinstance(token, str | bytes) else None
            source = ks.source_of(self.name, value)
            disabled = source is not None
            changed = disabled != gate.disabled
            fresh_value = token is not gate.token
            gate.token = token
            if ks.SWITCH.generation != generation:  # changed meanwhile: re-read next call
                gate.token = ks.SWITCH.stale
            gate.disabled = disabled
            if changed:
                gate.update()
        if fresh_value:
            self._warn_switch_doubts(value)
        if changed:
            message = f"kill switch: {source} turned this callable off"
            self.events.say(
                EventKind.DISABLED if disabled else EventKind.ENABLED,
                message if disabled else "kill switch: no longer applies",
                details={"source": source} if source else {},
            )

    def _warn_switch_doubts(self, value: str | bytes | None, *, unmatched: bool = False) -> None:
        """One warning event per doubtful part of a ``SAFECOMPILE_DISABLE`` value."""
        for doubt in ks.unwarned_doubts(value, unmatched=unmatched):
            self.events.warn(EventKind.SWITCH_WARNING, doubt)

    # ------------------------------------------------------------------ acting

    def act(self, *turns: Turn | None) -> None:
        """What the trips decided takes effect, here only: a trip is counted, a trial
        restarts the speed verdict, a recovery the canary checks too; the gate is
        recomputed once, then the events are recorded."""
        done = [turn for turn in turns if turn is not None]
        if not done:
            return
        for turn in done:
            if turn.kind == "trial":
                self.speed.restart()
            elif turn.kind == "recovered":
                self.shadow.restart_canary(self.table)
                self.speed.restart()
        if any(turn.kind in ("tripped", "trial", "recovered") for turn in done):
            self.gate.update()
        for turn in done:
            if turn.event is not None:
                self.events.record(turn.event, rollback=turn.kind == "tripped")

    def trip(
        self,
        reason: Reason,
        *,
        error: BaseException | None = None,
        message: str | None = None,
        bucket: str | None = None,
        graph: GraphRecord | None = None,
        max_abs: float | None = None,
        max_rel: float | None = None,
        breach: Event | None = None,
    ) -> None:
        """Send every later call to eager (until ``retry_after``, or ``reset()``); with a
        process group, the peers follow at the next safe point (:mod:`._trips`). Every
        trip comes here; ``breach``: the event of the comparison that tripped it, recorded
        first."""

        event = functools.partial(
            self.events.rollback,
            reason,
            error=error,
            message=message,
            bucket=bucket,
            graph=graph,
            max_abs=max_abs,
            max_rel=max_rel,
        )
        seen = Turn("breach", breach) if breach is not None else None
        self.act(seen, self.trips.trip(reason, event))

    def safe_point(self, call: int) -> None:
        """Agree with the peers before call ``call`` (a process group), and switch."""
        self.act(*self.trips.safe_point(call))

    # ------------------------------------------------------------------ the speed verdict

    def speed_tick(self, slot: Slot) -> None:
        """The hot path's report to the speed verdict (see :meth:`SpeedArm.tick`); when
        what it wants changed, the gate is recomputed."""
        if self.speed.tick(slot):
            self.gate.update()

    def speed_done(self, step: Step, seconds: float | None) -> None:
        """A timed call ended (``None``: it could not be timed): the hot path opens again
        when nothing is wanted; a round's verdict is said, and eager's win trips."""
        decision = self.speed.done(step, seconds)
        self.gate.update()
        if decision is None:
            return
        self.events.record(self.speed.verdict_event(decision, self.events.location))
        if decision.eager:
            self.trip(Reason.SLOWER, message=self.speed.slower(decision))

    def _serving_graphs(self) -> dict[str, int]:
        """The compiled graphs that serve live calls, by where their checks stand (``off``:
        shadow checks off); none while disabled, rolled back or warming up."""
        counts = dict.fromkeys(("checked", "unchecked", "not_yet", "off"), 0)
        if self.gate.blocked() in ("disabled", "rolled_back") or self.gate.warming_up:
            return counts
        for graph in self.table:
            if graph.compiled:
                counts[graph.check()] += 1
        return counts
