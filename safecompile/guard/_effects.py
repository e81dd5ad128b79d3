"""The Python objects a graph's frame updates (a KV cache layer, a config, a list
argument): read from dynamo's record of side effects while the graph is compiled, and
found again in the running frame when a check must copy them first.
"""

from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass
from typing import Any

from safecompile.base import torchcompat
from safecompile.observe.log import torch_missing

__all__ = ["Effect", "find_effects", "frame_key", "outside_effects"]


@dataclass(frozen=True, slots=True)
class Effect:
    """A Python object the graph's frame updates, by dynamo's record of its side effects
    (a KV cache layer, a config, a list argument): how to find it again at run time."""

    name: str  # dynamo's name for it, e.g. ``L['kwargs']['cache'].layers[0]``
    source: Any  # dynamo's ``Source``, read back against the running frame (``None``:
    # the frame's globals dict itself, for a ``global`` statement's store)
    keys: tuple[str, ...] | None  # the attributes (or globals) it stores; None: its items


_MODULE_STATE = ("_buffers", "_parameters", "_modules")


def outside_effects() -> tuple[tuple[Effect, ...], str | None]:
    """The Python objects the frame being compiled updates (dynamo's record of its side
    effects) as :class:`Effect`, and the name of one that cannot be found again (``None``:
    none). Left out: objects the frame creates, module state (a check puts it back
    itself: :mod:`safecompile.checks.snapshot`), the frame's own ``*args``/``**kwargs``."""
    try:
        dynamo = torchcompat.side_effects()
        if isinstance(dynamo, torchcompat.Missing):
            torch_missing(dynamo)
            return (), "dynamo's side-effect record (not readable in this torch)"
        if dynamo is None:
            return (), None
        code = dynamo.code
        packed = set(code.co_varnames[code.co_argcount + code.co_kwonlyargcount :][:2])
        found: list[Effect] = []
        for var in dynamo.modified:
            effect = _effect_of(var, dynamo, packed)
            if isinstance(effect, str):
                return tuple(found), effect
            if effect is not None:
                found.append(effect)
    except Exception as exc:  # not readable: a check cannot know what to put back
        return (), f"dynamo's record of side effects ({type(exc).__name__})"
    return tuple(found), None


def _effect_of(var: Any, dynamo: torchcompat.SideEffects, packed: set[str]) -> Effect | str | None:
    """One of dynamo's modified variables as an :class:`Effect`; ``None`` when it is left
    out (see :func:`outside_effects`); its name when it cannot be found again."""
    if isinstance(var.mutation_type, dynamo.new_objects) or isinstance(var, dynamo.modules):
        return None
    source: Any = var.source
    if source is None:
        return str(type(var).__name__)
    base: Any = source
    while getattr(base, "base", None) is not None:
        base = base.base
    local = isinstance(base, dynamo.local_source)
    if source is base and local and getattr(base, "local_name", None) in packed:
        return None  # the frame's own *args / **kwargs container
    name = _source_name(source)
    if any(part in name for part in _MODULE_STATE):
        return None
    if not (local or isinstance(base, dynamo.global_source)):
        return name
    stores = dynamo.stored_attributes.get(var)
    keys = tuple(str(k) for k in stores) if stores else None
    new_global = type(var).__name__ == torchcompat.NEW_GLOBAL  # `global x; x = ...`
    return Effect(name, None if new_global else source, keys)


def _source_name(source: Any) -> str:
    name = getattr(source, "name", "")
    return str(name() if callable(name) else name)


_FRAME_DEPTH = 32  # how far up from a graph's wrapper its frame may be


def find_effects(
    at: tuple[str, str, int] | None, effects: tuple[Effect, ...], code: str
) -> tuple[list[tuple[str, object, tuple[str, ...] | None]], str | None]:
    """At run time, just before a graph runs: the objects ``effects`` its frame (``at``,
    a :func:`frame_key`; of the function ``code``) will update, read back from the running
    frame (dynamo's transformed code keeps the frame's locals and globals). Also the name
    of the first one that could not be found (``None``: all)."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(_FRAME_DEPTH):
        if frame is None or frame_key(frame.f_code) == at:
            break
        frame = frame.f_back
    if frame is None or frame_key(frame.f_code) != at:
        return [], f"the frame of {code} (not found on the stack)"
    scope: dict[str, Any] = {"L": frame.f_locals, "G": frame.f_globals}
    names = _closure_names()
    cache: dict[Any, Any] = {}
    found: list[tuple[str, object, tuple[str, ...] | None]] = []
    for effect in effects:
        try:
            if effect.source is None:
                found.append((effect.name, frame.f_globals, effect.keys))
            else:
                value = torchcompat.source_value(effect.source, names, dict(scope), cache)
                if isinstance(value, torchcompat.Missing):
                    torch_missing(value)
                    return found, effect.name
                found.append((effect.name, value, effect.keys))
        except Exception:
            return found, effect.name
    return found, None


# the helpers dynamo's source names may call (``___odict_getitem``...)
_closure_names = functools.cache(torchcompat.closure_vars)


def frame_key(code: types.CodeType) -> tuple[str, str, int]:
    return (code.co_name, code.co_filename, code.co_firstlineno)
