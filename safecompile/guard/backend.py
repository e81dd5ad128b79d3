"""Checking ``torch.compile``'s own options early, and building the compiler we wrap:
the same compiler object ``torch.compile`` would build from ``mode``/``options``, so they
keep working behind our backend (:mod:`._graph_backend`)."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from safecompile.base import torchcompat
from safecompile.base.errors import ConfigError
from safecompile.base.options import CompilerFn, backend_name
from safecompile.observe.log import torch_missing

if TYPE_CHECKING:
    pass

__all__ = [
    "backend_name",
    "build_compiler",
    "compile_function",
    "own_frame",
    "validate_compile_options",
]


def _validate_backend(backend: object) -> None:
    if backend == "inductor":
        return  # torch.compile's own: listing the others imports them all (~0.3 s a process)
    if isinstance(backend, str):
        known = sorted(torch.compiler.list_backends(exclude_tags=()))
        if backend not in known:
            raise ConfigError(
                f"safe_compile(backend={backend!r}) is not a known backend; "
                f"allowed: {', '.join(known)}, or a callable (gm, example_inputs) -> callable"
            )
    elif not callable(backend):
        raise ConfigError(
            "safe_compile(backend=...) must be a backend name or a callable "
            f"(gm, example_inputs) -> callable, got {type(backend).__name__}"
        )


def _validate_mode(backend: object, mode: object) -> None:
    if mode is None:
        return
    modes = sorted(torchcompat.mode_options())
    if not isinstance(mode, str) or mode not in modes:
        raise ConfigError(f"safe_compile(mode={mode!r}) must be None or one of: {', '.join(modes)}")
    if backend != "inductor" and mode != "default":
        raise ConfigError(
            f"safe_compile(mode={mode!r}) only applies to backend='inductor', "
            f"got backend={backend_name(backend)!r}"
        )


def _validate_options(backend: object, mode: object, options: object) -> None:
    if options is None:
        return
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigError(
            "safe_compile(options=...) must be a dict of option name to value, "
            f"got {type(options).__name__}"
        )
    if mode is not None:
        raise ConfigError(
            "safe_compile(mode=..., options=...): give one of them, not both "
            "(torch.compile refuses both)"
        )
    if backend == "inductor":
        known_options = torchcompat.inductor_options()
        if isinstance(known_options, torchcompat.Missing):
            torch_missing(known_options)
            return
        special = {"guard_filter_fn", "use_aoti"}
        unknown = sorted(k for k in options if k not in known_options and k not in special)
        if unknown:
            raise ConfigError(
                f"safe_compile(options=...) has unknown inductor options: {', '.join(unknown)} "
                "(torch._inductor.list_options() lists the allowed ones)"
            )


def validate_compile_options(
    *,
    backend: object,
    mode: object,
    options: object,
    dynamic: object,
    fullgraph: object,
) -> None:
    """Refuse what ``torch.compile`` would refuse later (or silently ignore), now."""
    _validate_backend(backend)
    _validate_mode(backend, mode)
    _validate_options(backend, mode, options)
    if dynamic is not None and not isinstance(dynamic, bool):
        raise ConfigError(f"safe_compile(dynamic=...) must be None, True or False, got {dynamic!r}")
    if not isinstance(fullgraph, bool):
        raise ConfigError(f"safe_compile(fullgraph=...) must be True or False, got {fullgraph!r}")


def build_compiler(
    backend: str | Callable[..., Any],
    *,
    mode: str | None,
    options: Mapping[str, Any] | None,
    dynamic: bool | None,
) -> CompilerFn:
    """The compiler ``torch.compile(backend=..., mode=..., options=...)`` would use."""
    # guard_filter_fn is torch.compile's own option, not the compiler's
    opts = None if options is None else {k: v for k, v in options.items() if k != "guard_filter_fn"}
    if mode is None and opts is None:
        mode = "default"
    compiler = torchcompat.compiler_wrapper(backend, mode, opts, dynamic)
    if isinstance(compiler, torchcompat.Missing):
        torch_missing(compiler)
        return torchcompat.lookup_backend(backend)
    return compiler


def compile_function(
    fn: Callable[..., Any],
    *,
    backend: CompilerFn,
    dynamic: bool | None,
    fullgraph: bool,
    recompile_limit: int,
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    """``torch.compile`` with a per-function recompile limit and isolated cache entries,
    where this torch has them (2.13 does; older releases fall back to the global limit)."""
    extra: dict[str, Any] = {"options": options} if options else {}
    limits = torchcompat.per_function_limit(recompile_limit)
    if isinstance(limits, torchcompat.Missing):
        torch_missing(limits)
    else:
        extra.update(limits)
    compile_ = torchcompat.torch_compile()  # torch's own, also under safecompile.install()
    compiled: Callable[..., Any] = compile_(
        fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph, **extra
    )
    return compiled


def own_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind a top frame whose code object no other compiled callable shares.

    torch caches graphs on the code object it compiles; a bound method (a module's
    ``forward``) is compiled through a frame shared with every other such callable
    (``wrap_inline``'s ``inner``) or every instance of the class. With a frame of its own,
    ``reset()`` drops this callable's graphs and never another's.
    """
    if inspect.isfunction(fn):
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    name = str(getattr(fn, "__name__", "call"))
    code = call.__code__.replace(co_name=name, co_qualname=f"{name}[safecompile]")
    own = types.FunctionType(code, call.__globals__, name, None, call.__closure__)
    own.__qualname__ = code.co_qualname
    return own
