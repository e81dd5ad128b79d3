"""The controller behind every guarded callable: a small state machine and its hot path.

One :class:`Controller` per guarded callable holds the compiled function, one entry per
input shape (or bucket) seen, the trip state, counters and the recent events. The hot
path (:meth:`Controller.__call__`) is a few lines: read the kill switch, look the shape
up, and call the compiled function when the shape is compiled and no check is due.
Everything else — first calls that compile, shadow checks, failures, trips, retries — is
on the slow path, where clarity matters more than nanoseconds.
"""

from __future__ import annotations

import collections
import copy
import enum
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from . import _killswitch as ks
from ._backend import CompilerFn, compile_function
from ._buckets import Bucketer, BucketError, CutSpec, Plan
from ._cache import Verdict, VerdictStore, artifact_key, cache_root, use_torch_caches
from ._compare import compare
from ._model import Event, EventKind, Reason, State, Stats
from ._policies import Rollback, Shadow
from ._shadow import ShadowRunner
from ._source import (
    SourceLocation,
    dedupe_graph_breaks,
    error_type_name,
    graph_breaks_of,
    location_of_error,
    location_of_function,
    safe_message,
    truncate,
)

__all__ = ["Clock", "Controller", "Sink"]

_FOREVER = 1 << 62  # a countdown that never runs out
_MAX_EVENTS = 256
_MAX_ENTRIES = 4096
_Key = Hashable

# Exceptions raised while dynamo traces or a backend compiles (not by compiled code).
_COMPILE_ERRORS: tuple[type[BaseException], ...] = (
    torch._dynamo.exc.TorchDynamoException,
    torch._dynamo.exc.FailOnRecompileLimitHit,
)

# Operators whose compiled random streams differ from eager's: no faithful shadow check.
_RANDOM_MARKERS = (
    "rand",
    "dropout",
    "bernoulli",
    "normal",
    "multinomial",
    "uniform",
    "exponential",
    "cauchy",
    "geometric",
    "poisson",
)


class Clock(Protocol):
    """Monotonic seconds (default ``time.perf_counter``); injected so tests never sleep."""

    def __call__(self) -> float: ...


class Sink(Protocol):
    """Where events and shadow-check figures go (telemetry: traces, metrics, logs)."""

    def event(self, event: Event) -> None: ...

    def shadow_check(
        self, *, passed: bool, max_abs: float, max_rel: float, bucket: str | None, log_span: bool
    ) -> None: ...

    def observe_calls(self, source: Callable[[], tuple[int, int]]) -> None: ...


class _Status(enum.Enum):
    COMPILING = "compiling"  # its first call is compiling it now
    READY = "ready"  # compiled; serves
    EAGER = "eager"  # runs eager: past the recompile limit, oversize, or rejected


@dataclass(slots=True, eq=False)
class Entry:
    """What the controller knows about one input shape (or bucket)."""

    label: str
    status: _Status
    countdown: int = 0  # fast-path calls left before the next check is due
    canary_left: int = 0
    calls: int = 0
    graphs: int = 0
    compile_s: float = 0.0
    why_eager: str | None = None
    cuts: CutSpec | None = None  # bucketed: how to cut this bucket's outputs back
    padded_calls: int = 0
    padded_elements: int = 0  # bucketed: padding waste, in bucketed-dim positions
    real_elements: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """What is handed to ``torch.compile`` (validated by the decorator)."""

    backend: str | Callable[..., Any]
    backend_label: str
    mode: str | None
    options: Mapping[str, Any] | None
    dynamic: bool | None
    fullgraph: bool
    compiler: CompilerFn


