"""Loading the doctor's target: import ``MODULE``, call ``FACTORY()``, check what it gave.

Every failure is a :class:`~safecompile.doctor.report.UsageError` whose one line names the
user's own line (never torch's or safecompile's: a factory that raises inside
``torch.load`` points at the factory's call).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from safecompile.observe.source import innermost_user_frame, is_user_file

from .report import DoctorTarget, Example, UsageError, where

__all__ = [
    "call_factory",
    "error_at",
    "load_target",
    "parse_inputs",
    "parse_sweep",
    "to_target",
    "user_traceback",
]

_INPUTS = (
    "a list of calls (each a tuple of arguments, a dict of keyword arguments or a tensor) "
    "or one call's tuple of arguments"
)


def to_target(value: object, factory: str = "FACTORY") -> DoctorTarget:
    """``FACTORY()``'s return value as a :class:`DoctorTarget` (:class:`UsageError` if not one).

    Accepted: a ``DoctorTarget``, or a pair ``(fn, inputs)``.
    """
    if isinstance(value, DoctorTarget):
        target = value
    elif isinstance(value, tuple) and len(value) == 2 and callable(value[0]):
        target = DoctorTarget(fn=value[0], inputs=value[1])
    else:
        hint = " (a callable without inputs: return (fn, inputs))" if callable(value) else ""
        raise UsageError(
            f"{factory}() returned {_kind(value)}{hint}; expected "
            f"DoctorTarget(fn=..., inputs=[...]) or a pair (fn, inputs), where inputs is {_INPUTS}"
        )
    if not callable(target.fn):
        raise UsageError(
            f"{factory}(): fn must be a function or an nn.Module, got {_kind(target.fn)}"
        )
    parse_inputs(target.inputs, f"{factory}(): inputs")  # refuse bad inputs now
    parse_sweep(target.sweep, f"{factory}(): sweep")
    return target


def parse_inputs(value: object, what: str = "inputs") -> tuple[Example, ...]:
    """The example calls in ``value`` (see :class:`DoctorTarget`); :class:`UsageError` if none."""
    if isinstance(value, torch.Tensor | tuple | Mapping):
        return (_one(value, what),)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        if not value:
            raise UsageError(f"{what} is empty: give at least one example call")
        return tuple(_one(item, f"{what}[{i}]") for i, item in enumerate(value))
    raise UsageError(f"{what} must be {_INPUTS}, got {_kind(value)}")


def parse_sweep(value: object, what: str = "sweep") -> tuple[Example, ...] | None:
    """A target's ``sweep``: ``None`` to guess one, ``()`` for none, else its calls."""
    if value is None:
        return None
    if isinstance(value, Sequence) and len(value) == 0:
        return ()
    return parse_inputs(value, what)


def _kind(value: object) -> str:
    if value is None:
        return "None"
    name = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _one(value: object, what: str) -> Example:
    if isinstance(value, torch.Tensor):
        return Example((value,))
    if isinstance(value, tuple):
        return Example(value)
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            raise UsageError(f"{what}: keyword argument names must be identifiers, got {bad[0]!r}")
        return Example((), dict(value))
    raise UsageError(
        f"{what} must be a tuple of positional arguments, a dict of keyword arguments or a "
        f"tensor, got {_kind(value)} (wrap one argument as (arg,))"
    )


def load_target(spec: str) -> DoctorTarget:
    """Import ``MODULE`` and call ``FACTORY()`` for ``spec = "MODULE:FACTORY"``.

    ``MODULE`` is a dotted module name (the current directory is importable, as with
    ``python -m``) or a path to a ``.py`` file; ``FACTORY`` may be dotted
    (``Class.method``). Every failure is a :class:`UsageError`.
    """
    value, attr = call_factory(spec)
    return to_target(value, attr)


def call_factory(spec: str) -> tuple[Any, str]:
    """``FACTORY()``'s return value and the factory's name, for ``spec = "MODULE:FACTORY"``
    (as :func:`load_target`, without checking what it returned)."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr or os.sep in attr:
        raise UsageError(
            f"expected MODULE:FACTORY (e.g. mypkg.models:doctor_target or "
            f"path/to/file.py:doctor_target), got {spec!r}"
        )
    module = _import(module_part)
    factory: Any = module
    for part in attr.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            raise UsageError(
                f"{module_part} has no attribute {attr!r} (looked for the factory in "
                f"{getattr(module, '__file__', module_part)})"
            ) from None
    if not callable(factory):
        raise UsageError(f"{spec} is {_kind(factory)}, not a callable factory")
    try:
        return factory(), attr
    except (Exception, SystemExit) as exc:
        raise _user_error(f"{attr}() raised ", exc) from exc


def _import(name: str) -> types.ModuleType:
    if name.endswith(".py") or "/" in name or os.sep in name:
        return _import_file(name)
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)  # what `python -m` does; a console script does not
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as exc:
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing is not None and (name == missing or name.startswith(missing + ".")):
            raise UsageError(
                f"cannot import {name!r}: no module named {missing!r} here (run from the folder "
                "that holds it, or give a file: path/to/file.py:FACTORY)"
            ) from None
        raise _user_error(f"cannot import {name!r}: ", exc) from exc


def _import_file(name: str) -> types.ModuleType:
    path = os.path.abspath(name)
    if not os.path.isfile(path):
        raise UsageError(f"no such file: {name}")
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and os.path.abspath(file) == path:
            return module  # already imported under its own name: the same objects
    stem = os.path.splitext(os.path.basename(path))[0]
    modname = (
        stem if stem.isidentifier() and stem not in sys.modules else f"_doctor_{abs(hash(path))}"
    )
    spec = importlib.util.spec_from_file_location(modname, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {name}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its sibling modules import, as when run as a script
    sys.modules[modname] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[modname]
        raise _user_error(f"cannot import {name}: ", exc) from exc
    return module


#: About the longest :func:`error_at` text (so a usage error is one line a person reads).
ERROR_LIMIT = 140
_MIN_MESSAGE = 40


def _user_error(prefix: str, exc: BaseException) -> UsageError:
    return UsageError(prefix + error_at(exc), detail=user_traceback(exc))


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` from the user's first frame on (safecompile's, torch's and
    the import machinery's are left out)."""
    tb = exc.__traceback__
    while tb is not None and not is_user_file(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def error_at(exc: BaseException) -> str:
    """``Type: message (at file:line in function)`` on one line, at most about
    :data:`ERROR_LIMIT` characters (the message is cut, never the place): the user's
    deepest frame (a factory that raises inside ``torch.load`` is located at its own
    call, not torch's)."""
    place = _place(exc)
    if isinstance(exc, SystemExit):
        text = f"SystemExit({exc.code!r}) (sys.exit() while the doctor loaded it)"
    else:
        name = type(exc).__name__
        budget = max(_MIN_MESSAGE, ERROR_LIMIT - len(name) - len(place or ""))
        message = " ".join(str(exc).split())
        if len(message) > budget:
            message = message[: budget - 1] + "\u2026"
        text = f"{name}: {message}" if message else name
    return f"{text} (at {place})" if place else text


def _place(exc: BaseException) -> str | None:
    """``file:line in function`` of the user's deepest frame of ``exc``, if any."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return where(exc.filename, exc.lineno, None)
    at = innermost_user_frame(traceback.extract_tb(exc.__traceback__))
    return where(at.file, at.line, at.function) if at is not None else None
