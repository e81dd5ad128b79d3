"""Buckets on the slow path: planning a call's bucket, and rejecting a bucket that cannot
serve (its padding changes the result, its outputs cannot be cut back, its range cannot
be compiled as one graph). A rejected bucket's calls run eager; the callable stays up.

The bucketed calls themselves (pad, call, cut back, verify the padding once) run in
:mod:`._paths`; the hot path's bucketed form is in :mod:`._hot`.
"""

from __future__ import annotations

import time

from safecompile.base import torchcompat
from safecompile.base.errors import ConfigError
from safecompile.base.model import Event, EventKind, Reason
from safecompile.observe.log import warn_once
from safecompile.observe.source import exception_chain, location_fields, safe_message, truncate
from safecompile.shapes.buckets import BucketError
from safecompile.shapes.table import BucketEntry, BucketStatus

from ._engine import Engine
from ._slots import Call
from ._trips import Turn

__all__ = ["bucket_fault", "plan_bucket", "reject_bucket"]

# Exceptions raised while dynamo traces or a backend compiles (not by compiled code).
_COMPILE_ERRORS: tuple[type[BaseException], ...] = torchcompat.compile_errors()


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