class Controller:
    """The ``.safecompile`` attribute of a guarded callable (see API.md §2)."""

    def __init__(
        self,
        *,
        name: str,
        fn: Callable[..., Any],
        key: Callable[[tuple[Any, ...], dict[str, Any]], _Key],
        compile_options: CompileOptions,
        shadow: Shadow | None,
        rollback: Rollback,
        rollout: float,
        sink: Sink,
        clock: Clock,
        module: torch.nn.Module | None = None,
        bucketer: Bucketer | None = None,
    ) -> None:
        self.name = name
        self._bucketer = bucketer
        self._pad = bucketer is not None and bucketer.policy.strategy == "pad"
        self._fn = fn
        self._key = key
        self._opts = compile_options
        self._shadow_policy = shadow
        self._rollback_policy = rollback
        self._rollout = rollout
        self._sink = sink
        self._clock = clock
        self._module = module
        self._fn_location = location_of_function(module if module is not None else fn)

        self._lock = threading.RLock()
        self._tls = threading.local()
        self._entries: dict[_Key, Entry] = {}
        self._events: collections.deque[Event] = collections.deque(maxlen=_MAX_EVENTS)
        self._compiled: Callable[..., Any] = self._make_compiled()
        self._compiling_thread: int | None = None
        self._warming = 0
        self._warm = threading.Event()  # set once no background warmup is pending
        self._idle = threading.Condition(self._lock)  # notified when a compile ends
        self._warm.set()

        # kill switch cache: re-evaluated when the environment or code switch changes
        self._sw_token: object = object()
        self._sw_generation = -1
        self._disabled = False

        # trips
        self._tripped = False
        self._trial_running = False
        self._retry_at: float | None = None
        self._retry_wait = rollback.retry_after or 0.0
        self._last_recovery: float | None = None

        # the hot path's one flag: compiled may serve without the slow path
        self._fast = False
        self._rollout_acc = 0.0

        # counters (under the lock)
        self._compiled_calls = 0
        self._eager_calls = 0
        self._compiles = 0
        self._compile_errors = 0
        self._compile_s = 0.0
        self._graphs = 0
        self._graph_breaks = 0
        self._hidden_graphs = 0
        self._recompile_limit_calls = 0
        self._rollbacks = 0
        self._last_rollback: Event | None = None
        self._limit_reported = False
        self._random_op: str | None = None

        # persisted verdicts (SAFECOMPILE_CACHE_DIR): known compile failures survive restarts
        root = cache_root()
        self._store = VerdictStore(root) if root is not None else None
        if root is not None:
            use_torch_caches(root)
        self._verdict_key: str | None = None
        self._verdict_checked = False

        self.shadow = ShadowRunner(
            policy=shadow,
            rollback=rollback,
            fn=fn,
            module=module,
            on_breach=self._on_async_breach,
            on_slower=self._on_slower,
            sink=sink,
            record=self._record,
            clock=clock,
        )
        self._refresh_switch()
        sink.observe_calls(self._call_counts)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        """A copy of a guarded module is unguarded (see ``_ModuleForward``)."""
        return

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(None), ())

    # ------------------------------------------------------------------ hot path

    def entrypoint(self) -> Callable[..., Any]:
        """The guarded function: one frame that serves compiled when nothing is due.

        A closure rather than a method, so a call costs one Python frame; everything it
        does not handle itself goes to :meth:`_slow`.
        """
        entries = self._entries
        key = self._key
        lock = self._lock
        switch = ks.SWITCH
        env_token = ks.env_token
        refresh = self._refresh_switch
        slow = self._slow
        recover = self._recover

        if self._bucketer is not None:
            return self._bucketed_entrypoint()

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if env_token() is not self._sw_token or switch.generation != self._sw_generation:
                refresh()
            if self._fast:
                entry = entries.get(key(args, kwargs))
                if entry is not None and entry.countdown > 0:
                    entry.countdown -= 1
                    try:
                        out = self._compiled(*args, **kwargs)
                    except Exception as exc:
                        failure: Exception = exc
                    else:
                        with lock:
                            self._compiled_calls += 1
                            entry.calls += 1
                        return out
                    return recover(failure, entry, args, kwargs)
            return slow(args, kwargs)

        return guarded

    def _bucketed_entrypoint(self) -> Callable[..., Any]:
        """The hot path with buckets: plan, pad, call, cut back (see :meth:`entrypoint`)."""
        bucketer = self._bucketer
        assert bucketer is not None
        entries = self._entries
        plan_of = bucketer.plan
        pad = bucketer.pad
        unpad = bucketer.unpad
        pads = self._pad
        lock = self._lock
        switch = ks.SWITCH
        env_token = ks.env_token
        refresh = self._refresh_switch
        slow = self._slow
        recover = self._recover

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if env_token() is not self._sw_token or switch.generation != self._sw_generation:
                refresh()
            if self._fast:
                plan = plan_of(args, kwargs)
                if plan is not None and plan.status == "bucketed":
                    entry = entries.get(plan.key)
                    padded = pads and plan.padded
                    if (
                        entry is not None
                        and entry.countdown > 0
                        and (entry.cuts is not None or not padded)
                    ):
                        entry.countdown -= 1
                        try:
                            if padded:
                                a, k = pad(plan, args, kwargs)
                                out = unpad(plan, self._compiled(*a, **k), entry.cuts)
                            else:
                                out = self._compiled(*args, **kwargs)
                        except Exception as exc:
                            failure: Exception = exc
                        else:
                            with lock:
                                self._compiled_calls += 1
                                entry.calls += 1
                                if padded:
                                    entry.padded_calls += 1
                                    entry.padded_elements += plan.size - plan.length
                                    entry.real_elements += plan.length
                            return out
                        return recover(failure, entry, args, kwargs)
            return slow(args, kwargs)

        return guarded

    # ------------------------------------------------------------------ public controller

    @property
    def state(self) -> State:
        """Where the callable stands now (see :class:`State`)."""
        if self._disabled:
            return State.DISABLED
        if self._tripped:
            return State.ROLLED_BACK
        ready = [e for e in list(self._entries.values()) if e.status is _Status.READY]
        if not ready:
            busy = self._compiling_thread or self._warming or not self._warm.is_set()
            return State.WARMING if busy else State.PENDING
        if self.shadow.active and any(e.canary_left > 0 for e in ready):
            return State.CANARY
        return State.COMPILED

    def stats(self) -> Stats:
        """A frozen snapshot of the counters."""
        with self._lock:
            shadow = self.shadow.figures()
            return Stats(
                calls=self._compiled_calls + self._eager_calls,
                compiled_calls=self._compiled_calls,
                eager_calls=self._eager_calls,
                compiles=self._compiles,
                compile_errors=self._compile_errors,
                compile_seconds=self._compile_s,
                graphs=self._graphs,
                graph_breaks=self._graph_breaks,
                recompile_limit_calls=self._recompile_limit_calls,
                shadow_checks=shadow.checks,
                shadow_breaches=shadow.breaches,
                shadow_skipped=shadow.skipped,
                max_abs_diff=shadow.max_abs,
                max_rel_diff=shadow.max_rel,
                rollbacks=self._rollbacks,
                last_rollback=self._last_rollback,
                extra={
                    "latency": shadow.latency,
                    "shadow_queue_full": shadow.queue_full,
                    "hidden_recompiles": self._hidden_graphs,
                },
            )

    def events(self) -> tuple[Event, ...]:
        """The most recent events (at most 256), newest last."""
        with self._lock:
            return tuple(self._events)

    def warmup(self, *args: Any, **kwargs: Any) -> None:
        """Compile now for these inputs, blocking; the result is discarded.

        Warmup calls are not counted as calls. A failure trips the callable as a live
        call would (a user's own error in the example inputs is raised).
        """
        if self._disabled:
            return
        with self._lock:
            self._warming += 1
            self._update_fast()
        try:
            bucketer = self._bucketer
            if bucketer is None:
                self._slow(args, kwargs, warmup=True)
                return
            for length in bucketer.warmup_lengths():  # every bucket, before traffic
                sized_args, sized_kwargs = bucketer.resize(args, kwargs, length)
                self._slow(sized_args, sized_kwargs, warmup=True)
        finally:
            with self._lock:
                self._warming -= 1
                self._update_fast()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until a background warmup has finished (``True``), or ``timeout`` passed.

        For readiness probes: report ready once the compiled path is warm. Returns at
        once when there is no background warmup.
        """
        return self._warm.wait(timeout)

    def _background_warmup(self, *, pending: bool) -> None:
        """A background warmup starts (``pending``) or ends: while one is pending, live
        calls run eager and never touch compiled code (dynamo can miss its own cache and
        compile again on the caller's thread when a compiled call races a compile)."""
        with self._lock:
            if pending:
                self._warm.clear()
            else:
                self._warm.set()
            self._update_fast()

    def note_warmup_error(self, error: BaseException) -> None:
        """A background warmup example raised eagerly too: record it; eager keeps serving."""
        where, details = self._error_where(error)
        self._record(
            Event(
                kind=EventKind.WARMUP_FAILED,
                time=time.time(),
                error_type=error_type_name(error),
                message=safe_message(error),
                details=details,
                **where,
            )
        )

    def rollback(self, reason: Reason | str = Reason.MANUAL) -> None:
        """Trip to eager now."""
        self._trip(Reason(reason), message="rolled back by a call to rollback()")

    def reset(self) -> None:
        """Forget trips, verdicts and compiled graphs: back to ``"pending"``."""
        with self._lock:
            self._entries.clear()
            self._compiled = self._make_compiled()
            self._tripped = False
            self._trial_running = False
            self._retry_at = None
            self._retry_wait = self._rollback_policy.retry_after or 0.0
            self._last_recovery = None
            self._limit_reported = False
            self._compiles = 0
            self._graphs = 0
            self._hidden_graphs = 0
            self._random_op = None
            self._verdict_checked = False
            if self._store is not None and self._verdict_key is not None:
                self._store.clear(self._verdict_key)
            self.shadow.reset()
            self._update_fast()
        self._record(Event(kind=EventKind.RESET, time=time.time(), message="reset()"))

    def report(self) -> dict[str, Any]:
        """Everything above as a JSON-serialisable dict, for tools."""
        with self._lock:
            entries = {
                e.label: {
                    "status": e.status.value,
                    "calls": e.calls,
                    "graphs": e.graphs,
                    "compile_s": e.compile_s,
                    "canary_left": e.canary_left,
                    "why_eager": e.why_eager,
                    "padded_calls": e.padded_calls,
                    "padding_waste": (
                        e.padded_elements / (e.padded_elements + e.real_elements)
                        if e.padded_elements
                        else 0.0
                    ),
                    "cut": e.cuts.describe() if e.cuts is not None else None,
                    **e.extra,
                }
                for e in self._entries.values()
            }
        return {
            "name": self.name,
            "state": self.state.value,
            "backend": self._opts.backend_label,
            "mode": self._opts.mode,
            "dynamic": self._opts.dynamic,
            "fullgraph": self._opts.fullgraph,
            "rollout": self._rollout,
            "retry_at": self._retry_at,
            "stats": self.stats().to_dict(),
            "shapes": entries,
            "events": [e.to_dict() for e in self.events()],
            "source": _location_dict(self._fn_location),
        }

    # ------------------------------------------------------------------ slow path

    def _slow(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, warmup: bool = False) -> Any:
        if self._disabled:
            return self._eager(args, kwargs)
        trial = False
        if self._tripped:
            if not self._claim_trial():
                return self._eager(args, kwargs)
            trial = True
        elif self._rollout < 1.0 and not warmup and not self._pick_compiled():
            return self._eager(args, kwargs)
        if not warmup and (self._warming or not self._warm.is_set()):
            return self._eager(args, kwargs)  # a warmup is compiling: eager serves meanwhile
        try:
            key, plan = self._route(args, kwargs)
            if key is None:
                return self._eager(args, kwargs, warmup=warmup)
            entry = self._entries.get(key)
            if entry is None:
                if self._store is not None and self._known_failure(args, kwargs):
                    return self._eager(args, kwargs, warmup=warmup)
                entry = self._claim_new_entry(key, args, kwargs, plan, warmup=warmup)
                if entry is None:
                    return self._eager(args, kwargs, warmup=warmup)
                return self._run(entry, args, kwargs, plan, first=True, check=True, warmup=warmup)
            compiling = self._compiling_thread
            if compiling is not None and compiling != threading.get_ident():
                # While this callable compiles, eager serves every call: torch 2.13 can
                # miss its own cache (and compile again) when a compiled call races an
                # install of a new graph of the same function.
                return self._eager(args, kwargs, warmup=warmup)
            if entry.status is not _Status.READY:
                if entry.why_eager == "recompile_limit" and not warmup:
                    with self._lock:
                        self._recompile_limit_calls += 1
                return self._eager(args, kwargs, warmup=warmup)
            check = trial or warmup or entry.countdown <= 0
            if not check:
                entry.countdown -= 1
            return self._run(entry, args, kwargs, plan, first=False, check=check, warmup=warmup)
        finally:
            if trial:
                self._end_trial()

    def _known_failure(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a persisted verdict says this code fails to compile here (checked once
        per process, before the first compile): then trip without compiling again."""
        with self._lock:
            if self._verdict_checked:
                return False
            self._verdict_checked = True
        assert self._store is not None
        key = self._artifact_key(args, kwargs)
        verdict = self._store.get(key) if key is not None else None
        if verdict is None or verdict.kind != "compile_failed":
            return False
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(verdict.time))
        self._trip(
            Reason.COMPILE_ERROR,
            message=(
                f"known compile failure, persisted {when} UTC under this code, torch, Python "
                f"and device ({verdict.error_type}: {verdict.message}); not retried until "
                "one of them changes or reset()"
            ),
        )
        return True

    def _artifact_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        if self._verdict_key is None:
            device = next(
                (t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)),
                torch.device("cpu"),
            )
            opts = self._opts
            try:
                self._verdict_key = artifact_key(
                    self._module if self._module is not None else self._fn,
                    backend=opts.backend_label,
                    mode=opts.mode,
                    options=opts.options,
                    dynamic=opts.dynamic,
                    device=device,
                    extra={"fullgraph": opts.fullgraph},
                )
            except Exception:
                return None
        return self._verdict_key

    def _persist_failure(
        self, error: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if self._store is None:
            return
        key = self._artifact_key(args, kwargs)
        if key is not None:
            self._store.put(
                key,
                Verdict(
                    kind="compile_failed",
                    time=time.time(),
                    name=self.name,
                    reason=Reason.COMPILE_ERROR.value,
                    error_type=error_type_name(error),
                    message=safe_message(error),
                ),
            )

    def _route(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[_Key | None, Plan | None]:
        """The entry key for a call (``None``: run it eager), and its bucket plan."""
        bucketer = self._bucketer
        if bucketer is None:
            return self._key(args, kwargs), None
        plan = bucketer.plan(args, kwargs)
        if plan is None or plan.status == "unbucketable":
            return ("unbucketed", self._key(args, kwargs)), None
        if plan.status == "oversize":
            if bucketer.policy.oversize == "eager":
                return None, plan
            return ("oversize", self._key(args, kwargs)), None
        return plan.key, plan

    def _claim_new_entry(
        self,
        key: _Key,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        plan: Plan | None,
        *,
        warmup: bool = False,
    ) -> Entry | None:
        """Make the entry for a new shape and own its compile, or say to run eager.

        A warmup waits for a compile in flight instead of skipping its shape (live calls
        never get here while a warmup is pending: :meth:`_slow` serves them eager).
        """
        label = plan.describe() if plan is not None else _label(key)
        me = threading.get_ident()
        with self._lock:
            while warmup and self._compiling_thread not in (None, me):
                self._idle.wait(0.1)
            if key in self._entries or self._compiling_thread is not None:
                return None  # single flight: someone is compiling; eager serves meanwhile
            if self._compiles >= self._rollback_policy.max_recompiles:
                self._entries[key] = Entry(
                    label=label, status=_Status.EAGER, why_eager="recompile_limit"
                )
                self._recompile_limit_calls += 1
                first_time = not self._limit_reported
                self._limit_reported = True
            else:
                if len(self._entries) >= _MAX_ENTRIES:
                    self._entries.pop(next(iter(self._entries)))
                entry = Entry(label=label, status=_Status.COMPILING)
                self._entries[key] = entry
                self._compiling_thread = threading.get_ident()
                self._update_fast()
                return entry
        if first_time:
            limit = self._rollback_policy.max_recompiles
            self._record(
                Event(
                    kind=EventKind.RECOMPILE_LIMIT,
                    reason=Reason.RECOMPILE_LIMIT,
                    time=time.time(),
                    bucket=label,
                    message=(
                        f"{self._compiles} compiles reached max_recompiles={limit}: new shapes "
                        "run eager from now on; compiled shapes keep serving"
                    ),
                    **_location_kwargs(self._fn_location),
                )
            )
        return None

    def _run(
        self,
        entry: Entry,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        plan: Plan | None,
        *,
        first: bool,
        check: bool,
        warmup: bool,
    ) -> Any:
        """Call the compiled function, with a shadow check when one is due."""
        padded = plan is not None and plan.padded and self._pad
        learn = padded and entry.cuts is None
        call_args, call_kwargs = args, kwargs
        marked: list[tuple[torch.Tensor, dict[str, Any]]] = []
        if padded and plan is not None:
            assert self._bucketer is not None
            try:
                call_args, call_kwargs = self._bucketer.pad(plan, args, kwargs)
            except BucketError as exc:
                self._reject_bucket(entry, f"padding failed: {exc}", first=first)
                return self._eager(args, kwargs, warmup=warmup)
            with self._lock:
                entry.padded_calls += 1
                entry.padded_elements += plan.size - plan.length
                entry.real_elements += plan.length
        elif first and plan is not None and not self._pad:
            marked = self._mark_dynamic_range(plan, args, kwargs)
        check = not learn and check and self.shadow.wants_check(entry, first=first)
        prepared = self.shadow.prepare(args, kwargs) if (check or learn) else None
        if learn and prepared is None:
            self._reject_bucket(entry, "inputs could not be copied to verify padding", first=first)
            return self._eager(args, kwargs, warmup=warmup)
        self._tls.graphs = []
        started = self._clock()
        try:
            out = self._compiled(*call_args, **call_kwargs)
        except Exception as exc:
            failure: Exception | None = exc
        else:
            failure = None
        finally:
            _unmark(marked)
        if prepared is not None and failure is None:
            self.shadow.sync_device(out)
        elapsed = self._clock() - started
        graphs: list[dict[str, Any]] = self._tls.graphs
        self._tls.graphs = None
        if first:
            with self._lock:
                self._compiling_thread = None
                self._idle.notify_all()
                self._update_fast()
        if failure is not None:
            return self._recover(
                failure, entry, args, kwargs, graphs=graphs, warmup=warmup, seconds=elapsed
            )
        if first:
            self._compiled_entry(entry, graphs, self._clock() - started)
        if learn and plan is not None and prepared is not None:
            compiled_ok, result = self._learn_bucket(entry, plan, out, prepared, args, kwargs)
            self._count(compiled=compiled_ok, entry=entry, warmup=warmup)
            if compiled_ok:
                self._after_check(entry)
            return result
        if padded and plan is not None:
            assert self._bucketer is not None
            try:
                out = self._bucketer.unpad(plan, out, entry.cuts)
            except BucketError as exc:
                self._reject_bucket(entry, f"outputs could not be cut back: {exc}", first=False)
                return self._eager(args, kwargs, warmup=warmup)
        if prepared is None:
            self._count(compiled=True, entry=entry, warmup=warmup)
            return out
        verdict = self.shadow.check(
            entry, prepared, out, compiled_s=None if graphs else elapsed, first=first
        )
        if verdict.breach is not None:
            self._trip(
                Reason.DRIFT,
                message=verdict.breach,
                entry=entry,
                max_abs=verdict.max_abs,
                max_rel=verdict.max_rel,
            )
            self._count(compiled=False, entry=entry, warmup=warmup)
            return verdict.eager_out
        self._count(compiled=True, entry=entry, warmup=warmup)
        self._after_check(entry)
        return out

    def _learn_bucket(
        self,
        entry: Entry,
        plan: Plan,
        padded_out: Any,
        prepared: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[bool, Any]:
        """A bucket's first padded call: learn its output cut and verify its padding
        against unpadded eager (always, shadow checks on or off). Returns whether the
        compiled result is served, and the result."""
        bucketer = self._bucketer
        assert bucketer is not None
        copies_args, copies_kwargs = prepared.copies
        eager_out = self._fn(*copies_args, **copies_kwargs)
        try:
            if bucketer.policy.outputs is not None:
                cuts = bucketer.declared_cuts(plan, padded_out)
            else:
                cuts = bucketer.learn_cuts(plan, padded_out, eager_out)
            out = bucketer.unpad(plan, padded_out, cuts)
        except (BucketError, ValueError) as exc:
            self._reject_bucket(entry, f"outputs cannot be cut back: {exc}", first=False)
            return False, eager_out
        policy = self._shadow_policy
        rtol, atol = (policy.rtol, policy.atol) if policy is not None else (None, None)
        result = compare(out, eager_out, rtol=rtol, atol=atol)
        self.shadow.note(entry, result, canary=True)
        if result.ok:
            with self._lock:
                entry.cuts = cuts
            return True, out
        # Padding's fault, or the compiler's? Eager on the padded inputs tells.
        with torch.no_grad():
            padded_args, padded_kwargs = bucketer.pad(plan, args, kwargs)
            padded_eager = bucketer.unpad(plan, self._fn(*padded_args, **padded_kwargs), cuts)
        padding = compare(padded_eager, eager_out, rtol=rtol, atol=atol)
        if not padding.ok:
            self._reject_bucket(
                entry,
                f"padding changed the result: {padding.reason}",
                first=False,
                max_abs=padding.max_abs,
                max_rel=padding.max_rel,
            )
        else:
            self._trip(
                Reason.DRIFT,
                message=result.reason or "outputs differ",
                entry=entry,
                max_abs=result.max_abs,
                max_rel=result.max_rel,
            )
        return False, eager_out

    def _reject_bucket(
        self,
        entry: Entry,
        why: str,
        *,
        first: bool,
        max_abs: float | None = None,
        max_rel: float | None = None,
    ) -> None:
        """Stop using a bucket: its calls run eager from now on (the callable stays up)."""
        with self._lock:
            entry.status = _Status.EAGER
            entry.why_eager = "bucket_rejected"
            if first and self._compiling_thread == threading.get_ident():
                self._compiling_thread = None
                self._idle.notify_all()
                self._update_fast()
        self._record(
            Event(
                kind=EventKind.BUCKET_REJECTED,
                reason=Reason.DRIFT,
                time=time.time(),
                bucket=entry.label,
                message=truncate(f"bucket not used: {why}"),
                max_abs_diff=max_abs,
                max_rel_diff=max_rel,
                **_location_kwargs(self._fn_location),
            )
        )

    def _mark_dynamic_range(
        self, plan: Plan, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """``strategy="dynamic"``: bound the new graph to its bucket's range of lengths.

        Marks every bucketed tensor of the call (a call whose length is the bucket size
        too: ``plan.targets`` only lists the tensors that need padding) and returns what
        :func:`_unmark` needs to take the marks off again after the call:
        ``mark_dynamic`` writes attributes on the caller's tensor objects, and left there
        they would make every other compiled function those tensors reach recompile.
        """
        bucketer = self._bucketer
        assert bucketer is not None
        sizes = bucketer.policy.sizes
        index = sizes.index(plan.size) if plan.size in sizes else -1
        low = max(2, sizes[index - 1] + 1 if index > 0 else 2)
        if plan.length < low or plan.size <= low:
            return []  # a one-length range (or a length dynamo specialises): a static graph
        found, _ = bucketer._find(args, kwargs)
        marked = []
        for slot, _, tensor in found:
            saved = {a: copy.copy(getattr(tensor, a)) for a in _MARKS if hasattr(tensor, a)}
            marked.append((tensor, saved))
            for dim in slot.dims:
                torch._dynamo.mark_dynamic(tensor, dim % tensor.dim(), min=low, max=plan.size)
        return marked

    def _compiled_entry(self, entry: Entry, graphs: list[dict[str, Any]], seconds: float) -> None:
        """Note a shape's first successful compiled call (and the graphs it compiled)."""
        with self._lock:
            entry.status = _Status.READY
            policy = self._shadow_policy
            entry.canary_left = policy.canary if policy is not None else 0
            entry.countdown = self.shadow.next_countdown(entry)
            self._update_fast()
        if graphs:
            self._note_compile(entry, graphs, seconds)

    def _note_compile(
        self, entry: Entry, graphs: list[dict[str, Any]], seconds: float, note: str = ""
    ) -> None:
        """Count one compile (the graphs one call compiled) and record its event."""
        breaks = _breaks(graphs)
        with self._lock:
            self._compiles += 1
            self._graph_breaks += len(breaks)
            self._compile_s += seconds
            entry.graphs += len(graphs)
            entry.compile_s += seconds
        self._record(
            Event(
                kind=EventKind.COMPILED,
                time=time.time(),
                bucket=entry.label,
                duration_s=seconds,
                message=f"compiled {len(graphs)} graph(s) with {len(breaks)} graph break(s)" + note,
                details={"graphs": len(graphs), "graph_breaks": breaks},
                **_location_kwargs(self._fn_location),
            )
        )

    def _after_check(self, entry: Entry) -> None:
        with self._lock:
            if entry.canary_left > 0:
                entry.canary_left -= 1
            entry.countdown = self.shadow.next_countdown(entry)
            self._update_fast()

    def _recover(
        self,
        failure: Exception,
        entry: Entry,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        graphs: list[dict[str, Any]] | None = None,
        warmup: bool = False,
        seconds: float | None = None,
    ) -> Any:
        """The compiled path raised: answer with eager's result, or eager's own error."""
        if isinstance(failure, BucketError):  # padding or cutting back, not the compiler
            self._reject_bucket(entry, str(failure), first=False)
            return self._eager(args, kwargs)
        reason = (
            Reason.COMPILE_ERROR if isinstance(failure, _COMPILE_ERRORS) else Reason.RUNTIME_ERROR
        )
        if reason is Reason.COMPILE_ERROR or entry.status is _Status.COMPILING:
            with self._lock:
                if self._entries.get(self._key(args, kwargs)) is entry:
                    del self._entries[self._key(args, kwargs)]
                if self._compiling_thread == threading.get_ident():
                    self._compiling_thread = None
                    self._idle.notify_all()
                    self._update_fast()
        user_error: Exception | None = None
        out: Any = None
        try:
            out = self._fn(*args, **kwargs)
        except Exception as exc:
            user_error = exc
        if not warmup:
            self._count(compiled=False)
        if user_error is not None:
            del failure  # eager raises too: the user's own error, not the compiler's
            raise user_error
        if reason is Reason.RUNTIME_ERROR and graphs:
            # The compile succeeded; the compiled code then failed on its first run.
            self._note_compile(entry, graphs, seconds or 0.0, "; its first run failed")
        if reason is Reason.COMPILE_ERROR:
            self._persist_failure(failure, args, kwargs)
            with self._lock:
                self._compile_errors += 1
            where, details = self._error_where(failure)
            details["graph_breaks"] = _breaks(graphs or [])
            with self._lock:
                self._graph_breaks += len(details["graph_breaks"])
            self._record(
                Event(
                    kind=EventKind.COMPILE_FAILED,
                    reason=reason,
                    time=time.time(),
                    duration_s=seconds,
                    bucket=entry.label,
                    error_type=error_type_name(failure),
                    message=safe_message(failure),
                    details=details,
                    **where,
                )
            )
        self._trip(reason, error=failure, entry=entry)
        return out

    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, warmup: bool = False) -> Any:
        if warmup:
            return None
        try:
            return self._fn(*args, **kwargs)
        finally:
            self._count(compiled=False)

    def _count(self, *, compiled: bool, entry: Entry | None = None, warmup: bool = False) -> None:
        if warmup:
            return
        with self._lock:
            if compiled:
                self._compiled_calls += 1
            else:
                self._eager_calls += 1
            if entry is not None:
                entry.calls += 1

    def _call_counts(self) -> tuple[int, int]:
        return self._compiled_calls, self._eager_calls

    # ------------------------------------------------------------------ trips and retries

    def _trip(
        self,
        reason: Reason,
        *,
        error: BaseException | None = None,
        message: str | None = None,
        entry: Entry | None = None,
        max_abs: float | None = None,
        max_rel: float | None = None,
    ) -> None:
        """Send every later call to eager (until ``retry_after``, or ``reset()``)."""
        now = self._clock()
        with self._lock:
            if self._tripped and reason is not Reason.MANUAL:
                return
            self._tripped = True
            self._rollbacks += 1
            retry = self._rollback_policy.retry_after
            if retry is not None:
                # Back off while the compiled path keeps failing: a failed trial, or a trip
                # soon after a recovery, doubles the wait; a quiet spell resets it.
                recent = self._last_recovery is not None and (
                    now - self._last_recovery < 2 * self._retry_wait
                )
                if self._trial_running or recent:
                    cap = self._rollback_policy.max_retry_after
                    self._retry_wait = min(self._retry_wait * 2, cap)
                else:
                    self._retry_wait = retry
                self._retry_at = now + self._retry_wait
            self._update_fast()
        if error is not None:
            where, details = self._error_where(error)
        else:
            where, details = _location_kwargs(self._fn_location), {}
        if self._retry_at is not None and retry is not None:
            details["retry_in_s"] = self._retry_wait
        event = Event(
            kind=EventKind.ROLLBACK,
            reason=reason,
            time=time.time(),
            bucket=entry.label if entry is not None else None,
            error_type=error_type_name(error) if error is not None else None,
            message=truncate(message) if message is not None else safe_message(error or ""),
            max_abs_diff=max_abs,
            max_rel_diff=max_rel,
            details=details,
            **where,
        )
        with self._lock:
            self._last_rollback = event
        self._record(event)

    def _claim_trial(self) -> bool:
        """Whether this call is the half-open trial of the compiled path."""
        with self._lock:
            if (
                self._retry_at is None
                or self._trial_running
                or self._disabled
                or self._clock() < self._retry_at
            ):
                return False
            self._trial_running = True
            self._tripped = False  # lifted for the trial call; a failure re-trips
        self._record(
            Event(kind=EventKind.RETRY, time=time.time(), message="trying the compiled path again")
        )
        return True

    def _end_trial(self) -> None:
        with self._lock:
            self._trial_running = False
            if self._tripped:
                return  # the trial failed: _trip scheduled the next one, with a longer wait
            self._last_recovery = self._clock()
            self._retry_at = None
            for entry in self._entries.values():
                if entry.status is _Status.READY and self._shadow_policy is not None:
                    entry.canary_left = self._shadow_policy.canary
                    entry.countdown = self.shadow.next_countdown(entry)
            self._update_fast()
        self._record(
            Event(kind=EventKind.RECOVERED, time=time.time(), message="compiled path serves again")
        )

    def _on_async_breach(self, entry: Entry, message: str, max_abs: float, max_rel: float) -> None:
        self._trip(Reason.DRIFT, message=message, entry=entry, max_abs=max_abs, max_rel=max_rel)

    def _on_slower(self, message: str) -> None:
        self._trip(Reason.SLOWER, message=message)

    # ------------------------------------------------------------------ helpers

    def _refresh_switch(self) -> None:
        """Re-read the kill switch (the environment or ``disable()`` changed)."""
        with self._lock:
            token = ks.env_token()
            generation = ks.SWITCH.generation
            disabled = ks.parse(token if isinstance(token, str | bytes) else None).matches(
                self.name
            ) or ks.SWITCH.rule.matches(self.name)
            changed = disabled != self._disabled
            self._sw_token = token
            self._sw_generation = generation
            self._disabled = disabled
            self._update_fast()
        if changed:
            kind = EventKind.DISABLED if disabled else EventKind.ENABLED
            self._record(
                Event(
                    kind=kind,
                    time=time.time(),
                    message=f"kill switch: {ks.ENV_VAR} or disable() "
                    + ("turned this callable off" if disabled else "no longer applies"),
                )
            )

    def _update_fast(self) -> None:
        """Recompute the hot path's flag (call with the lock held)."""
        self._fast = (
            not self._disabled
            and not self._tripped
            and self._rollout >= 1.0
            and self._compiling_thread is None
            and not self._warming
            and self._warm.is_set()
        )

    def _pick_compiled(self) -> bool:
        """Staged rollout: route exactly a ``rollout`` share of calls to compiled."""
        with self._lock:
            self._rollout_acc += self._rollout
            if self._rollout_acc >= 1.0:
                self._rollout_acc -= 1.0
                return True
            return False

    def _record(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)
        self._sink.event(event)

    def _error_where(self, error: BaseException) -> tuple[dict[str, Any], dict[str, Any]]:
        """The user's source location of an error, and where generated code raised it."""
        where, generated = location_of_error(error, self._module or self._fn)
        details = {"generated_file": generated} if generated is not None else {}
        return _location_kwargs(where or self._fn_location), details

    def _make_compiled(self) -> Callable[..., Any]:
        opts = self._opts
        limit = self._rollback_policy.max_recompiles
        guard_filter = (opts.options or {}).get("guard_filter_fn")
        return compile_function(
            self._fn,
            backend=_GuardBackend(self),
            dynamic=opts.dynamic,
            fullgraph=opts.fullgraph,
            # torch's own limit stays above ours, so torch never falls back silently first
            recompile_limit=max(2 * limit + 2, 8),
            options={"guard_filter_fn": guard_filter} if guard_filter is not None else None,
        )

    def _on_graph(self, gm: torch.fx.GraphModule) -> None:
        """Called by the backend for every graph dynamo hands it (on the compiling thread)."""
        breaks = graph_breaks_of(gm, include_resumed=True)
        random_op = random_op_in(gm)
        graphs: list[dict[str, Any]] | None = getattr(self._tls, "graphs", None)
        with self._lock:
            self._graphs += 1
            if random_op is not None and self._random_op is None:
                self._random_op = random_op
                self.shadow.mark_random(random_op)
            if graphs is not None:
                graphs.append({"breaks": breaks})
                return
            # A graph compiled on the fast path: dynamo recompiled for a reason our shape
            # key does not see (a Python scalar, a global, grad mode...).
            self._hidden_graphs += 1
            self._graph_breaks += len(dedupe_graph_breaks(breaks))
            storm = self._hidden_graphs > 2 * self._rollback_policy.max_recompiles
        if storm:
            self._trip(
                Reason.RECOMPILE_LIMIT,
                message=(
                    f"{self._hidden_graphs} recompiles on shapes already compiled: the inputs "
                    "change in ways that force recompiles (Python scalars, globals, modes)"
                ),
            )


class _GuardBackend:
    """The backend handed to ``torch.compile``: observes each graph, then compiles it."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller
        self.__name__ = f"safecompile[{controller._opts.backend_label}]"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self._controller._on_graph(gm)
        compiler = self._controller._opts.compiler
        # Compile the backward graph now, not lazily at .backward(): a failure then
        # surfaces here, on the guarded call, where it can be answered with eager.
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            return compiler(gm, example_inputs)


def random_op_in(gm: torch.fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        target = node.target
        name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
        lowered = name.lower()
        if any(marker in lowered for marker in _RANDOM_MARKERS):
            if "dropout" in lowered and node.kwargs.get("training") is False:
                continue
            return name
    return None


# The attributes torch._dynamo.mark_dynamic sets on a tensor (torch 2.13).
_MARKS = (
    "_dynamo_dynamic_indices",
    "_dynamo_dynamic_range",
    "_dynamo_hint_overrides",
    "_specialize_on",
    "_has_dynamo_dim_marking",
)


def _unmark(marked: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
    """Put the caller's tensors' dynamo marks back as they were before we marked them."""
    for tensor, saved in marked:
        for name in _MARKS:
            if name in saved:
                setattr(tensor, name, saved[name])
            elif hasattr(tensor, name):
                delattr(tensor, name)


def _breaks(graphs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The graph breaks of one compile, each once (dynamo sees a break from both sides)."""
    return [dict(b) for b in dedupe_graph_breaks(b for g in graphs for b in g["breaks"])]


def _label(key: _Key) -> str:
    """A shape key as short text: ``8x32:float32``; shapes, dtypes and types only."""
    return truncate(_describe(key), 200)


def _describe(part: object) -> str:
    if isinstance(part, torch.Size):
        return "x".join(map(str, part)) or "scalar"
    if isinstance(part, torch.dtype):
        return str(part).removeprefix("torch.")
    if isinstance(part, type):
        return part.__name__
    if isinstance(part, tuple):
        if len(part) >= 2 and isinstance(part[0], torch.Size):
            return ":".join(_describe(p) for p in part)  # one tensor: shape, dtype, device
        return ", ".join(_describe(p) for p in part)
    return str(part)


def _location_kwargs(where: SourceLocation | None) -> dict[str, Any]:
    if where is None:
        return {}
    return {"file": where.file, "line": where.line, "function": where.function}


def _location_dict(where: SourceLocation | None) -> dict[str, Any] | None:
    return _location_kwargs(where) or None
