"""Every private torch name safecompile uses, reached here and nowhere else.

torch renames, moves and drops its ``torch._*`` names between releases without notice.
Each one safecompile relies on is looked up in this module, lazily, with the torch
versions whose source it was checked against (``checked:`` on each accessor), so a torch
upgrade is one file to read.

A name the installed torch lacks fails neither ``import safecompile`` nor a compile: its
accessor returns a :class:`Missing` marker (falsy, naming the torch name and what
degrades without it) and the caller carries on without that feature. This module logs
nothing (it sits below :mod:`safecompile.observe`); callers hand the marker to
:func:`safecompile.observe.log.torch_missing`, which says so once per name.

Versions: ``checked: 2.9.1, 2.13.0`` means the name, its signature and the behaviour
relied on were read in those versions' source and exercised by the tests that run there.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

# torch's pytree helpers (``tree_map_only``, ``tree_flatten``, ``tree_leaves``): private, but
# loaded by ``import torch`` itself and needed to copy and compare nested outputs, so they
# are imported here, not looked up. checked: 2.9.1, 2.13.0 (no public ``torch.utils.pytree``
# in either).
from torch.utils import _pytree as pytree

__all__ = [
    "CACHE_SETTINGS",
    "DYNAMIC_MARKS",
    "FAKE_TENSOR_LOGGER",
    "NEW_GLOBAL",
    "REMOTE_CACHE_FLAGS",
    "Missing",
    "SideEffects",
    "close_symbolic_trace_window",
    "closure_vars",
    "compile_callbacks",
    "compile_errors",
    "compile_lock",
    "compiler_wrapper",
    "config_entry",
    "config_settings",
    "default_cache_dir",
    "default_store",
    "drop_local_cache_path",
    "dynamo_dir",
    "eager_backward",
    "frame_code",
    "inductor_options",
    "is_op_overload",
    "is_tensor_property",
    "lookup",
    "lookup_backend",
    "mark_dynamic",
    "mode_options",
    "per_function_limit",
    "pytree",
    "remote_cache_classes",
    "reset_code",
    "side_effects",
    "source_value",
    "undisabled",
]


@dataclass(frozen=True, slots=True)
class Missing:
    """A private torch name the installed torch lacks, and what goes without it."""

    name: str  # the dotted torch name, e.g. ``torch._dynamo.reset_code``
    effect: str  # what safecompile does without it, in plain words (a short line)

    def __bool__(self) -> bool:
        return False


_FOUND: dict[str, Any] = {}  # names found that stay what they are: modules, classes, functions
_STABLE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)


def lookup(dotted: str) -> Any:
    """The object ``dotted`` names (``torch._dynamo.exc.Unsupported``), or ``None``.

    Imports the longest importable module prefix, then reads the rest as attributes;
    never raises (an import that fails for any reason counts as missing). Modules,
    classes and functions found are remembered (~0.1 µs again, not ~12 µs); values such
    as config flags are read afresh each time.
    """
    found = _FOUND.get(dotted)
    if found is not None:
        return found
    found = _resolve(dotted)
    if isinstance(found, _STABLE):
        _FOUND[dotted] = found
    return found


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


# ---------------------------------------------------------------- compiling


def compile_errors() -> tuple[type[BaseException], ...]:
    """Exceptions raised while dynamo traces or a backend compiles (not by compiled code).

    checked: 2.9.1, 2.13.0 (``torch._dynamo.exc.TorchDynamoException``,
    ``FailOnRecompileLimitHit``). Either one missing is left out of the tuple.
    """
    names = ("TorchDynamoException", "FailOnRecompileLimitHit")
    found = (lookup(f"torch._dynamo.exc.{name}") for name in names)
    return tuple(t for t in found if isinstance(t, type) and issubclass(t, BaseException))


def eager_backward() -> contextlib.AbstractContextManager[Any] | Missing:
    """A context in which AOTAutograd compiles the backward graph with the forward one.

    checked: 2.13.0 (``torch._functorch.config.force_non_lazy_backward_lowering``; absent in
    2.9.1). Without it the backward graph compiles lazily, at ``.backward()``.
    """
    config = lookup("torch._functorch.config")
    entries = getattr(config, "_config", None)
    if config is None or entries is None or "force_non_lazy_backward_lowering" not in entries:
        return Missing(
            "torch._functorch.config.force_non_lazy_backward_lowering",
            "a backward graph compiles at .backward(), unguarded",
        )
    patched: contextlib.AbstractContextManager[Any] = config.patch(
        force_non_lazy_backward_lowering=True
    )
    return patched


def per_function_limit(limit: int) -> dict[str, Any] | Missing:
    """``torch.compile`` keywords that give one function its own recompile limit and cache
    entries of its own (public names, but new: they decide whether graphs compile at all).

    checked: 2.13.0 (``recompile_limit=``, ``isolate_recompiles=``; both absent in 2.9.1,
    where every ``torch.compile`` of one code object shares dynamo's global limit of 8).
    """
    params = inspect.signature(torch.compile).parameters
    if "recompile_limit" not in params or "isolate_recompiles" not in params:
        return Missing(
            "torch.compile(recompile_limit=, isolate_recompiles=)",
            "graphs past torch's global recompile limit run eager",
        )
    return {"recompile_limit": limit, "isolate_recompiles": True}


def compiler_wrapper(
    backend: str | Callable[..., Any],
    mode: str | None,
    options: dict[str, Any] | None,
    dynamic: bool | None,
) -> Callable[..., Any] | Missing:
    """The compiler ``torch.compile(backend=..., mode=..., options=...)`` builds itself.

    checked: 2.9.1, 2.13.0 (``torch._TorchCompileInductorWrapper(mode, options, dynamic)``,
    ``torch._TorchCompileWrapper(backend, mode, options, dynamic)``).
    """
    if backend == "inductor":
        cls = lookup("torch._TorchCompileInductorWrapper")
        if cls is not None:
            return cls(mode, options, dynamic)  # type: ignore[no-any-return]
    else:
        cls = lookup("torch._TorchCompileWrapper")
        if cls is not None:
            return cls(backend, mode, options, dynamic)  # type: ignore[no-any-return]
    name = "_TorchCompileInductorWrapper" if backend == "inductor" else "_TorchCompileWrapper"
    return Missing(f"torch.{name}", "mode= and options= are not applied to the backend")


def lookup_backend(backend: str | Callable[..., Any]) -> Callable[..., Any]:
    """A backend given by name or as a callable, as a callable.

    checked: 2.9.1, 2.13.0 (``torch._dynamo.lookup_backend``). Without it a callable is
    returned as it is and a name raises ``ValueError``.
    """
    find = lookup("torch._dynamo.lookup_backend")
    if find is not None:
        return find(backend)  # type: ignore[no-any-return]
    if callable(backend):
        return backend
    raise ValueError(f"cannot look backend {backend!r} up in this torch")


def mode_options(mode: str | None = None) -> dict[str, Any]:
    """inductor's modes (``mode=None``) or the options one mode sets; ``{}`` if unknown.

    checked: 2.9.1, 2.13.0 (``torch._inductor.list_mode_options``).
    """
    listing = lookup("torch._inductor.list_mode_options")
    if listing is None:
        return {}
    return dict(listing(mode) if mode is not None else listing())


def inductor_options() -> frozenset[str] | Missing:
    """The option names ``torch.compile(options=...)`` accepts for inductor.

    checked: 2.9.1, 2.13.0 (``torch._inductor.list_options``).
    """
    listing = lookup("torch._inductor.list_options")
    if listing is None:
        return Missing("torch._inductor.list_options", "inductor options are not checked early")
    return frozenset(listing())


def compile_lock() -> Any:
    """Dynamo's global compile lock (it guards torch's cache-artifact list), or ``None``.

    checked: 2.9.1, 2.13.0 (``torch._dynamo.convert_frame.compile_lock``, an ``RLock``).
    """
    return lookup("torch._dynamo.convert_frame.compile_lock")


# ---------------------------------------------------------------- dynamo's state


def reset_code(code: types.CodeType) -> Missing | None:
    """Drop the graphs dynamo caches on one code object.

    checked: 2.9.1, 2.13.0 (``torch._dynamo.reset_code``). Without it they stay cached
    (torch's recompile limit bounds them).
    """
    drop = lookup("torch._dynamo.reset_code")
    if drop is None:
        return Missing("torch._dynamo.reset_code", "reset() keeps torch's cached graphs")
    drop(code)
    return None


def default_store() -> Any:
    """The c10d store ``init_process_group`` made, which every rank of the job reaches:
    ranks agree through it, never through the user's communicator.

    checked: 2.9.1, 2.13.0 (``torch.distributed.distributed_c10d._get_default_store``,
    the same in both). Without it, a :class:`Missing`: the ranks' safe points fail and
    every rank leaves the agreement (reason ``peer``), eager from then on.
    """
    found = lookup("torch.distributed.distributed_c10d._get_default_store")
    if found is None:
        return Missing(
            "torch.distributed.distributed_c10d._get_default_store",
            "ranks cannot agree: a rank of a process group serves eager at its first safe point",
        )
    return found()


#: The attributes ``torch._dynamo.mark_dynamic`` sets on a tensor.
#: checked: 2.9.1, 2.13.0 (a name missing in a version is simply not set there).
DYNAMIC_MARKS = (
    "_dynamo_dynamic_indices",
    "_dynamo_dynamic_range",
    "_dynamo_hint_overrides",
    "_specialize_on",
    "_has_dynamo_dim_marking",
)


def mark_dynamic(tensor: torch.Tensor, dim: int, low: int, high: int) -> Missing | None:
    """Mark ``tensor``'s ``dim`` dynamic between ``low`` and ``high``.

    checked: 2.9.1, 2.13.0 (``torch._dynamo.mark_dynamic(t, dim, min=, max=)``).
    """
    mark = lookup("torch._dynamo.mark_dynamic")
    if mark is None:
        return Missing("torch._dynamo.mark_dynamic", "dynamic ranges are left to torch")
    mark(tensor, dim, min=low, max=high)
    return None


def compile_callbacks() -> Any:
    """dynamo's compile-callback handler (``register_start_callback``), or ``None``.

    checked: 2.9.1, 2.13.0 (``torch._dynamo.callback.callback_handler``).
    """
    return lookup("torch._dynamo.callback.callback_handler")


def frame_code() -> types.CodeType | None:
    """The code object dynamo is tracing on this thread, or ``None`` outside a trace.

    checked: 2.9.1, 2.13.0 (``torch._dynamo.symbolic_convert.InstructionTranslator
    .current_tx().f_code``).
    """
    translator = lookup("torch._dynamo.symbolic_convert.InstructionTranslator")
    try:
        code = translator.current_tx().f_code
    except Exception:
        return None
    return code if isinstance(code, types.CodeType) else None


def undisabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without the ``torch._dynamo.disable`` wrappers around it.

    Inductor returns its artifact inside one, and dynamo wraps whatever a backend returns
    in another ("do not trace Dynamo-compiled graph") before its code calls it. Around the
    guard's graph wrapper that outer one already switches dynamo off, so the inner one
    only does it a second time (~0.25 µs a call). Only a recursive disable wrapper made by
    torch is taken off: its ``_torchdynamo_wrapper_id`` is its own id (what torch's
    ``innermost_fn`` checks), so a user's ``functools.wraps`` copy of one is kept.

    checked: 2.13.0 (``DisableContext.__call__`` sets ``_torchdynamo_disable``,
    ``_torchdynamo_disable_recursive``, ``_torchdynamo_orig_callable`` and
    ``_torchdynamo_wrapper_id``); 2.9.1 sets no wrapper id or recursive flag: nothing is
    taken off there (correct, not faster).
    """
    while (
        getattr(fn, "_torchdynamo_disable", False) is True
        and getattr(fn, "_torchdynamo_disable_recursive", False) is True
        and getattr(fn, "_torchdynamo_wrapper_id", None) == id(fn)
        and callable(getattr(fn, "_torchdynamo_orig_callable", None))
    ):
        fn = fn._torchdynamo_orig_callable  # type: ignore[attr-defined]
    return fn


class SideEffects(NamedTuple):
    """What dynamo recorded the frame being traced updates, and the types to read it."""

    code: types.CodeType  # the frame's code
    modified: list[Any]  # dynamo's VariableTrackers with pending mutations
    stored_attributes: Any  # variable -> {attribute name: new value} (a dict)
    new_objects: tuple[type, ...]  # mutation types of objects the frame itself created
    modules: tuple[type, ...]  # variables standing for nn.Modules
    local_source: type  # the source of a frame's local (``.is_input``, ``.local_name``)
    global_source: type  # the source of a module global


_SIDE_EFFECT_NAMES = (
    "torch._dynamo.variables.base.AttributeMutationNew",
    "torch._dynamo.variables.base.ValueMutationNew",
    "torch._dynamo.variables.nn_module.NNModuleVariable",
    "torch._dynamo.variables.nn_module.UnspecializedNNModuleVariable",
    "torch._dynamo.source.LocalSource",
    "torch._dynamo.source.GlobalSource",
)

#: The type name of dynamo's variable for ``global x; x = ...`` (it has no source).
#: checked: 2.9.1, 2.13.0 (``torch._dynamo.variables.misc.NewGlobalVariable``).
NEW_GLOBAL = "NewGlobalVariable"


def side_effects() -> SideEffects | Missing | None:
    """dynamo's side effects of the frame now traced; ``None`` outside a trace.

    checked: 2.9.1, 2.13.0 (``InstructionTranslator.current_tx().output.side_effects``:
    ``._get_modified_vars()``, ``.store_attr_mutations``; a variable's ``mutation_type``
    and ``source``; a source's ``.base``, ``.name()``, ``.local_name`` and
    ``.get_value(closure_vars, scope, cache)``; the types in ``_SIDE_EFFECT_NAMES``).
    """
    found = [lookup(name) for name in _SIDE_EFFECT_NAMES]
    translator = lookup("torch._dynamo.symbolic_convert.InstructionTranslator")
    if translator is None or any(t is None for t in found):
        missing = next((n for n, t in zip(_SIDE_EFFECT_NAMES, found, strict=True) if t is None), "")
        return Missing(
            missing or "torch._dynamo.symbolic_convert.InstructionTranslator",
            "a call updating an object it was given is checked anyway",
        )
    try:
        tx = translator.current_tx()
        record = tx.output.side_effects
        modified = list(record._get_modified_vars())
        stored = record.store_attr_mutations
    except Exception:
        return None
    new_attr, new_value, module, unspecialized, local, global_ = found
    return SideEffects(
        tx.f_code, modified, stored, (new_attr, new_value), (module, unspecialized), local, global_
    )


def source_value(source: Any, closure: dict[str, Any], scope: dict[str, Any], cache: Any) -> Any:
    """The object a dynamo source names in a running frame (``scope``: ``{"L": f_locals,
    "G": f_globals}``), or :class:`Missing` where sources cannot be read back.

    checked: 2.13.0 (``torch._guards.Source.get_value(closure_vars, scope, cache)``; absent
    in 2.9.1).
    """
    get = getattr(source, "get_value", None)
    if get is None:
        return Missing(
            "torch._guards.Source.get_value",
            "a call updating a Python object is not checked",
        )
    return get(closure, scope, cache)


def closure_vars() -> dict[str, Any]:
    """The helpers a dynamo source's ``get_value`` may call (``___odict_getitem``...);
    ``{}`` where this torch lacks them (a source that needs one is then not found).

    checked: 2.9.1, 2.13.0 (``torch._dynamo.guards._get_closure_vars``).
    """
    get = lookup("torch._dynamo.guards._get_closure_vars")
    try:
        return dict(get()) if get is not None else {}
    except Exception:
        return {}


# ---------------------------------------------------------------- graphs and ops


def is_op_overload(target: object) -> bool:
    """Whether an FX node's target is an ATen ``OpOverload`` (``aten.add.Tensor``).

    checked: 2.9.1, 2.13.0 (``torch._ops.OpOverload``, its ``_opname``).
    """
    cls = lookup("torch._ops.OpOverload")
    return isinstance(cls, type) and isinstance(target, cls)


def is_tensor_property(source: object) -> bool:
    """Whether a graph input's dynamo source is a size or stride dynamo lifted out of a
    tensor (not an argument of the user's).

    checked: 2.9.1, 2.13.0 (``torch._dynamo.source.TensorPropertySource``).
    """
    cls = lookup("torch._dynamo.source.TensorPropertySource")
    return isinstance(cls, type) and isinstance(source, cls)


def close_symbolic_trace_window() -> Missing | None:
    """Run inductor's one-time ``symbolic_trace`` of a helper module now (it patches
    ``nn.Module.__call__`` process-wide while it runs).

    checked: 2.9.1, 2.13.0 (``torch._inductor.loop_body.InterpreterShim._dummy_gm``).
    """
    shim = lookup("torch._inductor.loop_body.InterpreterShim")
    dummy = getattr(shim, "_dummy_gm", None)
    if dummy is None:
        return Missing(
            "torch._inductor.loop_body.InterpreterShim._dummy_gm",
            "a background compile may patch nn.Module.__call__ while eager serves",
        )
    dummy()
    return None


def dynamo_dir() -> str:
    """The directory of dynamo's own source files (to skip its frames in a stack).

    checked: 2.9.1, 2.13.0 (``torch/_dynamo/``).
    """
    return os.path.join(os.path.dirname(torch.__file__), "_dynamo")


# ---------------------------------------------------------------- torch's caches

#: torch's flags that switch a remote cache on: (environment variable, config module, name).
#: checked: 2.9.1, 2.13.0. Not ``bundled_autotune_remote_cache``: in torch 2.13 it fails
#: every compile of a graph without Triton kernels (an AssertionError on the missing
#: "backend_hash", e.g. any CPU graph), which would trip callables and persist compile
#: failures fleet-wide. Set it yourself on GPU-only fleets
#: (``TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE=1``): the transport is shared.
REMOTE_CACHE_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "torch._inductor.config", "fx_graph_remote_cache"),
    (
        "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE",
        "torch._functorch.config",
        "enable_remote_autograd_cache",
    ),
    ("TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "torch._inductor.config", "autotune_remote_cache"),
)

