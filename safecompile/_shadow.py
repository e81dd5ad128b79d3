"""Shadow checks: compare the compiled path with eager on live traffic.

A check runs the user's function eagerly on copies of the inputs and compares outputs
(:mod:`safecompile._compare`). ``sync`` checks happen before the call returns, so a
breach is answered with eager's result; ``async`` checks run on one worker thread fed by
a bounded budget per callable, so the caller never waits and memory never grows.
Checked calls also time both paths: the paired samples give the A/B latency figures and
the slower-than-eager verdict.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from ._compare import Comparison, compare
from ._model import Event, EventKind
from ._policies import Rollback, Shadow
from ._timing import LatencyWindow, slower_verdict

if TYPE_CHECKING:
    from ._controller import Entry, Sink

__all__ = ["Figures", "Prepared", "ShadowRunner", "Verdict", "drain"]

_FOREVER = 1 << 62
_SLOWER_ADVISORY = 1.10  # with slower_ratio=None: say once that compiled is this much slower
# A speed verdict sorts the whole A/B window (up to 1024 pairs: ~250 µs of pure Python,
# holding the GIL). Judge at min_samples pairs, then once per this many new pairs.
_JUDGE_EVERY = 16


@dataclass(frozen=True, slots=True)
class Figures:
    """Shadow-check counters for ``stats()``."""

    checks: int
    breaches: int
    skipped: int
    queue_full: int
    max_abs: float
    max_rel: float
    latency: dict[str, Any]


@dataclass(slots=True)
class Prepared:
    """What a check needs, captured before the compiled call runs."""

    args: tuple[Any, ...]  # the caller's own arguments
    kwargs: dict[str, Any]
    copies: tuple[tuple[Any, ...], dict[str, Any]]  # clones for the eager run
    versions: list[tuple[torch.Tensor, int]]  # input tensors and their versions before


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of a sync check (async checks always answer ``breach=None``)."""

    breach: str | None = None
    eager_out: Any = None
    max_abs: float = 0.0
    max_rel: float = 0.0


@dataclass(slots=True)
class _Counters:
    checks: int = 0
    breaches: int = 0
    skipped: int = 0
    queue_full: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    pending: int = 0
    said_skip: set[str] = field(default_factory=set)
    slower_said: bool = False
    next_judge: int = 0  # the pair count at which speed is judged next


