"""What a precompiled function came from, recorded when it is saved and checked before it
is loaded: an artifact never outlives the code it was built from.

At save, :func:`code_record` keeps, for every code object dynamo traced (torch's own record:
``AOTCompiledFunction.source_info().inlined_sources``, the user function and each function
and method it inlined, however reached), its module, qualified name and a hash of its
source text; and for every guard on a global (``G['helpers'].SCALE``, ``G['OPS']['f']``,
which a loaded function no longer checks), the global's source name and what it held.
:func:`stale_reasons` compares a record with the code importable now: no reason, current.
"""

from __future__ import annotations

import ast
import builtins
import functools
import hashlib
import importlib
import inspect
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any

from safecompile.base import torchcompat

from .cache import _LIBRARY_ROOTS, _stable

__all__ = ["code_record", "describe_global", "stale_reasons"]

RECORD_VERSION = 1


def code_record(
    inlined: Iterable[Any], globals_read: Mapping[str, str], scope: str
) -> dict[str, Any]:
    """The record saved with one precompiled function (JSON): ``inlined`` is torch's
    ``source_info().inlined_sources`` (``module``, ``firstlineno``, ``content``),
    ``globals_read`` maps a guarded global's source name to :func:`describe_global` of its
    value, ``scope`` names the module whose globals ``G`` is. Library code (torch,
    safecompile) is left out: its version is in the artifact key."""
    sources: dict[tuple[str, str], str] = {}
    for item in inlined:
        module = str(item.module)
        if module.partition(".")[0] in _LIBRARY_ROOTS:
            continue
        name = _qualname_at(str(item.content), int(item.firstlineno))
        text = _text_of(str(item.content), name)
        sources[(module, name)] = _digest(text)
    return {
        "version": RECORD_VERSION,
        "sources": [
            {"module": module, "qualname": name, "sha256": digest}
            for (module, name), digest in sorted(sources.items())
        ],
        "scope": scope,
        "globals": dict(sorted(globals_read.items())),
    }


def stale_reasons(entry: Mapping[str, Any], scope: Mapping[str, Any] | None = None) -> list[str]:
    """Why a stored precompiled function does not match the code importable here: one line
    per changed function (``helpers.py: act changed``) or global; ``[]`` when it is current.

    ``entry`` is one element of the precompiled verdict's ``details["graphs"]`` (or its
    ``"code"`` record). ``scope`` is the globals ``G`` reads (default: the recorded module's,
    imported). Modules are imported by name when not loaded yet, as torch's loader does.
    An entry without a record (saved by an older safecompile) is stale. Never raises."""
    record = entry.get("code", entry)
    if not isinstance(record, Mapping) or record.get("version") != RECORD_VERSION:
        return ["saved without a record of the code it came from"]
    reasons: list[str] = []
    for source in record.get("sources", []):
        try:
            reasons.extend(_source_changed(source))
        except Exception as exc:  # an odd record: stale, never a crash
            reasons.append(f"{source!r}: cannot be checked ({type(exc).__name__}: {exc})")
    if record.get("globals"):
        try:
            g = scope if scope is not None else vars(_module(str(record.get("scope"))))
        except Exception as exc:
            return [*reasons, f"module {record.get('scope')!r}: {type(exc).__name__}: {exc}"]
        for name, was in record["globals"].items():
            now = _read_global(str(name), g)
            if now != was:
                reasons.append(f"{name}: was {was}, now {now}")
    return reasons


def describe_global(value: object) -> str:
    """What a global a guard read holds, as text equal in every process for equal code:
    a module by name, a function or class by module and qualified name, a number, string
    or container by value (functions in it by name), any other object by its class (a
    partial's function and arguments are guards of their own)."""
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType | type):
        return f"{type(value).__name__} {value.__module__}.{value.__qualname__}"
    if isinstance(value, types.MethodType):
        return f"method {describe_global(value.__func__)} of {describe_global(value.__self__)}"
    if isinstance(value, dict | list | tuple):
        return _stable(value)
    if isinstance(value, type(None) | bool | int | float | str | bytes | complex):
        return _stable(value)
    return f"an instance of {type(value).__module__}.{type(value).__qualname__}"


