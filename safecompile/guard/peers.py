"""The seam the fleet plugs into: what the guard needs from other processes.

The guard never imports :mod:`safecompile.fleet`; it declares here what it uses, and
:mod:`safecompile.compose` hands the fleet's implementation in. A callable without
``group=`` has no :class:`Peers` at all (``None``): its trips apply on their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from safecompile.base.model import Event, Reason

__all__ = ["Fleet", "Local", "MakePeers", "Outcome", "Peers"]


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


class Peers(Protocol):
    """One guarded callable's agreement with its peers on trips (``group=``)."""

    broken: str | None  # why the agreement ended; set, it is over for this process

    def holds(self) -> bool:
        """Whether a local trip waits for the next safe point (else it applies now)."""
        ...

    def hold(self, event: Event) -> None:
        """Keep a local trip for the next safe point."""
        ...

    def take_held(self) -> Event | None:
        """The held trip, forgotten."""
        ...

    def counting(
        self, guarded: Callable[..., Any], safe_point: Callable[[int], None]
    ) -> Callable[..., Any]:
        """``guarded`` with ``safe_point(call)`` before every ``sync_every``-th call."""
        ...

    def agree(self, local: Local, call: int) -> Outcome | None:
        """One safe point with every peer (bounded); ``None`` when there is no agreement."""
        ...

    def report(self) -> dict[str, Any]:
        """The agreement's state, for ``report()``."""
        ...


class MakePeers(Protocol):
    def __call__(self, group: object, *, every: int, timeout: float, name: str) -> Peers: ...


@dataclass(frozen=True, slots=True)
class Fleet:
    """What the decorator takes from the fleet layer (:mod:`safecompile.compose` builds it)."""

    check_group: Callable[[object], None]  # at decoration: ConfigError for a bad group=
    peers: MakePeers  # one agreement per guarded callable with group=
    watch: Callable[[], None]  # at each guarded callable: the fleet kill switch's source
