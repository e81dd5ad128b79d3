"""A griffe extension for the docs site: signatures show what a user may write.

The reference renders signatures from the source, which names module-private defaults
(``shadow: Shadow | None = _DEFAULT_SHADOW``), private dataclass fields
(``FakeClock(_lock=...)``) and a catch-all ``**unknown: object`` that only exists so a
misspelled option gets a helpful error. Once the package is loaded, this:

- renders a default that names a private object as its value: ``Shadow()`` when it equals
  its class built with no arguments, else its ``repr``;
- drops parameters whose name starts with an underscore, and a class's private
  attributes (so a dataclass's ``__init__``, made from its fields, has none);
- drops a ``**kwargs`` annotated ``object`` (a catch-all, not an option).
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

_PRIVATE = re.compile(r"(?<![\w.])_[A-Za-z]\w*")


class PublicSignatures(griffe.Extension):
    """Rewrite every function's parameters once the whole package is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Called once the package and its members are loaded."""
        for function in _functions(pkg):
            _clean(function)


def _functions(obj: griffe.Object, seen: set[str] | None = None) -> list[griffe.Function]:
    """Every function and method under ``obj``, aliases skipped."""
    seen = set() if seen is None else seen
    found: list[griffe.Function] = []
    for member in obj.members.values():
        if member.is_alias or member.path in seen:
            continue
        seen.add(member.path)
        if isinstance(member, griffe.Function):
            found.append(member)
        elif isinstance(member, (griffe.Class, griffe.Module)):
            if isinstance(member, griffe.Class):
                _drop_private_attributes(member)
                _readable_field_defaults(member)
            found.extend(_functions(member, seen))
    return found


def _drop_private_attributes(cls: griffe.Class) -> None:
    private = [
        name
        for name, member in cls.members.items()
        if name.startswith("_") and not name.startswith("__") and member.is_attribute
    ]
    for name in private:
        del cls.members[name]


def _readable_field_defaults(cls: griffe.Class) -> None:
    """A class attribute (a dataclass field's default) that names a private object."""
    for name, member in cls.members.items():
        if member.is_attribute and member.value is not None and _PRIVATE.search(str(member.value)):
            runtime = getattr(importlib.import_module(cls.module.path), cls.name, None)
            if runtime is not None and name in vars(runtime):  # a class-level default
                member.value = _render(vars(runtime)[name])


def _clean(function: griffe.Function) -> None:
    for parameter in list(function.parameters):
        if parameter.name.startswith("_") or (
            parameter.kind is griffe.ParameterKind.var_keyword
            and str(parameter.annotation) == "object"
        ):
            del function.parameters[parameter.name]
        elif parameter.default is not None and _PRIVATE.search(str(parameter.default)):
            parameter.default = _readable(function, parameter.name)


def _readable(function: griffe.Function, name: str) -> str:
    """The runtime default of one parameter, as a user would write it."""
    owner = function.parent
    target = function.name if not isinstance(owner, griffe.Class) else None
    module = importlib.import_module(function.module.path)
    obj = getattr(module, target) if target else getattr(module, owner.name)
    if not target:
        obj = getattr(obj, function.name)
    return _render(inspect.signature(inspect.unwrap(obj)).parameters[name].default)


def _render(value: object) -> str:
    """As a user writes it: ``Shadow()`` for a value equal to its class built with no
    arguments, ``time.perf_counter`` for a function, else its repr."""
    if value is None or isinstance(value, (bool, int, float, str, tuple)):
        return repr(value)
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    try:
        if type(value)() == value:
            return f"{type(value).__name__}()"
    except TypeError:
        pass
    return repr(value)