def _source_changed(source: Mapping[str, Any]) -> list[str]:
    module_name, name = str(source["module"]), str(source["qualname"])
    try:
        module = _module(module_name)
        content = inspect.getsource(module)
    except Exception as exc:
        return [f"{module_name}: not importable here ({type(exc).__name__}: {exc})"]
    where = getattr(module, "__file__", None) or module_name
    text = _text_of(content, name)
    if text is None:
        return [f"{where}: {name} is gone"]
    if _digest(text) != source["sha256"]:
        return [f"{where}: {name} changed"]
    return []


def _module(name: str) -> types.ModuleType:
    found = sys.modules.get(name)
    return found if found is not None else importlib.import_module(name)


def _read_global(name: str, scope: Mapping[str, Any]) -> str:
    """The global a guard's source name (``G['m'].f``, ``G['d']['k']``) names, described;
    the source name is one this module saved, in a signed record."""
    env = {"__builtins__": builtins, **torchcompat.closure_vars(), "G": _Globals(scope)}
    try:
        return describe_global(eval(name, env))  # our own source name, in a signed record
    except Exception as exc:
        return f"unreadable ({type(exc).__name__})"


class _Globals(dict[str, Any]):
    """A module's globals, plus the names dynamo adds to them for its guards, which a new
    process has not made yet: a module's alias (``__import_a_dot_b``: module ``a.b``) and
    the builtins (``__builtins_dict___2``). checked: 2.13.0
    (``InstructionTranslator.import_source``, ``install_builtins_dict_in_fglobals``)"""

    def __missing__(self, name: str) -> Any:
        if name.startswith("__import_"):
            return _module(name.removeprefix("__import_").replace("_dot_", "."))
        if name.startswith("__builtins_dict__"):
            found = self.get("__builtins__", builtins)
            return vars(found) if isinstance(found, types.ModuleType) else found
        raise KeyError(name)


def _digest(text: str | None) -> str:
    return hashlib.sha256((text or "").encode()).hexdigest()


@functools.lru_cache(maxsize=64)  # a module's text, parsed once for all its functions
def _defs(content: str) -> tuple[tuple[str, int, int], ...]:
    """Every function and class of a module's source: (qualified name, first line with its
    decorators, last line)."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                found.append((name, first, child.end_lineno or child.lineno))
                inner = "." if isinstance(child, ast.ClassDef) else ".<locals>."
                visit(child, f"{name}{inner}")
            else:
                visit(child, prefix)

    visit(ast.parse(content), "")
    return tuple(found)


_MODULE = "<module>"  # code at no def's first line (a module-level lambda): the whole module


def _qualname_at(content: str, line: int) -> str:
    """The qualified name of the innermost def starting at ``line``; a lambda or
    comprehension's enclosing def (its text holds theirs); the module if none."""
    defs = _defs(content)
    starting = [d for d in defs if d[1] == line]
    if starting:
        return max(starting, key=lambda d: d[1] - d[2])[0]  # the innermost: the shortest
    enclosing = [d for d in defs if d[1] <= line <= d[2]]
    return max(enclosing, key=lambda d: d[1] - d[2])[0] if enclosing else _MODULE


def _text_of(content: str, name: str) -> str | None:
    """The source text of every def named ``name`` (its decorators included), joined; the
    whole module for :data:`_MODULE`; ``None`` if there is none."""
    if name == _MODULE:
        return content
    lines = content.splitlines(keepends=True)
    spans = [(first, last) for qual, first, last in _defs(content) if qual == name]
    if not spans:
        return None
    return "\x00".join("".join(lines[first - 1 : last]) for first, last in spans)
