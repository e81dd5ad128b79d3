"""The records that safecompile hands out: states, reasons, events and stats snapshots."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EAGER_REASONS", "Event", "EventKind", "Reason", "State", "Stats"]


class _Named(str, enum.Enum):
    """An enum whose members read as their values (``str(State.CANARY) == "canary"``)."""

    def __str__(self) -> str:
        return str(self.value)


class State(_Named):
    """Where a guarded callable stands."""

    PENDING = "pending"  # nothing compiled yet
    WARMING = "warming"  # compiling; eager serves
    NOTHING_TO_COMPILE = "nothing_to_compile"  # dynamo made no graph of it: eager serves
    MOSTLY_EAGER = "mostly_eager"  # graphs serve, but most recent calls ran eager
    CANARY = "canary"  # compiled, every call shadow-checked
    COMPILED = "compiled"  # every serving graph passed its canary
    UNCHECKED = "unchecked"  # compiled, but a serving graph cannot be shadow-checked
    ROLLED_BACK = "rolled_back"  # eager serves after a trip
    DISABLED = "disabled"  # kill switch


class Reason(_Named):
    """Why a guarded callable (or one shape of it) left the compiled path."""

    COMPILE_ERROR = "compile_error"
    RUNTIME_ERROR = "runtime_error"
    DRIFT = "drift"
    RECOMPILE_LIMIT = "recompile_limit"
    SLOWER = "slower"
    MANUAL = "manual"
    PEER = "peer"  # another rank of the process group tripped (or stopped answering)


class EventKind(_Named):
    """What an :class:`Event` records."""

    COMPILED = "compiled"  # a shape or bucket compiled
    COMPILE_FAILED = "compile_failed"  # compiling a shape or bucket raised
    COMPILING = "compiling"  # a compile still running after ~2 s (said once per compile)
    ROLLBACK = "rollback"  # the callable tripped to eager
    RECOMPILE_LIMIT = "recompile_limit"  # a new shape ran eager: too many graphs
    RETRY = "retry"  # a half-open trial of the compiled path after retry_after
    RECOVERED = "recovered"  # the trial succeeded; compiled serves again
    BREACH = "breach"  # a shadow check found drift
    BUCKET_REJECTED = "bucket_rejected"  # padding changed a bucket's results
    SHADOW_SKIPPED = "shadow_skipped"  # a shadow check could not be made faithfully
    DISABLED = "disabled"  # the kill switch turned the callable off
    ENABLED = "enabled"  # the kill switch turned it back on
    SWITCH_WARNING = "switch_warning"  # the kill switch's value looks like a mistake
    NAME_SHARED = "name_shared"  # another live guarded callable has the same name
    RESET = "reset"
    WARMUP_FAILED = "warmup_failed"  # a warmup example raised in eager too
    SPEED_VERDICT = "speed_verdict"  # a round of the speed verdict: compiled stays or eager won


@dataclass(frozen=True, kw_only=True)
class Event:
    """One thing that happened to a guarded callable.

    ``file``, ``line`` and ``function`` point at the user's own source (never torch's,
    safecompile's or generated code), where one is known.
    """

    kind: EventKind
    reason: Reason | None = None
    time: float = 0.0  # wall-clock seconds since the epoch
    bucket: str | None = None  # the shape or bucket concerned, as text
    error_type: str | None = None  # qualified name of the exception, for errors
    message: str | None = None  # bounded in length; never tensor values
    file: str | None = None
    line: int | None = None
    function: str | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    duration_s: float | None = None  # compile events: seconds spent compiling
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form."""
        out = asdict(self)
        out["kind"] = self.kind.value
        out["reason"] = self.reason.value if self.reason is not None else None
        return out


#: Why an eager call ran eager: the keys of ``Stats.eager_by_reason``, each eager call
#: counted under exactly one (docs/concepts.md, "Who serves").
EAGER_REASONS = (
    "disabled",  # the kill switch
    "rolled_back",  # after a trip, until it recovers
    "warming",  # a warmup or a compile in flight elsewhere
    "rollout",  # the staged rollout routed it eager
    "recompile_limit",  # its graph is past max_recompiles (or torch's own limit)
    "no_graph",  # dynamo made no graph of it: nothing to compile
    "bucket",  # its bucket runs eager: oversize, rejected, or not cut back
    "speed",  # the speed verdict's eager arm
    "check",  # a shadow check answered with eager's result
    "error",  # the compiled path raised; eager answered (or raised the user's error)
    "other",  # none of those: calls caught in flight as the gate opened
)


@dataclass(frozen=True, kw_only=True)
class Stats:
    """A snapshot of a guarded callable's counters. ``calls == compiled_calls + eager_calls``."""

    calls: int = 0
    compiled_calls: int = 0
    eager_calls: int = 0
    compiles: int = 0
    compile_errors: int = 0
    compile_seconds: float = 0.0
    graphs: int = 0
    graph_breaks: int = 0
    recompile_limit_calls: int = 0
    shadow_checks: int = 0
    shadow_breaches: int = 0
    shadow_skipped: int = 0
    # compiled graphs by their check: passed their canary / cannot be checked (each one's
    # event says why) / not yet (canary checks left); with shadow=None, none of these
    graphs_checked: int = 0
    graphs_unchecked: int = 0
    graphs_not_yet_checked: int = 0
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    rollbacks: int = 0
    last_rollback: Event | None = None
    # eager_calls by why, every key of EAGER_REASONS present; they sum to eager_calls
    eager_by_reason: dict[str, int] = field(default_factory=dict)
    # the calls of the last minute or so (since the previous look, when that was longer
    # ago), and the share of them served compiled (None: no calls)
    recent_calls: int = 0
    recent_compiled_share: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form."""
        out = asdict(self)
        out["last_rollback"] = (
            self.last_rollback.to_dict() if self.last_rollback is not None else None
        )
        return out
