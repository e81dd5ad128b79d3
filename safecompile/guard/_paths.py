"""The slow paths: every call the hot path (:mod:`._hot`) does not finish alone.

Each is handed the :class:`~._engine.Engine` and one :class:`~._slots.Call` record:

- :func:`finish`: the compiled call returned, and a check was due, a graph ran eagerly
  (recompile limit), a graph ran for the first time, or no graph ran at all;
- :func:`recover`: the compiled path raised; eager answers, on the caller's own
  tensors (so gradients reach them), or eager's own error is raised;
- :func:`call_slow`: the gate is closed (a trial due, rollout, a compile or warmup in
  flight, nothing compiled yet, the speed verdict wants the call), or a bucket still
  needs verifying.

What a path learns (a breach, a failure, a verdict) it hands to the engine
(``Engine.trip``, ``Engine.act``), which acts on it in one place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from safecompile.base import torchcompat
from safecompile.base.model import EventKind, Reason
from safecompile.checks.snapshot import Snapshot
from safecompile.checks.speed import Step
from safecompile.persist import remote
from safecompile.shapes.buckets import BucketError
from safecompile.shapes.table import BucketStatus, unmark

from ._buckets import bucket_fault, plan_bucket, reject_bucket
from ._deferred import copy_call, signature
from ._engine import Engine
from ._first_run import FirstRun
from ._logs import META_LOG
from ._slots import Call
from ._speed import call_key
from .backend import compile_seconds
from .graphs import GraphRecord
from .shadow import Outcome, run_later, sync_device

__all__ = ["call_slow", "defer", "finish", "recover", "warm_call"]

# Exceptions raised while dynamo traces or a backend compiles (not by compiled code).
_COMPILE_ERRORS: tuple[type[BaseException], ...] = torchcompat.compile_errors()


# ---------------------------------------------------------------- after the compiled call


def finish(e: Engine, call: Call, out: Any) -> Any:
    """The compiled call returned, and something needs more than counting."""
    slot = call.slot
    first, due, snapshot, fresh = slot.first, slot.due, slot.snapshot, slot.fresh
    # a graph's first run (._first_run) is no timing either
    new: list[Any] | None = slot.new if fresh is None else slot.new or fresh
    held = slot.held
    if held:  # a frame ran eagerly instead of making a new graph: compile it later
        slot.held = False
        if not call.warmup:
            defer(e, call)
    started = slot.started
    if call.timed:  # its time goes to the speed verdict, unless it is no live call's:
        call.timed = False  # no compiled graph served it, or it compiled one
        sync_device(out)
        elapsed = e.costs() - started
        served = first is not None and first.compiled and new is None
        e.speed_done(Step.TIME_COMPILED, elapsed if served else None)
    slot.end()
    if fresh is not None and _first_runs(e, call, fresh):
        return _checked_after_breach(e, call, due, snapshot, out)
    if first is None or not first.compiled:
        # No compiled graph served: the graph is past the recompile limit and its traced
        # code ran eagerly, or dynamo ran the frame eagerly: past torch's own limit (above
        # ours), or it made no graph of it (nothing to compile), or held back a new graph
        # to compile off the request path (warming)
        limited = first is not None or e.events.tally.limit_said
        _count_eager(call, "warming" if held else "recompile_limit" if limited else "no_graph")
        return out
    if due:
        if snapshot is None:
            first.prep = True  # a later graph is due: capture the state at the first
        else:
            first.prep = False
            answer = _check(e, call, due, snapshot, out, started if new is None else None)
            if answer is not None:
                return answer[0]
    if not call.warmup:
        slot.compiled += 1
        if slot.compiled >= slot.mark:
            e.speed_tick(slot)
    return out


def _first_runs(e: Engine, call: Call, runs: list[FirstRun]) -> bool:
    """Graphs ran for the first time in this call, their compiled code on copies that
    need no gradients (graphs._first_run): a breach one of them showed trips (``True``)."""
    for run in runs:
        seen = run.seen
        if seen is None or seen.ok:
            continue
        e.shadow.note(run.graph, None, seen)
        e.trip(
            Reason.DRIFT,
            message=f"first run: {seen.reason or 'outputs differ'}",
            graph=run.graph,
            max_abs=seen.max_abs,
            max_rel=seen.max_rel,
        )
        _count_eager(call, "check")
        return True
    return False


def _checked_after_breach(
    e: Engine, call: Call, due: list[GraphRecord] | None, snapshot: Snapshot | None, out: Any
) -> Any:
    """A graph's first run breached: its outputs were eager's already. A check due on this
    call still makes its eager run of the whole call, as a peer rank's call that checks it
    does, so the collectives inside pair up; eager's result if it asks for it."""
    if due and snapshot is not None:
        verdict = e.shadow.check(
            e.table, due, snapshot, call.args, call.kwargs, out, compiled_s=None
        )
        _check_later(e, verdict)
        if verdict.use_eager or verdict.breach is not None:
            discarded(e)
            return verdict.eager_out
    return out


