"""The kill switch: ``SAFECOMPILE_DISABLE`` in the environment, and ``disable()``/``enable()``.

The environment is re-read on every guarded call, so a change to ``os.environ`` takes
effect at the next call. Reading it must cost next to nothing: ``os.environ.get`` encodes
the key and decodes the value on each call (~0.9 µs here), so we look the raw value up in
``os.environ``'s backing dict, whose value object only changes when the variable is set.
"""

from __future__ import annotations

import fnmatch
import os
import re
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from safecompile.base.forks import in_forked_child

__all__ = [
    "ENV_VAR",
    "Rule",
    "disable",
    "doubts",
    "enable",
    "env_token",
    "is_disabled",
    "parse",
    "register",
    "set_watched",
    "source_of",
    "unwarned_doubts",
    "watch",
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


def _text(value: str | bytes) -> str:
    return os.fsdecode(value) if isinstance(value, bytes) else value


def parse(value: str | bytes | None) -> Rule:
    """Parse ``SAFECOMPILE_DISABLE``: off words, all words, or comma-separated names/globs."""
    if value is None:
        return NOTHING
    text = _text(value).strip()
    if text.lower() in _OFF:
        return NOTHING
    if text.lower() in _ALL:
        return EVERYTHING
    patterns = tuple(p.strip() for p in text.split(",") if p.strip())
    return Rule(patterns=patterns) if patterns else NOTHING


_SEPARATORS = re.compile(r"[;|\s]")
_GLOB = frozenset("*?[")


def doubts(
    value: str | bytes | None, names: Iterable[str], *, unmatched: bool = False
) -> list[tuple[str, str]]:
    """``(pattern, sentence)`` for each pattern of a ``SAFECOMPILE_DISABLE`` value that
    matches none of ``names`` and looks like a mistake; with ``unmatched``, every such
    pattern (asked only once the application's guards are built)."""
    if value is None:
        return []
    text = _text(value).strip()
    known = tuple(sorted(names))
    found: list[tuple[str, str]] = []
    for pattern in parse(text).patterns:  # none for the off and all words
        if not any(fnmatch.fnmatchcase(n, pattern) for n in known):
            doubt = _doubt(pattern, known, unmatched=unmatched)
            if doubt is not None:  # the consequence first, then why
                verdict, why = doubt
                head = f"{ENV_VAR}={text!r}" + ("" if pattern == text else f": {pattern!r}")
                found.append((pattern, f"{head} {verdict}: {why}"))
    return found


def _doubt(pattern: str, known: tuple[str, ...], *, unmatched: bool) -> tuple[str, str] | None:
    """What a pattern matching no guarded name does and why it looks wrong, if it does."""
    if _SEPARATORS.search(pattern):
        fixed = ",".join(p for p in _SEPARATORS.split(pattern) if p)
        return "disables nothing", (
            f"it was read as one name; separate names with commas ({fixed!r})"
        )
    if "." not in pattern and not _GLOB & set(pattern):
        return "disables nothing", (
            "it is neither a boolean (1/true/yes/on/all/* turn everything off, 0/false/no/off"
            " nothing) nor a guarded name"
        )
    folded = [n for n in known if fnmatch.fnmatchcase(n.lower(), pattern.lower())]
    if folded:
        return "disables nothing", (
            f"it matches no guarded name (names are case-sensitive; it would match {folded[0]!r})"
        )
    if unmatched:
        some = ", ".join(repr(n) for n in known[:3]) + (", ..." if len(known) > 3 else "")
        return "disables nothing here", (
            f"it matches none of the {len(known)} guarded names in this process ({some})"
        )
    return None


class _CodeSwitch:
    """What ``disable()`` / ``enable()`` and the fleet's watched source say (a generation
    number marks changes), the guarded names built so far and the doubts warned about."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rule = NOTHING
        self.watched = NOTHING
        self.watched_label = ""
        self.generation = 0
        self.names: set[str] = set()
        self.owners: dict[str, weakref.WeakSet[Any]] = {}  # the live guards of each name
        self.warned: set[str] = set()
        self.gates: weakref.WeakSet[Any] = weakref.WeakSet()  # see watch()
        self.stale = object()  # the token of a gate that must re-read (no environment value)

    def changed(self) -> None:
        """The code switch changed (under ``lock``): the generation moves, then every
        watched gate's token goes stale, so its next call re-reads the switch."""
        self.generation += 1
        for gate in self.gates:
            gate.token = self.stale


SWITCH = _CodeSwitch()


@in_forked_child
def _fresh_lock() -> None:
    SWITCH.lock = threading.Lock()  # another thread may have held it at the fork


def watch(gate: Any) -> None:
    """Have ``gate`` (an object with a ``token``: the environment's value it last read)
    re-read the switch after ``disable()``, ``enable()`` or a watched change, as after an
    environment change: its hot path compares that one token, nothing more."""
    with SWITCH.lock:
        SWITCH.gates.add(gate)


def disable(names: str | Iterable[str] = "*") -> None:
    """Run guarded callables eager from their next call: all (default), or those named.

    ``names`` is one name or glob (``"ranker.*"``), or several. Adds to what the
    environment variable disables; ``enable()`` undoes what code disabled.
    """
    patterns = (names,) if isinstance(names, str) else tuple(names)
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"disable() takes names or globs as strings, got {pattern!r}")
    with SWITCH.lock:
        if "*" in patterns or SWITCH.rule.everything:
            SWITCH.rule = EVERYTHING
        else:
            SWITCH.rule = Rule(patterns=tuple(dict.fromkeys(SWITCH.rule.patterns + patterns)))
        SWITCH.changed()


