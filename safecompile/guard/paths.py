"""The paths a call takes: one hot-path closure, and the slow paths behind it.

The hot path is one frame: re-read the kill switch only when the environment's value
object changed, then — when the gate is open — call the compiled function and look at
the calling thread's slot, where the graph wrappers noted which graph served the call
and whether a check is due. Nothing due: count the call in the thread's own slot and
return. Everything else is a slow path:

- :func:`finish`: a check was due, a graph ran eagerly (recompile limit), or no graph
  ran at all;
- :func:`recover`: the compiled path raised; eager answers, on the caller's own
  tensors (so gradients reach them), or eager's own error is raised;
- :func:`call_slow`: the gate is closed (kill switch, trip and trial, rollout, a compile
  or warmup in flight, nothing compiled yet), or a bucket still needs verifying.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from safecompile.base import killswitch as ks
from safecompile.base import torchcompat
from safecompile.base.errors import ConfigError
from safecompile.base.model import Event, EventKind, Reason
from safecompile.checks.compare import compare
from safecompile.checks.snapshot import Snapshot
from safecompile.checks.speed import Step
from safecompile.observe.log import Once, torch_missing
from safecompile.observe.source import (
    exception_chain,
    location_fields,
    safe_message,
    truncate,
    without_our_frames,
)
from safecompile.shapes.buckets import BucketError, Plan
from safecompile.shapes.table import BucketEntry, BucketStatus, unmark

from .controller import Controller
from .graphs import CallSlot, GraphRecord
from .shadow import sync_device

__all__ = ["call_slow", "entrypoint", "finish", "recover", "warm_call"]

# Exceptions raised while dynamo traces or a backend compiles (not by compiled code).
_COMPILE_ERRORS: tuple[type[BaseException], ...] = torchcompat.compile_errors()


_NONE: Any = None  # typed Any: the call below changes what the slot holds


class _MetaLogHold(logging.Filter):
    """Holds torch's ``failed while attempting to run meta`` error log (a traceback per
    op, logged while dynamo traces a call that fails) when it is logged inside a guarded
    call: :func:`recover` drops it when eager raises the same error (the user's own bug:
    eager's error says it all) and hands it on otherwise. Outside guarded calls it
    passes untouched. Only a record this logger emits pays for the stack walk."""

    LOGGER = torchcompat.FAKE_TENSOR_LOGGER

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self.local, "replaying", False) or not _in_guarded_call():
            return True
        held: collections.deque[logging.LogRecord] | None = getattr(self.local, "held", None)
        if held is None:
            held = self.local.held = collections.deque(maxlen=16)
        held.append(record)
        return False

    def drop(self) -> None:
        held = getattr(self.local, "held", None)
        if held:
            held.clear()

    def replay(self) -> None:
        held = getattr(self.local, "held", None)
        if not held:
            return
        records = list(held)
        held.clear()
        logger = logging.getLogger(self.LOGGER)
        self.local.replaying = True
        try:
            for record in records:
                logger.handle(record)
        finally:
            self.local.replaying = False


def _in_guarded_call() -> bool:
    """Whether a frame of this module (a guarded call's path) is on the stack, above the
    filter that asks."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == __file__:
            return True
        frame = frame.f_back
    return False


_META_LOG = _MetaLogHold()
logging.getLogger(_MetaLogHold.LOGGER).addFilter(_META_LOG)


def entrypoint(c: Controller) -> Callable[..., Any]:
    """The guarded function (see the module doc). With a process group, every call is
    counted for the ranks' safe points (:mod:`._ranks`); without one, nothing is added."""
    if c._ranks is not None:
        return c._ranks.counting(_entrypoint(c), c._safe_point)
    return _entrypoint(c)


def _entrypoint(c: Controller) -> Callable[..., Any]:
    if c._buckets is not None:
        return _bucketed_entrypoint(c)
    gate = c._gate
    fn = c._fn
    local = c._slots.local
    new_slot = c._slots.get
    env_get, env_key = _env_reader()
    switch = ks.SWITCH
    refresh = c._refresh_switch
    ticked = _ticker(c)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:  # an error escaping is eager's: raised from the user's line, not ours
            if env_get(env_key) is not gate.token or switch.generation != gate.generation:
                refresh()
            if gate.fast:
                try:
                    slot: CallSlot = local.slot
                except AttributeError:
                    slot = new_slot()
                slot.first = _NONE  # the graph wrappers fill these in during the call
                slot.due = _NONE
                try:  # no empty dict built for a call without keywords
                    out = gate.compiled(*args, **kwargs) if kwargs else gate.compiled(*args)
                except Exception as exc:
                    failure: Exception = exc
                else:
                    first = slot.first
                    if slot.due is None and first is not None:  # a limited graph sets due
                        slot.compiled = n = slot.compiled + 1
                        # the speed verdict counts calls in batches: told at the slot's mark
                        return out if n < slot.mark else ticked(slot, out)
                    return finish(c, slot, out, args, kwargs)
                return recover(c, failure, args, kwargs)  # outside except: eager's unchained
            if gate.disabled:  # the kill switch: eager, in this frame
                try:
                    return fn(*args, **kwargs)
                finally:
                    new_slot().eager += 1
            return call_slow(c, args, kwargs)
        except Exception as exc:
            raise without_our_frames(exc)  # noqa: B904 - the user's error, kept unchained

    return guarded


def _bucketed_entrypoint(c: Controller) -> Callable[..., Any]:
    """The hot path with buckets: plan, pad, call, cut back (see :func:`entrypoint`)."""
    assert c._buckets is not None
    gate = c._gate
    fn = c._fn
    local = c._slots.local
    new_slot = c._slots.get
    env_get, env_key = _env_reader()
    switch = ks.SWITCH
    refresh = c._refresh_switch
    ticked = _ticker(c)
    bucketer, entries, pads = c._buckets.bucketer, c._buckets.entries, c._buckets.pads
    plan_of, pad, unpad = bucketer.plan, bucketer.pad, bucketer.unpad
    ready = BucketStatus.READY

    def guarded(*args: Any, **kwargs: Any) -> Any:  # noqa: PLR0912 - one frame on purpose
        try:  # an error escaping is eager's: raised from the user's line, not ours
            if env_get(env_key) is not gate.token or switch.generation != gate.generation:
                refresh()
            if gate.fast:
                plan = plan_of(args, kwargs)
                if plan is not None and plan.status == "bucketed":
                    entry = entries.get(plan.key)
                    padded = pads and plan.padded
                    if (
                        entry is not None
                        and entry.status is ready
                        and (entry.cuts is not None or not padded)
                    ):
                        try:
                            slot: CallSlot = local.slot
                        except AttributeError:
                            slot = new_slot()
                        slot.first = _NONE
                        slot.due = _NONE
                        try:
                            if padded:
                                a, k = pad(plan, args, kwargs)
                                out = unpad(plan, gate.compiled(*a, **k), entry.cuts)
                            else:
                                out = gate.compiled(*args, **kwargs)
                        except Exception as exc:
                            failure: Exception = exc
                        else:
                            entry.count(plan, padded=padded)
                            first = slot.first
                            if slot.due is None and first is not None:  # a limited graph sets due
                                slot.compiled = n = slot.compiled + 1
                                # the speed verdict counts calls in batches: told at the slot's mark
                                return out if n < slot.mark else ticked(slot, out)
                            return finish(c, slot, out, args, kwargs)
                        return recover(c, failure, args, kwargs, plan=plan, entry=entry)
            elif gate.disabled:  # the kill switch: eager, in this frame
                try:
                    return fn(*args, **kwargs)
                finally:
                    new_slot().eager += 1
            return call_slow(c, args, kwargs)
        except Exception as exc:
            raise without_our_frames(exc)  # noqa: B904 - the user's error, kept unchained

    return guarded


def _ticker(c: Controller) -> Callable[[CallSlot, Any], Any]:
    """The hot path's call at a slot's mark: tell the speed verdict, return ``out``."""
    tick = c._speed_tick

    def ticked(slot: CallSlot, out: Any) -> Any:
        tick(slot)
        return out

    return ticked


def _env_reader() -> tuple[Callable[[object], object], object]:
    """How the hot path reads the kill switch's raw environment value (see _killswitch)."""
    data = ks._ENV_DATA
    if data is not None:
        return data.get, ks._ENV_KEY
    return (lambda _key: ks.env_token()), None  # pragma: no cover


# ---------------------------------------------------------------- after the compiled call


def finish(
    c: Controller,
    slot: CallSlot,
    out: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    warmup: bool = False,
) -> Any:
    """The compiled call returned, and something needs more than counting."""
    first, due, snapshot, new = slot.first, slot.due, slot.snapshot, slot.new
    if slot.timer >= 0.0:
        _timed_compiled(c, slot, out, first, new)
    slot.end()
    if first is None or not first.compiled:
        # No compiled graph served: dynamo ran the frame eagerly, or the graph is past
        # the recompile limit and its traced code ran eagerly.
        if not warmup:
            slot.eager += 1
            if first is not None:
                slot.limited += 1
        return out
    if due:
        if snapshot is None:
            first.prep = True  # a later graph is due: capture the state at the first
        else:
            first.prep = False
            answer = _check(c, slot, due, snapshot, out, args, kwargs, new=new, warmup=warmup)
            if answer is not None:
                return answer[0]
    if not warmup:
        _count_compiled(c, slot)
    return out


def _check(
    c: Controller,
    slot: CallSlot,
    due: list[GraphRecord],
    snapshot: Snapshot,
    out: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    new: object,
    warmup: bool,
) -> tuple[Any] | None:
    """Shadow-check a compiled call; ``(eager's result,)`` when eager answers it."""
    compiled_s = None
    if new is None:  # a call that compiled is not a timing
        sync_device(out)  # on CUDA: the work done, not its launch
        compiled_s = c._clock() - slot.started
    verdict = c._shadow.check(c._table, due, snapshot, args, kwargs, out, compiled_s=compiled_s)
    if not verdict.use_eager and verdict.breach is None:
        return None
    discarded(c)  # the compiled outputs go unused
    if verdict.breach is not None:
        c._trip(
            Reason.DRIFT,
            message=verdict.breach,
            graph=verdict.graph,
            max_abs=verdict.max_abs,
            max_rel=verdict.max_rel,
        )
    if not warmup:
        slot.eager += 1
    return (verdict.eager_out,)


def _count_compiled(c: Controller, slot: CallSlot) -> None:
    slot.compiled += 1
    if slot.compiled >= slot.mark:
        c._speed_tick(slot)


def _timed_compiled(
    c: Controller, slot: CallSlot, out: Any, first: GraphRecord | None, new: object
) -> None:
    """A timed compiled call returned: its time goes to the speed verdict, unless no
    compiled graph served it or it compiled a graph (then it is not a live call's time)."""
    sync_device(out)
    elapsed = c._clock() - slot.timer
    slot.timer = -1.0
    if first is None or not first.compiled or new is not None:
        c._speed_done(Step.TIME_COMPILED, None)
    else:
        c._speed_done(Step.TIME_COMPILED, elapsed)


def recover(
    c: Controller,
    failure: Exception,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    plan: Plan | None = None,
    entry: BucketEntry | None = None,
    warmup: bool = False,
) -> Any:
    """The compiled path raised: answer with eager's result, or eager's own error."""
    slot = c._slots.get()
    slot.end()
    if entry is not None and _bucket_fault(c, failure, entry):
        return eager(c, args, kwargs, warmup=warmup)
    user_error: Exception | None = None
    out: Any = None
    try:
        out = c._fn(*args, **kwargs)
    except Exception as exc:
        user_error = exc
    if not warmup:
        slot.eager += 1
    if user_error is not None:
        del failure  # eager raises too: the user's own error, not the compiler's
        _META_LOG.drop()  # torch's log of it while tracing is noise: eager's error says it
        raise user_error
    _META_LOG.replay()
    if isinstance(failure, _COMPILE_ERRORS) and c._failures.cache_fault(failure):
        return out  # the shared cache's fault: the next call compiles without it
    if isinstance(failure, _COMPILE_ERRORS):
        c._compile_failed(failure, args, kwargs)
        c._trip(Reason.COMPILE_ERROR, error=failure, bucket=entry.label if entry else None)
    else:
        c._trip(Reason.RUNTIME_ERROR, error=failure, bucket=entry.label if entry else None)
    return out


def _bucket_fault(c: Controller, failure: Exception, entry: BucketEntry) -> bool:
    """Whether the failure is the bucket's own (padding, cutting back, a dynamic range
    torch cannot keep): then only that bucket is rejected."""
    if isinstance(failure, BucketError):
        reject_bucket(c, entry, f"padding or cutting back failed: {failure}")
        return True
    assert c._buckets is not None
    # A range's first compile failing while other graphs compiled fine is the range's
    # fault; with nothing compiled yet it is the compiler's: trip, as without buckets.
    first_range_compile = (
        not c._buckets.pads
        and entry.status is BucketStatus.NEW
        and any(g.compiled for g in c._table)
    )
    if _constraint_violation(failure) or (
        first_range_compile and isinstance(failure, _COMPILE_ERRORS)
    ):
        reject_bucket(
            c, entry, f"its range cannot be compiled as one dynamic graph: {safe_message(failure)}"
        )
        return True
    return False


def _constraint_violation(error: BaseException) -> bool:
    chain = exception_chain(error, inner=True, limit=8)
    return any("ConstraintViolation" in type(seen).__name__ for seen in chain)


def eager(c: Controller, args: tuple[Any, ...], kwargs: dict[str, Any], *, warmup: bool) -> Any:
    """Run eager and count it (a warmup call runs nothing: its result is discarded)."""
    if warmup:
        return None
    slot = c._slots.get()
    try:
        return c._fn(*args, **kwargs)
    finally:
        slot.eager += 1


# ---------------------------------------------------------------- the gate is closed


def call_slow(
    c: Controller, args: tuple[Any, ...], kwargs: dict[str, Any], *, warmup: bool = False
) -> Any:
    """Every call the hot path does not take (see the module doc)."""
    admitted = _admit(c, args, kwargs, warmup=warmup)
    if admitted is None:
        return eager(c, args, kwargs, warmup=warmup)
    trial = admitted == "trial"
    slot = c._slots.get()
    before = slot.compiled
    try:
        if len(c._table) > 0:
            return _call_compiled(c, slot, args, kwargs, force=trial or warmup, warmup=warmup)
        # Nothing compiled yet: own the first compile, so other threads serve eager
        # instead of compiling the same graph again (torch does not de-duplicate).
        with c._compiles.claim(exclusive=True) as mine:
            if not mine and not warmup:
                return eager(c, args, kwargs, warmup=warmup)
            return _call_compiled(c, slot, args, kwargs, force=trial or warmup, warmup=warmup)
    finally:
        if trial:
            c._trips.end_trial(served=slot.compiled > before)


def warm_call(c: Controller, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One warmup call (:meth:`Controller.warmup`): the slow path, checked, not counted."""
    try:
        return call_slow(c, args, kwargs, warmup=True)
    finally:
        discarded(c)  # its outputs are dropped: their backward never runs


def discarded(c: Controller) -> None:
    """A compiled call's outputs go unused (a warmup call, a check answered by eager).

    Under CUDA graphs, a forward whose outputs carry gradients leaves a backward pending;
    torch starts a new iteration at the next compiled call only once every pending
    backward ran, and that one never will: the next calls would miss the CUDA graphs'
    fast path. ``torch.compiler.cudagraph_mark_step_begin()`` starts the new iteration.
    Only under CUDA graphs, and only with gradients on (inference starts one per call).
    """
    if c._cudagraphs and torch.is_grad_enabled():
        with contextlib.suppress(Exception):  # never breaks a call
            mark_step: Callable[[], None] = torch.compiler.cudagraph_mark_step_begin
            mark_step()


def _admit(
    c: Controller, args: tuple[Any, ...], kwargs: dict[str, Any], *, warmup: bool
) -> str | None:
    """Whether this call may try the compiled path: ``"trial"`` (the half-open trial),
    ``"compiled"``, or ``None`` (eager serves it)."""
    if c._gate.disabled:
        return None
    if c._trips.tripped:
        return "trial" if not warmup and c._trips.claim_trial() else None
    if not warmup and (
        (c._rollout < 1.0 and not c._pick_compiled())
        or c._warming_up
        or c._compiles.busy_elsewhere()  # a compile is in flight elsewhere: eager meanwhile
    ):
        return None
    known = c._failures.known(args, kwargs) if c._failures.active else None
    if known is not None:
        c._trip(Reason.COMPILE_ERROR, message=known)
        return None
    if len(c._table) == 0 and c._persisted.active:
        c._persisted.load_artifacts(args, kwargs)  # once: torch's artifacts, if needed
    return "compiled"


def _call_compiled(
    c: Controller,
    slot: CallSlot,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    force: bool,
    warmup: bool,
) -> Any:
    """Call the compiled function from the slow path (buckets planned here)."""
    planned = _plan_bucket(c, args, kwargs, warmup=warmup)
    if planned is None:
        return eager(c, args, kwargs, warmup=warmup)
    plan, entry = planned
    step = Step.UNTIMED
    if c._speed is not None and not (force or warmup):
        step = _plan_speed(c, slot, args, kwargs, plan, entry)
        if step is Step.TIME_EAGER:
            return _probe(c, slot, args, kwargs)
    slot.begin()
    slot.force = force
    c._slots.local.bucket = entry.label if entry is not None else None
    if step is Step.TIME_COMPILED:
        sync_device((args, kwargs))
        slot.timer = c._clock()
    try:
        if plan is not None and entry is not None:
            return _call_bucket(c, slot, plan, entry, args, kwargs, warmup=warmup)
        try:
            out = c._gate.compiled(*args, **kwargs)
        except Exception as exc:
            failure: Exception = exc
        else:
            return finish(c, slot, out, args, kwargs, warmup=warmup)
        return recover(c, failure, args, kwargs, warmup=warmup)
    finally:
        slot.force = False
        c._slots.local.bucket = None
        if slot.timer >= 0.0:  # a timed call that did not reach finish(): not a time
            slot.timer = -1.0
            c._speed_done(Step.TIME_COMPILED, None)


def _plan_bucket(
    c: Controller, args: tuple[Any, ...], kwargs: dict[str, Any], *, warmup: bool
) -> tuple[Plan | None, BucketEntry | None] | None:
    """The call's bucket and its entry (``(None, None)``: not bucketed), or ``None`` when
    eager serves the call (oversize, or a rejected bucket)."""
    if c._buckets is None:
        return None, None
    plan = c._buckets.bucketer.plan(args, kwargs)
    if plan is not None and plan.status == "oversize":
        if c._buckets.bucketer.policy.oversize == "eager":
            return None
        return None, None  # compile the shape as it is
    if plan is None or plan.status != "bucketed":
        if plan is not None:  # a dim past the argument's rank
            _check_bucket_dims(c, args, kwargs, warmup=warmup)
        return None, None  # unbucketable: run it unpadded
    entry = c._buckets.entry(plan)
    if not entry.looked_up:  # what an earlier process learnt (_restart)
        c._persisted.restore(entry, args, kwargs)
    if entry.status is BucketStatus.REJECTED:
        return None
    return plan, entry


def _plan_speed(
    c: Controller,
    slot: CallSlot,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    plan: Plan | None,
    entry: BucketEntry | None,
) -> Step:
    """Whether the speed verdict times this call, and on which arm (see
    :mod:`safecompile.checks.speed`). A bucket still verifying its padding is not timed."""
    speed = c._speed
    assert speed is not None
    c._speed_tick(slot)
    if not speed.wants:
        return Step.UNTIMED
    bucket: str | None = None
    if plan is not None and entry is not None:
        if entry.status is not BucketStatus.READY or (
            entry.cuts is None and c._buckets is not None and c._buckets.pads and plan.padded
        ):
            return Step.UNTIMED
        bucket = entry.label
    return speed.plan(call_key(args, kwargs, bucket, c._module))


def _probe(c: Controller, slot: CallSlot, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The eager arm of a pair: the original function on the caller's own arguments
    (its values, side effects and gradients are the caller's), timed."""
    sync_device((args, kwargs))
    started = c._clock()
    try:
        out = c._fn(*args, **kwargs)
        sync_device(out)
    except BaseException:
        slot.eager += 1
        c._speed_done(Step.TIME_EAGER, None)
        raise  # eager's own error: the caller gets it, as eager would raise it
    elapsed = c._clock() - started
    slot.eager += 1
    c._speed_done(Step.TIME_EAGER, elapsed)
    return out


def call_key(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    bucket: str | None,
    module: torch.nn.Module | None,
) -> Hashable:
    """What groups like calls for a pair: the bucket, grad mode, train/eval, the keyword
    names, and for each argument (top level) a tensor's dtype, device, grad flag, rank and
    element count rounded up to a power of two (so variable-length traffic still pairs),
    a bool's value, or another value's type. Cheap: it runs on every call of a round."""
    parts: list[object] = [bucket, torch.is_grad_enabled(), tuple(kwargs)]
    if module is not None:
        parts.append(module.training)
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            n = value.numel()
            size = 1 << (n - 1).bit_length() if n > 1 else n
            parts.append((value.dtype, value.device.type, value.requires_grad, value.dim(), size))
        elif isinstance(value, bool):
            parts.append(value)
        else:
            parts.append(type(value))
    return tuple(parts)


def _call_bucket(
    c: Controller,
    slot: CallSlot,
    plan: Plan,
    entry: BucketEntry,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    warmup: bool,
) -> Any:
    assert c._buckets is not None
    bucketer = c._buckets.bucketer
    padded = c._buckets.pads and plan.padded
    marked: list[tuple[torch.Tensor, dict[str, Any]]] = []
    if not c._buckets.pads and entry.status is BucketStatus.NEW:
        marked = c._buckets.mark_range(plan, args, kwargs)
    failure: Exception | None = None
    try:
        call_args, call_kwargs = bucketer.pad(plan, args, kwargs) if padded else (args, kwargs)
        out = c._gate.compiled(*call_args, **call_kwargs)
    except Exception as exc:
        failure = exc
    finally:
        unmark(marked)
    if failure is not None:
        return recover(c, failure, args, kwargs, plan=plan, entry=entry, warmup=warmup)
    if (
        padded
        and entry.cuts is None
        and not c._persisted.reuse(c._buckets.bucketer, plan, entry, out)
    ):
        return _verify_bucket(c, slot, plan, entry, out, args, kwargs, warmup=warmup)
    if padded:
        try:
            out = bucketer.unpad(plan, out, entry.cuts)
        except BucketError as exc:
            reject_bucket(c, entry, f"outputs could not be cut back: {exc}")
            slot.end()
            return eager(c, args, kwargs, warmup=warmup)
    if not padded:  # nothing padded in this key (or a dynamic range): nothing to verify
        entry.status = BucketStatus.READY
    if not warmup:
        entry.count(plan, padded=padded)
    return finish(c, slot, out, args, kwargs, warmup=warmup)


def _verify_bucket(
    c: Controller,
    slot: CallSlot,
    plan: Plan,
    entry: BucketEntry,
    padded_out: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    warmup: bool,
) -> Any:
    """A bucket's first padded call: learn its output cut and verify its padding against
    unpadded eager — on the caller's own tensors, so eager's result can be returned
    with its gradients. Runs with shadow checks on or off."""
    assert c._buckets is not None
    bucketer = c._buckets.bucketer
    due, first = slot.due, slot.first
    slot.end()
    eager_out = c._fn(*args, **kwargs)
    try:
        if bucketer.policy.outputs is not None:
            cuts = bucketer.declared_cuts(plan, padded_out)
        else:
            cuts = bucketer.learn_cuts(plan, padded_out, eager_out)
        out = bucketer.unpad(plan, padded_out, cuts)
    except (BucketError, ValueError) as exc:
        reject_bucket(c, entry, f"outputs cannot be cut back: {exc}")
        return _served_eager(slot, eager_out, warmup=warmup)
    rtol, atol = c._shadow.tolerances()
    result = compare(out, eager_out, rtol=rtol, atol=atol)
    c._shadow.note(first, entry.label, result)
    for graph in due or ():
        c._table.checked(graph)
    if result.ok:
        if not cuts.ambiguous:  # else right for this call only: a later call learns again
            entry.cuts = cuts
            entry.status = BucketStatus.READY
            c._persisted.keep_verified(entry, cuts, c.name)
        if not warmup:
            entry.count(plan, padded=True)
            slot.compiled += 1
        return out
    # Padding's fault, or the compiler's? Eager on the padded inputs tells.
    with torch.no_grad():
        padded_args, padded_kwargs = bucketer.pad(plan, args, kwargs)
        padded_eager = bucketer.unpad(plan, c._fn(*padded_args, **padded_kwargs), cuts)
    padding = compare(padded_eager, eager_out, rtol=rtol, atol=atol)
    if not padding.ok:
        reject_bucket(
            c,
            entry,
            f"padding changed the result: {padding.reason}",
            max_abs=padding.max_abs,
            max_rel=padding.max_rel,
        )
    else:
        c._trip(
            Reason.DRIFT,
            message=result.reason or "outputs differ",
            bucket=entry.label,
            graph=first,
            max_abs=result.max_abs,
            max_rel=result.max_rel,
        )
    return _served_eager(slot, eager_out, warmup=warmup)


def _served_eager(slot: CallSlot, out: Any, *, warmup: bool) -> Any:
    if warmup:
        return None
    slot.eager += 1
    return out


def reject_bucket(
    c: Controller,
    entry: BucketEntry,
    why: str,
    *,
    max_abs: float | None = None,
    max_rel: float | None = None,
) -> None:
    """Stop using a bucket: its calls run eager from now on (the callable stays up)."""
    with c._lock:
        if entry.status is BucketStatus.REJECTED:
            return
        entry.status = BucketStatus.REJECTED
        entry.why = truncate(why, 300)
    c._persisted.keep_rejected(entry, truncate(why, 300), c.name)
    c._record(
        Event(
            kind=EventKind.BUCKET_REJECTED,
            reason=Reason.DRIFT,
            time=time.time(),
            bucket=entry.label,
            message=truncate(f"bucket not used: {why}"),
            max_abs_diff=max_abs,
            max_rel_diff=max_rel,
            **location_fields(c._location),
        )
    )


_dims_said = Once()


def _check_bucket_dims(
    c: Controller, args: tuple[Any, ...], kwargs: dict[str, Any], *, warmup: bool
) -> None:
    """A bucketed dim past its argument's rank is the user's configuration mistake: a
    warmup raises its ``ConfigError``; a live call is served unpadded (eager would not
    raise) with one warning per callable and message."""
    assert c._buckets is not None
    try:
        c._buckets.bucketer.check_dims(args, kwargs)
    except ConfigError as error:
        if warmup:
            raise
        _dims_said.warn(
            (c.name, str(error)),
            "safecompile.bucket_dims_wrong",
            function=c.name,
            description=truncate(f"{error}; calls with this shape run unpadded"),
        )


def start_background(c: Controller, run: Callable[[], None], *, nice: int | None = 19) -> None:
    """Run a warmup on a worker thread while eager serves (see ``Warmup(background=)``).

    The worker lowers its own priority to ``nice`` first (``None`` or 0: unchanged), so
    live calls keep the CPU; only that thread, and the processes it starts, are affected.

    inductor traces one helper module with ``torch.fx.symbolic_trace`` the first time it
    lowers a graph, which patches ``nn.Module.__call__`` for the whole process while it
    runs: an eager call on another thread in that window can fail. That one-time trace
    is done here, before any live call can overlap it.
    """
    if c._opts.backend_label == "inductor":
        _close_symbolic_trace_window()
    c._background_warmup(pending=True)

    def work() -> None:
        try:
            if nice:
                lower_priority(nice)
            run()
        except Exception as exc:
            c._note_warmup_error(exc)
        finally:
            c._background_warmup(pending=False)

    worker = threading.Thread(target=work, name=f"safecompile-warmup:{c.name}", daemon=True)
    _WORKERS.add(worker)
    worker.start()


#: Seconds the interpreter's exit waits, in all, for warmup threads still running.
EXIT_WAIT_S = 10.0
_WORKERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _join_workers(timeout: float = EXIT_WAIT_S) -> None:
    """At exit, give running warmup threads up to ``timeout`` seconds to end.

    A daemon thread still inside torch when the interpreter finalises is ended by an
    unwind that torch's C++ frames turn into ``std::terminate`` (the process aborts with
    "terminate called without an active exception"), even one that has just finished
    its work. A warmup still compiling past the bound is left to that fate.
    """
    deadline = time.monotonic() + timeout
    for worker in list(_WORKERS):
        worker.join(max(0.0, deadline - time.monotonic()))


def lower_priority(nice: int) -> bool:
    """Raise the calling thread's niceness to ``nice`` (Linux: per thread); ``False``
    where the platform cannot. An unprivileged thread cannot lower it back, so callers
    run it on a thread of their own."""
    setpriority = getattr(os, "setpriority", None)
    native_id = getattr(threading, "get_native_id", None)
    if setpriority is None or native_id is None:  # pragma: no cover - not POSIX
        return False
    try:
        current = os.getpriority(os.PRIO_PROCESS, native_id())
        setpriority(os.PRIO_PROCESS, native_id(), max(current, nice))
    except OSError:  # pragma: no cover - a sandbox that forbids it
        return False
    return True


def _close_symbolic_trace_window() -> None:
    try:
        closed = torchcompat.close_symbolic_trace_window()
    except Exception:  # pragma: no cover - another torch: nothing to close
        return
    if closed is not None:
        torch_missing(closed)