def _check(
    e: Engine,
    call: Call,
    due: list[GraphRecord],
    snapshot: Snapshot,
    out: Any,
    started: float | None,
) -> tuple[Any] | None:
    """Shadow-check a compiled call (``started``: its start on the cost clock, ``None``:
    not a timing, it compiled); ``(eager's result,)`` when eager answers it."""
    compiled_s = None
    if started is not None and started >= 0.0:
        sync_device(out)  # on CUDA: the work done, not its launch
        compiled_s = e.costs() - started
    verdict = e.shadow.check(
        e.table, due, snapshot, call.args, call.kwargs, out, compiled_s=compiled_s
    )
    _check_later(e, verdict)
    if not verdict.use_eager and verdict.breach is None:
        return None
    discarded(e)  # the compiled outputs go unused
    if verdict.breach is not None:
        _drifted(e, verdict)
    _count_eager(call, "check")
    return (verdict.eager_out,)


def _drifted(e: Engine, verdict: Outcome) -> None:
    """A check found drift: trip."""
    e.trip(
        Reason.DRIFT,
        message=verdict.breach,
        graph=verdict.graph,
        max_abs=verdict.max_abs,
        max_rel=verdict.max_rel,
    )


def _check_later(e: Engine, verdict: Outcome) -> None:
    """An async check runs on the shadow worker; drift it finds trips there."""
    later = verdict.later
    if later is None:
        return

    def check() -> None:
        outcome = later()
        if outcome.breach is not None:
            _drifted(e, outcome)

    run_later(check)


def recover(e: Engine, call: Call, failure: Exception) -> Any:
    """The compiled path raised: answer with eager's result, or eager's own error."""
    call.slot.end()
    call.slot.held = False
    if call.entry is not None and bucket_fault(e, failure, call.entry):
        return eager(e, call, "bucket")
    try:
        out = e.fn(*call.args, **call.kwargs)
    except Exception:
        del failure  # eager raises too: the user's own error, not the compiler's
        META_LOG.drop()  # torch's log of it while tracing is noise: eager's error says it
        raise
    finally:
        _count_eager(call, "error")
    META_LOG.replay()
    if not isinstance(failure, _COMPILE_ERRORS):
        e.trip(Reason.RUNTIME_ERROR, error=failure, bucket=call.bucket)
    # a fault of what torch read from its remote caches: the next call compiles without it
    elif not remote.cache_fault(failure):
        e.failures.persist(e.name, failure, call.args, call.kwargs)
        e.events.compile_failed(failure, call.bucket, compile_seconds(e.clock))
        e.trip(Reason.COMPILE_ERROR, error=failure, bucket=call.bucket)
    return out


def _count_eager(call: Call, why: str) -> None:
    """Count the call as served eager, for ``why`` (a key of ``EAGER_REASONS``); a warmup
    call is not counted."""
    if not call.warmup:
        call.slot.eager += 1
        call.slot.why[why] += 1


