"""``safe_compile``: the decorator, its forms, and the guarded callable it returns."""

from __future__ import annotations

import functools
import inspect
import time
import types
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, overload, runtime_checkable

import torch

from safecompile.base.errors import ConfigError
from safecompile.base.options import Clock, CompileOptions
from safecompile.base.policies import Buckets, Rollback, Shadow, Warmup
from safecompile.fleet.ranks import check_group
from safecompile.fleet.switch import watch as watch_disable_source
from safecompile.observe.source import without_our_frames
from safecompile.observe.telemetry import Telemetry
from safecompile.persist.remote import activate as activate_remote_cache
from safecompile.shapes.buckets import Bucketer, Strategy, resolve_strategy

from .backend import backend_name, build_compiler, validate_compile_options
from .controller import Controller, Sink
from .paths import entrypoint, start_background, warm_call

__all__ = ["Guarded", "safe_compile"]

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=torch.nn.Module)

_DEFAULT_SHADOW = Shadow()
_DEFAULT_ROLLBACK = Rollback()
_UNSET: Any = object()


@runtime_checkable
class Guarded(Protocol):
    """What ``safe_compile`` returns for a function: call it like the original;
    ``.safecompile`` is its :class:`~safecompile.guard.controller.Controller`."""

    safecompile: Controller

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def _make_guarded(controller: Controller, wrapped: Callable[..., Any]) -> Guarded:
    guarded = entrypoint(controller)
    functools.update_wrapper(guarded, wrapped)
    guarded.safecompile = controller  # type: ignore[attr-defined]
    return guarded  # type: ignore[return-value]


class _ModuleForward:
    """A guarded module's ``forward`` (an instance attribute, so the class is untouched).

    A deep copy or a pickle of the module gets its class's plain ``forward`` back: the
    copy is an ordinary, unguarded module (guard it again if you want).
    """

    __slots__ = ("__wrapped__", "_call", "safecompile")

    def __init__(self, controller: Controller, forward: Callable[..., Any]) -> None:
        self._call = entrypoint(controller)
        self.safecompile = controller
        self.__wrapped__ = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._call(*args, **kwargs)
        except Exception as exc:
            raise without_our_frames(exc)  # noqa: B904 - eager's error, kept unchained

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        module = self.safecompile._module
        assert module is not None
        return _plain_forward(memo.get(id(module), module))

    def __reduce__(self) -> tuple[Any, ...]:
        module = self.safecompile._module
        assert module is not None
        return (_plain_forward, (module,))

    def __repr__(self) -> str:
        return f"<safe_compile forward of {self.safecompile.name!r}>"


def _plain_forward(module: torch.nn.Module) -> Callable[..., Any]:
    return types.MethodType(type(module).forward, module)


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
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    name: str | None = None,
    buckets: Buckets | None = None,
    warmup: Warmup | None = None,
    shadow: Shadow | None = _DEFAULT_SHADOW,
    rollback: Rollback = _DEFAULT_ROLLBACK,
    rollout: float = 1.0,
    group: Any = None,
    tracer_provider: Any = None,
    meter_provider: Any = None,
    clock: Clock = time.perf_counter,
    **unknown: object,
) -> Any:
    """Guard ``torch.compile`` on a function, a method or an ``nn.Module``.

    Forms: ``@safe_compile``, ``@safe_compile(...)``, ``safe_compile(fn, ...)`` and
    ``safe_compile(module, ...)`` (the module is guarded in place and returned).

    ``backend``, ``mode``, ``options``, ``dynamic`` and ``fullgraph`` go to
    ``torch.compile`` unchanged. ``name`` is the stable name (kill switch, telemetry,
    persisted verdicts). ``buckets`` pads variable dims to bounded sizes; ``warmup``
    compiles before traffic; ``shadow`` compares compiled outputs with eager (``None``:
    off); ``rollback`` says when to leave the compiled path and when to retry;
    ``rollout`` routes that share of calls to the compiled path; ``group`` (a
    ``torch.distributed`` ProcessGroup, or ``True`` for the default group, resolved at
    the first safe point) makes every rank switch together (docs/fleet.md);
    ``tracer_provider`` / ``meter_provider`` default to OpenTelemetry's globals;
    ``clock`` (monotonic seconds) is injected by tests. Bad options raise
    :class:`ConfigError` now, not on the first call.
    """
    given: dict[str, Any] = {
        "backend": backend,
        "mode": mode,
        "options": options,
        "dynamic": dynamic,
        "fullgraph": fullgraph,
        "name": name,
        "buckets": buckets,
        "warmup": warmup,
        "shadow": shadow,
        "rollout": rollout,
        "group": group,
        "tracer_provider": tracer_provider,
        "meter_provider": meter_provider,
        "clock": clock,
        **unknown,
    }
    if rollback is not _DEFAULT_ROLLBACK:
        given["rollback"] = rollback
    config = _Config.build(given)
    if fn is None:
        return functools.partial(_guard, config=config)
    return _guard(fn, config=config)


