"""Buckets on the slow path: a call's bucket planned, the bucketed call (pad, call, cut
back), a bucket's padding verified once against unpadded eager, and a bucket rejected when
it cannot serve (its padding changes the result, its outputs cannot be cut back, its range
cannot be compiled as one graph). A rejected bucket's calls run eager; the callable stays
up. The hot path's bucketed form is in :mod:`._hot`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from safecompile.base import torchcompat
from safecompile.base.errors import ConfigError
from safecompile.base.model import Event, EventKind, Reason
from safecompile.observe.log import warn_once
from safecompile.observe.source import exception_chain, location_fields, safe_message, truncate
from safecompile.shapes.buckets import BucketError
from safecompile.shapes.table import BucketEntry, BucketStatus, unmark

from ._engine import Engine
from ._finish import defer, eager, finish, first_runs, recover, served_eager
from ._slots import Call
from ._trips import Turn

__all__ = ["call_bucket", "plan_bucket", "recover_bucketed", "reject_bucket"]

# Exceptions raised while dynamo traces or a backend compiles (not by compiled code).
_COMPILE_ERRORS: tuple[type[BaseException], ...] = torchcompat.compile_errors()


def recover_bucketed(e: Engine, call: Call, failure: Exception) -> Any:
    """A bucketed call's compiled path raised: a fault of its bucket's own rejects that
    bucket (eager answers); any other is recovered as without buckets."""
    entry = call.entry
    if entry is not None and bucket_fault(e, failure, entry):
        call.slot.end()
        call.slot.held = False
        return eager(e, call, "bucket")
    return recover(e, call, failure)


def bucket_fault(e: Engine, failure: Exception, entry: BucketEntry) -> bool:
    """Whether the failure is the bucket's own (padding, cutting back, a dynamic range
    torch cannot keep): then only that bucket is rejected."""
    if isinstance(failure, BucketError):
        reject_bucket(e, entry, f"padding or cutting back failed: {failure}")
        return True
    assert e.buckets is not None
    # A range's first compile failing while other graphs compiled fine is the range's
    # fault; with nothing compiled yet it is the compiler's: trip, as without buckets.
    first_range_compile = (
        not e.buckets.pads and entry.status is BucketStatus.NEW and any(g.compiled for g in e.table)
    )
    chain = exception_chain(failure, inner=True, limit=8)
    if any("ConstraintViolation" in type(seen).__name__ for seen in chain) or (
        first_range_compile and isinstance(failure, _COMPILE_ERRORS)
    ):
        reject_bucket(
            e, entry, f"its range cannot be compiled as one dynamic graph: {safe_message(failure)}"
        )
        return True
    return False


def plan_bucket(e: Engine, call: Call) -> bool:
    """Plan the call's bucket into ``call`` (none: not bucketed); ``False`` when eager
    serves the call (oversize, or a rejected bucket)."""
    if e.buckets is None:
        return True
    bucketer = e.buckets.bucketer
    plan = bucketer.plan(call.args, call.kwargs)
    if plan is not None and plan.status == "oversize":
        return bucketer.policy.oversize != "eager"  # or compile the shape as it is
    if plan is None or plan.status != "bucketed":
        if plan is not None:  # a dim past the argument's rank
            _check_bucket_dims(e, call)
        return True  # unbucketable: run it unpadded
    entry = e.buckets.entry(plan)
    if not entry.looked_up:  # what an earlier process learnt (persist.restart)
        e.persisted.restore(entry, call.args, call.kwargs)
    call.plan, call.entry = plan, entry
    return entry.status is not BucketStatus.REJECTED


def reject_bucket(
    e: Engine,
    entry: BucketEntry,
    why: str,
    *,
    max_abs: float | None = None,
    max_rel: float | None = None,
) -> None:
    """Stop using a bucket: its calls run eager from now on (the callable stays up)."""
    with e.gate.lock:
        if entry.status is BucketStatus.REJECTED:
            return
        entry.status = BucketStatus.REJECTED
        entry.why = truncate(why, 300)
    e.persisted.keep_rejected(entry, truncate(why, 300), e.name)
    event = Event(
        kind=EventKind.BUCKET_REJECTED,
        time=time.time(),
        message=truncate(f"bucket not used: {why}"),
        reason=Reason.DRIFT,
        bucket=entry.label,
        max_abs_diff=max_abs,
        max_rel_diff=max_rel,
        **location_fields(e.events.location),
    )
    e.act(Turn("bucket_rejected", event))


def _check_bucket_dims(e: Engine, call: Call) -> None:
    """A bucketed dim past its argument's rank is the user's configuration mistake: a
    warmup raises its ``ConfigError``; a live call is served unpadded (eager would not
    raise) with one warning per callable and message."""
    assert e.buckets is not None
    try:
        e.buckets.bucketer.check_dims(call.args, call.kwargs)
    except ConfigError as error:
        if call.warmup:
            raise
        warn_once(
            ("bucket dims", e.name, str(error)),
            "safecompile.bucket_dims_wrong",
            function=e.name,
            description=truncate(f"{error}; calls with this shape run unpadded"),
        )


def call_bucket(e: Engine, call: Call) -> Any:
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
        return recover_bucketed(e, call, failure)
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
    if fresh is not None and first_runs(e, call, fresh):  # counted eager there
        return None if call.warmup else eager_out
    try:
        if bucketer.policy.outputs is not None:
            cuts = bucketer.declared_cuts(plan, padded_out)
        else:
            cuts = bucketer.learn_cuts(plan, padded_out, eager_out)
        out = bucketer.unpad(plan, padded_out, cuts)
    except (BucketError, ValueError) as exc:
        reject_bucket(e, entry, f"outputs cannot be cut back: {exc}")
        return served_eager(call, eager_out, "bucket")
    result = e.shadow.compare_outputs(out, eager_out, call.args, call.kwargs)
    breach = e.shadow.note(first, entry.label, result)
    if breach is not None:
        e.events.record(breach)
    for graph in due or ():
        e.shadow.checked(graph)
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
    return served_eager(call, eager_out, served)
