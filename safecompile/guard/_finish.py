"""After the compiled call: what a call needs beyond counting, and how eager answers.

- :func:`finish`: the compiled call returned, and a check was due, a graph ran eagerly
  (recompile limit), a graph ran for the first time, or no graph ran at all;
- :func:`recover`: the compiled path raised; eager answers, on the caller's own
  tensors (so gradients reach them), or eager's own error is raised;
- :func:`eager`: eager serves the call, counted for why.

What a check or a failure shows (a breach, an error) goes to ``Engine.trip``.
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

from ._deferred import copy_call, signature
from ._engine import Engine
from ._first_run import FirstRun
from ._graph_backend import compile_seconds
from ._logs import META_LOG
from ._slots import Call
from .graphs import GraphRecord
from .shadow import Outcome, run_later, sync_device

__all__ = [
    "count_eager",
    "defer",
    "discarded",
    "eager",
    "finish",
    "first_runs",
    "recover",
    "served_eager",
]

# Exceptions raised while dynamo traces or a backend compiles (not by compiled code).
_COMPILE_ERRORS: tuple[type[BaseException], ...] = torchcompat.compile_errors()


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
    if call.started >= 0.0:  # its time goes to the speed verdict, unless it is no live
        sync_device(out)  # call's: no compiled graph served it, or it compiled one
        elapsed = e.costs() - call.started
        call.started = -1.0
        served = first is not None and first.compiled and new is None
        e.speed_done(Step.TIME_COMPILED, elapsed if served else None)
    started = slot.started  # when its first checked graph started
    slot.end()
    if fresh is not None and first_runs(e, call, fresh):
        return _checked_after_breach(e, call, due, snapshot, out)
    if first is None or not first.compiled:
        # No compiled graph served: the graph is past the recompile limit and its traced
        # code ran eagerly, or dynamo ran the frame eagerly: past torch's own limit (above
        # ours), or it made no graph of it (nothing to compile), or held back a new graph
        # to compile off the request path (warming)
        limited = first is not None or e.events.tally.limit_said
        count_eager(call, "warming" if held else "recompile_limit" if limited else "no_graph")
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


def first_runs(e: Engine, call: Call, runs: list[FirstRun]) -> bool:
    """Graphs ran for the first time in this call, their compiled code on copies that
    need no gradients (._first_run): a breach one of them showed trips (``True``)."""
    for run in runs:
        seen = run.seen
        if seen is None or seen.ok:
            continue
        e.trip(
            Reason.DRIFT,
            message=f"first run: {seen.reason or 'outputs differ'}",
            graph=run.graph,
            max_abs=seen.max_abs,
            max_rel=seen.max_rel,
            breach=e.shadow.note(run.graph, None, seen),
        )
        count_eager(call, "check")
        return True
    return False


def _checked_after_breach(
    e: Engine, call: Call, due: list[GraphRecord] | None, snapshot: Snapshot | None, out: Any
) -> Any:
    """A graph's first run breached: its outputs were eager's already. A check due on this
    call still makes its eager run of the whole call, as a peer rank's call that checks it
    does, so the collectives inside pair up; eager's result if it asks for it."""
    if due and snapshot is not None:
        verdict = e.shadow.check(due, snapshot, call.args, call.kwargs, out, compiled_s=None)
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
    verdict = e.shadow.check(due, snapshot, call.args, call.kwargs, out, compiled_s=compiled_s)
    _check_later(e, verdict)
    if not verdict.use_eager and verdict.breach is None:
        return None
    discarded(e)  # the compiled outputs go unused
    if verdict.breach is not None:
        _drifted(e, verdict)
    count_eager(call, "check")
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
    try:
        out = e.fn(*call.args, **call.kwargs)
    except Exception:
        del failure  # eager raises too: the user's own error, not the compiler's
        META_LOG.drop()  # torch's log of it while tracing is noise: eager's error says it
        raise
    finally:
        count_eager(call, "error")
    META_LOG.replay()
    if not isinstance(failure, _COMPILE_ERRORS):
        e.trip(Reason.RUNTIME_ERROR, error=failure, bucket=call.bucket)
    # a fault of what torch read from its remote caches: the next call compiles without it
    elif not remote.cache_fault(failure):
        e.failures.persist(e.name, failure, call.args, call.kwargs)
        e.events.compile_failed(failure, call.bucket, compile_seconds(e.clock))
        e.trip(Reason.COMPILE_ERROR, error=failure, bucket=call.bucket)
    return out


def count_eager(call: Call, why: str) -> None:
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
        count_eager(call, why)


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
    warm = deferred.warm
    assert warm is not None  # wanted() says so

    def compile_it() -> None:
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                warm(args, kwargs)
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


def served_eager(call: Call, out: Any, why: str) -> Any:
    count_eager(call, why)
    return None if call.warmup else out
