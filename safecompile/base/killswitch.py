"""The kill switch: ``SAFECOMPILE_DISABLE`` in the environment, and ``disable()``/``enable()``.

The environment is re-read on every guarded call, so a change to ``os.environ`` takes
effect at the next call. Reading it must cost next to nothing: ``os.environ.get`` encodes
the key and decodes the value on each call (~0.9 µs here), so we look the raw value up in
``os.environ``'s backing dict, whose value object only changes when the variable is set.
"""

from __future__ import annotations

import fnmatch
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "ENV_VAR",
    "Rule",
    "disable",
    "enable",
    "env_token",
    "is_disabled",
    "parse",
    "set_watched",
]

ENV_VAR = "SAFECOMPILE_DISABLE"

_OFF = frozenset({"", "0", "false", "no", "off"})
_ALL = frozenset({"1", "true", "yes", "on", "all", "*"})

_ENV_DATA: Mapping[object, object] | None = getattr(os.environ, "_data", None)
_ENV_KEY: object = os.environ.encodekey(ENV_VAR) if _ENV_DATA is not None else ENV_VAR


def env_token() -> object:
    """The environment's raw value, an object that stays identical while it is unchanged."""
    if _ENV_DATA is not None:
        return _ENV_DATA.get(_ENV_KEY)
    return os.environ.get(ENV_VAR)  # pragma: no cover - platforms without os.environ._data


@dataclass(frozen=True, slots=True)
class Rule:
    """Which guarded callables are disabled: all of them, or those matching a pattern."""

    everything: bool = False
    patterns: tuple[str, ...] = ()

    def matches(self, name: str) -> bool:
        """Whether the callable named ``name`` is disabled by this rule."""
        return self.everything or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


NOTHING = Rule()
EVERYTHING = Rule(everything=True)


def parse(value: str | bytes | None) -> Rule:
    """Parse ``SAFECOMPILE_DISABLE``: off words, all words, or comma-separated names/globs."""
    if value is None:
        return NOTHING
    if isinstance(value, bytes):
        value = os.fsdecode(value)
    text = value.strip()
    if text.lower() in _OFF:
        return NOTHING
    if text.lower() in _ALL:
        return EVERYTHING
    patterns = tuple(p.strip() for p in text.split(",") if p.strip())
    return Rule(patterns=patterns) if patterns else NOTHING


class _CodeSwitch:
    """What ``disable()`` / ``enable()`` set from code, and what the fleet's watched source
    says (``watched``, see :mod:`._fleetswitch`); a generation number marks changes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rule = NOTHING
        self.watched = NOTHING
        self.generation = 0

    def matches(self, name: str) -> bool:
        """Whether code or the watched source disables the callable named ``name``."""
        return self.rule.matches(name) or self.watched.matches(name)


SWITCH = _CodeSwitch()


def disable(names: str | Iterable[str] = "*") -> None:
    """Run guarded callables eager from their next call: all (default), or those named.

    ``names`` is one name or glob (``"ranker.*"``), or several. Adds to what the
    environment variable disables; ``enable()`` undoes what code disabled.
    """
    patterns = (names,) if isinstance(names, str) else tuple(names)
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"disable() takes names or globs as strings, got {pattern!r}")
    rule = EVERYTHING if "*" in patterns else Rule(patterns=patterns)
    with SWITCH.lock:
        if not SWITCH.rule.everything and not rule.everything:
            merged = tuple(dict.fromkeys(SWITCH.rule.patterns + rule.patterns))
            rule = Rule(patterns=merged)
        elif SWITCH.rule.everything:
            rule = EVERYTHING
        SWITCH.rule = rule
        SWITCH.generation += 1


def enable() -> None:
    """Undo ``disable()``. The environment variable, if set, still applies."""
    with SWITCH.lock:
        SWITCH.rule = NOTHING
        SWITCH.generation += 1


def set_watched(rule: Rule) -> bool:
    """Install what the fleet's watched source disables; ``True`` when that changed (the
    generation moves, so running callables re-read the switch at their next call)."""
    with SWITCH.lock:
        if rule == SWITCH.watched:
            return False
        SWITCH.watched = rule
        SWITCH.generation += 1
        return True


def is_disabled(name: str) -> bool:
    """Whether the callable named ``name`` runs eager now (environment, code or the
    watched source)."""
    token = env_token()
    env_rule = parse(token if isinstance(token, str | bytes) else None)
    return env_rule.matches(name) or SWITCH.matches(name)
