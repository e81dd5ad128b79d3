"""Every private torch name safecompile uses, reached here and nowhere else.

torch renames, moves and drops its ``torch._*`` names without notice, so each one is
looked up here, lazily, and a torch upgrade is one file to read. ``checked: 2.9.1,
2.13.0`` on a use means the name, its signature and the behaviour relied on were read in
those versions' source and exercised by the tests that run there.

A name the installed torch lacks fails neither the import nor a compile: its accessor
returns a falsy :class:`Missing` (the name and what degrades without it), which callers
hand to :func:`safecompile.observe.log.torch_missing` (said once per name; this module
sits below logging).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

# Loaded by ``import torch`` itself, so imported, not looked up. checked: 2.9.1, 2.13.0 (no
# public ``torch.utils.pytree`` in either).
from torch.utils import _pytree as pytree

__all__ = [
    "DYNAMIC_MARKS",
    "FAKE_TENSOR_LOGGER",
    "NEW_GLOBAL",
    "RECOMPILE_LIMIT_LOG",
    "REMOTE_CACHE_FLAGS",
    "Missing",
    "SideEffects",
    "close_symbolic_trace_window",
    "closure_vars",
    "compile_cache_counts",
    "compile_callbacks",
    "compile_errors",
    "compile_lock",
    "compiled_function_loader",
    "compiled_original",
    "compiler_wrapper",
    "config_entry",
    "config_settings",
    "default_cache_dir",
    "default_store",
    "drop_local_cache_path",
    "dynamo_dir",
    "eager_backward",
    "frame_code",
    "graph_line_map",
    "headers_not_precompiled",
    "hold_new_graphs",
    "inductor_cache_dir",
    "inductor_options",
    "inlined_sources",
    "is_op_overload",
    "is_tensor_property",
    "kernel_compiler",
    "kernel_libraries",
    "lookup",
    "lookup_backend",
    "mark_dynamic",
    "mode_options",
    "per_function_limit",
    "precompiled_rewrapped",
    "pytree",
    "remote_cache_classes",
    "reset_code",
    "route_vec_isa_checks",
    "side_effects",
    "source_value",
    "torch_compile",
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
    """The object ``dotted`` names (``torch._dynamo.exc.Unsupported``), or ``None``;
    never raises. Modules, classes and functions are remembered (~0.1 µs again, not
    ~12 µs); values such as config flags are read afresh."""
    found = _FOUND.get(dotted)
    if found is not None:
        return found
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr, None)
        break
    if isinstance(found, _STABLE):
        _FOUND[dotted] = found
    return found


# ---------------------------------------------------------------- compiling


def compile_errors() -> tuple[type[BaseException], ...]:
    """Errors raised while dynamo traces or a backend compiles (a missing one left out).
    checked: 2.9.1, 2.13.0"""
    names = ("TorchDynamoException", "FailOnRecompileLimitHit")
    found = (lookup(f"torch._dynamo.exc.{name}") for name in names)
    return tuple(t for t in found if isinstance(t, type) and issubclass(t, BaseException))


def eager_backward() -> contextlib.AbstractContextManager[Any] | Missing:
    """A context in which AOTAutograd compiles the backward graph with the forward one.
    checked: 2.13.0 (absent in 2.9.1)"""
    config = lookup("torch._functorch.config")
    entries = getattr(config, "_config", None)
    if entries is None or "force_non_lazy_backward_lowering" not in entries:
        return Missing(
            "torch._functorch.config.force_non_lazy_backward_lowering",
            "a backward graph compiles at .backward(), unguarded",
        )
    return config.patch(force_non_lazy_backward_lowering=True)  # type: ignore[no-any-return]


def torch_compile() -> Callable[..., Any]:
    """``torch.compile`` as safecompile calls it: the module attribute, read at each call
    (tests replace it), or the function it stands for when :func:`safecompile.install`
    answers ``torch.compile`` (so a guard never guards its own compile)."""
    found: Callable[..., Any] = torch.compile
    return getattr(found, "__safecompile_original__", found)


def per_function_limit(limit: int) -> dict[str, Any] | Missing:
    """``torch.compile`` keywords that give one function its own recompile limit and
    cache entries (public, but new). checked: 2.13.0 (absent in 2.9.1, where every
    ``torch.compile`` of one code object shares dynamo's global limit of 8)"""
    params = inspect.signature(torch_compile()).parameters
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
    checked: 2.9.1, 2.13.0"""
    args: tuple[Any, ...]
    if backend == "inductor":
        name, args = "torch._TorchCompileInductorWrapper", (mode, options, dynamic)
    else:
        name, args = "torch._TorchCompileWrapper", (backend, mode, options, dynamic)
    cls = lookup(name)
    if cls is None:
        return Missing(name, "mode= and options= are not applied to the backend")
    return cls(*args)  # type: ignore[no-any-return]


def lookup_backend(backend: str | Callable[..., Any]) -> Callable[..., Any]:
    """A backend given by name or as a callable, as a callable. checked: 2.9.1, 2.13.0"""
    find = lookup("torch._dynamo.lookup_backend")
    if find is not None:
        return find(backend)  # type: ignore[no-any-return]
    if callable(backend):
        return backend
    raise ValueError(f"cannot look backend {backend!r} up in this torch")


def mode_options(mode: str | None = None) -> dict[str, Any]:
    """inductor's modes (``mode=None``) or the options one mode sets; ``{}`` if unknown.
    checked: 2.9.1, 2.13.0"""
    listing = lookup("torch._inductor.list_mode_options")
    if listing is None:
        return {}
    return dict(listing(mode) if mode is not None else listing())


def inductor_options() -> frozenset[str] | Missing:
    """The option names ``torch.compile(options=...)`` accepts for inductor.
    checked: 2.9.1, 2.13.0"""
    listing = lookup("torch._inductor.list_options")
    if listing is None:
        return Missing("torch._inductor.list_options", "inductor options are not checked early")
    return frozenset(listing())


def compile_lock() -> Any:
    """Dynamo's global compile lock (it guards torch's cache-artifact list), or ``None``.
    checked: 2.9.1, 2.13.0 (an ``RLock``)"""
    return lookup("torch._dynamo.convert_frame.compile_lock")


# ---------------------------------------------------------------- dynamo's state


def _call(name: str, effect: str, *args: Any, **kwargs: Any) -> Missing | None:
    """Call the torch function ``name``; a :class:`Missing` (with ``effect``) without it."""
    found = lookup(name)
    if found is None:
        return Missing(name, effect)
    found(*args, **kwargs)
    return None


def set_versions(tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> Missing | None:
    """Set tensors' version counters (what autograd checks a saved tensor against).
    checked: 2.9.1, 2.13.0 (``torch._C._autograd._unsafe_set_version_counter``)"""
    return _call(
        "torch._C._autograd._unsafe_set_version_counter",
        "a passing check of a call that updates a tensor its outputs saved for backward "
        "leaves that backward raising",
        tensors,
        versions,
    )


def reset_code(code: types.CodeType) -> Missing | None:
    """Drop the graphs dynamo caches on one code object. checked: 2.9.1, 2.13.0"""
    return _call("torch._dynamo.reset_code", "reset() keeps torch's cached graphs", code)


def default_store() -> Any:
    """The c10d store ``init_process_group`` made, which every rank reaches: ranks agree
    through it, never through the user's communicator. checked: 2.9.1, 2.13.0"""
    found = lookup("torch.distributed.distributed_c10d._get_default_store")
    if found is None:
        return Missing(
            "torch.distributed.distributed_c10d._get_default_store",
            "ranks cannot agree: a rank of a process group serves eager at its first safe point",
        )
    return found()