def eager(e: Engine, call: Call, why: str) -> Any:
    """Run eager and count it, for ``why`` (a key of ``Stats.eager_by_reason``); a warmup
    call runs nothing: its result is discarded."""
    if call.warmup:
        return None
    try:
        return e.fn(*call.args, **call.kwargs)
    finally:
        _count_eager(call, why)


# ---------------------------------------------------------------- the gate is closed


def call_slow(
    e: Engine, args: tuple[Any, ...], kwargs: dict[str, Any], *, warmup: bool = False
) -> Any:
    """Every call the hot path does not take (see the module doc)."""
    call = Call(args, kwargs, e.slots.get(), warmup=warmup)
    admitted = _admit(e, call)
    if admitted not in ("trial", "compiled"):
        return eager(e, call, admitted)
    trial = admitted == "trial"
    before = call.slot.compiled
    try:
        if e.table.size > 0 or (e.deferred is not None and not warmup):
            return _call_compiled(e, call, force=trial or warmup)  # (deferred: no compile)
        # Nothing compiled yet: own the first compile, so other threads serve eager
        # instead of compiling the same graph again (torch does not de-duplicate).
        with e.compiles.claim(exclusive=True) as mine:
            if not mine and not warmup:
                return eager(e, call, "warming")
            return _call_compiled(e, call, force=trial or warmup)
    finally:
        if trial:
            e.act(e.trips.end_trial(served=call.slot.compiled > before))


