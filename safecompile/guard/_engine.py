"""The engine of one guarded callable: the parts its calls need, and how they react.

The call paths (:mod:`._paths`) take an :class:`Engine`, never the controller: the graph
table (:mod:`.graphs`), the trips (:mod:`._trips`), compiles in flight
(:mod:`._compiles`), shadow checks (:mod:`.shadow`), the per-thread slots
(:mod:`._slots`), the buckets, the speed verdict, the options, the clock and the events
sink. :class:`~._controller.Controller` is the public face over it.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from safecompile.base import killswitch as ks
from safecompile.base import torchcompat
from safecompile.base.model import Event, EventKind, Reason
from safecompile.base.options import CompilerFn, Options
from safecompile.base.policies import FOREVER
from safecompile.checks.snapshot import Snapshot
from safecompile.checks.speed import CallSpeed, Decision, SpeedPolicy, Step, call_clock
from safecompile.observe.explain import Explanation, explain
from safecompile.observe.log import Once, log_event, torch_missing
from safecompile.observe.progress import Compiling, watch_compile
from safecompile.observe.source import (
    dedupe_graph_breaks,
    error_type_name,
    location_fields,
    location_of_error,
    location_of_function,
    safe_message,
    truncate,
)
from safecompile.observe.telemetry import Telemetry
from safecompile.persist.restart import Persisted
from safecompile.shapes.buckets import Bucketer, uses_cudagraphs
from safecompile.shapes.table import BucketTable

from ._compiles import CompileTracker, KnownFailures
from ._deferred import Deferred
from ._precompile import Precompiled
from ._serving import Serving
from ._slots import Slots
from ._trips import TripHooks, Trips
from .backend import compile_function, own_frame
from .graphs import (
    Call,
    CallSlot,
    GraphHooks,
    GraphRecord,
    GraphTable,
    GuardBackend,
    find_effects,
    time_tracing,
    trace_started,
)
from .peers import Peers
from .shadow import ShadowRunner

__all__ = ["Engine", "Gate"]

_MAX_EVENTS = 256
_TICK = 1024  # at most this many calls of a thread between reports to the speed verdict


class Gate:
    """The one prepared value the hot path reads (see :mod:`._paths`)."""

    __slots__ = ("__weakref__", "compiled", "disabled", "eager", "eager_until", "fast", "token")

    def __init__(self, compiled: Callable[..., Any]) -> None:
        # the kill switch's environment value last read (stale: re-read, see ks.watch)
        self.token: object = object()
        self.disabled = False
        self.fast = False  # compiled may serve without the slow path
        self.eager_until = -math.inf  # tripped: eager serves, decision-free, until this clock
        self.eager = False  # eager serves every call, no clock read: disabled, or no trial due
        self.compiled = compiled


_precompile_said = Once()


def _warn_if_precompile(name: str) -> None:
    """``TORCH_CACHING_PRECOMPILE=1`` installs cached graphs without calling any backend:
    the guard never sees them. Say so once per process."""
    # checked: 2.13.0 (``torch._dynamo.config.caching_precompile``; absent in 2.9.1: None)
    if torchcompat.lookup("torch._dynamo.config.caching_precompile") is True:
        _precompile_said.warn(
            "caching_precompile",
            "safecompile.precompile_unguarded",
            function=name,
            description=(
                "TORCH_CACHING_PRECOMPILE=1: graphs torch loads from its precompile cache "
                "bypass safecompile's backend (no shadow checks, no rollback); unset it"
            ),
        )


@dataclass
class Tally:
    """What ``stats()`` counts beyond the slots and the graphs (zeroed by ``reset()``)."""

    compile_errors: int = 0
    graph_breaks: int = 0
    rollbacks: int = 0
    last_rollback: Event | None = None
    limit_said: bool = False  # the recompile_limit event is out
    seen_breaks: set[tuple[object, object]] = field(default_factory=set)


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
        self.clock = opts.clock
        # the verdict's clock: CPU time where it covers the call (an injected clock: tests)
        self.speed_clock = call_clock if opts.clock is time.perf_counter else opts.clock
        self.sink = sink
        target = module if module is not None else fn
        self.location = location_of_function(target)
        # CUDA graphs: outputs live in a pool the next replay overwrites (paths.discarded)
        self.cudagraphs = uses_cudagraphs(opts.backend_label, opts.mode, opts.options)
        self.lock = threading.RLock()
        # torch.compile runs on the first call that takes the compiled path, never
        # while the kill switch is on (API.md §3), not at decoration.
        self.gate = Gate(self._first_use)
        self._compile_lock = threading.Lock()
        self.slots: Slots[GraphRecord] = Slots()
        self.serving = Serving(self.slots, self.clock)  # who served: eager calls by why
        self.table = GraphTable(opts.shadow)
        hooks = TripHooks(
            self.record, self._counted, self.restart_speed, self._recovered, self.location
        )
        self.trips = Trips(opts.rollback, self.clock, hooks, peers)
        self.compiles = CompileTracker(self.update_gate)
        self.buckets = BucketTable(bucketer) if bucketer is not None else None
        self.failures = KnownFailures(target, opts.verdict_key(checks=False))
        self.persisted = Persisted(target, opts.verdict_key(checks=True))
        top = own_frame(fn)  # as _compile compiles it
        inductor = opts.backend_label == "inductor"
        self.precompiled = Precompiled(
            self.persisted, top, target, compiler, opts.dynamic, inductor
        )
        self.shadow = ShadowRunner(
            policy=opts.shadow,
            fn=fn,
            on_breach=self._on_async_breach,
            sink=sink,
            record=self.record,
            clock=self.clock,
        )
        self.events: collections.deque[Event] = collections.deque(maxlen=_MAX_EVENTS)
        self.background = threading.Event()  # set while no background warmup is pending
        self.background.set()
        self._backgrounds = 0  # background warmups pending (a reset() can start another)
        # Warmup(background=True): a live call that would make a new graph is served
        # eager, and the graph compiled later on a worker (._deferred); only threads
        # inside a warmup call (warm_call) may compile then.
        warmup = opts.warmup
        self.deferred: Deferred | None = None
        if warmup is not None and warmup.background:
            self.deferred = Deferred(name, warmup.queue_size, warmup.nice)
        self._compile_here = threading.local()
        # held by each warmup call (they may compile) and by reset(): torch cannot drop a
        # code's graphs while another thread is between compiling and installing one
        self.warm_lock = threading.RLock()
        self.warmups = 0  # blocking warmups in progress
        self._rollout_acc = 0.0
        self.start_afresh()
        # One backend for the life of the callable (torch keeps every one it is given).
        graph_hooks = GraphHooks(
            table=self.table,
            local=self.slots.local,
            limit=opts.rollback.recompile_limit,
            compiling=self.compiles.claim,
            on_graph=self._on_graph,
            snapshot=self._snapshot,
            bucket_label=self.slots.bucket,
            clock=self.clock,
            announce=self._announce_compile,
            cudagraphs=self.cudagraphs,
        )
        self.backend = GuardBackend(compiler, graph_hooks, opts.backend_label)
        if ks.register(name, self):
            self._warn(
                EventKind.NAME_SHARED,
                f"two guarded callables are named {name!r}: the kill switch, telemetry and "
                "persisted verdicts cannot tell them apart; give each its own "
                "safe_compile(name=...)",
                here=True,
            )
        ks.watch(self.gate)
        self.refresh_switch()
        sink.observe_calls(self.serving.lifetime, self._serving_graphs)

    def start_afresh(self) -> None:
        """A new speed verdict and tally (at the start, and on ``reset()``)."""
        rollback = self.opts.rollback
        self.speed: CallSpeed | None = None
        if rollback.slower_ratio is not None:
            policy = SpeedPolicy(ratio=rollback.slower_ratio, min_pairs=rollback.slower_min_samples)
            self.speed = CallSpeed(policy)
        self.tally = Tally()
        time_tracing()  # again after ``torch._dynamo.reset()``, which clears it

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
            missing = torchcompat.hold_new_graphs(traced, self.may_compile_here, self._held)
            if missing is not None:
                torch_missing(missing)
                self.deferred = None
        return self.precompiled.serving(traced)  # what an earlier process saved, first

    def may_compile_here(self) -> bool:
        """Whether a call on this thread may make a new graph (see :attr:`deferred`)."""
        return getattr(self._compile_here, "allowed", False)

    @contextlib.contextmanager
    def compiling_here(self) -> Iterator[None]:
        """A warmup call: this thread may make new graphs while the block runs."""
        before = self.may_compile_here()
        with self.warm_lock:
            self._compile_here.allowed = True
            try:
                yield
            finally:
                self._compile_here.allowed = before

    def _held(self) -> None:
        """A live call's frame would have made a new graph and ran eagerly instead: the
        call goes to the slow path after it returns (``finish``), which defers it."""
        slot = self.slots.get()
        slot.held = True
        if slot.due is None:
            slot.due = []

    def _snapshot(self, graph_args: tuple[Any, ...], graph: GraphRecord) -> Any:
        """State before the first graph of a checked call runs (on the calling thread)."""
        snapshot = Snapshot.take(
            graph_args, self.module, copy=graph.mutates, by_value=self.cudagraphs
        )
        if graph.effects:
            snapshot.add_objects(*find_effects(graph))
        return snapshot

    # ------------------------------------------------------------------ the gate

    def update_gate(self) -> None:
        """Recompute the hot path's flag: open only when nothing needs the slow path."""
        with self.lock:
            self.gate.fast = (
                not self.gate.disabled
                and not self.trips.tripped
                and self.opts.rollout >= 1.0
                # a compile elsewhere shuts it, unless a live call cannot compile (a
                # miss is served eager: ._deferred), so the race it avoids is harmless
                and (self.deferred is not None or not self.compiles.busy)
                and not self.warming_up
                and len(self.table) > 0
                and not (self.speed is not None and self.speed.wants)
            )
            self.gate.eager_until = until = self.trips.eager_until()
            self.gate.eager = self.gate.disabled or until == math.inf
            tripped = "rolled_back" if self.trips.tripped else None
            self.serving.gate_mode("disabled" if self.gate.disabled else tripped)

    @property
    def warming_up(self) -> bool:
        """Whether a warmup (blocking or background) is compiling now."""
        return bool(self.warmups) or not self.background.is_set()

    def background_warmup(self, *, pending: bool) -> None:
        """A background warmup starts (``pending``: live calls run eager) or ends; the
        gate opens when the last one pending ends."""
        with self.lock:
            self._backgrounds = max(0, self._backgrounds + (1 if pending else -1))
            if self._backgrounds:
                self.background.clear()
            else:
                self.background.set()
        self.update_gate()

    def pick_compiled(self) -> bool:
        """Staged rollout: route exactly a ``rollout`` share of calls to compiled."""
        with self.lock:
            self._rollout_acc += self.opts.rollout
            if self._rollout_acc >= 1.0:
                self._rollout_acc -= 1.0
                return True
            return False

    def refresh_switch(self) -> None:
        """Re-read the kill switch (the environment, ``disable()`` or the watched source
        changed); the event names the switch that turned this callable off."""
        with self.lock:
            token = ks.env_token()
            generation = ks.SWITCH.generation  # before the rules: a change after is seen
            value = token if isinstance(token, str | bytes) else None
            source = ks.source_of(self.name, value)
            disabled = source is not None
            changed = disabled != self.gate.disabled
            fresh_value = token is not self.gate.token
            self.gate.token = token
            if ks.SWITCH.generation != generation:  # changed meanwhile: re-read next call
                self.gate.token = ks.SWITCH.stale
            self.gate.disabled = disabled
            self.update_gate()
        if fresh_value:
            self._warn_switch_doubts(value)
        if changed:
            message = f"kill switch: {source} turned this callable off"
            self.say(
                EventKind.DISABLED if disabled else EventKind.ENABLED,
                message if disabled else "kill switch: no longer applies",
                details={"source": source} if source else {},
            )

    def _warn_switch_doubts(self, value: str | bytes | None, *, unmatched: bool = False) -> None:
        """One warning event per doubtful part of a ``SAFECOMPILE_DISABLE`` value."""
        for doubt in ks.unwarned_doubts(value, unmatched=unmatched):
            self._warn(EventKind.SWITCH_WARNING, doubt)

    def _warn(self, kind: EventKind, message: str, *, here: bool = False) -> None:
        """A mistake of the user's: an event, and a Python warning (seen where no logging is
        set up); each is said once per process by its caller."""
        self.say(kind, message, here=here)
        warnings.warn(message, UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ events and trips

    def record(self, event: Event) -> None:
        with self.lock:
            self.events.append(event)
        self.sink.event(event)

    def say(self, kind: EventKind, message: str, *, here: bool = False, **fields: Any) -> None:
        """Record an event of ``kind`` now (``here``: at the user's function)."""
        where = location_fields(self.location) if here else {}
        self.record(Event(kind=kind, time=time.time(), message=message, **where, **fields))

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
    ) -> None:
        """Send every later call to eager (until ``retry_after``, or ``reset()``); with a
        process group, the peers follow at the next safe point (:mod:`._trips`)."""

        def event() -> Event:
            text = ""
            if error is not None:
                where, details, explained = self.describe_error(error)
                text = explained.text
                if reason is Reason.COMPILE_ERROR:
                    # the compile_failed event just before says it in full: refer to it
                    del details["error_message"]
                    text = f"compile failed: {explained.summary} (see compile_failed)"
            else:
                where, details = location_fields(self.location), {}
            if graph is not None:
                details["graph"] = graph.id
                details["graph_inputs"] = graph.label
            return Event(
                kind=EventKind.ROLLBACK,
                reason=reason,
                time=time.time(),
                bucket=bucket if bucket is not None else (graph.bucket if graph else None),
                error_type=error_type_name(error) if error is not None else None,
                message=truncate(message) if message is not None else text,
                max_abs_diff=max_abs,
                max_rel_diff=max_rel,
                details=details,
                **where,
            )

        self.trips.trip(reason, event)

    def _counted(self, event: Event) -> None:
        """The breaker has just tripped: count it and record its event."""
        if self.trips.wait is not None:
            event.details["retry_in_s"] = self.trips.wait
        with self.lock:
            self.tally.rollbacks += 1
            self.tally.last_rollback = event
            self.update_gate()
        self.record(event)

    def restart_speed(self) -> None:
        """The speed verdict starts afresh (a trial, a recovery)."""
        if self.speed is not None:
            self.speed.restart()
            self.slots.remark()
            self.update_gate()

    def _recovered(self) -> None:
        """The compiled path serves again: every graph's canary restarts, and the speed
        verdict."""
        self.table.restart_canary()
        self.restart_speed()
        self.update_gate()

    def compile_failed(self, error: BaseException, call: Call) -> None:
        """A compile raised (not the user's own error): persist it and say so."""
        self.failures.persist(self.name, error, call.args, call.kwargs)
        started = trace_started()
        with self.lock:
            self.tally.compile_errors += 1
        self.say_error(
            EventKind.COMPILE_FAILED,
            error,
            reason=Reason.COMPILE_ERROR,
            bucket=call.bucket,
            duration_s=time.perf_counter() - started if started is not None else None,
        )

    def say_error(self, kind: EventKind, error: BaseException, **fields: Any) -> None:
        """An event of ``kind`` about ``error``, at the user's line that raised it."""
        where, details, explained = self.describe_error(error)
        error_type = error_type_name(error)
        self.say(kind, explained.text, error_type=error_type, details=details, **where, **fields)

    def describe_error(
        self, error: BaseException
    ) -> tuple[dict[str, Any], dict[str, Any], Explanation]:
        """The user's line of an error (and where generated code raised it), and the
        error in plain words; the raw text in ``details["error_message"]``."""
        at, generated = location_of_error(error, self.module or self.fn)
        details: dict[str, Any] = {"generated_file": generated} if generated is not None else {}
        explained = explain(error, at or self.location)
        details["error_kind"] = explained.kind
        details["error_message"] = safe_message(error)
        return location_fields(at or self.location), details, explained

    def _on_async_breach(
        self, graph: GraphRecord | None, message: str, max_abs: float, max_rel: float
    ) -> None:
        self.trip(Reason.DRIFT, message=message, graph=graph, max_abs=max_abs, max_rel=max_rel)

    # ------------------------------------------------------------------ compiles

    def _announce_compile(self, graph: str, started: float) -> Callable[[], None]:
        """A compile starts (on the compiling thread): say so if it takes a while."""
        label = self.slots.bucket() or graph
        return watch_compile(
            self.name, label, started, self._compiling, on_still=self._still_compiling
        )

    def _compiling(self, compiling: Compiling) -> None:
        """A compile is still running after ~2 s (on the timer's thread)."""
        self.say(
            EventKind.COMPILING,
            f"still compiling after {compiling.elapsed():.0f} s: {compiling.graph}",
            here=True,
            bucket=compiling.graph,
        )

    def _still_compiling(self, compiling: Compiling) -> None:
        """A slow compile goes on: a log line, not an event (events keep changes)."""
        log_event(
            "safecompile.still_compiling",
            function=self.name,
            bucket=compiling.graph,
            duration_s=round(compiling.elapsed(), 1),
            description=compiling.graph,
        )

    def _on_graph(self, graph: GraphRecord, gm: torch.fx.GraphModule) -> None:
        """The backend made a graph (on the compiling thread, inside the call)."""
        with self.lock:
            # A break is seen from both sides (the graph it ends, the one resuming after
            # it): each is told once, on the graph where it first shows.
            breaks = []
            for found in dedupe_graph_breaks(graph.breaks):
                at = (found.get("file"), found.get("line"))
                if at == (None, None) or at not in self.tally.seen_breaks:
                    self.tally.seen_breaks.add(at)
                    breaks.append(dict(found))
            graph.breaks = breaks
            self.tally.graph_breaks += len(breaks)
            first_limit = not graph.compiled and not self.tally.limit_said
            if first_limit:
                self.tally.limit_said = True
        slot = self.slots.get()
        slot.new = [graph] if slot.new is None else [*slot.new, graph]
        where = graph.bucket if graph.bucket is not None else f"graph {graph.id}"
        if graph.compiled:
            self.say(
                EventKind.COMPILED,
                f"compiled graph {graph.id} ({graph.label}) with {len(breaks)} graph break(s)",
                here=True,
                bucket=where,
                duration_s=graph.compile_s,
                details={"graph": graph.id, "graphs": 1, "graph_breaks": breaks},
            )
        elif first_limit:
            limit = self.opts.rollback.recompile_limit
            self.say(
                EventKind.RECOMPILE_LIMIT,
                f"{limit} graphs compiled for {graph.code.split('@')[0]} reached "
                f"max_recompiles={limit}: new graphs run eager from now on; "
                "compiled graphs keep serving",
                here=True,
                reason=Reason.RECOMPILE_LIMIT,
                bucket=where,
                details={"graph": graph.id},
            )
        if graph.unchecked is not None and self.opts.shadow is not None:
            self.shadow.skip_graph(graph, graph.unchecked)

    # ------------------------------------------------------------------ the speed verdict

    def speed_tick(self, slot: CallSlot) -> None:
        """Tell the speed verdict the calls this thread made since it last did (the hot
        path calls this when ``slot.compiled`` reaches ``slot.mark``), and set the next
        mark; when the verdict wants the next call, close the hot path."""
        speed = self.speed
        if speed is None:
            slot.mark = FOREVER
            return
        seen = slot.compiled + slot.eager
        wanted = speed.wants
        left = speed.add(seen - slot.seen)
        slot.seen = seen
        slot.mark = slot.compiled + max(1, min(left, _TICK))
        if speed.wants != wanted:
            self.update_gate()

    def speed_done(self, step: Step, seconds: float | None) -> None:
        """A timed call ended (``None``: it could not be timed): a verdict is acted on;
        the hot path opens again when nothing is wanted."""
        speed = self.speed
        if speed is None:
            return
        decision = None
        if seconds is None:
            speed.abandon()
        else:
            decision = speed.record(step, seconds)
        self.update_gate()
        if decision is not None:
            self._on_speed(decision)

    def _on_speed(self, decision: Decision) -> None:
        """A round's verdict: say so; eager won: roll back (``slower``)."""
        limit = self.opts.rollback.slower_ratio
        figures = f"[{decision.low:.3f}, {decision.high:.3f}]"
        self.say(
            EventKind.SPEED_VERDICT,
            f"{'eager' if decision.eager else 'compiled'} serves: the whole call, "
            f"compiled/eager summed time {decision.ratio:.3f}x {figures} (median pair "
            f"{decision.median:.3f}x) over "
            f"{decision.pairs} paired live calls (slower_ratio={limit})",
            here=True,
            details=decision.to_dict(),
        )
        if decision.eager:
            self.trip(
                Reason.SLOWER,
                message=(
                    f"the compiled path is slower than eager (slower_ratio={limit}): the "
                    f"whole call {decision.ratio:.3f}x eager's time {figures} over "
                    f"{decision.pairs} pairs"
                ),
            )

    def _serving_graphs(self) -> dict[str, int]:
        """The compiled graphs that serve live calls, by where their checks stand (``off``:
        shadow checks off); none while disabled, rolled back or warming up."""
        counts = dict.fromkeys(("checked", "unchecked", "not_yet", "off"), 0)
        with self.lock:
            if self.gate.disabled or self.trips.tripped or self.warming_up:
                return counts
            for graph in self.table:
                if graph.compiled:
                    counts[graph.check()] += 1
        return counts