#: The attributes ``torch._dynamo.mark_dynamic`` sets on a tensor. checked: 2.9.1, 2.13.0
DYNAMIC_MARKS = (
    "_dynamo_dynamic_indices",
    "_dynamo_dynamic_range",
    "_dynamo_hint_overrides",
    "_specialize_on",
    "_has_dynamo_dim_marking",
)


def mark_dynamic(tensor: torch.Tensor, dim: int, low: int, high: int) -> Missing | None:
    """Mark ``tensor``'s ``dim`` dynamic between ``low`` and ``high``. checked: 2.9.1, 2.13.0"""
    effect = "dynamic ranges are left to torch"
    return _call("torch._dynamo.mark_dynamic", effect, tensor, dim, min=low, max=high)


def compile_callbacks() -> Any:
    """dynamo's compile-callback handler (``register_start_callback``), or ``None``.
    checked: 2.9.1, 2.13.0"""
    return lookup("torch._dynamo.callback.callback_handler")


def frame_code() -> types.CodeType | None:
    """The code object dynamo is tracing on this thread, or ``None`` outside a trace.
    checked: 2.9.1, 2.13.0"""
    translator = lookup("torch._dynamo.symbolic_convert.InstructionTranslator")
    try:
        code = translator.current_tx().f_code
    except Exception:
        return None
    return code if isinstance(code, types.CodeType) else None