class _Config:
    """The decorator's options, validated once."""

    _ALLOWED = frozenset(
        {
            "backend",
            "buckets",
            "clock",
            "dynamic",
            "fullgraph",
            "group",
            "meter_provider",
            "mode",
            "name",
            "options",
            "rollback",
            "rollout",
            "shadow",
            "tracer_provider",
            "warmup",
        }
    )

    backend: str | Callable[..., Any]
    mode: str | None
    options: dict[str, Any] | None
    dynamic: bool | None
    fullgraph: bool
    name: str | None
    buckets: Buckets | None
    bucket_strategy: Strategy | None = None  # Buckets(strategy=...) resolved ("auto")
    warmup: Warmup | None
    shadow: Shadow | None
    rollback: Rollback
    rollout: float
    clock: Clock
    group: Any
    tracer_provider: Any
    meter_provider: Any

    @classmethod
    def build(cls, given: dict[str, Any]) -> _Config:
        unknown = sorted(set(given) - cls._ALLOWED)
        if unknown:
            raise ConfigError(
                f"safe_compile() got unknown option(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(cls._ALLOWED))}"
            )
        self = cls()
        self.backend = given.get("backend", "inductor")
        self.mode = given.get("mode")
        self.options = given.get("options")
        self.dynamic = given.get("dynamic")
        self.fullgraph = given.get("fullgraph", False)
        validate_compile_options(
            backend=self.backend,
            mode=self.mode,
            options=self.options,
            dynamic=self.dynamic,
            fullgraph=self.fullgraph,
        )
        self.name = given.get("name")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ConfigError(
                f"safe_compile(name=...) must be a non-empty string, got {self.name!r}"
            )
        self.buckets = _policy(given, "buckets", Buckets, None)
        self.warmup = _policy(given, "warmup", Warmup, None)
        self.shadow = _policy(given, "shadow", Shadow, _DEFAULT_SHADOW)
        self.rollback = _policy(given, "rollback", Rollback, _DEFAULT_ROLLBACK)
        if self.rollback is None:
            raise ConfigError("safe_compile(rollback=None): give a Rollback(...) or leave it out")
        self.rollout = given.get("rollout", 1.0)
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
        self.clock = given.get("clock", time.perf_counter)
        if not callable(self.clock):
            raise ConfigError("safe_compile(clock=...) must be a callable returning seconds")
        if self.buckets is not None:
            self._fit_buckets(given)
        self.group = given.get("group")
        check_group(self.group)
        self.tracer_provider = given.get("tracer_provider")
        self.meter_provider = given.get("meter_provider")
        return self

    def _fit_buckets(self, given: dict[str, Any]) -> None:
        """Make torch.compile's settings agree with the buckets."""
        buckets = self.buckets
        assert buckets is not None
        self.bucket_strategy = resolve_strategy(
            buckets,
            backend=backend_name(self.backend),
            mode=self.mode,
            options=self.options,
            dynamic=self.dynamic,
        )
        graphs = buckets.bucket_count  # the product of each axis's number of sizes
        if "rollback" not in given:
            most = buckets.max_graphs(self.bucket_strategy)
            self.rollback = Rollback(max_recompiles=max(self.rollback.max_recompiles, most))
        elif self.rollback.max_recompiles < graphs:
            raise ConfigError(
                f"safe_compile(rollback=Rollback(max_recompiles={self.rollback.max_recompiles}))"
                f" is below the number of bucket sizes ({graphs}, every combination of "
                "sizes): buckets past the limit would never compile; raise max_recompiles "
                "or use fewer sizes"
            )
        if self.bucket_strategy == "pad":
            if self.dynamic is None:
                # static padded shapes: automatic dynamic would fold the buckets into one
                # dynamic graph, and pay for the padding anyway
                self.dynamic = False
            elif self.dynamic:
                raise ConfigError(
                    "safe_compile(dynamic=True) with Buckets(strategy='pad') pads to static "
                    "sizes for nothing; use Buckets(strategy='dynamic') or dynamic=None"
                )
        elif self.dynamic is False:
            raise ConfigError(
                "safe_compile(dynamic=False) contradicts Buckets(strategy='dynamic'), "
                "which compiles one dynamic graph per range; use dynamic=None"
            )


