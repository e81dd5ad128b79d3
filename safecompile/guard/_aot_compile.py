"""One warm signature compiled ahead of time to be saved, and why one is not saved.

``torch.compile(fullgraph=True).aot_compile()`` compiles the guarded callable whole for a
warm call's arguments (as the compiled function got them: padded, or marked dynamic). A
function is saved only when what it checked at run time can be checked at load: no guard on
a global is kept, each global's value is recorded instead (or the function is not saved),
it updates no Python object, and the code it came from is known. A warm restart
(``_precompile``) serializes what this returns, and says ``not_saved`` with the cause this
module gives.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from safecompile.base import torchcompat
from safecompile.observe.explain import explain
from safecompile.observe.source import location_of_error
from safecompile.persist.sources import code_record, describe_global
from safecompile.shapes.buckets import Plan
from safecompile.shapes.table import BucketStatus, BucketTable

from .facts import GraphFacts, read_facts

__all__ = ["AotCompiled", "Args", "NotSaved", "aot_compile", "as_compiled", "not_saved"]

# Guards (``<kind>_MATCH``) on a global that a loaded function no longer checks, whose
# value (described) is saved and compared at load; a graph guarded on a global in any
# other way (a tensor's) is not saved.
_RECORDED = frozenset(
    [
        *("BUILTIN", "CLASS", "CLOSURE", "FUNCTION", "ID", "MODULE", "TYPE", "CONSTANT"),
        *("EQUALS", "SEQUENCE_LENGTH", "DICT_KEYS", "DICT_LENGTH", "LIST_LENGTH", "BOOL"),
        *("NONE", "NOT_NONE", "TUPLE_ITERATOR_LEN", "NOT_PRESENT_IN_GENERIC_DICT"),
        *("DICT_CONTAINS", "HASATTR", "DUPLICATE_INPUT"),
    ]
)
_UNRECORDED_VALUES = (torch.Tensor, torch.nn.Module)
_TORCH_GLOBAL = "G['__import_torch"  # torch's own modules: part of the torch version

Args = tuple[tuple[Any, ...], dict[str, Any]]  # a call's positional and keyword arguments


@dataclasses.dataclass(frozen=True)
class AotCompiled:
    """One warm signature's function, fit to save."""

    fn: Any  # torch's compiled function: serialized, and its guards asked
    facts: GraphFacts  # its graph's
    code: dict[str, Any]  # what it came from (``persist/sources.code_record``)


def aot_compile(
    top: Callable[..., Any],
    compiler: Callable[..., Any],
    dynamic: bool | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> AotCompiled:
    """``top`` compiled whole by ``compiler`` for ``args`` and ``kwargs``; raises
    :class:`NotSaved` for a function that cannot be saved, or whatever torch raised."""
    facts: list[GraphFacts] = []
    read: list[str] = []  # globals guarded on in a way no record checks
    recorded: dict[str, str] = {}  # the other globals guarded on: name -> value described
    unserializable = torchcompat.lookup(  # checked: 2.13.0 (torch's default filter's)
        "torch._dynamo.guards.CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES"
    )

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled = compiler(gm, example_inputs)
        facts.append(read_facts(gm))
        return compiled

    def guards(entries: list[Any]) -> list[bool]:
        # as torch's default, no guard on a global is kept: each is recorded with the
        # value it held (checked before a load), or the graph is not saved
        for g in entries:
            if not g.is_global or g.name.startswith(_TORCH_GLOBAL):
                continue
            if (
                g.has_value
                and g.guard_type.removesuffix("_MATCH") in _RECORDED
                and not isinstance(g.value, _UNRECORDED_VALUES)
            ):
                recorded[g.name] = describe_global(g.value)
            else:
                read.append(g.name)
        return [not (g.is_global or g.guard_type in (unserializable or ())) for g in entries]

    compile_: Any = torchcompat.torch_compile()  # torch's own, under install() too
    options = {"guard_filter_fn": guards}
    fn = compile_(top, fullgraph=True, backend=backend, dynamic=dynamic, options=options)
    saved = fn.aot_compile((args, kwargs))
    if facts[0].effects:  # updates to find again at run time
        raise NotSaved("python_side_effects", "it updates Python objects")
    if read:  # global values no record checks
        raise NotSaved("global_read", f"it reads globals no record checks: {read[:3]}")
    inlined = torchcompat.inlined_sources(saved)
    if isinstance(inlined, torchcompat.Missing):  # what it came from cannot be checked
        raise NotSaved("untracked_code", f"{inlined.name}: {inlined.effect}")
    scope = str(top.__globals__.get("__name__"))
    return AotCompiled(saved, facts[0], code_record(inlined, recorded, scope))


class NotSaved(Exception):
    """A warm signature that is compiled but not saved, and why (``cause``: one word)."""

    def __init__(self, cause: str, reason: str) -> None:
        super().__init__(reason)
        self.cause = cause


def not_saved(exc: Exception, fn: Callable[..., Any]) -> tuple[str, str]:
    """The ``cause`` and ``reason`` of a ``not_saved`` event: ``graph_break`` (torch
    precompiles whole graphs only), ``not_serializable`` (a backend's result torch cannot
    save), ``python_side_effects``, ``global_read``, ``untracked_code`` or ``error``."""
    if isinstance(exc, NotSaved):
        return exc.cause, f"{exc}: this signature is traced at every start"
    said = explain(exc, location_of_error(exc, fn)[0])
    if said.kind == "graph_break":
        location, _ = location_of_error(exc, fn)
        where = f" at {os.path.basename(location.file)}:{location.line}" if location else ""
        reason = (
            f"{said.summary}{where}: torch precompiles whole graphs only, so this "
            "signature is traced at every start"
        )
        return "graph_break", reason
    cause = "not_serializable" if "SerializableCallable" in str(exc) else "error"
    return cause, f"{type(exc).__name__}: {exc}"


def as_compiled(call: Args, buckets: BucketTable | None) -> tuple[Args, Plan | None] | None:
    """A warm call's arguments as the compiled function got them, and with
    ``strategy="dynamic"`` the plan whose range to mark on them (``None``: it did not get
    them, a rejected bucket)."""
    plan = buckets.bucketer.plan(*call) if buckets is not None else None
    if buckets is None or plan is None or plan.status != "bucketed":
        return call, None
    if buckets.entry(plan).status is BucketStatus.REJECTED:
        return None
    if not buckets.pads:
        return call, plan
    return buckets.bucketer.pad(plan, *call), None
