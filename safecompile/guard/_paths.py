"""The paths a call takes: one hot-path closure, and the slow paths behind it.

The hot path is one frame: re-read the kill switch only when the environment's value
object is not the one last read (``disable()`` makes it stale: ``killswitch.watch``),
then — when the gate is open — call the compiled function and look at the calling
thread's slot, where the graph wrappers noted which graph served the call and whether a
check is due. Nothing due: count the call in the thread's own slot and
return. Everything else is a slow path, handed the :class:`~.engine.Engine` and one
:class:`~.slots.CallState` record for the call:

- :func:`finish`: a check was due, a graph ran eagerly (recompile limit), or no graph
  ran at all;
- :func:`recover`: the compiled path raised; eager answers, on the caller's own
  tensors (so gradients reach them), or eager's own error is raised;
- :func:`call_slow`: the gate is closed (a trial due, rollout, a compile or warmup in
  flight, nothing compiled yet), or a bucket still needs verifying.

With the kill switch on, or rolled back with no trial to come (``gate.eager``: no clock
read), or none due yet (one clock read against ``gate.eager_until``), the hot path itself
serves eager, as the slow path would, and counts it in the thread's slot.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import threading
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch

from safecompile.base import killswitch as ks
from safecompile.base import torchcompat
from safecompile.base.errors import ConfigError
from safecompile.base.model import EventKind, Reason
from safecompile.checks.snapshot import Snapshot
from safecompile.checks.speed import Step
from safecompile.observe.log import Once
from safecompile.observe.source import (
    exception_chain,
    safe_message,
    truncate,
    without_our_frames,
)
from safecompile.persist import remote
from safecompile.shapes.buckets import BucketError
from safecompile.shapes.table import BucketEntry, BucketStatus, unmark

from ._deferred import copy_call, signature
from ._engine import Engine
from .graphs import Call, CallSlot, FirstRun, GraphRecord
from .shadow import sync_device

__all__ = ["call_slow", "defer", "entrypoint", "finish", "recover", "warm_call"]

# Exceptions raised while dynamo traces or a backend compiles (not by compiled code).
_COMPILE_ERRORS: tuple[type[BaseException], ...] = torchcompat.compile_errors()


_NONE: Any = None  # typed Any: the call below changes what the slot holds


class _Held(threading.local):
    """One thread's held log records (see :class:`_MetaLogHold`)."""

    def __init__(self) -> None:
        self.records: collections.deque[logging.LogRecord] = collections.deque(maxlen=16)
        self.replaying = False


class _MetaLogHold(logging.Filter):
    """Holds torch's ``failed while attempting to run meta`` error log (a traceback per op)
    logged inside a guarded call: :func:`recover` drops it when eager raises too (the
    user's own bug: eager's error says it all) and hands it on otherwise."""

    LOGGER = torchcompat.FAKE_TENSOR_LOGGER

    def __init__(self) -> None:
        super().__init__()
        self.held = _Held()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.held.replaying or not _in_guarded_call():
            return True
        self.held.records.append(record)
        return False

    def drop(self) -> None:
        self.held.records.clear()

    def replay(self) -> None:
        held = self.held
        records = list(held.records)
        held.records.clear()
        held.replaying = True
        try:
            for record in records:
                logging.getLogger(self.LOGGER).handle(record)
        finally:
            held.replaying = False