class ShadowRunner:
    """The shadow-check machinery of one guarded callable."""

    def __init__(
        self,
        *,
        policy: Shadow | None,
        rollback: Rollback,
        fn: Callable[..., Any],
        module: torch.nn.Module | None,
        on_breach: Callable[[Entry, str, float, float], None],
        on_slower: Callable[[str], None],
        sink: Sink,
        record: Callable[[Event], None],
        clock: Callable[[], float],
    ) -> None:
        self._policy = policy
        self._clock = clock
        self._rollback = rollback
        self._fn = fn
        self._module = module
        self._on_breach = on_breach
        self._on_slower = on_slower
        self._sink = sink
        self._record = record
        self._lock = threading.Lock()
        self._c = _Counters()
        self._random_op: str | None = None
        self._compiled_lat = LatencyWindow()
        self._eager_lat = LatencyWindow()

    # -- scheduling -------------------------------------------------------------------

    def next_countdown(self, entry: Entry) -> int:
        """Fast-path calls of this shape before the next check is due."""
        policy = self._policy
        if policy is None or self._random_op is not None:
            return _FOREVER
        if entry.canary_left > 0:
            return 0
        return _FOREVER if policy.every == 0 else policy.every - 1

    def wants_check(self, entry: Entry, *, first: bool) -> bool:
        """Whether this call is to be checked (the due check may have to be skipped)."""
        if self._policy is None:
            return False
        if not first and entry.canary_left <= 0 and self._policy.every == 0:
            return False
        if self._random_op is not None:
            self._skip(f"the compiled graph draws random numbers ({self._random_op})")
            return False
        if self._module is not None and self._module.training:
            self._skip("the module is in training mode")
            return False
        return True

    @property
    def active(self) -> bool:
        """Whether checks can happen at all (a policy, and nothing that rules them out)."""
        return self._policy is not None and self._random_op is None

    def mark_random(self, op: str) -> None:
        """The function draws random numbers: compiled RNG differs from eager's."""
        self._random_op = op

    def reset(self) -> None:
        with self._lock:
            self._c = _Counters()
            self._random_op = None
            self._compiled_lat = LatencyWindow()
            self._eager_lat = LatencyWindow()

    def figures(self) -> Figures:
        with self._lock:
            c = self._c
            return Figures(
                checks=c.checks,
                breaches=c.breaches,
                skipped=c.skipped,
                queue_full=c.queue_full,
                max_abs=c.max_abs,
                max_rel=c.max_rel,
                latency={
                    "compiled": self._compiled_lat.percentiles(),
                    "eager": self._eager_lat.percentiles(),
                    "pairs": min(self._compiled_lat.count(), self._eager_lat.count()),
                },
            )

    # -- a check ----------------------------------------------------------------------

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Prepared | None:
        """Copy the inputs before the compiled call can mutate them."""
        try:
            with torch.no_grad():
                copies = pytree.tree_map_only(torch.Tensor, _copy, (args, kwargs))
            versions = [
                (t, t._version)
                for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            ]
        except Exception as exc:
            self._skip(f"inputs could not be copied for the eager run ({type(exc).__name__})")
            return None
        return Prepared(args=args, kwargs=kwargs, copies=copies, versions=versions)

    def check(
        self,
        entry: Entry,
        prepared: Prepared,
        out: Any,
        *,
        compiled_s: float | None,
        first: bool,
    ) -> Verdict:
        """Compare ``out`` (compiled) with eager on the prepared inputs."""
        assert self._policy is not None
        if self._random_op is not None:  # learnt while compiling this very call
            self._skip(f"the compiled graph draws random numbers ({self._random_op})")
            return Verdict()
        mutated = [t for t, v in prepared.versions if t._version != v]
        canary = first or entry.canary_left > 0
        if self._policy.mode == "async":
            self._submit(entry, prepared, out, mutated, compiled_s, canary)
            return Verdict()
        perf0 = self._clock()
        args, kwargs = prepared.copies
        grad = torch.is_grad_enabled() and _requires_grad(out)
        with torch.set_grad_enabled(grad):
            eager_out = self._fn(*args, **kwargs)
        self.sync_device(eager_out)
        eager_s = self._clock() - perf0
        result = self._compare(out, eager_out, prepared, mutated)
        self._note(entry, result, compiled_s, eager_s, canary)
        if result.ok:
            return Verdict(max_abs=result.max_abs, max_rel=result.max_rel)
        if mutated:
            # The caller sees eager's side effects, as eager would have left them.
            with torch.no_grad():
                for original, copy in zip(
                    _tensors(prepared.args, prepared.kwargs), _tensors(args, kwargs), strict=True
                ):
                    if original._version != copy._version or original in mutated:
                        original.copy_(copy)
        return Verdict(
            breach=result.reason or "outputs differ",
            eager_out=eager_out,
            max_abs=result.max_abs,
            max_rel=result.max_rel,
        )

    def sync_device(self, out: Any) -> None:
        """Wait for queued GPU work, so a timing covers the work and not its launch."""
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                torch.cuda.synchronize(leaf.device)
                return

    # -- internals ----------------------------------------------------------------------

    def _compare(
        self, out: Any, eager_out: Any, prepared: Prepared, mutated: list[torch.Tensor]
    ) -> Comparison:
        rtol, atol = self._tolerances()
        result = compare(out, eager_out, rtol=rtol, atol=atol)
        if result.ok and mutated:
            # In-place updates of the inputs are outputs too.
            side = compare(
                list(_tensors(prepared.args, prepared.kwargs)),
                list(_tensors(*prepared.copies)),
                rtol=rtol,
                atol=atol,
            )
            if not side.ok:
                return Comparison(
                    ok=False,
                    max_abs=side.max_abs,
                    max_rel=side.max_rel,
                    reason=f"in-place update of an input differs: {side.reason}",
                    leaves=result.leaves + side.leaves,
                )
        return result

    def note(self, entry: Entry, result: Comparison, *, canary: bool) -> None:
        """Count a comparison the controller made itself (a bucket's padding check)."""
        self._note(entry, result, None, None, canary)

    def _tolerances(self) -> tuple[float | None, float | None]:
        policy = self._policy
        return (policy.rtol, policy.atol) if policy is not None else (None, None)

    def _note(
        self,
        entry: Entry,
        result: Comparison,
        compiled_s: float | None,
        eager_s: float | None,
        canary: bool,
    ) -> None:
        with self._lock:
            c = self._c
            c.checks += 1
            if not result.ok:
                c.breaches += 1
            if result.max_abs == result.max_abs:  # not NaN
                c.max_abs = max(c.max_abs, result.max_abs)
            if result.max_rel == result.max_rel:
                c.max_rel = max(c.max_rel, result.max_rel)
        self._sink.shadow_check(
            passed=result.ok,
            max_abs=result.max_abs,
            max_rel=result.max_rel,
            bucket=entry.label,
            log_span=canary,
        )
        if not result.ok:
            self._record(
                Event(
                    kind=EventKind.BREACH,
                    time=time.time(),
                    bucket=entry.label,
                    message=result.reason,
                    max_abs_diff=result.max_abs,
                    max_rel_diff=result.max_rel,
                )
            )
        if compiled_s is not None and eager_s is not None and result.ok:
            self._compiled_lat.record(compiled_s)
            self._eager_lat.record(eager_s)
            self._judge_speed()

    def _judge_speed(self) -> None:
        pairs = self._compiled_lat.count()
        with self._lock:
            if pairs < max(self._c.next_judge, self._rollback.slower_min_samples):
                return
            self._c.next_judge = pairs + _JUDGE_EVERY
        ratio_limit = self._rollback.slower_ratio
        slower, measured = slower_verdict(
            self._compiled_lat.samples(),
            self._eager_lat.samples(),
            ratio=ratio_limit if ratio_limit is not None else _SLOWER_ADVISORY,
            min_samples=self._rollback.slower_min_samples,
        )
        if not slower:
            return
        message = (
            f"compiled median is {measured:.2f}x eager's over "
            f"{self._compiled_lat.count()} paired samples"
        )
        if ratio_limit is not None:
            self._on_slower(f"{message} (slower_ratio={ratio_limit})")
            return
        with self._lock:
            if self._c.slower_said:
                return
            self._c.slower_said = True
        self._record(
            Event(
                kind=EventKind.SHADOW_SKIPPED,
                time=time.time(),
                message=f"advisory: {message}; set Rollback(slower_ratio=...) to roll back",
                details={"advisory": "slower"},
            )
        )

    def _skip(self, why: str) -> None:
        with self._lock:
            self._c.skipped += 1
            first = why not in self._c.said_skip
            self._c.said_skip.add(why)
        if first:
            self._record(
                Event(
                    kind=EventKind.SHADOW_SKIPPED,
                    time=time.time(),
                    message=f"shadow checks skipped: {why}",
                )
            )

    def _submit(
        self,
        entry: Entry,
        prepared: Prepared,
        out: Any,
        mutated: list[torch.Tensor],
        compiled_s: float | None,
        canary: bool,
    ) -> None:
        assert self._policy is not None
        with self._lock:
            if self._c.pending >= self._policy.queue_size:
                self._c.queue_full += 1
                self._c.skipped += 1
                return
            self._c.pending += 1
        with torch.no_grad():
            out_copy = pytree.tree_map_only(torch.Tensor, _copy, out)
            after = [_copy(t) for t in mutated]
        job = _Job(self, entry, prepared, out_copy, after, compiled_s, canary)
        _WORKER.submit(job)

    def _run_job(self, job: _Job) -> None:
        try:
            args, kwargs = job.prepared.copies
            perf0 = self._clock()
            with torch.no_grad():
                eager_out = self._fn(*args, **kwargs)
            self.sync_device(eager_out)
            eager_s = self._clock() - perf0
            rtol, atol = self._tolerances()
            result = compare(job.out, eager_out, rtol=rtol, atol=atol)
            if result.ok and job.after:
                mutated_copies = [c for c in _tensors(args, kwargs) if c._version > 0]
                side = compare(job.after, mutated_copies, rtol=rtol, atol=atol)
                if not side.ok:
                    result = Comparison(
                        ok=False,
                        max_abs=side.max_abs,
                        max_rel=side.max_rel,
                        reason=f"in-place update of an input differs: {side.reason}",
                        leaves=side.leaves,
                    )
            self._note(job.entry, result, job.compiled_s, eager_s, job.canary)
            if not result.ok:
                self._on_breach(
                    job.entry, result.reason or "outputs differ", result.max_abs, result.max_rel
                )
        except Exception as exc:
            self._skip(f"the async eager run raised {type(exc).__name__}")
        finally:
            with self._lock:
                self._c.pending -= 1


@dataclass(slots=True)
class _Job:
    runner: ShadowRunner
    entry: Entry
    prepared: Prepared
    out: Any
    after: list[torch.Tensor]
    compiled_s: float | None
    canary: bool


class _Worker:
    """One daemon thread for every callable's async checks."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._in_flight = 0

    def submit(self, job: _Job) -> None:
        with self._idle:
            self._in_flight += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="safecompile-shadow", daemon=True
                )
                self._thread.start()
        self._queue.put(job)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                job.runner._run_job(job)
            finally:
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every submitted check has run; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)


_WORKER = _Worker()


def drain(timeout: float = 30.0) -> bool:
    """Wait until every queued async shadow check has run (tests, graceful shutdown)."""
    return _WORKER.drain(timeout)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _requires_grad(out: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(out))
