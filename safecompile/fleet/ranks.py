"""Ranks that agree: local verdicts agreed across a ``torch.distributed`` process group.

With ``safe_compile(..., group=...)`` a trip on one rank does not switch that rank
alone (a compiled graph holding collectives on one rank against eager on another can
hang the job, and numerics would diverge). The trip is *held* and every rank switches
together at the next *safe point*: every ``Rollback(sync_every=N)`` calls of the guarded
callable (counted on every path, so all ranks of an SPMD program meet at the same call
index) and at an explicit ``wrapped.safecompile.sync()``.

A safe point is one small collective: an ``all_reduce(MAX)`` of four int64s per rank,

- ``key``: ``(world - rank) << 8 | reason`` when the rank tripped (held or applied),
  else 0 — the maximum names the lowest tripped rank and its reason;
- ``blocked``: 0 only when the rank is tripped, its ``retry_after`` wait is over and
  nothing new is held — a maximum of 0 means every rank may try compiled again;
- the wall-clock milliseconds at which the rank entered, and their negation — the spread
  tells a rank that came late that a peer already gave up waiting for it.

Every collective waits at most ``Rollback(sync_timeout=...)`` seconds. A collective that
fails or times out (a peer died, hangs, or never reaches the safe point) ends the
agreement for this process: the rank trips to eager (reason ``peer``) and never runs a
collective of safecompile's again.

One verdict is not held: a compile error trips its own rank at once (it has no compiled
code to run, and would compile again on every call); the peers follow at the next safe
point. Retries (``retry_after``) are agreed as well: never taken by one rank alone.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from safecompile.base.errors import ConfigError
from safecompile.base.model import Event, Reason

__all__ = ["Agreement", "Local", "Outcome", "check_group"]

# Reason codes on the wire: position + 1 (0: not tripped). Every rank runs the same code.
_CODES: tuple[Reason, ...] = tuple(Reason)
_REASON_BITS = 8


def check_group(group: object) -> None:
    """Validate ``safe_compile(group=...)`` (at decoration): a ProcessGroup, ``True`` or ``None``.

    ``True`` (the default group) is resolved lazily, at the first safe point: decorators
    usually run at import, before ``torch.distributed.init_process_group``.
    """
    if group is None:
        return
    if group is False:
        raise ConfigError(
            "safe_compile(group=False) is not an option: leave it out (None) for no agreement, "
            "True for the default process group, or pass a ProcessGroup"
        )
    dist = _dist()
    if dist is None:
        raise ConfigError(
            "safe_compile(group=...) needs torch.distributed, which this torch build lacks"
        )
    if group is True or isinstance(group, dist.ProcessGroup):
        return
    raise ConfigError(
        "safe_compile(group=...) must be a torch.distributed ProcessGroup (this rank must be "
        "a member), True for the default group, or None, got "
        f"{type(group).__name__} {group!r}"
    )


def _dist() -> Any:
    import torch.distributed as dist  # noqa: PLC0415 - optional part of torch

    return dist if dist.is_available() else None


@dataclass(frozen=True, slots=True)
class Local:
    """This rank's side of a safe point."""

    tripped: bool  # held for agreement, or already eager
    reason: Reason | None
    ready: bool  # tripped, its retry wait over, nothing new held: may try compiled again


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a safe point decided, the same on every rank."""

    call: int  # calls served before the safe point: the first call on the new path
    rank: int
    world: int
    trip: bool = False  # some rank tripped: every rank leaves the compiled path
    origin: int | None = None  # the lowest tripped rank
    origin_reason: Reason | None = None
    recover: bool = False  # every rank tripped and ready: all try compiled again
    failure: str | None = None  # the agreement ended here (timeout, a dead or late peer)


class Agreement:
    """The agreement of one guarded callable with its peers (see the module doc)."""

    def __init__(
        self,
        group: object,
        *,
        every: int,
        timeout: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._group = group  # a ProcessGroup, or True: the default group, resolved lazily
        self.every = every
        self.timeout = timeout
        self._wall = wall
        self._calls = itertools.count()  # next() is atomic: one index per call
        self._lock = threading.Lock()  # one safe point at a time
        self._held_lock = threading.Lock()  # never held across a collective
        self._held: Event | None = None  # the first trip held since the last safe point
        self.broken: str | None = None  # why the agreement ended
        self.safe_points = 0
        self.rank: int | None = None
        self.world: int | None = None

    # ------------------------------------------------------------------ trips between points

    def holds(self) -> bool:
        """Whether a local trip waits for the next safe point (``False``: apply it now —
        the agreement ended, or ``group=True`` and torch.distributed is not initialized)."""
        return self.broken is None and self._resolve() is not None

    def hold(self, event: Event) -> None:
        """Keep a local trip for the next safe point (the first one since the last wins)."""
        with self._held_lock:
            if self._held is None:
                self._held = event

    def take_held(self) -> Event | None:
        """The held trip, forgotten (a safe point applied it)."""
        with self._held_lock:
            held, self._held = self._held, None
            return held

    def counting(
        self, guarded: Callable[..., Any], safe_point: Callable[[int], None]
    ) -> Callable[..., Any]:
        """``guarded`` with a safe point before every ``every``-th call after the first.

        The index counts every call on every path (compiled, eager, disabled), so ranks
        making the same calls meet at the same index. ``reset()`` does not restart it.
        """
        calls = self._calls
        every = self.every

        def ranked(*args: Any, **kwargs: Any) -> Any:
            index = next(calls)
            if index % every == 0 and index:
                safe_point(index)
            return guarded(*args, **kwargs)

        return ranked

    # ------------------------------------------------------------------ the safe point

    def agree(self, local: Local, call: int) -> Outcome | None:
        """One safe point: exchange verdicts with every rank (blocking, bounded by the
        timeout). ``None`` when there is no agreement (ended, or no group yet)."""
        with self._lock:
            if self.broken is not None:
                return None
            group = self._resolve()
            if group is None:
                return None
            rank, world = int(group.rank()), int(group.size())
            self.rank, self.world = rank, world
            self.safe_points += 1
            key = 0
            if local.tripped:
                code = _CODES.index(local.reason) + 1 if local.reason in _CODES else 0
                key = ((world - rank) << _REASON_BITS) | code
            entered = int(self._wall() * 1000)
            mine = [key, 0 if local.ready else 1, entered, -entered]
            try:
                seen = self._all_reduce(group, mine)
            except Exception as exc:  # a dead peer, a timeout, a group torn down
                self.broken = _why(exc, self.timeout)
                return Outcome(call=call, rank=rank, world=world, failure=self.broken)
            outcome = _decode(seen, call, rank, world, self.timeout)
            self.broken = outcome.failure
            return outcome

    def _resolve(self) -> Any:
        group = self._group
        if group is not True:
            return group
        dist = _dist()
        if dist is None or not dist.is_initialized():
            return None
        group = dist.group.WORLD
        self._group = group
        return group

    def _all_reduce(self, group: Any, values: list[int]) -> list[int]:
        dist = _dist()
        tensor = torch.tensor(values, dtype=torch.int64, device=_device(dist, group))
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
        # A timeout raises (gloo) or returns False; either way the collective is
        # abandoned and the group may be unusable: the caller stops syncing.
        if work.wait(timeout=datetime.timedelta(seconds=self.timeout)) is False:
            raise TimeoutError(f"no answer within sync_timeout={self.timeout}s")
        return [int(v) for v in tensor.tolist()]

    def report(self) -> dict[str, Any]:
        """The agreement's state, for ``report()``."""
        return {
            "rank": self.rank,
            "world": self.world,
            "sync_every": self.every,
            "sync_timeout": self.timeout,
            "safe_points": self.safe_points,
            "held": self._held is not None,
            "ended": self.broken,
        }


