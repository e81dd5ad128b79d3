"""The ``.safecompile`` attribute of a guarded callable: the public face of its engine.

The parts and what they do together live in :class:`~._engine.Engine`; the calls take
the paths in :mod:`._hot` and :mod:`._paths`. The controller answers what the docs
document, and nothing more: ``name``, ``state``, ``stats()``, ``events()``, ``warmup()``,
``wait_warm()``, ``rollback()``, ``reset()``, ``report()`` and ``sync()``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from safecompile.base import killswitch as ks
from safecompile.base import torchcompat
from safecompile.base.model import Event, EventKind, Reason, State, Stats
from safecompile.observe.log import torch_missing
from safecompile.observe.source import location_fields

from . import _workers
from ._engine import Engine
from ._paths import warm_call
from .graphs import GraphRecord

__all__ = ["Controller"]


class Controller:
    """The ``.safecompile`` attribute of a guarded callable: its state, counters, events
    and report, and the calls that warm it up, roll it back or reset it.

    Made by :func:`~safecompile.safe_compile`, never by hand.
    """

    def __init__(self, engine: Engine) -> None:
        self.name = engine.name
        """The stable name: what the kill switch, telemetry and persisted verdicts use."""
        self._engine = engine
        self._warm_grad: bool | None = None  # the grad mode warmups run under
        if engine.deferred is not None:  # a live call's deferred compile: one warmup call
            engine.deferred.warm = functools.partial(warm_call, engine)
        engine.events.sink.observe_state(self._observed)

    def _observed(self) -> tuple[str, bool]:
        """What the ``safecompile.state`` and ``safecompile.disabled`` gauges read."""
        return self.state.value, self._engine.gate.disabled

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        """A copy of a guarded module is unguarded (see ``_ModuleForward``)."""
        return

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(None), ())

    @property
    def state(self) -> State:
        """Where the callable stands now (see :class:`State`)."""
        e = self._engine
        gate = e.gate
        if ks.env_token() is not gate.token:
            e.refresh_switch()  # the switch changed: the next call's path is known now
        if gate.disabled:
            return State.DISABLED
        if e.trips.tripped:
            return State.ROLLED_BACK
        if gate.warming_up:  # live calls run eager until the warmup is done
            return State.WARMING
        compiled = [g for g in e.table if g.compiled]
        if not compiled:
            return _uncompiled_state(e)
        if e.serving.recent(e.serving.counts()).mostly_eager:
            return State.MOSTLY_EAGER  # graphs serve, but most recent calls ran eager
        return _compiled_state(compiled, checked=e.opts.shadow is not None)

    def stats(self) -> Stats:
        """A frozen snapshot of the counters."""
        e = self._engine
        counts = e.serving.counts()
        recent = e.serving.recent(counts)
        shadow = e.shadow.figures()
        with e.events.lock:
            tally = e.events.tally
            graphs = [g for g in e.table if g.compiled]
            checks = e.table.checks()
            return Stats(
                calls=counts.compiled + counts.eager,
                compiled_calls=counts.compiled,
                eager_calls=counts.eager,
                compiles=len(graphs),
                compile_errors=tally.compile_errors,
                compile_seconds=sum(g.compile_s for g in graphs),
                graphs=len(graphs),
                graph_breaks=tally.graph_breaks,
                recompile_limit_calls=counts.by_reason["recompile_limit"],
                shadow_checks=shadow.checks,
                shadow_breaches=shadow.breaches,
                shadow_skipped=shadow.skipped,
                graphs_checked=checks["checked"],
                graphs_unchecked=checks["unchecked"],
                graphs_not_yet_checked=checks["not_yet"],
                max_abs_diff=shadow.max_abs,
                max_rel_diff=shadow.max_rel,
                rollbacks=tally.rollbacks,
                last_rollback=tally.last_rollback,
                eager_by_reason=counts.by_reason,
                recent_calls=recent.calls,
                recent_compiled_share=recent.compiled_share,
                extra={
                    "latency": shadow.latency,
                    "shadow_queue_full": shadow.queue_full,
                    "speed": e.speed.figures(),
                    "deferred": (
                        e.deferred.counts.as_dict(e.deferred.pending())
                        if e.deferred is not None
                        else None
                    ),
                },
            )

    def events(self) -> tuple[Event, ...]:
        """The most recent events (at most 256), newest last."""
        events = self._engine.events
        with events.lock:
            return tuple(events.events)

    def warmup(self, *args: Any, **kwargs: Any) -> None:
        """Compile now for these inputs, blocking; the result is discarded.

        With buckets, every bucket is compiled: each size, or with several axes each
        combination of sizes (the product), its padding verified. Warmup calls are not
        counted as calls and are checked against eager. A failure trips the callable as a
        live call would (a user's own error in the example inputs is raised).
        """
        e = self._engine
        if e.gate.disabled:
            return
        e.gate.warming(background=False, pending=True)
        try:
            calls = [(args, kwargs)]
            if e.buckets is None:
                warm_call(e, args, kwargs)
            else:
                bucketer = e.buckets.bucketer
                calls = [bucketer.resize(args, kwargs, n) for n in bucketer.warmup_calls()]
                for sized in calls:  # every combination of sizes
                    warm_call(e, *sized)
                for lengths in bucketer.warmup_specialised():  # length 1, dynamic ranges
                    try:
                        warm_call(e, *bucketer.resize(args, kwargs, lengths))
                    except Exception:  # it cannot take length 1: none will come, skip it
                        continue
                    calls.append(bucketer.resize(args, kwargs, lengths))
            if not e.trips.tripped:  # every warm call passed its checks
                e.precompiled.save(calls, e.name, e.buckets)  # loaded, not traced, next time
            e.persisted.save_artifacts(e.name)  # torch's artifacts, for a restart
        finally:
            e.gate.warming(background=False, pending=False)

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until a background warmup has finished (``True``), or ``timeout`` passed.

        For readiness probes. Returns at once when there is no background warmup.
        """
        return self._engine.gate.background.wait(timeout)

    def rollback(self, reason: Reason | str = Reason.MANUAL) -> None:
        """Trip to eager now."""
        self._engine.trip(Reason(reason), message="rolled back by a call to rollback()")

    def sync(self) -> State:
        """Agree on trips with every rank of the process group now, and return the state.

        Call it on every rank at the same point (a training step's boundary): the ranks
        meet here through the process group's store, never on its communicator. A trip
        held on any rank switches every rank here, together; it waits at most
        ``Rollback(sync_timeout=...)`` for the peers, and a rank that calls it alone is
        caught (the ranks' call counts differ) and leaves the agreement. Without a
        group: nothing to agree, the state is returned.
        """
        e = self._engine
        if e.trips.ranks is not None:
            compiled, eager, _ = e.slots.totals()
            e.safe_point(compiled + eager)
        return self.state

    def reset(self) -> None:
        """Forget trips, verdicts and compiled graphs: back to ``"pending"``.

        The graphs torch holds for this function and its resume functions are dropped
        too (``torch._dynamo.reset_code``), and the same backend and compiled function
        serve on, so resets never pile up cache entries, graphs or backends. The
        callable's ``warmup=`` runs again as it did at decoration (under the grad mode
        of the decoration): on its worker with ``background=True`` (eager serves
        meanwhile), else before ``reset()`` returns.
        """
        e = self._engine
        # A warmup call in flight on another thread (a background warmup, a deferred
        # compile) ends first: torch cannot drop a code's graphs while a thread is between
        # compiling one and installing it (the process crashed). Then dynamo's compile
        # lock (any other compile), then the engine's, in the order a compile takes them.
        with (
            e.compiles.warm_lock,
            torchcompat.compile_lock() or contextlib.nullcontext(),
            e.gate.lock,
        ):
            e.reset()
        e.events.say(EventKind.RESET, "reset()")
        self._start_warmup()  # again, as at decoration: eager serves meanwhile

    def _start_warmup(self) -> None:
        """Run the ``warmup=`` policy: now, or on a worker thread while eager serves
        (``Warmup(background=True)``; at decoration and on ``reset()``).

        The worker lowers its own priority to ``warmup.nice`` first, so live calls keep
        the CPU. inductor traces one helper module with ``torch.fx.symbolic_trace`` the
        first time it lowers a graph, which patches ``nn.Module.__call__`` process-wide
        while it runs: that one-time trace is done here, before any live call can overlap
        it.
        """
        e = self._engine
        warmup = e.opts.warmup
        if warmup is None:
            return
        if self._warm_grad is None:  # decoration's grad mode, on reset() too
            self._warm_grad = torch.is_grad_enabled()
        grad = self._warm_grad

        def run() -> None:
            with torch.set_grad_enabled(grad):
                for example in warmup.resolve():
                    self.warmup(*example)

        if not warmup.background:
            run()
            return
        if e.opts.backend_label == "inductor":
            with contextlib.suppress(Exception):  # another torch: nothing to close
                closed = torchcompat.close_symbolic_trace_window()
                if closed is not None:
                    torch_missing(closed)
        e.gate.warming(background=True, pending=True)

        def work() -> None:
            try:
                run()
            except Exception as exc:
                e.events.say_error(EventKind.WARMUP_FAILED, exc)  # eager keeps serving
            finally:
                e.gate.warming(background=True, pending=False)

        _workers.start(f"safecompile-warmup:{e.name}", work, nice=warmup.nice)

    def report(self) -> dict[str, Any]:
        """Everything above as a JSON-serialisable dict, for tools."""
        e = self._engine
        opts = e.opts
        return {
            "name": self.name,
            "state": self.state.value,
            "backend": opts.backend_label,
            "mode": opts.mode,
            "dynamic": opts.dynamic,
            "fullgraph": opts.fullgraph,
            "rollout": float(opts.rollout),
            "retry_at": e.trips.retry_at,
            "stats": self.stats().to_dict(),
            "graphs": [g.to_dict() for g in e.table],
            "speed": e.speed.verdict.to_dict() if e.speed.verdict is not None else None,
            "shadow": e.shadow.describe(),
            "buckets": e.buckets.report() if e.buckets is not None else {},
            "bucketing": e.buckets.summary() if e.buckets is not None else None,
            "events": [event.to_dict() for event in self.events()],
            "source": location_fields(e.events.location) or None,
            "ranks": e.trips.ranks.report() if e.trips.ranks is not None else None,
        }


def _uncompiled_state(e: Engine) -> State:
    """No graph compiled: ``warming`` while one compiles, ``nothing_to_compile`` when
    dynamo ran the callable and made no graph (eager serves, as under torch.compile),
    else ``pending``."""
    if e.compiles.busy:
        return State.WARMING
    if e.serving.counts().by_reason["no_graph"]:
        return State.NOTHING_TO_COMPILE
    return State.PENDING


def _compiled_state(compiled: list[GraphRecord], *, checked: bool) -> State:
    """``unchecked`` while any compiled graph cannot be checked, ``canary`` while any has
    canary checks left, else ``compiled``."""
    if any(g.check() == "unchecked" for g in compiled):
        return State.UNCHECKED
    if checked and any(g.canary_left > 0 for g in compiled):
        return State.CANARY
    return State.COMPILED
