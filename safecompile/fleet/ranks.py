"""Ranks that agree (docs/fleet.md): the guard's ``Peers`` over a ``torch.distributed`` group.

A safe point never runs a collective on the user's communicator (it would pair with the
user's own whenever call counts differ): each rank writes ``[index, call, tripped, reason,
ready, entered_ms]`` to the group's c10d store under its own key. Rows at different calls
end the agreement; the lowest tripped rank's reason wins; all ready: all compile again; an
``entered_ms`` spread past the timeout, or an ``ended`` key, says a peer gave up.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from safecompile.base import torchcompat
from safecompile.base.errors import ConfigError
from safecompile.base.forks import in_forked_child
from safecompile.base.model import Event, Reason
from safecompile.guard.peers import Local, Outcome
from safecompile.observe.log import torch_missing
from safecompile.observe.source import without_our_frames

__all__ = ["Agreement", "Local", "Outcome", "check_group"]

# Reason codes on the wire: position + 1 (0: not tripped). Every rank runs the same code.
_CODES: tuple[Reason, ...] = tuple(Reason)


def check_group(group: object) -> None:
    """Validate ``safe_compile(group=...)``: a ProcessGroup, ``True`` or ``None``. ``True``
    is resolved at the first safe point (decorators run before ``init_process_group``)."""
    if group is None:
        return
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


class Agreement:
    """The agreement of one guarded callable with its peers (see the module doc)."""

    def __init__(
        self,
        group: object,
        *,
        every: int,
        timeout: float,
        name: str = "safecompile",
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._group = group  # a ProcessGroup, or True: the default group, resolved lazily
        self.every = every
        self.timeout = timeout
        self._channel = _CHANNELS.next(name)  # decorated in the same order on every rank
        self._wall = wall
        self._calls = itertools.count()  # next() is atomic: one index per call
        self._lock = threading.Lock()  # one safe point at a time
        self._held_lock = threading.Lock()  # never held across a safe point
        self._held: Event | None = None  # the first trip held since the last safe point
        self.broken: str | None = None  # why the agreement ended
        self.safe_points = 0
        self.rank: int | None = None
        self.world: int | None = None

    def holds(self) -> bool:
        """Whether a local trip waits for the next safe point (an agreement, and a group)."""
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
        """``guarded`` with a safe point before every ``every``-th call (any path counts)."""
        calls = self._calls
        every = self.every

        def ranked(*args: Any, **kwargs: Any) -> Any:
            index = next(calls)
            if index % every == 0 and index:
                safe_point(index)
            try:
                return guarded(*args, **kwargs)
            except Exception as exc:  # eager's error, from the user's line: one frame of ours
                raise without_our_frames(exc)  # noqa: B904 - the user's error, kept unchained

        return ranked

    def agree(self, local: Local, call: int) -> Outcome | None:
        """One safe point with every rank (waits up to the timeout); ``None``: no agreement."""
        with self._lock:
            if self.broken is not None:
                return None
            group = self._resolve()
            if group is None:
                return None
            rank, world = int(group.rank()), int(group.size())
            self.rank, self.world = rank, world
            self.safe_points += 1
            index = self.safe_points
            tripped = local.tripped and local.reason in _CODES
            code = _CODES.index(local.reason) + 1 if tripped else 0  # 0: none
            row = [index, call, int(local.tripped), code, int(local.ready), int(self._wall() * 1e3)]
            try:
                rows = self._exchange(group, index, row)
                outcome = _decode(rows, index, call, rank, world, self.timeout)
            except _PeerLeft as left:
                why = f"this rank reached safe point {index} after another had left the agreement"
                outcome = Outcome(call=call, rank=rank, world=world, failure=f"{why} ({left})")
            except Exception as exc:  # a dead peer, a timeout, a store torn down
                failure = _why(exc, self.timeout)
                outcome = Outcome(call=call, rank=rank, world=world, failure=failure)
            self.broken = outcome.failure
            if outcome.failure is not None:
                self._leave(group, outcome.failure)  # no-op when a peer left first
            return outcome

    def _resolve(self) -> Any:
        group = self._group
        if group is not True:
            return group
        dist = _dist()
        if dist is None or not dist.is_initialized():
            return None
        self._group = dist.group.WORLD
        return self._group

    def _exchange(self, group: Any, index: int, row: list[int]) -> list[list[int]]:
        """Every rank's row of safe point ``index`` through the store; raises if a peer left."""
        store, prefix = self._store(group)
        rank, world = int(group.rank()), int(group.size())
        ended = f"{prefix}/ended"
        _left(store, ended)
        store.set(f"{prefix}/{index}/{rank}", json.dumps(row))
        keys = [f"{prefix}/{index}/{peer}" for peer in range(world)]
        self._await(store, keys, ended)
        rows = [json.loads(store.get(key)) for key in keys]
        if index > 1:  # every rank has read the previous rows: they wrote these after
            with contextlib.suppress(Exception):
                store.delete_key(f"{prefix}/{index - 1}/{rank}")
        return [[int(value) for value in found] for found in rows]

    def _await(self, store: Any, keys: list[str], ended: str) -> None:
        """Wait until every key is there (at most ``timeout`` seconds), or a peer left."""
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        while not store.check(keys):
            _left(store, ended)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within sync_timeout={self.timeout}s")
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)

    def _leave(self, group: Any, why: str) -> None:
        """Tell the peers this rank left (best effort: the store itself may have failed)."""
        with contextlib.suppress(Exception):
            store, prefix = self._store(group)
            if not store.check([f"{prefix}/ended"]):
                store.set(f"{prefix}/ended", f"rank {group.rank()}: {why}")

    def _store(self, group: Any) -> tuple[Any, str]:
        """The store the process group was built on, and this agreement's key prefix."""
        dist = _dist()
        ranks = dist.get_process_group_ranks(group)
        prefix = f"safecompile/{self._channel}/{'-'.join(str(r) for r in ranks)}"
        store = torchcompat.default_store()
        if isinstance(store, torchcompat.Missing):
            torch_missing(store)
            raise RuntimeError(f"no {store.name} in this torch")
        return store, prefix

    def report(self) -> dict[str, Any]:
        """The agreement's state, for ``report()``."""
        return {
            "rank": self.rank,
            "world": self.world,
            "channel": self._channel,
            "sync_every": self.every,
            "sync_timeout": self.timeout,
            "safe_points": self.safe_points,
            "held": self._held is not None,
            "ended": self.broken,
        }