def _decode(seen: list[int], call: int, rank: int, world: int, timeout: float) -> Outcome:
    """What every rank's verdicts, reduced with MAX, say."""
    top, blocked, latest, earliest = seen[0], seen[1], seen[2], -seen[3]
    if latest - earliest > timeout * 1000:
        # The first rank in waited past the timeout and left: this collective only
        # completed because a late rank met the one it abandoned.
        return Outcome(
            call=call,
            rank=rank,
            world=world,
            failure=f"a peer entered this safe point {(latest - earliest) / 1000:.1f}s after "
            f"another, past sync_timeout={timeout}s: the rank that waited left the agreement",
        )
    if top == 0:
        return Outcome(call=call, rank=rank, world=world)
    code = top & ((1 << _REASON_BITS) - 1)
    return Outcome(
        call=call,
        rank=rank,
        world=world,
        trip=True,
        origin=world - (top >> _REASON_BITS),
        origin_reason=_CODES[code - 1] if 0 < code <= len(_CODES) else None,
        recover=blocked == 0,
    )


def _device(dist: Any, group: Any) -> torch.device:
    """Where the verdict tensor lives: the CPU unless the group only speaks NCCL."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _why(error: BaseException, timeout: float) -> str:
    text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    kind = type(error).__name__
    if "timed out" in text.lower() or isinstance(error, TimeoutError):
        return f"no answer from a peer within sync_timeout={timeout}s ({kind})"
    return f"the safe point's collective failed ({kind}: {text})"