def precompiled_rewrapped(
    loaded: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Any:
    """A function ``torch.compiler.load_compiled_function`` returned, its compiled graph
    replaced by ``wrap(graph)``; its guards are kept (they read the call's arguments, not
    the graph: rebuilt, they were built twice a load). checked: 2.13.0
    (``AOTCompiledFunction``, a dataclass whose code calls ``_artifacts.compiled_fn``)."""
    artifacts = getattr(loaded, "_artifacts", None)
    if artifacts is None:
        return Missing("AOTCompiledFunction._artifacts", "precompiled graphs are not loaded")
    rebuilt = dataclasses.replace(artifacts, compiled_fn=wrap(artifacts.compiled_fn))
    return dataclasses.replace(loaded, _artifacts=rebuilt)


def inlined_sources(saved: Any) -> Any:
    """What dynamo traced for a function ``aot_compile`` returned: torch's own record,
    one ``InlinedSource`` (``module``, ``firstlineno``, ``content``: the module's text) per
    code object (the function and each one it inlined). checked: 2.13.0
    (``AOTCompiledFunction.source_info()``, filled from the tracing context's
    ``traced_code``)"""
    info = getattr(saved, "source_info", None)
    sources = getattr(info(), "inlined_sources", None) if callable(info) else None
    if sources is None:
        return Missing(
            "AOTCompiledFunction.source_info().inlined_sources",
            "nothing is precompiled: what it came from cannot be checked at load",
        )
    return sources


def compiled_function_loader() -> Callable[..., Any] | Missing:
    """``torch.compiler.load_compiled_function``, where ``torch.compile``'s result also has
    the ``aot_compile`` that saves what it loads. checked: 2.13.0 (``aot_compile`` is set
    while ``torch._dynamo.config.enable_aot_compile``, on by default; the loader takes
    ``f_globals=`` and ``external_data=``), 2.9.1 (off by default; a loader without
    them); on 2.11.0 the result had no ``aot_compile``"""
    effect = "nothing is precompiled: a warm restart traces again"
    if lookup("torch._dynamo.config.enable_aot_compile") is not True:
        return Missing("torch.compile(...).aot_compile", effect)
    load = lookup("torch.compiler.load_compiled_function")
    if not callable(load) or not {"f_globals", "external_data"} <= set(
        inspect.signature(load).parameters
    ):
        return Missing("torch.compiler.load_compiled_function(f_globals=, external_data=)", effect)
    return load  # type: ignore[no-any-return]


def undisabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without the ``torch._dynamo.disable`` wrappers around it.

    Inductor returns its artifact inside one, needless (~0.25 µs a call) inside dynamo's
    own around the guard's wrapper. Only torch's recursive wrapper (its wrapper id its own
    id, as ``innermost_fn`` checks) is taken off, never a user's ``functools.wraps`` copy.
    checked: 2.13.0; 2.9.1 sets no wrapper id: nothing is taken off (correct, not faster)
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

    code: types.CodeType
    modified: list[Any]  # dynamo's VariableTrackers with pending mutations
    stored_attributes: Any  # variable -> {attribute name: new value}
    new_objects: tuple[type, ...]  # mutation types of objects the frame itself created
    modules: tuple[type, ...]  # variables standing for nn.Modules
    local_source: type
    global_source: type


_SIDE_EFFECT_NAMES = (
    "torch._dynamo.symbolic_convert.InstructionTranslator",
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
    checked: 2.9.1, 2.13.0 (also a variable's ``mutation_type`` and ``source``; a
    source's ``.base``, ``.name()``, ``.local_name``)"""
    found = [lookup(name) for name in _SIDE_EFFECT_NAMES]
    missing = [name for name, t in zip(_SIDE_EFFECT_NAMES, found, strict=True) if t is None]
    if missing:
        return Missing(missing[0], "a call updating an object it was given is checked anyway")
    translator, new_attr, new_value, module, unspecialized, local, global_ = found
    try:
        tx = translator.current_tx()
        record = tx.output.side_effects
        modified = list(record._get_modified_vars())
        stored = record.store_attr_mutations
    except Exception:
        return None
    return SideEffects(
        tx.f_code, modified, stored, (new_attr, new_value), (module, unspecialized), local, global_
    )


def source_value(source: Any, closure: dict[str, Any], scope: dict[str, Any], cache: Any) -> Any:
    """The object a dynamo source names in a running frame (``scope``: ``{"L": f_locals,
    "G": f_globals}``). checked: 2.13.0 (absent in 2.9.1)"""
    get = getattr(source, "get_value", None)
    if get is None:
        return Missing(
            "torch._guards.Source.get_value", "a call updating a Python object is not checked"
        )
    return get(closure, scope, cache)


def closure_vars() -> dict[str, Any]:
    """The helpers a dynamo source's ``get_value`` may call (``___odict_getitem``...),
    ``{}`` where missing. checked: 2.9.1, 2.13.0"""
    get = lookup("torch._dynamo.guards._get_closure_vars")
    try:
        return dict(get()) if get is not None else {}
    except Exception:
        return {}


# ---------------------------------------------------------------- graphs and ops


def is_op_overload(target: object) -> bool:
    """Whether an FX node's target is an ATen ``OpOverload`` (``aten.add.Tensor``).
    checked: 2.9.1, 2.13.0 (and its ``_opname``)"""
    cls = lookup("torch._ops.OpOverload")
    return isinstance(cls, type) and isinstance(target, cls)


def is_tensor_property(source: object) -> bool:
    """Whether a graph input's dynamo source is a size or stride lifted out of a tensor.
    checked: 2.9.1, 2.13.0"""
    cls = lookup("torch._dynamo.source.TensorPropertySource")
    return isinstance(cls, type) and isinstance(source, cls)


def compiled_original(fn: object) -> object | None:
    """What ``torch.compile`` wrapped: an ``OptimizedModule``'s module, or the callable
    under a dynamo-wrapped function; ``None`` when ``fn`` is neither.
    checked: 2.9.1, 2.13.0 (``_orig_mod``, ``_torchdynamo_orig_callable``)"""
    if isinstance(fn, torch.nn.Module):
        orig = getattr(fn, "_orig_mod", None)
        return orig if isinstance(orig, torch.nn.Module) else None
    return getattr(fn, "_torchdynamo_orig_callable", None)


def graph_line_map(module: torch.fx.GraphModule) -> dict[int, int] | None:
    """A ``GraphModule``'s generated-code line (from ``forward``'s first) to its node's
    index, or ``None``. checked: 2.9.1, 2.13.0 (``_lineno_map``)"""
    found = getattr(module, "_lineno_map", None)
    return found if isinstance(found, dict) else None


def close_symbolic_trace_window() -> Missing | None:
    """Run inductor's one-time ``symbolic_trace`` of a helper module now (it patches
    ``nn.Module.__call__`` process-wide while it runs). checked: 2.9.1, 2.13.0"""
    effect = "a background compile may patch nn.Module.__call__ while eager serves"
    return _call("torch._inductor.loop_body.InterpreterShim._dummy_gm", effect)


def dynamo_dir() -> str:
    """The directory of dynamo's own source files, ending in a separator.
    checked: 2.9.1, 2.13.0"""
    return os.path.join(os.path.dirname(torch.__file__), "_dynamo", "")


# ---------------------------------------------------------------- torch's caches

#: torch's flags that switch a remote cache on: (environment variable, config module, name).
#: checked: 2.9.1, 2.13.0. Not ``bundled_autotune_remote_cache``: in 2.13 it fails every
#: compile of a graph without Triton kernels (any CPU graph); GPU-only fleets may set
#: ``TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE=1`` themselves.
REMOTE_CACHE_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "torch._inductor.config", "fx_graph_remote_cache"),
    (
        "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE",
        "torch._functorch.config",
        "enable_remote_autograd_cache",
    ),
    ("TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "torch._inductor.config", "autotune_remote_cache"),
)

#: The logger of torch's fake tensors ("failed while attempting to run meta").
#: checked: 2.9.1, 2.13.0
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"

#: The logger, and the start of the message, of dynamo's warning that a code object hit
#: its recompile limit (``convert_frame._compile``). checked: 2.13.0
RECOMPILE_LIMIT_LOG = ("torch._dynamo.convert_frame", "torch._dynamo hit config.")


def config_entry(module_name: str, attr: str) -> Any:
    """The ``_ConfigEntry`` of ``attr`` in an already-imported torch config module, or
    ``None``. checked: 2.9.1, 2.13.0 (and its ``.default``)"""
    module = sys.modules.get(module_name)
    entries = getattr(module, "_config", None)
    return entries.get(attr) if isinstance(entries, dict) else None


def config_settings() -> dict[str, Any]:
    """torch's cache settings for reports (``None`` where this torch lacks one).
    checked: 2.9.1, 2.13.0"""
    return {
        "fx_graph_cache": lookup("torch._inductor.config.fx_graph_cache"),
        "autograd_cache": lookup("torch._functorch.config.enable_autograd_cache"),
        "force_disable_caches": lookup("torch._inductor.config.force_disable_caches"),
    }


def drop_local_cache_path() -> None:
    """Forget inductor's memoised local cache path, if its codecache is imported.
    checked: 2.9.1, 2.13.0 (an ``lru_cache``)"""
    codecache = sys.modules.get("torch._inductor.codecache")
    local = getattr(getattr(codecache, "CacheBase", None), "get_local_cache_path", None)
    clear = getattr(local, "cache_clear", None)
    if callable(clear):
        clear()


def default_cache_dir() -> str | None:
    """inductor's default cache directory, if its module is imported (else ``None``).
    checked: 2.9.1, 2.13.0"""
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    default = getattr(utils, "default_cache_dir", None)
    return str(default()) if callable(default) else None


def remote_cache_classes() -> tuple[Any, Any] | Missing:
    """``(RedisRemoteCache, RemoteCacheBackend)`` from inductor's remote cache.
    checked: 2.9.1, 2.13.0 (``backend_override_cls``; a backend's ``_get``, ``_put``)"""
    redis_cache = lookup("torch._inductor.remote_cache.RedisRemoteCache")
    backend = lookup("torch._inductor.remote_cache.RemoteCacheBackend")
    if redis_cache is None or backend is None:
        return Missing(
            "torch._inductor.remote_cache.RedisRemoteCache",
            "torch's own compile caches are not shared over Redis",
        )
    return redis_cache, backend


IsaAnswer = Callable[[str, Callable[[], bool]], bool]


def route_vec_isa_checks(answer: IsaAnswer) -> Missing | None:
    """Send inductor's vector-ISA build checks through ``answer(key, check)``, once per
    process: ``key`` is torch's own key for the check (the check program, the compiler's
    version, the ISA flags, the torch version), ``check()`` runs torch's check. The CPU's
    flags are read by torch before any check is asked. checked: 2.13.0 (``VecISA.check_build``
    keyed as it keys its build)."""
    isa = lookup("torch._inductor.cpu_vec_isa.VecISA")
    fingerprint = lookup("torch._inductor.cpu_vec_isa._get_isa_dry_compile_fingerprint")
    write = lookup("torch._inductor.codecache.write")
    if isa is None or fingerprint is None or write is None:
        return Missing("torch._inductor.cpu_vec_isa.VecISA", "inductor probes its ISAs again")
    checked = isa.check_build
    if getattr(checked, "_safecompile_routed", False):
        return None

    def check_build(self: Any, code: str) -> bool:
        key, _ = write(code, "cpp", extra=fingerprint(self.build_arch_flags()))
        return answer(key, lambda: checked(self, code))

    check_build._safecompile_routed = True  # type: ignore[attr-defined]
    isa.check_build = check_build
    return None


def compile_cache_counts() -> dict[str, int]:
    """inductor's FX graph cache and AOTAutograd's cache, counted so far in this process:
    ``fx_hit``, ``fx_miss`` (a miss or a bypass: inductor compiled afresh), ``aot_hit``;
    ``{}`` where torch keeps no such counters. Read before and after a call, they tell a
    cold compile from one the caches served. checked: 2.13.0
    (``torch._dynamo.utils.counters``, set in ``_inductor/codecache.py`` and
    ``_functorch/_aot_autograd/autograd_cache.py``)"""
    counters = lookup("torch._dynamo.utils.counters")
    if not isinstance(counters, Mapping):
        return {}
    inductor = counters.get("inductor") or {}
    aot = counters.get("aot_autograd") or {}
    return {
        "fx_hit": int(inductor.get("fxgraph_cache_hit", 0)),
        "fx_miss": int(inductor.get("fxgraph_cache_miss", 0))
        + int(inductor.get("fxgraph_cache_bypass", 0)),
        "aot_hit": int(aot.get("autograd_cache_hit", 0)),
    }


# ---------------------------------------------------------------- new graphs held back


def hold_new_graphs(
    compiled: Callable[..., Any], allow: Callable[[], bool], held: Callable[[], None]
) -> Missing | None:
    """Make ``compiled`` (what ``torch.compile`` returned) ask before it makes a graph.

    dynamo calls the compiled function's frame callback only when a frame finds no cache
    entry whose guards pass (a hit never calls it): wrapped here, on a thread where
    ``allow()`` is false, a frame that dynamo would trace runs eagerly instead (for this
    call only: the code is not marked), the frames it calls run only what is compiled
    already, and ``held()`` is told. Frames dynamo skips anyway keep torch's answer. The
    wrapper names torch's callback as its backend, so cache entries match as before (as
    ``set_stance("fail_on_recompile")``'s callback does). checked: 2.13.0 (the
    ``callback`` cell of ``_TorchDynamoContext.__call__``'s ``compile_wrapper``;
    ``ConvertFrameReturn(frame_exec_strategy=, apply_to_code=)``; ``_FrameExecStrategy``,
    ``_FrameAction.SKIP``/``RUN_ONLY``; ``trace_rules.check``; ``has_tensor_in_frame``)."""
    effect = "a live call that makes a new graph waits for its compile"
    code = getattr(compiled, "__code__", None)
    cells = getattr(compiled, "__closure__", None)
    answer = lookup("torch._dynamo.types.ConvertFrameReturn")
    strategy = lookup("torch._C._dynamo.eval_frame._FrameExecStrategy")
    action = lookup("torch._C._dynamo.eval_frame._FrameAction")
    skipped = lookup("torch._dynamo.trace_rules.check")
    has_tensor = lookup("torch._dynamo.convert_frame.has_tensor_in_frame")
    if (
        code is None
        or cells is None
        or "callback" not in code.co_freevars
        or None in (answer, strategy, action, skipped, has_tensor)
    ):
        return Missing("torch._dynamo.eval_frame._TorchDynamoContext callback", effect)
    cell = cells[code.co_freevars.index("callback")]
    inner = cell.cell_contents
    if not callable(inner) or not hasattr(inner, "_torchdynamo_orig_backend"):
        return Missing("torch._dynamo.eval_frame._TorchDynamoContext callback", effect)
    run_eagerly = strategy(action.SKIP, action.SKIP)  # this frame and those it calls
    skipped(code)  # its rule tables are built on first use (~20 ms): not on a live call
    skips: dict[types.CodeType, bool] = {}  # ``trace_rules.check`` per code (~0.1 ms each)

    class _Held:
        """torch's callback, asking ``allow()`` before a frame it would trace."""

        def __init__(self) -> None:
            self._torchdynamo_orig_backend = inner

        def __call__(self, frame: Any, cache_entry: Any, frame_state: Any) -> Any:
            if allow():
                return inner(frame, cache_entry, frame_state)
            skip = skips.get(frame.f_code)
            if skip is None:
                if len(skips) > 1024:
                    skips.clear()
                skip = skips[frame.f_code] = bool(skipped(frame.f_code))
            if skip or not has_tensor(frame):
                return inner(frame, cache_entry, frame_state)
            held()
            return answer(frame_exec_strategy=run_eagerly, apply_to_code=False)

    cell.cell_contents = _Held()
    return None


# ---------------------------------------------------------------- built C++ kernels

_KERNELS_EFFECT = "its C++ kernels are not shipped: each process that loads it builds them"


def kernel_libraries(saved: Any) -> list[str] | Missing:
    """The C++ kernel libraries (``.so`` paths, as built in this process) that the compiled
    graphs of ``saved`` (what ``aot_compile`` returned) load; ``[]`` for graphs that are not
    inductor's. checked: 2.13.0 (``_artifacts.compiled_fn.compiled_fn.serialize()`` is a
    ``BundledAOTAutogradResult``; ``compiled_fw``/``compiled_bw`` ``.result`` a
    ``CompiledFxGraph`` whose module ``PyCodeCache`` loaded from ``get_path(cache_key,
    "py")``; its CPU kernels are ``cpp_pybinding``'s: builtins of an extension module whose
    ``__file__`` is the library)"""
    compiled = getattr(getattr(saved, "_artifacts", None), "compiled_fn", None)
    serialize = getattr(getattr(compiled, "compiled_fn", None), "serialize", None)
    get_path = lookup("torch._inductor.codecache.get_path")
    modules = lookup("torch._inductor.codecache.PyCodeCache.modules")
    graph_type = lookup("torch._inductor.output_code.CompiledFxGraph")
    missing = Missing("BundledAOTAutogradResult.compiled_fw.result", _KERNELS_EFFECT)
    if not callable(serialize) or get_path is None or graph_type is None:
        return missing
    try:
        bundled = serialize()
    except Exception:
        return missing
    loaded = {getattr(m, "__file__", None): m for m in modules or ()}
    found: set[str] = set()
    for part in (getattr(bundled, "compiled_fw", None), getattr(bundled, "compiled_bw", None)):
        graph = getattr(part, "result", None)
        if not isinstance(graph, graph_type):
            continue  # no backward, or not inductor's graph
        module = loaded.get(get_path(graph.cache_key, "py")[2])
        if module is None:
            return missing
        for value in vars(module).values():
            library = getattr(getattr(value, "__self__", None), "__file__", None)
            if isinstance(value, types.BuiltinFunctionType) and str(library).endswith(".so"):
                found.add(str(library))
            elif type(value).__name__ in ("CFuncPtr", "_FuncPtr", "LambdaFuture"):
                return missing  # a kernel of a kind not found this way
    return sorted(found)


def inductor_cache_dir() -> str | Missing:
    """inductor's cache directory in this process (``TORCHINDUCTOR_CACHE_DIR``), where it
    looks for a kernel it built before. checked: 2.13.0"""
    cache_dir = lookup("torch._inductor.runtime.cache_dir_utils.cache_dir")
    if not callable(cache_dir):
        return Missing("torch._inductor.runtime.cache_dir_utils.cache_dir", _KERNELS_EFFECT)
    return str(cache_dir())


def kernel_compiler() -> str:
    """The C++ compiler inductor builds with, and its version (inductor's own answers,
    kept for the process). checked: 2.13.0"""
    compiler = lookup("torch._inductor.cpp_builder.get_cpp_compiler")
    version = lookup("torch._inductor.cpp_builder.get_compiler_version_info")
    try:
        name = compiler()
        return f"{name}: {version(name)}"
    except Exception as exc:  # none installed: nothing built here matches a shipped one
        return f"unavailable ({type(exc).__name__})"


@contextlib.contextmanager
def headers_not_precompiled(directory: str) -> Iterator[Missing | None]:
    """While this thread loads graphs whose kernels are already built: inductor's header
    precompile (a preprocessor run and a precompiled-header build, once a process, before
    it looks for the library it built) is answered with a plain header under ``directory``
    that includes the same file, so nothing is compiled; a kernel built after all is
    compiled without the precompiled header. checked: 2.13.0
    (``codecache._precompile_header(header, cmd_line, **options)`` returns the path given
    to ``-include``, read only by a build)"""
    codecache = sys.modules.get("torch._inductor.codecache") or lookup("torch._inductor.codecache")
    real = getattr(codecache, "_precompile_header", None)
    if not callable(real):
        yield Missing("torch._inductor.codecache._precompile_header", "headers are precompiled")
        return
    loading = getattr(real, "_safecompile_plain", None)
    if not isinstance(loading, threading.local):
        patched = _plain_header(real)
        codecache._precompile_header = patched  # type: ignore[union-attr]
        loading = patched._safecompile_plain  # type: ignore[attr-defined]
    loading.directory = directory
    try:
        yield None
    finally:
        loading.directory = None


def _plain_header(real: Callable[..., str]) -> Callable[..., str]:
    """``real`` answered with a plain header on a thread that loads built kernels (the
    directory in its ``_safecompile_plain``, a ``threading.local``)."""
    loading = threading.local()  # .directory: this thread loads built kernels

    def precompile_header(header: str, *args: Any, **kwargs: Any) -> str:
        directory = getattr(loading, "directory", None)
        if directory is None:  # any other thread, or outside a load: torch's own
            return real(header, *args, **kwargs)
        name = hashlib.sha256(header.encode()).hexdigest()[:32]
        path = os.path.join(directory, f"{name}.h")
        if not os.path.exists(path):
            os.makedirs(directory, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                f.write(f"#include <{header}>\n")
            os.replace(tmp, path)
        return path

    precompile_header._safecompile_plain = loading  # type: ignore[attr-defined]
    return precompile_header