#: What :func:`config_settings` reads for reports: (key, torch config value).
#: checked: 2.9.1, 2.13.0.
CACHE_SETTINGS: dict[str, str] = {
    "fx_graph_cache": "torch._inductor.config.fx_graph_cache",
    "autograd_cache": "torch._functorch.config.enable_autograd_cache",
    "force_disable_caches": "torch._inductor.config.force_disable_caches",
}

#: The logger of torch's fake tensors (its "failed while attempting to run meta" errors).
#: checked: 2.9.1, 2.13.0 (``torch._subclasses.fake_tensor``'s module logger).
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


def config_entry(module_name: str, attr: str) -> Any:
    """The ``_ConfigEntry`` of ``attr`` in an already-imported torch config module
    (``torch._inductor.config``), or ``None`` (not imported, or no such entry).

    checked: 2.9.1, 2.13.0 (``module._config[attr]``, its ``.default``).
    """
    module = sys.modules.get(module_name)
    entries = getattr(module, "_config", None)
    return entries.get(attr) if isinstance(entries, dict) else None


def config_settings() -> dict[str, Any]:
    """``{key: value}`` of the config values in :data:`CACHE_SETTINGS` (imports the config
    modules); a value this torch lacks is ``None``."""
    return {key: lookup(dotted) for key, dotted in CACHE_SETTINGS.items()}