def enable() -> None:
    """Undo ``disable()``. The environment variable, if set, still applies."""
    with SWITCH.lock:
        SWITCH.rule = NOTHING
        SWITCH.changed()


def set_watched(rule: Rule, label: str | None = None) -> bool:
    """Install what the fleet's watched source (``label``, as messages name it) disables;
    ``True`` when that changed (the generation moves, so running callables re-read the
    switch at their next call)."""
    with SWITCH.lock:
        if label is not None:
            SWITCH.watched_label = label
        if rule == SWITCH.watched:
            return False
        SWITCH.watched = rule
        SWITCH.changed()
        return True


def register(name: str, owner: object) -> bool:
    """Note a guarded name (what :func:`doubts` checks patterns against), held by
    ``owner`` (weakly); ``True`` the first time in this process that a live guard
    already holds it (two guards sharing a name: the switch cannot tell them apart)."""
    with SWITCH.lock:
        SWITCH.names.add(name)
        owners = SWITCH.owners.setdefault(name, weakref.WeakSet())
        shared = len(owners) > 0 and f"\0shared\0{name}" not in SWITCH.warned
        owners.add(owner)
        if shared:
            SWITCH.warned.add(f"\0shared\0{name}")
    return shared


def unwarned_doubts(value: str | bytes | None, *, unmatched: bool = False) -> list[str]:
    """:func:`doubts` about ``value`` against every registered name, less those already
    returned once in this process (each is warned about once)."""
    with SWITCH.lock:
        names = tuple(SWITCH.names)
    found = doubts(value, names, unmatched=unmatched)
    if value is None or not found:
        return []
    text = _text(value)
    with SWITCH.lock:
        fresh = [(f"{text}\0{p}", d) for p, d in found if f"{text}\0{p}" not in SWITCH.warned]
        SWITCH.warned.update(key for key, _ in fresh)
    return [sentence for _, sentence in fresh]


def source_of(name: str, value: str | bytes | None) -> str | None:
    """Which switch disables ``name`` (``value`` being the environment's), in words:
    ``SAFECOMPILE_DISABLE='ranker.*'``, ``disable()`` or the watched source; ``None`` if
    none does."""
    if value is not None and parse(value).matches(name):
        return f"{ENV_VAR}={_text(value).strip()!r}"
    with SWITCH.lock:
        if SWITCH.rule.matches(name):
            return "disable()"
        if SWITCH.watched.matches(name):
            label = SWITCH.watched_label
            return f"the watched source {label}" if label else "the watched source"
    return None


def is_disabled(name: str) -> bool:
    """Whether the callable named ``name`` runs eager now (environment, code or the
    watched source)."""
    token = env_token()
    env_rule = parse(token if isinstance(token, str | bytes) else None)
    return env_rule.matches(name) or SWITCH.rule.matches(name) or SWITCH.watched.matches(name)
