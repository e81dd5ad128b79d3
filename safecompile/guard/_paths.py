"""The slow path: every call the hot path (:mod:`._hot`) does not take.

:func:`call_slow` admits the call (the gate's predicate, a trial, rollout, a known
compile failure), owns the first compile, plans its bucket, asks the speed arm whether to
time it (or run the eager arm of a pair), and calls the compiled function; what comes
after is :mod:`._finish`'s. :func:`warm_call` is one warmup call (a blocking warmup, or a
deferred compile on the worker).
"""

from __future__ import annotations

from typing import Any

from safecompile.base.model import Reason
from safecompile.checks.speed import Step
from safecompile.shapes.table import BucketStatus

from ._buckets import call_bucket, plan_bucket
from ._engine import Engine
from ._finish import count_eager, defer, discarded, eager, finish, recover
from ._slots import Call, Slot
from ._speed import call_key
from .shadow import sync_device

__all__ = ["call_slow", "warm_call"]


def call_slow(
    e: Engine, args: tuple[Any, ...], kwargs: dict[str, Any], *, warmup: bool = False
) -> Any:
    """Every call the hot path does not take (see the module doc)."""
    slot: Slot | None = getattr(e.slots.local, "slot", None)
    call = Call(args, kwargs, slot if slot is not None else e.slots.get(), warmup=warmup)
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
        with e.compiles.here():
            return call_slow(e, args, kwargs, warmup=True)
    finally:
        discarded(e)  # its outputs are dropped: their backward never runs


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
    planned = e.buckets is None or plan_bucket(e, call)
    why = "bucket" if not planned else "warming" if _deferred_now(e, call) else None
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
    slot.begin()
    slot.force = force
    slot.bucket = call.entry.label if call.entry is not None else None
    if step is Step.TIME_COMPILED:
        sync_device((call.args, call.kwargs))
        call.started = e.costs()
    try:
        if call.plan is not None:
            return call_bucket(e, call)
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
        if call.started >= 0.0:  # a timed call that did not reach finish(): not a time
            call.started = -1.0
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
    verdict, slot = e.speed.verdict, call.slot
    if verdict is None:
        return Step.UNTIMED
    # told of the calls so far while it wants calls, else in batches, as the hot path does
    if (verdict.wants or slot.compiled + slot.eager >= slot.mark) and e.speed.tick(slot):
        e.gate.update()  # what the verdict wants changed
    if not verdict.wants:
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
        count_eager(call, "speed")
        e.speed_done(Step.TIME_EAGER, elapsed)
    return out
