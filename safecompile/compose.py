"""``safe_compile``: the guard with the fleet plugged in.

The guard (:mod:`safecompile.guard`) never imports :mod:`safecompile.fleet`: it
declares the seam it needs (:class:`~safecompile.guard.peers.Fleet`), and this module,
above both, fills it with the fleet's parts and defines the public decorator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

from safecompile.base.options import Clock, Options
from safecompile.base.policies import Buckets, Rollback, Shadow, Warmup
from safecompile.fleet import ranks, switch
from safecompile.guard.decorator import decorate
from safecompile.guard.peers import Fleet

__all__ = ["safe_compile"]

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=torch.nn.Module)

_DEFAULT = Options()  # the signature's defaults: the record's (a test compares them)
_FLEET = Fleet(check_group=ranks.check_group, peers=ranks.Agreement, watch=switch.watch)


@overload
def safe_compile(fn: M, /, **options: Any) -> M: ...


@overload
def safe_compile(fn: F, /, **options: Any) -> F: ...


@overload
def safe_compile(fn: None = None, /, **options: Any) -> Callable[[F], F]: ...


def safe_compile(
    fn: Any = None,
    /,
    *,
    backend: str | Callable[..., Any] = _DEFAULT.backend,
    mode: str | None = _DEFAULT.mode,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = _DEFAULT.dynamic,
    fullgraph: bool = _DEFAULT.fullgraph,
    name: str | None = _DEFAULT.name,
    buckets: Buckets | None = _DEFAULT.buckets,
    warmup: Warmup | None = _DEFAULT.warmup,
    shadow: Shadow | None = _DEFAULT.shadow,
    rollback: Rollback = _DEFAULT.rollback,
    rollout: float = _DEFAULT.rollout,
    group: Any = _DEFAULT.group,
    tracer_provider: Any = _DEFAULT.tracer_provider,
    meter_provider: Any = _DEFAULT.meter_provider,
    clock: Clock = _DEFAULT.clock,
    **unknown: object,
) -> Any:
    """Guard ``torch.compile`` on a function, a method or an ``nn.Module``.

    Forms: ``@safe_compile``, ``@safe_compile(...)``, ``safe_compile(fn, ...)`` and
    ``safe_compile(module, ...)`` (the module is guarded in place and returned). A
    ``functools.partial`` or a callable object is guarded like a function. Bad options
    raise :class:`ConfigError` now, not on the first call.

    :param fn: the function, method or ``nn.Module`` to guard; omitted in the
        ``@safe_compile(...)`` form.
    :param backend: ``torch.compile``'s backend: a name or a callable, unchanged.
    :param mode: ``torch.compile``'s mode (``"reduce-overhead"``, ``"max-autotune"``...).
    :param options: ``torch.compile``'s backend options, unchanged.
    :param dynamic: ``torch.compile``'s ``dynamic``, unchanged.
    :param fullgraph: ``torch.compile``'s ``fullgraph``: a graph break is a compile failure.
    :param name: the stable name the kill switch, telemetry and persisted verdicts use;
        default ``module.qualname`` of the function (of the class, plus ``.forward``).
    :param buckets: pad variable dims to a bounded set of sizes (:class:`Buckets`);
        ``None``: no padding.
    :param warmup: compile ahead of traffic (:class:`Warmup`); ``None``: on the first call.
    :param shadow: compare compiled outputs with eager's (:class:`Shadow`); ``None``: off.
    :param rollback: when to leave the compiled path and when to retry (:class:`Rollback`).
    :param rollout: the share of calls sent to the compiled path (0 to 1; the rest run eager).
    :param group: a ``torch.distributed`` ProcessGroup, or ``True`` for the default
        group (resolved at the first safe point): every rank switches together
        (docs/fleet.md).
    :param tracer_provider: OpenTelemetry tracer provider; ``None``: the global one.
    :param meter_provider: OpenTelemetry meter provider; ``None``: the global one.
    :param clock: monotonic seconds, injected by tests (``safecompile.testing.FakeClock``).
    :returns: the guarded callable (for a module: the same module, guarded in place).
    """
    given = locals()  # first: exactly the parameters, one per field of Options
    Options.refuse_unknown(unknown)
    opts = Options(**{option: given[option] for option in Options.names()})
    return decorate(fn, opts, _FLEET)
