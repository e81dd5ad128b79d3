"""The speed verdict's arm in the guard: which calls it times, and what it decided.

The verdict itself (pairs of timed calls, rounds, the decision) is
:class:`safecompile.checks.speed.CallSpeed`; this module feeds it. The hot path tells it
the calls a thread made in batches (:meth:`SpeedArm.tick`); while it wants a call, the gate
sends calls to the slow path, which asks :meth:`SpeedArm.plan` whether to time this one
and on which arm, and reports the time (:meth:`SpeedArm.done`). A decision comes back to
the engine, which says it and, when eager won, trips (``slower``).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

import torch

from safecompile.base.model import Event, EventKind
from safecompile.base.policies import FOREVER, Rollback
from safecompile.checks.speed import CallSpeed, Decision, SpeedPolicy, Step
from safecompile.observe.source import SourceLocation, location_fields

from ._slots import Slot, Slots

__all__ = ["SpeedArm", "call_key"]

_TICK = 1024  # at most this many calls of a thread between reports to the speed verdict


class SpeedArm:
    """The speed verdict of one guarded callable (``None`` inside: ``slower_ratio=None``)."""

    def __init__(self, rollback: Rollback, slots: Slots) -> None:
        self._rollback = rollback
        self._slots = slots
        self.verdict: CallSpeed | None = None
        self.start()

    def start(self) -> None:
        """A new verdict (at the start, and on ``reset()``)."""
        rollback = self._rollback
        self.verdict = None
        if rollback.slower_ratio is not None:
            policy = SpeedPolicy(ratio=rollback.slower_ratio, min_pairs=rollback.slower_min_samples)
            self.verdict = CallSpeed(policy)

    @property
    def wants(self) -> bool:
        """Whether the verdict wants the next call (the gate closes the hot path)."""
        return self.verdict is not None and self.verdict.wants

    def restart(self) -> None:
        """The verdict starts a round afresh (a trial, a recovery); every thread reports
        on its next call."""
        if self.verdict is not None:
            self.verdict.restart()
            self._slots.remark()

    def tick(self, slot: Slot) -> bool:
        """Tell the verdict the calls this thread made since it last did (the hot path
        calls this when ``slot.compiled`` reaches ``slot.mark``), and set the next mark;
        ``True`` when what the verdict wants changed (the gate is recomputed)."""
        speed = self.verdict
        if speed is None:
            slot.mark = FOREVER
            return False
        seen = slot.compiled + slot.eager
        wanted = speed.wants
        left = speed.add(seen - slot.seen)
        slot.seen = seen
        slot.mark = slot.compiled + max(1, min(left, _TICK))
        return speed.wants != wanted

    def plan(self, key: Hashable) -> Step:
        """Whether the verdict times a call of ``key`` (:func:`call_key`), and on which arm."""
        speed = self.verdict
        if speed is None or not speed.wants:
            return Step.UNTIMED
        return speed.plan(key)

    def done(self, step: Step, seconds: float | None) -> Decision | None:
        """A timed call ended (``None``: it could not be timed); a round's decision."""
        speed = self.verdict
        if speed is None:
            return None
        if seconds is None:
            speed.abandon()
            return None
        return speed.record(step, seconds)

    def figures(self) -> dict[str, Any]:
        """The verdict's counters, for ``stats().extra["speed"]``."""
        speed = self.verdict
        if speed is None:
            return {"on": False, "probes": 0, "timed": 0, "rounds": 0, "last_ratio": None}
        last = speed.last
        return {
            "on": True,
            "probes": speed.probes,
            "timed": speed.timed,
            "rounds": speed.rounds,
            "last_ratio": last.to_dict()["ratio"] if last is not None else None,
        }

    def verdict_event(self, decision: Decision, location: SourceLocation | None) -> Event:
        """The ``speed_verdict`` event of a round's decision."""
        limit = self._rollback.slower_ratio
        return Event(
            kind=EventKind.SPEED_VERDICT,
            time=time.time(),
            message=(
                f"{'eager' if decision.eager else 'compiled'} serves: the whole call, "
                f"compiled/eager summed time {decision.ratio:.3f}x {_figures(decision)} "
                f"(median pair {decision.median:.3f}x) over {decision.pairs} paired live "
                f"calls (slower_ratio={limit})"
            ),
            details=decision.to_dict(),
            **location_fields(location),
        )

    def slower(self, decision: Decision) -> str:
        """Why eager won a round: the message of its ``slower`` trip."""
        return (
            f"the compiled path is slower than eager (slower_ratio="
            f"{self._rollback.slower_ratio}): the whole call {decision.ratio:.3f}x eager's "
            f"time {_figures(decision)} over {decision.pairs} pairs"
        )


def _figures(decision: Decision) -> str:
    return f"[{decision.low:.3f}, {decision.high:.3f}]"


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
