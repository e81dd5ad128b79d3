"""Shadow checks: compare a compiled call with eager, per graph, state-safe.

A check is due when a graph that served the call says so (its countdown, kept here),
and runs *after* the compiled call. ``sync``: eager runs on the caller's own arguments and
grad mode, so on a breach the caller gets eager's result with its gradients; state the
compiled run updated is swapped back first (:mod:`safecompile.checks.snapshot`), and the
two updates are compared like outputs. ``async``: copies of the inputs and output go to
one worker thread on a bounded budget (the call path hands :attr:`Outcome.later` to
:func:`run_later` and acts on what it returns); graphs that update state are not checked.
The two paths' times, on the cost clock, feed only the A/B figures in ``stats()`` (eager
runs on warm caches there). The comparison itself, as the policy declares it, is
:class:`~._compare.Comparer`'s; this module counts what it answers and says the breaches.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from safecompile.base.model import Event, EventKind
from safecompile.base.policies import FOREVER, Shadow, compare_label
from safecompile.base.torchcompat import pytree
from safecompile.checks.compare import Comparison
from safecompile.checks.timing import LatencyWindow
from safecompile.observe.log import Once

from ._compare import Comparer
from ._workers import CHECKS
from .graphs import GraphRecord, GraphTable

if TYPE_CHECKING:
    from safecompile.checks.snapshot import Snapshot
    from safecompile.observe.telemetry import Telemetry

    from ._events import EventLog

__all__ = ["Figures", "Outcome", "ShadowRunner", "drain", "run_later", "sync_device"]


@dataclass(slots=True)
class Figures:
    """Shadow-check counters for ``stats()`` (:meth:`ShadowRunner.figures` hands out copies)."""

    checks: int = 0
    breaches: int = 0
    skipped: int = 0
    queue_full: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    latency: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Outcome:
    """The outcome of a check: ``breach`` is ``None`` unless it found drift; an async
    check's is :attr:`later`, run on the worker (:func:`run_later`)."""

    breach: str | None = None
    eager_out: Any = None
    max_abs: float = 0.0
    max_rel: float = 0.0
    graph: GraphRecord | None = None
    use_eager: bool = False  # serve eager_out without a trip (nothing could be compared)
    later: Callable[[], Outcome] | None = None  # the async check, to run off the call


@dataclass(slots=True)
class _Counters:
    counts: Figures = field(default_factory=Figures)
    pending: int = 0
    said: Once = field(default_factory=Once)  # (graph id, why) of the skips said
    compiled_lat: LatencyWindow = field(default_factory=LatencyWindow)
    eager_lat: LatencyWindow = field(default_factory=LatencyWindow)