def _policy(given: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = given.get(name, default)
    if value is not None and not isinstance(value, kind):
        raise ConfigError(
            f"safe_compile({name}=...) must be a {kind.__name__}(...) or None, "
            f"got {type(value).__name__}"
        )
    return value


def _guard(target: Any, *, config: _Config) -> Any:
    if getattr(target, "safecompile", None) is not None:
        raise TypeError(f"{target!r} is already guarded by safe_compile")
    if isinstance(target, torch.nn.Module):
        return _guard_module(target, config)
    if inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target):
        raise TypeError(
            "safe_compile cannot guard async function "
            f"{getattr(target, '__qualname__', target)!r}: "
            "torch.compile traces synchronous code; guard the synchronous function it awaits"
        )
    if inspect.isgeneratorfunction(target):
        raise TypeError(
            f"safe_compile cannot guard generator function "
            f"{getattr(target, '__qualname__', target)!r}: guard the function computing each item"
        )
    if isinstance(target, staticmethod | classmethod):
        raise TypeError(
            "safe_compile goes below @staticmethod/@classmethod, not above: "
            "@staticmethod\n@safe_compile\ndef f(...)"
        )
    if not callable(target):
        raise TypeError(
            f"safe_compile needs a function or an nn.Module, got {type(target).__name__}"
        )
    name = config.name or f"{target.__module__}.{target.__qualname__}"
    controller = _controller(name, target, target, config, module=None)
    guarded = _make_guarded(controller, target)
    _start_warmup(controller, config)
    return guarded


def _guard_module(module: M, config: _Config) -> M:
    cls = type(module)
    name = config.name or f"{cls.__module__}.{cls.__qualname__}.forward"
    forward = module.forward  # the bound forward, as the class defines it
    controller = _controller(name, forward, forward, config, module=module)
    # Instance attributes: type, parameters, buffers and state_dict() keys stay as they are.
    object.__setattr__(module, "forward", _ModuleForward(controller, forward))
    object.__setattr__(module, "safecompile", controller)
    _start_warmup(controller, config)
    return module


def _controller(
    name: str,
    fn: Callable[..., Any],
    signature_of: Callable[..., Any],
    config: _Config,
    *,
    module: torch.nn.Module | None,
) -> Controller:
    activate_remote_cache()  # SAFECOMPILE_REMOTE_CACHE: torch's remote caches, fleet verdicts
    watch_disable_source()  # SAFECOMPILE_DISABLE_SOURCE: the fleet kill switch
    options = CompileOptions(
        backend=config.backend,
        backend_label=backend_name(config.backend),
        mode=config.mode,
        options=config.options,
        dynamic=config.dynamic,
        fullgraph=config.fullgraph,
        compiler=build_compiler(
            config.backend, mode=config.mode, options=config.options, dynamic=config.dynamic
        ),
    )
    sink: Sink = Telemetry(
        function=name,
        backend=options.backend_label,
        tracer_provider=config.tracer_provider,
        meter_provider=config.meter_provider,
    )
    clock: Clock = config.clock
    bucketer = (
        Bucketer(config.buckets, fn, strategy=config.bucket_strategy)
        if config.buckets is not None
        else None
    )
    return Controller(
        name=name,
        fn=fn,
        compile_options=options,
        shadow=config.shadow,
        rollback=config.rollback,
        rollout=float(config.rollout),
        sink=sink,
        clock=clock,
        module=module,
        bucketer=bucketer,
        group=config.group,
        warm_call=warm_call,
    )


def _start_warmup(controller: Controller, config: _Config) -> None:
    warmup = config.warmup
    if warmup is None:
        return
    grad = torch.is_grad_enabled()

    def run() -> None:
        with torch.set_grad_enabled(grad):
            for example in warmup.resolve():
                controller.warmup(*example)

    if warmup.background:
        start_background(controller, run, nice=warmup.nice)
    else:
        run()