def _in_guarded_call() -> bool:
    """Whether a frame of this module (a guarded call's path) is on the stack."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == __file__:
            return True
        frame = frame.f_back
    return False


_META_LOG = _MetaLogHold()
logging.getLogger(_MetaLogHold.LOGGER).addFilter(_META_LOG)


class _TorchLimitQuiet(logging.Filter):
    """Drops dynamo's own recompile-limit warning raised inside a guarded call: our
    ``recompile_limit`` event said it first (our limit is below torch's), and the calls
    past torch's limit are counted as ``recompile_limit`` too. Elsewhere it stays."""

    LOGGER, START = torchcompat.RECOMPILE_LIMIT_LOG

    def filter(self, record: logging.LogRecord) -> bool:
        said_by_us = isinstance(record.msg, str) and record.msg.startswith(self.START)
        return not (said_by_us and _in_guarded_call())


logging.getLogger(_TorchLimitQuiet.LOGGER).addFilter(_TorchLimitQuiet())


def entrypoint(e: Engine) -> Callable[..., Any]:
    """The guarded function (see the module doc). With a process group, every call is
    counted for the ranks' safe points; without one, nothing is added."""
    guarded = _bucketed_entrypoint(e) if e.buckets is not None else _entrypoint(e)
    ranks = e.trips.ranks
    return ranks.counting(guarded, e.trips.safe_point) if ranks is not None else guarded


def _entrypoint(e: Engine) -> Callable[..., Any]:
    gate = e.gate
    fn = e.fn
    local = e.slots.local
    new_slot = e.slots.get
    env_get, env_key = _env_reader()
    refresh = e.refresh_switch
    tick = e.speed_tick
    clock = e.clock

    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:  # an error escaping is eager's: raised from the user's line, not ours
            if env_get(env_key) is not gate.token:  # stale after disable() too (ks.watch)
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
                        if n >= slot.mark:  # the speed verdict is told calls in batches
                            tick(slot)
                        return out
                    return finish(e, Call(args, kwargs, slot), out)
                # outside except: eager's error unchained
                return recover(e, Call(args, kwargs, slot), failure)
            if gate.eager or clock() < gate.eager_until:  # kill switch, rolled back: eager
                try:
                    slot = local.slot
                except AttributeError:
                    slot = new_slot()
                slot.eager += 1  # counted first: a call eager raises in counts too
                return fn(*args, **kwargs) if kwargs else fn(*args)
            return call_slow(e, args, kwargs)
        except Exception as exc:
            raise without_our_frames(exc)  # noqa: B904 - the user's error, kept unchained

    return guarded


def _bucketed_entrypoint(e: Engine) -> Callable[..., Any]:  # noqa: PLR0915 - one frame
    """The hot path with buckets: plan, pad, call, cut back (see :func:`entrypoint`)."""
    assert e.buckets is not None
    gate = e.gate
    fn = e.fn
    local = e.slots.local
    new_slot = e.slots.get
    env_get, env_key = _env_reader()
    refresh = e.refresh_switch
    tick = e.speed_tick
    clock = e.clock
    bucketer, entries, pads = e.buckets.bucketer, e.buckets.entries, e.buckets.pads
    plan_of, pad, unpad = bucketer.plan, bucketer.pad, bucketer.unpad
    ready = BucketStatus.READY

    def guarded(*args: Any, **kwargs: Any) -> Any:  # noqa: PLR0912 - one frame on purpose
        try:  # an error escaping is eager's: raised from the user's line, not ours
            if env_get(env_key) is not gate.token:  # stale after disable() too (ks.watch)
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
                                if n >= slot.mark:  # the speed verdict is told in batches
                                    tick(slot)
                                return out
                            return finish(e, Call(args, kwargs, slot, plan=plan, entry=entry), out)
                        return recover(e, Call(args, kwargs, slot, plan=plan, entry=entry), failure)
            elif gate.eager or clock() < gate.eager_until:  # kill switch, rolled back: eager
                try:
                    slot = local.slot
                except AttributeError:
                    slot = new_slot()
                slot.eager += 1  # counted first: a call eager raises in counts too
                return fn(*args, **kwargs) if kwargs else fn(*args)
            return call_slow(e, args, kwargs)
        except Exception as exc:
            raise without_our_frames(exc)  # noqa: B904 - the user's error, kept unchained

    return guarded


def _env_reader() -> tuple[Callable[[object], object], object]:
    """How the hot path reads the kill switch's raw environment value (see _killswitch)."""
    data = ks._ENV_DATA
    if data is not None:
        return data.get, ks._ENV_KEY
    return (lambda _key: ks.env_token()), None  # pragma: no cover


# ---------------------------------------------------------------- after the compiled call


def finish(e: Engine, call: Call, out: Any) -> Any:
    """The compiled call returned, and something needs more than counting."""
    slot = call.slot
    first, due, snapshot, new, fresh = slot.first, slot.due, slot.snapshot, slot.new, slot.fresh
    if fresh is not None:  # a graph's first run (graphs._first_run) is no timing either
        new = new or fresh
    held = slot.held
    if held:  # a frame ran eagerly instead of making a new graph: compile it later
        slot.held = False
        if not call.warmup:
            defer(e, call)
    if slot.timer >= 0.0:  # its time goes to the speed verdict, unless it is no live call's:
        sync_device(out)  # no compiled graph served it, or it compiled one
        elapsed = e.speed_clock() - slot.timer
        slot.timer = -1.0
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
        limited = first is not None or e.tally.limit_said
        call.count_eager("warming" if held else "recompile_limit" if limited else "no_graph")
        return out
    if due:
        if snapshot is None:
            first.prep = True  # a later graph is due: capture the state at the first
        else:
            first.prep = False
            answer = _check(e, call, due, snapshot, out, new=new)
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
        call.count_eager("check")
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
        if verdict.use_eager or verdict.breach is not None:
            discarded(e)
            return verdict.eager_out
    return out


def _check(
    e: Engine, call: Call, due: list[GraphRecord], snapshot: Snapshot, out: Any, *, new: object
) -> tuple[Any] | None:
    """Shadow-check a compiled call; ``(eager's result,)`` when eager answers it."""
    compiled_s = None
    if new is None:  # a call that compiled is not a timing
        sync_device(out)  # on CUDA: the work done, not its launch
        compiled_s = e.clock() - call.slot.started
    verdict = e.shadow.check(
        e.table, due, snapshot, call.args, call.kwargs, out, compiled_s=compiled_s
    )
    if not verdict.use_eager and verdict.breach is None:
        return None
    discarded(e)  # the compiled outputs go unused
    if verdict.breach is not None:
        e.trip(
            Reason.DRIFT,
            message=verdict.breach,
            graph=verdict.graph,
            max_abs=verdict.max_abs,
            max_rel=verdict.max_rel,
        )
    call.count_eager("check")
    return (verdict.eager_out,)


def recover(e: Engine, call: Call, failure: Exception) -> Any:
    """The compiled path raised: answer with eager's result, or eager's own error."""
    call.slot.end()
    call.slot.held = False
    if call.entry is not None and _bucket_fault(e, failure, call.entry):
        return eager(e, call, "bucket")
    try:
        out = e.fn(*call.args, **call.kwargs)
    except Exception:
        del failure  # eager raises too: the user's own error, not the compiler's
        _META_LOG.drop()  # torch's log of it while tracing is noise: eager's error says it
        raise
    finally:
        call.count_eager("error")
    _META_LOG.replay()
    if not isinstance(failure, _COMPILE_ERRORS):
        e.trip(Reason.RUNTIME_ERROR, error=failure, bucket=call.bucket)
    # a fault of what torch read from its remote caches: the next call compiles without it
    elif not remote.cache_fault(failure):
        e.compile_failed(failure, call)
        e.trip(Reason.COMPILE_ERROR, error=failure, bucket=call.bucket)
    return out


def _bucket_fault(e: Engine, failure: Exception, entry: BucketEntry) -> bool:
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


def eager(e: Engine, call: Call, why: str) -> Any:
    """Run eager and count it, for ``why`` (a key of ``Stats.eager_by_reason``); a warmup
    call runs nothing: its result is discarded."""
    if call.warmup:
        return None
    try:
        return e.fn(*call.args, **call.kwargs)
    finally:
        call.count_eager(why)


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
        if len(e.table) > 0 or (e.deferred is not None and not warmup):
            return _call_compiled(e, call, force=trial or warmup)  # (deferred: no compile)
        # Nothing compiled yet: own the first compile, so other threads serve eager
        # instead of compiling the same graph again (torch does not de-duplicate).
        with e.compiles.claim(exclusive=True) as mine:
            if not mine and not warmup:
                return eager(e, call, "warming")
            return _call_compiled(e, call, force=trial or warmup)
    finally:
        if trial:
            e.trips.end_trial(served=call.slot.compiled > before)


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
            e.say_error(EventKind.WARMUP_FAILED, exc)

    deferred.submit(key, compile_it)


def discarded(e: Engine) -> None:
    """A compiled call's outputs go unused (a warmup call, a check answered by eager):
    under CUDA graphs with gradients on, its backward would stay pending forever and
    torch would start no new iteration, so start one (docs/design.md, "Under CUDA graphs").
    """
    if e.cudagraphs and torch.is_grad_enabled():
        with contextlib.suppress(Exception):  # never breaks a call
            mark_step: Callable[[], None] = torch.compiler.cudagraph_mark_step_begin
            mark_step()


def _admit(e: Engine, call: Call) -> str:
    """Whether this call may try the compiled path: ``"trial"`` (the half-open trial),
    ``"compiled"``, or why eager serves it (a key of ``Stats.eager_by_reason``)."""
    if e.gate.disabled:
        return "disabled"
    if e.trips.tripped:
        return "trial" if not call.warmup and e.trips.claim_trial() else "rolled_back"
    if not call.warmup:
        if e.opts.rollout < 1.0 and not e.pick_compiled():
            return "rollout"
        # a warmup, or a compile in flight elsewhere (unless deferred): eager meanwhile
        if e.warming_up or (e.deferred is None and e.compiles.busy_elsewhere()):
            return "warming"
    known = e.failures.known(call.args, call.kwargs)
    if known is not None:
        e.trip(Reason.COMPILE_ERROR, message=known)
        return "error"
    if len(e.table) == 0 and e.persisted.active:
        e.persisted.load_artifacts(call.args, call.kwargs)  # once: torch's artifacts
        e.precompiled.load(call.args, call.kwargs, e.backend.adopt)  # once: loaded, not traced
    return "compiled"


def _call_compiled(e: Engine, call: Call, *, force: bool) -> Any:
    """Call the compiled function from the slow path (buckets planned here)."""
    why = "bucket" if not _plan_bucket(e, call) else "warming" if _deferred_now(e, call) else None
    if why is not None:  # its bucket runs eager, or its first compile is deferred
        return eager(e, call, why)
    slot = call.slot
    step = Step.UNTIMED
    if e.speed is not None and not (force or call.warmup):
        step = _plan_speed(e, call)
        if step is Step.TIME_EAGER:
            return _probe(e, call)
        if step is Step.EAGER:  # a call that settles the eager arm before a probe
            return eager(e, call, "speed")
    slot.begin()
    slot.force = force
    slot.call = call
    if step is Step.TIME_COMPILED:
        sync_device((call.args, call.kwargs))
        slot.timer = e.speed_clock()
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
        slot.call = None
        if slot.timer >= 0.0:  # a timed call that did not reach finish(): not a time
            slot.timer = -1.0
            e.speed_done(Step.TIME_COMPILED, None)


def _deferred_now(e: Engine, call: Call) -> bool:
    """With deferred compiles, a live call while nothing is compiled yet is deferred at
    once: eager serves it. Any other call tries the compiled function, where a frame that
    would make a new graph runs eagerly instead (``slot.held``)."""
    if e.deferred is None or call.warmup or len(e.table) > 0:
        return False
    defer(e, call)
    return True


def _plan_bucket(e: Engine, call: Call) -> bool:
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


def _plan_speed(e: Engine, call: Call) -> Step:
    """Whether the speed verdict times this call, and on which arm (see
    :mod:`safecompile.checks.speed`). A bucket still verifying its padding is not timed."""
    speed = e.speed
    assert speed is not None
    e.speed_tick(call.slot)
    if not speed.wants:
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
    return speed.plan(call_key(call.args, call.kwargs, call.bucket, e.module))


def _probe(e: Engine, call: Call) -> Any:
    """The eager arm of a pair: the original function on the caller's own arguments
    (its values, side effects and gradients are the caller's), timed."""
    sync_device((call.args, call.kwargs))
    started = e.speed_clock()
    elapsed: float | None = None  # eager raised: the caller gets its error, as eager would
    try:
        out = e.fn(*call.args, **call.kwargs)
        sync_device(out)
        elapsed = e.speed_clock() - started
    finally:
        call.count_eager("speed")
        e.speed_done(Step.TIME_EAGER, elapsed)
    return out


def call_key(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    bucket: str | None,
    module: torch.nn.Module | None,
) -> Hashable:
    """What groups like calls for a pair (cheap: it runs on every call of a round); a
    tensor's size rounded up to a power of two, so variable-length traffic still pairs."""
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
    call.count_eager(why)
    return None if call.warmup else out


def reject_bucket(
    e: Engine,
    entry: BucketEntry,
    why: str,
    *,
    max_abs: float | None = None,
    max_rel: float | None = None,
) -> None:
    """Stop using a bucket: its calls run eager from now on (the callable stays up)."""
    with e.lock:
        if entry.status is BucketStatus.REJECTED:
            return
        entry.status = BucketStatus.REJECTED
        entry.why = truncate(why, 300)
    e.persisted.keep_rejected(entry, truncate(why, 300), e.name)
    e.say(
        EventKind.BUCKET_REJECTED,
        truncate(f"bucket not used: {why}"),
        here=True,
        reason=Reason.DRIFT,
        bucket=entry.label,
        max_abs_diff=max_abs,
        max_rel_diff=max_rel,
    )


_dims_said = Once()


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
        _dims_said.warn(
            (e.name, str(error)),
            "safecompile.bucket_dims_wrong",
            function=e.name,
            description=truncate(f"{error}; calls with this shape run unpadded"),
        )