def drop_local_cache_path() -> None:
    """Forget inductor's memoised local cache path, if inductor's codecache is imported.

    checked: 2.9.1, 2.13.0 (``torch._inductor.codecache.CacheBase.get_local_cache_path``,
    an ``lru_cache``).
    """
    codecache = sys.modules.get("torch._inductor.codecache")
    local = getattr(getattr(codecache, "CacheBase", None), "get_local_cache_path", None)
    clear = getattr(local, "cache_clear", None)
    if callable(clear):
        clear()


def default_cache_dir() -> str | None:
    """inductor's default cache directory, if its module is imported (else ``None``).

    checked: 2.9.1, 2.13.0 (``torch._inductor.runtime.cache_dir_utils.default_cache_dir``).
    """
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    default = getattr(utils, "default_cache_dir", None)
    return str(default()) if callable(default) else None


def remote_cache_classes() -> tuple[Any, Any] | Missing:
    """``(RedisRemoteCache, RemoteCacheBackend)`` from inductor's remote cache.

    checked: 2.9.1, 2.13.0 (``torch._inductor.remote_cache``; ``RedisRemoteCache
    .backend_override_cls``; a backend implements ``_get(key)`` and ``_put(key, data)``).
    """
    redis_cache = lookup("torch._inductor.remote_cache.RedisRemoteCache")
    backend = lookup("torch._inductor.remote_cache.RemoteCacheBackend")
    if redis_cache is None or backend is None:
        return Missing(
            "torch._inductor.remote_cache.RedisRemoteCache",
            "torch's own compile caches are not shared over Redis",
        )
    return redis_cache, backend
