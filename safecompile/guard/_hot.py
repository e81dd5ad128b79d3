"""The hot path: one closure per guarded callable (see :func:`entrypoint`).

The hot path is one frame: re-read the kill switch only when the environment's value
object is not the one last read (``disable()`` makes it stale: ``killswitch.watch``),
then — when the gate is open — call the compiled function and look at the calling
thread's slot, where the graph wrappers noted which graph served the call and whether a
check is due. Nothing due: count the call in the thread's own slot and return.
Everything else is a slow path, handed the engine and one :class:`~._slots.Call` record:
``finish`` and ``recover`` (:mod:`._finish`: a check was due, a graph ran eagerly or for
the first time, no graph ran; the compiled path raised), ``call_slow`` (:mod:`._paths`:
the gate is closed, or a bucket still needs verifying).

With the kill switch on, or rolled back with no trial to come (``gate.eager``: no clock
read), or none due yet (one clock read against ``gate.eager_until``), the hot path itself
serves eager, as the slow path would, and counts it in the thread's slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from safecompile.base import killswitch as ks
from safecompile.observe.source import without_our_frames
from safecompile.shapes.table import BucketStatus

from ._buckets import recover_bucketed
from ._engine import Engine
from ._finish import finish, recover
from ._paths import call_slow
from ._slots import Call, Slot

__all__ = ["entrypoint"]

_NONE: Any = None  # typed Any: the call below changes what the slot holds


def entrypoint(e: Engine) -> Callable[..., Any]:
    """The guarded function (see the module doc). With a process group, every call is
    counted for the ranks' safe points; without one, nothing is added."""
    guarded = _bucketed_entrypoint(e) if e.buckets is not None else _entrypoint(e)
    ranks = e.trips.ranks
    return ranks.counting(guarded, e.safe_point) if ranks is not None else guarded


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
                    slot: Slot = local.slot
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
                            slot: Slot = local.slot
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
                        return recover_bucketed(
                            e, Call(args, kwargs, slot, plan=plan, entry=entry), failure
                        )
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
