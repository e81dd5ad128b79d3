"""The body of ``safe_compile`` (:mod:`safecompile.compose`): its forms, options resolved,
modules guarded in place, and the guarded callable it returns."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from safecompile.base.errors import ConfigError
from safecompile.base.options import Options
from safecompile.base.policies import Buckets
from safecompile.observe.telemetry import Telemetry
from safecompile.persist.remote import activate as activate_remote_cache
from safecompile.shapes.buckets import Bucketer, Strategy, resolve_strategy

from ._controller import Controller
from ._engine import Engine
from ._hot import entrypoint
from .backend import build_compiler, validate_compile_options
from .peers import Fleet, Peers

__all__ = ["Guarded", "decorate"]

M = TypeVar("M", bound=torch.nn.Module)


@runtime_checkable
class Guarded(Protocol):
    """What ``safe_compile`` returns for a function: call it like the original;
    ``.safecompile`` is its :class:`~safecompile.guard._controller.Controller`."""

    safecompile: Controller

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class _ModuleForward(functools.partial[Any]):
    """A guarded module's ``forward`` (an instance attribute, so the class is untouched).

    A ``functools.partial`` of the guarded function with nothing bound: ``Module.__call__``
    reaches the guarded function through C, without a frame of ours. A deep copy or a
    pickle of the module gets its class's plain ``forward`` back: the copy is an ordinary,
    unguarded module (guard it again if you want).
    """

    safecompile: Controller
    __wrapped__: Callable[..., Any]

    def __new__(cls, controller: Controller, forward: Callable[..., Any]) -> _ModuleForward:
        self = super().__new__(cls, entrypoint(controller._engine))
        self.safecompile = controller
        self.__wrapped__ = forward
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        module = self.safecompile._engine.module
        assert module is not None
        return _plain_forward(memo.get(id(module), module))

    def __reduce__(self) -> tuple[Any, ...]:
        module = self.safecompile._engine.module
        assert module is not None
        return (_plain_forward, (module,))

    def __repr__(self) -> str:
        return f"<safe_compile forward of {self.safecompile.name!r}>"


def _plain_forward(module: torch.nn.Module) -> Callable[..., Any]:
    return types.MethodType(type(module).forward, module)


def decorate(fn: Any, opts: Options, fleet: Fleet) -> Any:
    """``safe_compile``'s body, with the fleet plugged in (:mod:`safecompile.compose`):
    the options checked, then ``fn`` guarded, or a decorator when ``fn`` is ``None``."""
    validate_compile_options(
        backend=opts.backend,
        mode=opts.mode,
        options=opts.options,
        dynamic=opts.dynamic,
        fullgraph=opts.fullgraph,
    )
    fleet.check_group(opts.group)
    strategy = None
    if opts.buckets is not None:
        opts, strategy = _fit_buckets(opts, opts.buckets)
    if fn is None:
        return functools.partial(_guard, opts=opts, strategy=strategy, fleet=fleet)
    return _guard(fn, opts=opts, strategy=strategy, fleet=fleet)


def _fit_buckets(opts: Options, buckets: Buckets) -> tuple[Options, Strategy]:
    """Make torch.compile's settings and the recompile limit agree with the buckets."""
    strategy = resolve_strategy(
        buckets,
        backend=opts.backend_label,
        mode=opts.mode,
        options=opts.options,
        dynamic=opts.dynamic,
    )
    graphs = buckets.bucket_count  # the product of each axis's number of sizes
    limit = opts.rollback.max_recompiles
    if limit is None:
        limit = max(opts.rollback.recompile_limit, buckets.max_graphs(strategy))
    elif limit < graphs:
        raise ConfigError(
            f"safe_compile(rollback=Rollback(max_recompiles={limit})) is below the number of "
            f"bucket sizes ({graphs}, every combination of sizes): buckets past the limit "
            "would never compile; raise max_recompiles or use fewer sizes"
        )
    dynamic = opts.dynamic
    if strategy == "pad":
        if dynamic:
            raise ConfigError(
                "safe_compile(dynamic=True) with Buckets(strategy='pad') pads to static "
                "sizes for nothing; use Buckets(strategy='dynamic') or dynamic=None"
            )
        # static padded shapes: automatic dynamic would fold the buckets into one
        # dynamic graph, and pay for the padding anyway
        dynamic = False
    elif dynamic is False:
        raise ConfigError(
            "safe_compile(dynamic=False) contradicts Buckets(strategy='dynamic'), "
            "which compiles one dynamic graph per range; use dynamic=None"
        )
    rollback = dataclasses.replace(opts.rollback, max_recompiles=limit)
    return dataclasses.replace(opts, dynamic=dynamic, rollback=rollback), strategy


def _guard(target: Any, *, opts: Options, strategy: Strategy | None, fleet: Fleet) -> Any:
    if getattr(target, "safecompile", None) is not None:
        raise TypeError(f"{target!r} is already guarded by safe_compile")
    if isinstance(target, torch.nn.Module):
        return _guard_module(target, opts, strategy, fleet)
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
    name = opts.name or _name_of(target)
    controller = _controller(name, target, opts, strategy, fleet, module=None)
    guarded = functools.update_wrapper(entrypoint(controller._engine), target)
    guarded.safecompile = controller  # type: ignore[attr-defined]
    controller._start_warmup()
    return guarded


def _name_of(target: Callable[..., Any]) -> str:
    """The default name: the function's (through ``functools.partial``), or a callable
    object's class's."""
    inner = target
    while isinstance(inner, functools.partial):
        inner = inner.func
    if not hasattr(inner, "__qualname__"):  # a callable object
        inner = type(inner)
    return f"{getattr(inner, '__module__', None) or '__main__'}.{inner.__qualname__}"


def _guard_module(module: M, opts: Options, strategy: Strategy | None, fleet: Fleet) -> M:
    cls = type(module)
    name = opts.name or f"{cls.__module__}.{cls.__qualname__}.forward"
    forward = module.forward  # the bound forward, as the class defines it
    controller = _controller(name, forward, opts, strategy, fleet, module=module)
    # Instance attributes: type, parameters, buffers and state_dict() keys stay as they are.
    object.__setattr__(module, "forward", _ModuleForward(controller, forward))
    object.__setattr__(module, "safecompile", controller)
    controller._start_warmup()
    return module


def _controller(
    name: str,
    fn: Callable[..., Any],
    opts: Options,
    strategy: Strategy | None,
    fleet: Fleet,
    *,
    module: torch.nn.Module | None,
) -> Controller:
    activate_remote_cache()  # SAFECOMPILE_REMOTE_CACHE: torch's remote caches, fleet verdicts
    fleet.watch()  # SAFECOMPILE_DISABLE_SOURCE: the fleet kill switch
    sink = Telemetry(
        function=name,
        backend=opts.backend_label,
        tracer_provider=opts.tracer_provider,
        meter_provider=opts.meter_provider,
    )
    compiler = build_compiler(
        opts.backend, mode=opts.mode, options=opts.options, dynamic=opts.dynamic
    )
    bucketer = Bucketer(opts.buckets, fn, strategy=strategy) if opts.buckets is not None else None
    rollback = opts.rollback
    peers: Peers | None = None  # the agreement with the ranks of ``group=``
    if opts.group is not None:
        every, timeout = rollback.sync_every, rollback.sync_timeout
        peers = fleet.peers(opts.group, every=every, timeout=timeout, name=name)
    engine = Engine(
        name=name,
        fn=fn,
        opts=opts,
        compiler=compiler,
        sink=sink,
        module=module,
        bucketer=bucketer,
        peers=peers,
    )
    return Controller(engine)