class ShadowRunner:
    """The shadow checks of one guarded callable."""

    def __init__(
        self,
        policy: Shadow | None,
        fn: Callable[..., Any],
        sink: Telemetry,
        events: EventLog,
        costs: Callable[[], float],
    ) -> None:
        self.policy = policy
        self.fn = fn
        self._sink = sink
        self._events = events
        self._costs = costs  # the cost clock (the A/B figures)
        self._lock = threading.Lock()
        self._c = _Counters()
        self._comparer = Comparer(policy, fn)  # checks an ignore_where's argument now

    def check(
        self,
        due: list[GraphRecord],
        snapshot: Snapshot | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        *,
        compiled_s: float | None,
    ) -> Outcome:
        """Check one call whose graphs ``due`` wanted a check; see the module doc."""
        graph = due[0]
        # No snapshot: the call path has the call's first graph capture it next time.
        if self.policy is None or snapshot is None:
            return Outcome()
        changed = snapshot.changed()
        if not self._checkable(due, snapshot, changed=changed):
            return Outcome()
        canary = any(g.canary_left > 0 for g in due)
        for g in due:
            self.checked(g)
        if self.policy.mode == "async":
            return Outcome(later=self._later(graph, args, kwargs, out, compiled_s, canary))
        after = snapshot.swap_back() if changed or snapshot.objects else None
        eager_out, eager_s = self._eager(args, kwargs)
        try:
            compiled_out = after.compiled_value(out) if after is not None else out
            result = self.compare_outputs(compiled_out, eager_out, args, kwargs)
            if after is not None:
                after = snapshot.settle(after)
                if result.ok:
                    result = self._comparer.state(after)
        except Exception as exc:  # a comparison that cannot be made: eager's answer stands
            self.skip_graph(graph, f"the outputs could not be compared ({type(exc).__name__})")
            return Outcome(eager_out=eager_out, graph=graph, use_eager=True)
        said = self.note(graph, None, result, compiled_s, eager_s, canary)
        if said is not None:
            self._events.record(said)
        if result.ok and after is not None:
            after.keep_compiled()  # the state the compiled outputs came with
        breach = None if result.ok else result.reason or "outputs differ"
        return Outcome(breach, eager_out, result.max_abs, result.max_rel, graph)

    def _checkable(self, due: list[GraphRecord], snapshot: Snapshot, *, changed: bool) -> bool:
        """Whether this check can be made faithfully; if not, an event says why once, and
        the state is copied from the next check on, or the graphs are never checked."""
        assert self.policy is not None
        why: str | None
        if snapshot.problem is not None:
            why = f"it updates a Python object that cannot be copied ({snapshot.problem})"
        elif not changed:
            return True
        else:
            why = snapshot.unrestorable()
            if why is not None and "parameter" not in why:
                for g in due:
                    g.mutates = True
                self.skip_graph(due[0], f"{why}; from its next check on, the state is restored")
                return False
            if why is None and self.policy.mode == "sync":
                return True
            why = why or "it updates state, which an async check cannot isolate"
        for g in due:
            self.never_check(g, why)
        hint = "" if self.policy.mode == "sync" else " (Shadow(mode='sync') can check it)"
        self.skip_graph(due[0], f"{why}; this graph is not checked{hint}")
        return False

    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, float]:
        """Eager's output and time (the work done, not only launched)."""
        started = self._costs()
        eager_out = self.fn(*args, **kwargs)
        sync_device(eager_out)
        return eager_out, self._costs() - started

    def figures(self) -> Figures:
        with self._lock:
            c = self._c
            latency = {
                "compiled": c.compiled_lat.percentiles(),
                "eager": c.eager_lat.percentiles(),
                "pairs": min(c.compiled_lat.count(), c.eager_lat.count()),
            }
            return dataclasses.replace(c.counts, latency=latency)

    def reset(self) -> None:
        with self._lock:
            self._c = _Counters()

    def describe(self) -> dict[str, Any] | None:
        """The shadow policy as ``report()`` shows it (the declared comparison by name)."""
        p = self.policy
        if p is None:
            return None
        return {
            "canary": p.canary,
            "every": p.every,
            "mode": p.mode,
            "rtol": p.rtol,
            "atol": p.atol,
            "compare": compare_label(p.compare),
        }

    def compare_outputs(
        self, out: Any, eager_out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Comparison:
        """Compare as the policy declares (:meth:`Comparer.outputs`)."""
        return self._comparer.outputs(out, eager_out, args, kwargs)

    def note(
        self,
        graph: GraphRecord | None,
        bucket: str | None,
        result: Comparison,
        compiled_s: float | None = None,
        eager_s: float | None = None,
        canary: bool = True,
    ) -> Event | None:
        """Count a comparison: a check's, or one the call path made (a graph's first run, a
        bucket's padding); the ``breach`` event of one that failed, for the caller to
        record (``None``: it passed)."""
        with self._lock:
            c, counts = self._c, self._c.counts
            counts.checks += 1
            if not result.ok:
                counts.breaches += 1
            counts.max_abs = max(counts.max_abs, result.max_abs)  # a NaN never replaces the first
            counts.max_rel = max(counts.max_rel, result.max_rel)
            if compiled_s is not None and eager_s is not None and result.ok:
                c.compiled_lat.record(compiled_s)
                c.eager_lat.record(eager_s)
        where = bucket if bucket is not None else _where(graph)
        self._sink.shadow_check(
            passed=result.ok,
            max_abs=result.max_abs,
            max_rel=result.max_rel,
            bucket=where,
            log_span=canary,
        )
        if result.ok:
            return None
        extra = {"differ": dict(result.where)} if result.where is not None else {}
        details = {"graph": graph.id} if graph is not None else {}
        return Event(
            kind=EventKind.BREACH,
            time=time.time(),
            bucket=where,
            message=result.reason,
            details=details | extra,
            max_abs_diff=result.max_abs,
            max_rel_diff=result.max_rel,
        )

    def checked(self, record: GraphRecord) -> None:
        """One check of the record was made (or could not be made and never will): a
        canary check less to go, and the countdown to its next check, as the policy says."""
        if record.canary_left > 0:
            record.canary_left -= 1
        record.checks += 1
        _count_down(record, self._countdown(record))

    def never_check(self, record: GraphRecord, why: str) -> None:
        record.unchecked = why
        record.canary_left = 0
        _count_down(record, FOREVER)

    def restart_canary(self, table: GraphTable) -> None:
        """After a recovery, every compiled graph is watched again from the start."""
        policy = self.policy
        if policy is None:
            return
        for record in table:
            if record.compiled and record.unchecked is None:
                record.canary_left = policy.canary
                _count_down(record, self._countdown(record))

    def _countdown(self, record: GraphRecord) -> int:
        """The record's next countdown, as the shadow policy decides."""
        policy = self.policy
        if policy is None or record.unchecked is not None or not record.compiled:
            return FOREVER
        return policy.countdown(record.canary_left)

    def skip_graph(self, graph: GraphRecord | None, why: str) -> None:
        """Count a skipped check, and say once per graph and reason why it was skipped."""
        with self._lock:
            self._c.counts.skipped += 1
            said = self._c.said
        if said.first((graph.id if graph is not None else 0, why)):
            message = f"shadow checks skipped: {why}"
            self._say(EventKind.SHADOW_SKIPPED, graph, bucket=_where(graph), message=message)

    def _say(
        self,
        kind: EventKind,
        graph: GraphRecord | None,
        extra: dict[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        details = {"graph": graph.id} if graph is not None else {}
        event = Event(kind=kind, time=time.time(), details=details | (extra or {}), **fields)
        self._events.record(event)

    def _later(
        self,
        graph: GraphRecord,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        compiled_s: float | None,
        canary: bool,
    ) -> Callable[[], Outcome] | None:
        """An async check: copies of the call now, the eager run and comparison later
        (``None``: skipped, the queue is full or the inputs cannot be copied)."""
        assert self.policy is not None
        with self._lock:
            if self._c.pending >= self.policy.queue_size:
                self._c.counts.queue_full += 1
                self._c.counts.skipped += 1
                return None
            self._c.pending += 1
        try:
            with torch.no_grad():
                inputs, out = pytree.tree_map_only(torch.Tensor, _copy, ((args, kwargs), out))
        except Exception as exc:
            with self._lock:
                self._c.pending -= 1
            self.skip_graph(
                graph, f"inputs could not be copied for the eager run ({type(exc).__name__})"
            )
            return None

        def job() -> Outcome:  # on the worker thread
            try:
                with torch.no_grad():
                    eager_out, eager_s = self._eager(*inputs)
                result = self.compare_outputs(out, eager_out, *inputs)
                said = self.note(graph, None, result, compiled_s, eager_s, canary)
                if said is not None:
                    self._events.record(said)
                if not result.ok:
                    breach = result.reason or "outputs differ"
                    return Outcome(breach, None, result.max_abs, result.max_rel, graph)
            except Exception as exc:
                self.skip_graph(graph, f"the async eager run raised {type(exc).__name__}")
            finally:
                with self._lock:
                    self._c.pending -= 1
            return Outcome()

        return job


def sync_device(out: Any) -> None:
    """Wait for queued GPU work, so a timing covers the work and not its launch."""
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            torch.cuda.synchronize(leaf.device)
            return


def _count_down(record: GraphRecord, value: int) -> None:
    """Runs left before the record's next check; the runs counted down so far are kept
    (as :meth:`GraphRecord.set_countdown`)."""
    record.runs += record.counted_from - record.countdown
    record.countdown = record.counted_from = value


def _where(graph: GraphRecord | None) -> str | None:
    if graph is None:
        return None
    return graph.bucket if graph.bucket is not None else f"graph {graph.id} ({graph.label})"


drain = CHECKS.drain
run_later = CHECKS.submit


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()
