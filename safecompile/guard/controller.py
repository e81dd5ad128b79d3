"""The ``.safecompile`` attribute of a guarded callable: its parts, and its public face.

A :class:`Controller` owns the parts (docs/design.md, "Who owns what"): the graph
table (:mod:`.graphs`), the trips (:mod:`.trips`), compiles in flight (:mod:`.compiles`),
shadow checks (:mod:`.shadow`), per-thread slots (:mod:`.slots`), the buckets
(:mod:`safecompile.shapes.table`) and what a restart keeps (:mod:`safecompile.persist.restart`);
the calls themselves take the paths in :mod:`.paths`.

The controller itself wires them, keeps the events, and answers what the docs document,
and nothing more: ``name``, ``state``, ``stats()``, ``events()``, ``warmup()``,
``wait_warm()``, ``rollback()``, ``reset()``, ``report()`` and ``sync()``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from safecompile.base import killswitch as ks
from safecompile.base import torchcompat
from safecompile.base.model import Event, EventKind, Reason, State, Stats
from safecompile.base.options import CompilerFn, Options
from safecompile.base.policies import FOREVER
from safecompile.checks.snapshot import Snapshot
from safecompile.checks.speed import CallSpeed, Decision, SpeedPolicy, Step
from safecompile.observe.explain import Explanation, explain
from safecompile.observe.log import Once, log_event, torch_missing
from safecompile.observe.progress import Compiling, watch_compile
from safecompile.observe.source import (
    SourceLocation,
    dedupe_graph_breaks,
    error_type_name,
    location_fields,
    location_of_error,
    location_of_function,
    safe_message,
    truncate,
)
from safecompile.persist.restart import Persisted
from safecompile.shapes.buckets import Bucketer, uses_cudagraphs
from safecompile.shapes.table import BucketTable

from .backend import compile_function, own_frame
from .compiles import CompileTracker, KnownFailures
from .graphs import (
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
from .shadow import ShadowRunner, Sink
from .slots import Slots
from .trips import TripHooks, Trips

__all__ = ["Controller", "Gate", "Sink", "WarmCall"]

_MAX_EVENTS = 256
_TICK = 1024  # at most this many calls of a thread between reports to the speed verdict

WarmCall = Callable[["Controller", tuple[Any, ...], dict[str, Any]], object]
"""One warmup call down the slow path (:func:`safecompile.guard.paths.warm_call`: the
paths build on this module, so the decorator hands it in)."""


class Gate:
    """The one prepared value the hot path reads (see :mod:`._paths`)."""

    __slots__ = ("compiled", "disabled", "fast", "generation", "token")

    def __init__(self) -> None:
        self.token: object = object()  # the kill switch's environment value last read
        self.generation = -1  # and its code switch's generation
        self.disabled = False
        self.fast = False  # compiled may serve without the slow path
        self.compiled: Callable[..., Any] = _unset


def _unset(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover - replaced at once
    raise RuntimeError("safecompile: the compiled function is not built yet")


_precompile_said = Once()


def _warn_if_precompile(name: str) -> None:
    """torch's caching precompile (``TORCH_CACHING_PRECOMPILE=1``) installs graphs loaded
    from its cache without calling any backend: the guard never sees them (no canary, no
    checks, no counts). Say so once per process, naming the first guarded callable."""
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


class _CompileOnFirstUse:
    """``gate.compiled`` until the compiled path is first taken: calls ``torch.compile``
    then (once, whichever thread comes first), puts the result in the gate, and runs it."""

    __slots__ = ("_build", "_built", "_gate", "_lock")

    def __init__(self, gate: Gate, build: Callable[[], Callable[..., Any]]) -> None:
        self._gate = gate
        self._build = build
        self._built: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        built = self._built
        if built is None:
            with self._lock:
                built = self._built
                if built is None:
                    built = self._built = self._build()
                    if self._gate.compiled is self:  # reset() may have replaced us
                        self._gate.compiled = built
        return built(*args, **kwargs)


class Controller:
    """The ``.safecompile`` attribute of a guarded callable: its state, counters, events
    and report, and the calls that warm it up, roll it back or reset it.

    Made by :func:`~safecompile.safe_compile`, never by hand.
    """

    def __init__(
        self,
        *,
        name: str,
        fn: Callable[..., Any],
        opts: Options,
        compiler: CompilerFn,
        sink: Sink,
        module: torch.nn.Module | None = None,
        bucketer: Bucketer | None = None,
        warm_call: WarmCall,
        peers: Peers | None = None,
    ) -> None:
        self.name = name
        """The stable name: what the kill switch, telemetry and persisted verdicts use."""
        self._fn = fn
        self._module = module
        self._opts = opts  # resolved by the decorator
        # CUDA graphs: outputs live in a pool the next replay overwrites (see paths.discarded)
        self._cudagraphs = uses_cudagraphs(opts.backend_label, opts.mode, opts.options)
        self._compiler = compiler
        shadow, rollback, clock = opts.shadow, opts.rollback, opts.clock
        self._shadow_policy = shadow
        self._rollback_policy = rollback
        self._rollout = float(opts.rollout)
        self._clock = clock
        self._warm_call = warm_call
        self._sink = sink
        self._location = location_of_function(module if module is not None else fn)

        self._lock = threading.RLock()
        self._gate = Gate()
        self._slots: Slots[GraphRecord] = Slots()
        self._trips = Trips(
            rollback,
            clock,
            TripHooks(
                record=self._record,
                counted=self._note_trip,
                update_gate=self._update_gate,
                restart_canary=self._restart_canary,
                restart_speed=self._restart_speed,
                last_reason=self._last_reason,
                location=self._location,
            ),
            peers,
        )
        self._compiles = CompileTracker(self._update_gate)
        self._buckets = BucketTable(bucketer) if bucketer is not None else None
        target = module if module is not None else fn
        self._failures = KnownFailures(target, opts.verdict_key(checks=False))
        self._persisted = Persisted(target, opts.verdict_key(checks=True))
        self._speed_policy = (
            SpeedPolicy(ratio=rollback.slower_ratio, min_pairs=rollback.slower_min_samples)
            if rollback.slower_ratio is not None
            else None
        )
        self._shadow = ShadowRunner(
            policy=shadow,
            fn=fn,
            on_breach=self._on_async_breach,
            sink=sink,
            record=self._record,
            clock=clock,
        )
        self._events: collections.deque[Event] = collections.deque(maxlen=_MAX_EVENTS)
        self._background = threading.Event()  # set while no background warmup is pending
        self._background.set()
        self._warmups = 0
        self._rollout_acc = 0.0
        self._zero()
        self._build()
        ks.register(self.name)
        self._refresh_switch()
        sink.observe_calls(self._call_counts, self._graph_checks)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        """A copy of a guarded module is unguarded (see ``_ModuleForward``)."""
        return

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(None), ())

    # ------------------------------------------------------------------ public controller

    @property
    def _ranks(self) -> Peers | None:
        """The agreement with the peers of a process group (``None`` without one)."""
        return self._trips.ranks

    @property
    def state(self) -> State:
        """Where the callable stands now (see :class:`State`)."""
        gate = self._gate
        if ks.env_token() is not gate.token or ks.SWITCH.generation != gate.generation:
            self._refresh_switch()  # the switch changed: the next call's path is known now
        if gate.disabled:
            return State.DISABLED
        if self._trips.tripped:
            return State.ROLLED_BACK
        if self._warming_up:  # live calls run eager until the warmup is done
            return State.WARMING
        compiled = [g for g in self._table if g.compiled]
        if not compiled:
            return State.WARMING if self._compiles.busy else State.PENDING
        return _compiled_state(compiled, checked=self._shadow_policy is not None)

    def stats(self) -> Stats:
        """A frozen snapshot of the counters."""
        compiled_calls, eager_calls, limited = self._slots.totals()
        shadow = self._shadow.figures()
        with self._lock:
            graphs = [g for g in self._table if g.compiled]
            checks = self._table.checks()
            return Stats(
                calls=compiled_calls + eager_calls,
                compiled_calls=compiled_calls,
                eager_calls=eager_calls,
                compiles=len(graphs),
                compile_errors=self._compile_errors,
                compile_seconds=sum(g.compile_s for g in graphs),
                graphs=len(graphs),
                graph_breaks=self._graph_breaks,
                recompile_limit_calls=limited,
                shadow_checks=shadow.checks,
                shadow_breaches=shadow.breaches,
                shadow_skipped=shadow.skipped,
                graphs_checked=checks["checked"],
                graphs_unchecked=checks["unchecked"],
                graphs_not_yet_checked=checks["not_yet"],
                max_abs_diff=shadow.max_abs,
                max_rel_diff=shadow.max_rel,
                rollbacks=self._rollbacks,
                last_rollback=self._last_rollback,
                extra={
                    "latency": shadow.latency,
                    "shadow_queue_full": shadow.queue_full,
                    "speed": _speed_figures(self._speed),
                },
            )

    def events(self) -> tuple[Event, ...]:
        """The most recent events (at most 256), newest last."""
        with self._lock:
            return tuple(self._events)

    def warmup(self, *args: Any, **kwargs: Any) -> None:
        """Compile now for these inputs, blocking; the result is discarded.

        With buckets, every bucket is compiled: each size, or with several axes each
        combination of sizes (the product), its padding verified. Warmup calls are not
        counted as calls and are checked against eager. A failure trips the callable as a
        live call would (a user's own error in the example inputs is raised).
        """
        if self._gate.disabled:
            return
        with self._lock:
            self._warmups += 1
            self._update_gate()
        try:
            if self._buckets is None:
                self._warm_call(self, args, kwargs)
            else:
                bucketer = self._buckets.bucketer
                for lengths in bucketer.warmup_calls():  # every combination of sizes
                    sized_args, sized_kwargs = bucketer.resize(args, kwargs, lengths)
                    self._warm_call(self, sized_args, sized_kwargs)
                for lengths in bucketer.warmup_specialised():  # length 1, dynamic ranges
                    sized_args, sized_kwargs = bucketer.resize(args, kwargs, lengths)
                    try:
                        self._warm_call(self, sized_args, sized_kwargs)
                    except Exception:  # it cannot take length 1: none will come, skip it
                        continue
            self._persisted.save_artifacts(self.name)  # torch's artifacts, for a restart
        finally:
            with self._lock:
                self._warmups -= 1
                self._update_gate()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until a background warmup has finished (``True``), or ``timeout`` passed.

        For readiness probes. Returns at once when there is no background warmup.
        """
        return self._background.wait(timeout)

    def rollback(self, reason: Reason | str = Reason.MANUAL) -> None:
        """Trip to eager now."""
        self._trip(Reason(reason), message="rolled back by a call to rollback()")

    def sync(self) -> State:
        """Agree on trips with every rank of the process group now, and return the state.

        Call it on every rank at the same point (a training step's boundary): the ranks
        meet here through the process group's store, never on its communicator. A trip
        held on any rank switches every rank here, together; it waits at most
        ``Rollback(sync_timeout=...)`` for the peers, and a rank that calls it alone is
        caught (the ranks' call counts differ) and leaves the agreement. Without a
        group: nothing to agree, the state is returned.
        """
        if self._ranks is not None:
            compiled, eager, _ = self._slots.totals()
            self._trips.safe_point(compiled + eager)
        return self.state

    def _safe_point(self, call: int) -> None:
        """The safe point before call ``call`` (0-based), every ``sync_every`` calls."""
        self._trips.safe_point(call)

    def reset(self) -> None:
        """Forget trips, verdicts and compiled graphs: back to ``"pending"``.

        The graphs torch holds for this function and its resume functions are dropped
        too (``torch._dynamo.reset_code``), and the same backend and compiled function
        serve on, so resets never pile up cache entries, graphs or backends.
        """
        with self._lock:
            self._table = GraphTable(self._shadow_policy)
            self._speed = CallSpeed(self._speed_policy) if self._speed_policy is not None else None
            for code in self._backend.restart(self._hooks()):  # ours, resume functions too
                dropped = torchcompat.reset_code(code)
                if dropped is not None:
                    torch_missing(dropped)
            time_tracing()
            self._trips.reset()
            self._compiles.reset()
            self._slots.clear()
            self._shadow.reset()
            self._failures.forget()
            self._persisted.forget()
            if self._buckets is not None:
                self._buckets.clear()
            self._zero()
            self._update_gate()
        self._record(Event(kind=EventKind.RESET, time=time.time(), message="reset()"))

    def report(self) -> dict[str, Any]:
        """Everything above as a JSON-serialisable dict, for tools."""
        return {
            "name": self.name,
            "state": self.state.value,
            "backend": self._opts.backend_label,
            "mode": self._opts.mode,
            "dynamic": self._opts.dynamic,
            "fullgraph": self._opts.fullgraph,
            "rollout": self._rollout,
            "retry_at": self._trips.breaker.retry_at,
            "stats": self.stats().to_dict(),
            "graphs": [g.to_dict() for g in self._table],
            "speed": self._speed.to_dict() if self._speed is not None else None,
            "buckets": self._buckets.report() if self._buckets is not None else {},
            "bucketing": self._buckets.summary() if self._buckets is not None else None,
            "events": [e.to_dict() for e in self.events()],
            "source": location_fields(self._location) or None,
            "ranks": self._ranks.report() if self._ranks is not None else None,
        }

    # ------------------------------------------------------------------ wiring

    def _zero(self) -> None:
        self._compile_errors = 0
        self._graph_breaks = 0
        self._rollbacks = 0
        self._last_rollback: Event | None = None
        self._limit_said = False
        self._seen_breaks: set[tuple[object, object]] = set()

    def _hooks(self) -> GraphHooks:
        """What the backend needs: the graph table in use, and the controller's parts."""
        return GraphHooks(
            table=self._table,
            slots_local=self._slots.local,
            limit=self._rollback_policy.recompile_limit,
            on_compile_start=self._compiles.enter,
            on_compile_end=self._compiles.leave,
            on_graph=self._on_graph,
            snapshot=self._snapshot,
            bucket_label=lambda: getattr(self._slots.local, "bucket", None),
            clock=self._clock,
            announce=self._announce_compile,
        )

    def _build(self) -> None:
        """A graph table, and the compiled function whose backend fills it (once: a
        ``reset()`` gives the same backend a fresh table)."""
        self._table = GraphTable(self._shadow_policy)
        self._speed = CallSpeed(self._speed_policy) if self._speed_policy is not None else None
        time_tracing()
        limit = self._rollback_policy.recompile_limit
        opts = self._opts
        guard_filter = (opts.options or {}).get("guard_filter_fn")
        backend = self._backend = GuardBackend(self._compiler, self._hooks(), opts.backend_label)

        top = own_frame(self._fn)  # reset() drops the graphs of this callable alone

        def build() -> Callable[..., Any]:
            _warn_if_precompile(self.name)
            # the application's guards are built by now: a pattern matching none is a typo
            token = ks.env_token()
            self._warn_switch_doubts(
                token if isinstance(token, str | bytes) else None, unmatched=True
            )
            return compile_function(
                top,
                backend=backend,
                dynamic=opts.dynamic,
                fullgraph=opts.fullgraph,
                # torch's own limit stays above ours: past ours, our backend serves the
                # traced graph eagerly and says so; torch never falls back silently first
                recompile_limit=max(2 * limit + 2, 8),
                options={"guard_filter_fn": guard_filter} if guard_filter is not None else None,
            )

        # torch.compile is called on the first call that takes the compiled path, never
        # while the kill switch is on (API.md §3), not at decoration.
        self._gate.compiled = _CompileOnFirstUse(self._gate, build)

    def _snapshot(self, graph_args: tuple[Any, ...], graph: GraphRecord) -> Any:
        """State before the first graph of a checked call runs (on the calling thread)."""
        snapshot = Snapshot.take(
            graph_args, self._module, copy=graph.mutates, by_value=self._cudagraphs
        )
        if graph.effects:
            snapshot.add_objects(*find_effects(graph))
        return snapshot

    def _update_gate(self) -> None:
        """Recompute the hot path's flag: open only when nothing needs the slow path."""
        with self._lock:
            self._gate.fast = (
                not self._gate.disabled
                and not self._trips.tripped
                and self._rollout >= 1.0
                and not self._compiles.busy
                and not self._warmups
                and self._background.is_set()
                and len(self._table) > 0
                and not (self._speed is not None and self._speed.wants)
            )

    def _background_warmup(self, *, pending: bool) -> None:
        """A background warmup starts (``pending``) or ends: while pending, live calls run
        eager and never touch compiled code."""
        if pending:
            self._background.clear()
        else:
            self._background.set()
        self._update_gate()

    @property
    def _warming_up(self) -> bool:
        """Whether a warmup (blocking or background) is compiling now."""
        return bool(self._warmups) or not self._background.is_set()

    def _note_warmup_error(self, error: BaseException) -> None:
        """A background warmup example raised eagerly too: record it; eager keeps serving."""
        where, details, explained = self._describe_error(error)
        self._record(
            Event(
                kind=EventKind.WARMUP_FAILED,
                time=time.time(),
                error_type=error_type_name(error),
                message=explained.text,
                details=details,
                **where,
            )
        )

    def _refresh_switch(self) -> None:
        """Re-read the kill switch (the environment, ``disable()`` or the watched source
        changed); the event names the switch that turned this callable off."""
        with self._lock:
            token = ks.env_token()
            generation = ks.SWITCH.generation  # before the rules: a change after is seen
            value = token if isinstance(token, str | bytes) else None
            source = ks.source_of(self.name, value)
            disabled = source is not None
            changed = disabled != self._gate.disabled
            fresh_value = token is not self._gate.token
            self._gate.token = token
            self._gate.generation = generation
            self._gate.disabled = disabled
            self._update_gate()
        if fresh_value:
            self._warn_switch_doubts(value)
        if changed:
            self._record(
                Event(
                    kind=EventKind.DISABLED if disabled else EventKind.ENABLED,
                    time=time.time(),
                    message=f"kill switch: {source} turned this callable off"
                    if disabled
                    else "kill switch: no longer applies",
                    details={"source": source} if source else {},
                )
            )

    def _warn_switch_doubts(self, value: str | bytes | None, *, unmatched: bool = False) -> None:
        """One warning event per doubtful part of a ``SAFECOMPILE_DISABLE`` value."""
        for doubt in ks.unwarned_doubts(value, unmatched=unmatched):
            self._record(Event(kind=EventKind.SWITCH_WARNING, time=time.time(), message=doubt))

    def _pick_compiled(self) -> bool:
        """Staged rollout: route exactly a ``rollout`` share of calls to compiled."""
        with self._lock:
            self._rollout_acc += self._rollout
            if self._rollout_acc >= 1.0:
                self._rollout_acc -= 1.0
                return True
            return False

    # ------------------------------------------------------------------ what happened

    def _record(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)
        self._sink.event(event)

    def _trip(
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
        """Send every later call to eager (until ``retry_after``, or ``reset()``).

        With a process group, a drift or a compile error trips this rank at once and its
        peers follow at the next safe point; any other verdict is held until then, and
        every rank switches together (:mod:`.trips`). The call that tripped has its
        answer from eager already.
        """
        self._trips.trip(
            reason,
            lambda: self._rollback_event(reason, error, message, bucket, graph, max_abs, max_rel),
        )

    def _note_trip(self, event: Event) -> None:
        """The breaker has just tripped: count it and record its event."""
        with self._lock:
            self._rollbacks += 1
            self._update_gate()
        wait = self._trips.breaker.wait
        if wait is not None:
            event.details["retry_in_s"] = wait
        with self._lock:
            self._last_rollback = event
        self._record(event)

    def _restart_canary(self) -> None:
        """After a recovery, every compiled graph is watched again from the start."""
        self._table.restart_canary()

    def _restart_speed(self) -> None:
        """The speed verdict starts afresh (a trial, a recovery): compiled serves, and a
        new measurement starts after the warm-up."""
        if self._speed is not None:
            self._speed.restart()
            self._slots.remark()
            self._update_gate()

    def _last_reason(self) -> Reason | None:
        last = self._last_rollback
        return last.reason if last is not None else None

    def _rollback_event(
        self,
        reason: Reason,
        error: BaseException | None,
        message: str | None,
        bucket: str | None,
        graph: GraphRecord | None,
        max_abs: float | None,
        max_rel: float | None,
    ) -> Event:
        text = ""
        if error is not None:
            where, details, explained = self._describe_error(error)
            text = explained.text
            if reason is Reason.COMPILE_ERROR:
                # the compile_failed event just before says it in full: refer to it
                del details["error_message"]
                text = f"compile failed: {explained.summary} (see compile_failed)"
        else:
            where, details = location_fields(self._location), {}
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

    def _compile_failed(
        self, error: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A compile raised (not the user's own error): persist it and say so."""
        self._failures.persist(self.name, error, args, kwargs)
        started = trace_started()
        where, details, explained = self._describe_error(error)
        with self._lock:
            self._compile_errors += 1
        self._record(
            Event(
                kind=EventKind.COMPILE_FAILED,
                reason=Reason.COMPILE_ERROR,
                time=time.time(),
                bucket=getattr(self._slots.local, "bucket", None),
                duration_s=time.perf_counter() - started if started is not None else None,
                error_type=error_type_name(error),
                message=explained.text,
                details=details,
                **where,
            )
        )

    def _announce_compile(self, graph: str, started: float) -> Callable[[], None]:
        """A compile starts (on the compiling thread): say so if it takes a while."""
        bucket = getattr(self._slots.local, "bucket", None)
        return watch_compile(
            self.name, bucket or graph, started, self._compiling, on_still=self._still_compiling
        )

    def _compiling(self, compiling: Compiling) -> None:
        """A compile is still running after ~2 s (on the timer's thread)."""
        self._record(
            Event(
                kind=EventKind.COMPILING,
                time=time.time(),
                bucket=compiling.graph,
                message=f"still compiling after {compiling.elapsed():.0f} s: {compiling.graph}",
                **location_fields(self._location),
            )
        )

    def _still_compiling(self, compiling: Compiling) -> None:
        """A slow compile goes on (every few seconds, on the timer's thread): one log line,
        not an event (``events()`` keeps what changed, not progress)."""
        log_event(
            "safecompile.still_compiling",
            function=self.name,
            bucket=compiling.graph,
            duration_s=round(compiling.elapsed(), 1),
            description=compiling.graph,
        )

    def _describe_error(
        self, error: BaseException
    ) -> tuple[dict[str, Any], dict[str, Any], Explanation]:
        """:meth:`_error_where`, and the error in plain words (:mod:`._explain`); the raw
        text goes in ``details["error_message"]``, its kind in ``details["error_kind"]``."""
        where, details = self._error_where(error)
        location = (
            SourceLocation(where["file"], where.get("line"), where.get("function"))
            if where
            else None
        )
        explained = explain(error, location)
        details["error_kind"] = explained.kind
        details["error_message"] = safe_message(error)
        return where, details, explained

    def _error_where(self, error: BaseException) -> tuple[dict[str, Any], dict[str, Any]]:
        """The user's source location of an error, and where generated code raised it."""
        where, generated = location_of_error(error, self._module or self._fn)
        details = {"generated_file": generated} if generated is not None else {}
        return location_fields(where or self._location), details

    def _on_graph(self, graph: GraphRecord, gm: torch.fx.GraphModule) -> None:
        """The backend made a graph (on the compiling thread, inside the call)."""
        with self._lock:
            # A break is seen from both sides (the graph it ends, the one resuming after
            # it): each is told once, on the graph where it first shows.
            breaks = []
            for found in dedupe_graph_breaks(graph.breaks):
                at = (found.get("file"), found.get("line"))
                if at == (None, None) or at not in self._seen_breaks:
                    self._seen_breaks.add(at)
                    breaks.append(dict(found))
            graph.breaks = breaks
            self._graph_breaks += len(breaks)
            first_limit = not graph.compiled and not self._limit_said
            if first_limit:
                self._limit_said = True
        slot = self._slots.get()
        slot.new = [graph] if slot.new is None else [*slot.new, graph]
        where = graph.bucket if graph.bucket is not None else f"graph {graph.id}"
        if graph.compiled:
            self._record(
                Event(
                    kind=EventKind.COMPILED,
                    time=time.time(),
                    bucket=where,
                    duration_s=graph.compile_s,
                    message=f"compiled graph {graph.id} ({graph.label}) with "
                    f"{len(breaks)} graph break(s)",
                    details={"graph": graph.id, "graphs": 1, "graph_breaks": breaks},
                    **location_fields(self._location),
                )
            )
        elif first_limit:
            limit = self._rollback_policy.recompile_limit
            self._record(
                Event(
                    kind=EventKind.RECOMPILE_LIMIT,
                    reason=Reason.RECOMPILE_LIMIT,
                    time=time.time(),
                    bucket=where,
                    message=(
                        f"{limit} graphs compiled for {graph.code.split('@')[0]} reached "
                        f"max_recompiles={limit}: new graphs run eager from now on; "
                        "compiled graphs keep serving"
                    ),
                    details={"graph": graph.id},
                    **location_fields(self._location),
                )
            )
        if graph.unchecked is not None and self._shadow_policy is not None:
            self._shadow.skip_graph(graph, graph.unchecked)

    # ------------------------------------------------------------------ the speed verdict

    def _speed_tick(self, slot: CallSlot) -> None:
        """Tell the speed verdict the calls this thread made since it last did (the hot
        path calls this when ``slot.compiled`` reaches ``slot.mark``), and set the next
        mark; when the verdict wants the next call, close the hot path."""
        speed = self._speed
        if speed is None:
            slot.mark = FOREVER
            return
        seen = slot.compiled + slot.eager
        wanted = speed.wants
        left = speed.add(seen - slot.seen)
        slot.seen = seen
        slot.mark = slot.compiled + max(1, min(left, _TICK))
        if speed.wants != wanted:
            self._update_gate()

    def _speed_done(self, step: Step, seconds: float | None) -> None:
        """A timed call ended: its time (``None``: it could not be timed) goes to the
        verdict; a verdict is acted on; the hot path opens again when nothing is wanted."""
        speed = self._speed
        if speed is None:
            return
        decision = None
        if seconds is None:
            speed.abandon()
        else:
            decision = speed.record(step, seconds)
        self._update_gate()
        if decision is not None:
            self._on_speed(decision)

    def _on_speed(self, decision: Decision) -> None:
        """A round's verdict (on the calling thread): say so; eager won: roll back
        (``slower``)."""
        assert self._speed_policy is not None
        limit = self._speed_policy.ratio
        arm = "eager" if decision.eager else "compiled"
        self._record(
            Event(
                kind=EventKind.SPEED_VERDICT,
                time=time.time(),
                message=(
                    f"{arm} serves: the whole call, compiled/eager median "
                    f"{decision.ratio:.3f}x [{decision.low:.3f}, {decision.high:.3f}] over "
                    f"{decision.pairs} paired live calls (slower_ratio={limit})"
                ),
                details=decision.to_dict(),
                **location_fields(self._location),
            )
        )
        if decision.eager:
            self._trip(
                Reason.SLOWER,
                message=(
                    f"the compiled path is slower than eager (slower_ratio={limit}): the "
                    f"whole call {decision.ratio:.3f}x eager's time "
                    f"[{decision.low:.3f}, {decision.high:.3f}] over {decision.pairs} pairs"
                ),
            )

    def _on_async_breach(
        self, graph: GraphRecord | None, message: str, max_abs: float, max_rel: float
    ) -> None:
        self._trip(Reason.DRIFT, message=message, graph=graph, max_abs=max_abs, max_rel=max_rel)

    def _graph_checks(self) -> dict[str, int]:
        """Compiled graphs by where their checks stand (the ``safecompile.graphs`` gauge)."""
        return self._table.checks()

    def _call_counts(self) -> tuple[int, int]:
        compiled, eager, _ = self._slots.totals()
        return compiled, eager


def _compiled_state(compiled: list[GraphRecord], *, checked: bool) -> State:
    """The state of a callable whose compiled graphs serve: ``unchecked`` while any of
    them cannot be checked, ``canary`` while any has canary checks left."""
    if any(g.check() == "unchecked" for g in compiled):
        return State.UNCHECKED
    if checked and any(g.canary_left > 0 for g in compiled):
        return State.CANARY
    return State.COMPILED


def _speed_figures(speed: CallSpeed | None) -> dict[str, Any]:
    """The speed verdict's counters, for ``stats().extra["speed"]``."""
    if speed is None:
        return {"on": False, "probes": 0, "timed": 0, "rounds": 0, "last_ratio": None}
    last = speed.last
    return {
        "on": True,
        "probes": speed.probes,
        "timed": speed.timed,
        "rounds": speed.rounds,
        "last_ratio": last.to_dict()["ratio"] if last is not None else None,
    }
