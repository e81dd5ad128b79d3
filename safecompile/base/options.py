"""The decorator's options, declared once (:class:`Options`), as a record every layer reads.

From it derive the decorator's signature and the table in docs/configuration.md (tests
compare both), the unknown-option check, the checks that need no layer above this one,
and the key of persisted verdicts (:meth:`Options.verdict_key`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ConfigError, unknown_options
from .policies import Buckets, Rollback, Shadow, Warmup, compare_label

__all__ = ["Clock", "CompilerFn", "Options", "backend_name"]

Clock = Callable[[], float]
"""Monotonic seconds (``time.perf_counter``; tests inject fake clocks)."""

CompilerFn = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]
"""A ``torch.compile`` backend: ``(gm, example_inputs) -> callable``."""

_KEY = {"key": True}  # a field persisted verdicts are keyed on
_SHADOW = Shadow()  # policies are frozen: one default instance serves every record
_ROLLBACK = Rollback()


def backend_name(backend: object) -> str:
    """A readable name for a backend given as a name or a callable."""
    if isinstance(backend, str):
        return backend
    name = getattr(backend, "__name__", None) or type(backend).__name__
    return str(name)


@dataclass(frozen=True, kw_only=True)
class Options:
    """Every option of ``safe_compile`` (see its docstring and docs/configuration.md).

    The first five are handed to ``torch.compile``. A record the decorator resolved
    (buckets fitted) is what the controller holds.
    """

    backend: str | Callable[..., Any] = field(default="inductor", metadata=_KEY)
    mode: str | None = field(default=None, metadata=_KEY)
    options: Mapping[str, Any] | None = field(default=None, metadata=_KEY)
    dynamic: bool | None = field(default=None, metadata=_KEY)
    fullgraph: bool = field(default=False, metadata=_KEY)
    name: str | None = None
    buckets: Buckets | None = None
    warmup: Warmup | None = None
    shadow: Shadow | None = _SHADOW
    rollback: Rollback = _ROLLBACK
    rollout: float = 1.0
    group: Any = None
    tracer_provider: Any = None
    meter_provider: Any = None
    clock: Clock = time.perf_counter

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ConfigError(
                f"safe_compile(name=...) must be a non-empty string, got {self.name!r}"
            )
        _check_policy("buckets", self.buckets, Buckets)
        _check_policy("warmup", self.warmup, Warmup)
        _check_policy("shadow", self.shadow, Shadow)
        if self.rollback is None:
            raise ConfigError("safe_compile(rollback=None): give a Rollback(...) or leave it out")
        _check_policy("rollback", self.rollback, Rollback)
        rollout = self.rollout
        if (
            isinstance(rollout, bool)
            or not isinstance(rollout, int | float)
            or not 0.0 <= rollout <= 1.0
        ):
            raise ConfigError(
                f"safe_compile(rollout=...) must be a fraction from 0.0 to 1.0 of calls to "
                f"route to the compiled path, got {rollout!r}"
            )
        _check_clock(self.clock)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def refuse_unknown(cls, given: Mapping[str, object]) -> None:
        """Raise :class:`ConfigError` for options ``safe_compile`` does not take, with a
        did-you-mean for a misspelled one."""
        if given:
            raise unknown_options("safe_compile()", given, cls.names())

    @property
    def backend_label(self) -> str:
        """The backend's name (a callable's ``__name__``)."""
        return backend_name(self.backend)

    def verdict_key(self, *, checks: bool) -> dict[str, Any]:
        """What a persisted verdict is keyed on besides code and versions: the fields
        marked ``key`` (torch.compile's options); with ``checks``, the ``Buckets`` policy
        and the drift tolerances too (a padding verdict depends on both)."""
        keyed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata}
        extra: dict[str, Any] = {"fullgraph": keyed.pop("fullgraph")}
        if checks:
            shadow = self.shadow
            extra["buckets"] = repr(self.buckets) if self.buckets is not None else None
            extra["tolerances"] = repr((shadow.rtol, shadow.atol)) if shadow is not None else None
            if shadow is not None and shadow.compare is not None:
                extra["compare"] = compare_label(shadow.compare)
        return keyed | {"backend": self.backend_label, "extra": extra}


def _check_policy(name: str, value: object, kind: type) -> None:
    if value is not None and not isinstance(value, kind):
        raise ConfigError(
            f"safe_compile({name}=...) must be a {kind.__name__}(...) or None, "
            f"got {type(value).__name__}"
        )


def _check_clock(clock: object) -> None:
    if not callable(clock):
        raise ConfigError("safe_compile(clock=...) must be a callable returning seconds")
    try:
        now = clock()
    except Exception as exc:
        raise ConfigError(
            f"safe_compile(clock=...) raised {type(exc).__name__} when read: it must be a "
            "callable returning monotonic seconds as a float"
        ) from exc
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise ConfigError(
            f"safe_compile(clock=...) must return monotonic seconds as a finite float, got {now!r}"
        )