def warm_call(e: Engine, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One warmup call (:meth:`Controller.warmup`, a deferred compile): the slow path,
    checked, not counted; it may make new graphs."""
    try:
        with e.compiling_here():
            return call_slow(e, args, kwargs, warmup=True)
    finally:
        discarded(e)  # its outputs are dropped: their backward never runs


def defer(e: Engine, call: Call) -> None:
    """A live call a new graph would serve ran eagerly: compile that graph on a worker,
    from a copy of the call's inputs (:mod:`._deferred`). Never breaks the call."""
    deferred = e.deferred
    if deferred is None:
        return
    try:
        key = signature(call.args, call.kwargs, e.module.training if e.module else None)
        if not deferred.wanted(key):
            return
        args, kwargs = copy_call(call.args, call.kwargs)
    except Exception:  # an argument deepcopy refuses: served eager, not compiled later
        deferred.counts.uncopyable += 1
        return
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def compile_it() -> None:
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                warm_call(e, args, kwargs)
        except Exception as exc:  # eager raised on the copy: live calls serve on, eager
            e.events.say_error(EventKind.WARMUP_FAILED, exc)

    deferred.submit(key, compile_it)


def discarded(e: Engine) -> None:
    """A compiled call's outputs go unused (a warmup call, a check answered by eager):
    under CUDA graphs with gradients on, its backward would stay pending forever and
    torch would start no new iteration, so start one (docs/design.md, "Under CUDA graphs").
    """
    if e.backend.cudagraphs and torch.is_grad_enabled():
        with contextlib.suppress(Exception):  # never breaks a call
            mark_step: Callable[[], None] = torch.compiler.cudagraph_mark_step_begin
            mark_step()


def _admit(e: Engine, call: Call) -> str:  # noqa: PLR0911 - one reason per return
    """Whether this call may try the compiled path: ``"trial"`` (the half-open trial),
    ``"compiled"``, or why eager serves it (a key of ``Stats.eager_by_reason``)."""
    blocked = e.gate.blocked(here=True)  # the gate's own predicate
    if blocked == "disabled":
        return blocked
    if blocked == "rolled_back":
        trial = None if call.warmup else e.trips.claim_trial()
        if trial is None:
            return blocked
        e.act(trial)
        return "trial"
    if not call.warmup:
        if e.gate.rollout < 1.0 and not e.gate.pick():
            return "rollout"
        if blocked is not None:  # a warmup, or a compile in flight elsewhere: eager meanwhile
            return blocked
    known = e.failures.known(call.args, call.kwargs)
    if known is not None:
        e.trip(Reason.COMPILE_ERROR, message=known)
        return "error"
    if e.table.size == 0 and e.persisted.active:
        e.persisted.load_artifacts(call.args, call.kwargs)  # once: torch's artifacts
        e.precompiled.load(call.args, call.kwargs, e.backend.adopt)  # once: loaded, not traced
    return "compiled"


def _call_compiled(e: Engine, call: Call, *, force: bool) -> Any:
    """Call the compiled function from the slow path (buckets planned here)."""
    why = "bucket" if not plan_bucket(e, call) else "warming" if _deferred_now(e, call) else None
    if why is not None:  # its bucket runs eager, or its first compile is deferred
        return eager(e, call, why)
    slot = call.slot
    step = Step.UNTIMED
    if e.speed.verdict is not None and not (force or call.warmup):
        step = _plan_speed(e, call)
        if step is Step.TIME_EAGER:
            return _probe(e, call)
        if step is Step.EAGER:  # a call that settles the eager arm before a probe
            return eager(e, call, "speed")
    slot.first = slot.due = slot.snapshot = slot.new = slot.fresh = None  # a new call
    slot.started = -1.0
    slot.force = force
    slot.bucket = call.entry.label if call.entry is not None else None
    if step is Step.TIME_COMPILED:
        sync_device((call.args, call.kwargs))
        call.timed = True
        slot.started = e.costs()
    try:
        if call.plan is not None:
            return _call_bucket(e, call)
        try:
            out = e.gate.compiled(*call.args, **call.kwargs)
        except Exception as exc:
            failure: Exception = exc
        else:
            return finish(e, call, out)
        return recover(e, call, failure)
    finally:
        slot.force = False
        slot.bucket = None
        slot.started = -1.0
        if call.timed:  # a timed call that did not reach finish(): not a time
            call.timed = False
            e.speed_done(Step.TIME_COMPILED, None)


def _deferred_now(e: Engine, call: Call) -> bool:
    """With deferred compiles, a live call while nothing is compiled yet is deferred at
    once: eager serves it. Any other call tries the compiled function, where a frame that
    would make a new graph runs eagerly instead (``slot.held``)."""
    if e.deferred is None or call.warmup or e.table.size > 0:
        return False
    defer(e, call)
    return True


def _plan_speed(e: Engine, call: Call) -> Step:
    """Whether the speed verdict times this call, and on which arm (see
    :mod:`safecompile.checks.speed`). A bucket still verifying its padding is not timed."""
    e.speed_tick(call.slot)
    verdict = e.speed.verdict
    if verdict is None or not verdict.wants:
        return Step.UNTIMED
    plan, entry = call.plan, call.entry
    pads = e.buckets is not None and e.buckets.pads
    if (
        plan is not None
        and entry is not None
        and (
            entry.status is not BucketStatus.READY or (entry.cuts is None and pads and plan.padded)
        )
    ):
        return Step.UNTIMED
    return e.speed.plan(call_key(call.args, call.kwargs, call.bucket, e.module))


def _probe(e: Engine, call: Call) -> Any:
    """The eager arm of a pair: the original function on the caller's own arguments
    (its values, side effects and gradients are the caller's), timed."""
    sync_device((call.args, call.kwargs))
    started = e.costs()
    elapsed: float | None = None  # eager raised: the caller gets its error, as eager would
    try:
        out = e.fn(*call.args, **call.kwargs)
        sync_device(out)
        elapsed = e.costs() - started
    finally:
        _count_eager(call, "speed")
        e.speed_done(Step.TIME_EAGER, elapsed)
    return out


def _call_bucket(e: Engine, call: Call) -> Any:
    plan, entry, buckets = call.plan, call.entry, e.buckets
    assert plan is not None
    assert entry is not None
    assert buckets is not None
    bucketer = buckets.bucketer
    padded = buckets.pads and plan.padded
    marked: list[tuple[torch.Tensor, dict[str, Any]]] = []
    if not buckets.pads and entry.status is BucketStatus.NEW:
        marked = buckets.mark_range(plan, call.args, call.kwargs)
    failure: Exception | None = None
    try:
        args, kwargs = (
            bucketer.pad(plan, call.args, call.kwargs) if padded else (call.args, call.kwargs)
        )
        out = e.gate.compiled(*args, **kwargs)
    except Exception as exc:
        failure = exc
    finally:
        unmark(marked)
    if failure is not None:
        return recover(e, call, failure)
    if call.slot.held:  # a frame ran eagerly, on the padded inputs, instead of compiling:
        call.slot.held = False  # eager answers on the caller's own (a new bucket's first
        call.slot.end()  # call: two eager runs, no compile)
        defer(e, call)
        return eager(e, call, "warming")
    if padded and entry.cuts is None and not e.persisted.reuse(bucketer, plan, entry, out):
        return _verify_bucket(e, call, out)
    if padded:
        try:
            out = bucketer.unpad(plan, out, entry.cuts)
        except BucketError as exc:
            reject_bucket(e, entry, f"outputs could not be cut back: {exc}")
            call.slot.end()
            return eager(e, call, "bucket")
    else:  # nothing padded in this key (or a dynamic range): nothing to verify
        entry.status = BucketStatus.READY
    if not call.warmup:
        entry.count(plan, padded=padded)
    return finish(e, call, out)


def _verify_bucket(e: Engine, call: Call, padded_out: Any) -> Any:
    """A bucket's first padded call: learn its output cut and verify its padding against
    unpadded eager — on the caller's own tensors, so eager's result can be returned
    with its gradients. Runs with shadow checks on or off."""
    plan, entry, buckets = call.plan, call.entry, e.buckets
    assert plan is not None
    assert entry is not None
    assert buckets is not None
    bucketer = buckets.bucketer
    slot = call.slot
    due, first, fresh = slot.due, slot.first, slot.fresh
    slot.end()
    eager_out = e.fn(*call.args, **call.kwargs)
    if fresh is not None and _first_runs(e, call, fresh):  # counted eager there
        return None if call.warmup else eager_out
    try:
        if bucketer.policy.outputs is not None:
            cuts = bucketer.declared_cuts(plan, padded_out)
        else:
            cuts = bucketer.learn_cuts(plan, padded_out, eager_out)
        out = bucketer.unpad(plan, padded_out, cuts)
    except (BucketError, ValueError) as exc:
        reject_bucket(e, entry, f"outputs cannot be cut back: {exc}")
        return _served_eager(call, eager_out, "bucket")
    result = e.shadow.compare_outputs(out, eager_out, call.args, call.kwargs)
    e.shadow.note(first, entry.label, result)
    for graph in due or ():
        e.table.checked(graph)
    if result.ok:
        if not cuts.ambiguous:  # else right for this call only: a later call learns again
            entry.cuts = cuts
            entry.status = BucketStatus.READY
            e.persisted.keep_verified(entry, cuts, e.name)
        if not call.warmup:
            entry.count(plan, padded=True)
            slot.compiled += 1
        return out
    # Padding's fault, or the compiler's? Eager on the padded inputs tells.
    with torch.no_grad():
        padded_args, padded_kwargs = bucketer.pad(plan, call.args, call.kwargs)
        padded_eager = bucketer.unpad(plan, e.fn(*padded_args, **padded_kwargs), cuts)
    padding = e.shadow.compare_outputs(padded_eager, eager_out, call.args, call.kwargs)
    served = "bucket"
    if not padding.ok:
        why = f"padding changed the result: {padding.reason}"
        reject_bucket(e, entry, why, max_abs=padding.max_abs, max_rel=padding.max_rel)
    else:
        served = "check"
        e.trip(
            Reason.DRIFT,
            message=result.reason or "outputs differ",
            bucket=entry.label,
            graph=first,
            max_abs=result.max_abs,
            max_rel=result.max_rel,
        )
    return _served_eager(call, eager_out, served)


def _served_eager(call: Call, out: Any, why: str) -> Any:
    _count_eager(call, why)
    return None if call.warmup else out