class _PeerLeft(Exception):
    """A peer ended the agreement before this rank's safe point completed."""


def _left(store: Any, ended: str) -> None:
    """Raise :class:`_PeerLeft` when a peer has ended the agreement."""
    if store.check([ended]):
        raise _PeerLeft(bytes(store.get(ended)).decode(errors="replace"))


class _Channels:
    """The agreements made in this process, counted by name: ranks decorate in the same
    order, so the n-th of a name is the same channel on every rank."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.made: Counter[str] = Counter()

    def next(self, name: str) -> str:
        """``name#n``, the n-th of that name."""
        with self.lock:
            self.made[name] += 1
            return f"{name}#{self.made[name]}"

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork


_CHANNELS = _Channels()
in_forked_child(_CHANNELS.after_fork_in_child)


def _decode(
    rows: list[list[int]], index: int, call: int, rank: int, world: int, timeout: float
) -> Outcome:
    """What every rank's row of one safe point says (the same on every rank)."""
    same = Outcome(call=call, rank=rank, world=world)
    calls = [row[1] for row in rows]
    if any(row[0] != index for row in rows) or len(set(calls)) > 1:
        seen = ", ".join(f"rank {peer} at call {at}" for peer, at in enumerate(calls))
        return replace(
            same,
            failure=f"the ranks reached safe point {index} at different calls ({seen}): "
            "their guarded calls differ (an extra call, or sync() on some ranks only), "
            "so their verdicts cannot be paired",
        )
    entered = [row[5] for row in rows]
    spread = max(entered) - min(entered)
    if spread > timeout * 1000:
        # the first rank in waited past the timeout and left before saying so
        return replace(
            same,
            failure=f"a peer entered this safe point {spread / 1000:.1f}s after another, "
            f"past sync_timeout={timeout}s: the rank that waited left the agreement",
        )
    tripped = [(peer, row) for peer, row in enumerate(rows) if row[2]]
    if not tripped:
        return same
    origin, row = tripped[0]
    return replace(
        same,
        trip=True,
        origin=origin,
        origin_reason=_CODES[row[3] - 1] if 0 < row[3] <= len(_CODES) else None,
        recover=all(found[2] and found[4] for found in rows),
    )


def _why(error: BaseException, timeout: float) -> str:
    text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    kind = type(error).__name__
    if "timed out" in text.lower() or "timeout" in text.lower() or isinstance(error, TimeoutError):
        return f"no answer from a peer within sync_timeout={timeout}s ({kind})"
    return f"the safe point's store failed ({kind}: {text})"
