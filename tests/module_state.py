"""The module-level mutable state of safecompile: what each module binds at import to an
object that changes while the process runs.

A module's top-level names (its assignments, outside functions and classes) are read from
its source; their values from the imported module. A name is state when its value is:

- ``lock``: a ``threading`` lock, condition, semaphore, event or barrier;
- ``thread-local``: a ``threading.local``; ``context-var``: a ``contextvars.ContextVar``;
- ``container``: a dict, list, set, deque, weak collection... that the package mutates (an
  item assigned or deleted, a mutating method called, an augmented assignment); a container
  nothing mutates is a ``table`` (a constant, not counted);
- ``object``: an instance of one of safecompile's classes that holds attributes and is not a
  frozen dataclass or an enum;
- ``cache``: a ``functools.cache``/``lru_cache`` function (its ``cache_info``);
- ``rebound``: any value a function rebinds through ``global``.

``safecompile/_autorun/sitecustomize.py`` is read, never imported (importing it installs an
import hook).

    python tests/module_state.py           # every state global, grouped by subpackage
    python tests/module_state.py --tables  # and the constant tables
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextvars
import dataclasses
import enum
import importlib
import threading
import weakref
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "safecompile"
NOT_IMPORTED = {"safecompile._autorun.sitecustomize"}

_LOCKS: tuple[type, ...] = (
    type(threading.Lock()),
    type(threading.RLock()),
    threading.Condition,
    threading.Semaphore,
    threading.Event,
    threading.Barrier,
)
_CONTAINERS: tuple[type, ...] = (
    dict,
    list,
    set,
    bytearray,
    collections.deque,
    weakref.WeakSet,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
)
_MUTATORS = frozenset(
    {
        "add",
        "append",
        "appendleft",
        "clear",
        "discard",
        "extend",
        "insert",
        "pop",
        "popitem",
        "popleft",
        "remove",
        "setdefault",
        "update",
    }
)


@dataclasses.dataclass(frozen=True)
class Found:
    module: str  # safecompile.persist.remote
    name: str
    kind: str  # lock, thread-local, container, object, cache, rebound; or table

    @property
    def subpackage(self) -> str:
        """``persist``, ``guard``...; a top-level module's own name (``runner``)."""
        parts = self.module.split(".")
        return parts[1] if len(parts) > 1 else "__init__"

    @property
    def key(self) -> str:
        """``persist/remote.py:_links``: how the allow-list names it."""
        path = str(modules()[self.module].relative_to(PACKAGE))
        return f"{path}:{self.name}"


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _top_level(body: list[ast.stmt]) -> dict[str, ast.AST | None]:
    """The names a module body binds (through ``if``/``try``/``with`` too), each with the
    expression bound to it (``None``: unpacked or bound otherwise)."""
    names: dict[str, ast.AST | None] = {}
    for stmt in body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = stmt.value
                elif isinstance(target, ast.Tuple):
                    names.update({e.id: None for e in target.elts if isinstance(e, ast.Name)})
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if stmt.value is not None:
                names[stmt.target.id] = stmt.value
        elif isinstance(stmt, ast.If | ast.Try | ast.With):
            for inner in ("body", "orelse", "finalbody", "handlers"):
                for part in getattr(stmt, inner, []):
                    block = part.body if isinstance(part, ast.ExceptHandler) else [part]
                    names.update(_top_level(block))
    return names


def _defined(body: list[ast.stmt]) -> set[str]:
    """The functions a module body defines."""
    return {s.name for s in body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)}


def _mutated(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The names a module mutates (item store/delete, a mutating method, ``+=``) and the
    names its functions rebind through ``global``."""
    mutated: set[str] = set()
    rebound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            rebound.update(node.names)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            if isinstance(node.value, ast.Name):
                mutated.add(node.value.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and node.func.attr in _MUTATORS:
                mutated.add(owner.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            mutated.add(node.target.id)
    return mutated, rebound


def _has_state(value: object) -> bool:
    """Whether ``value`` is an instance of a safecompile class that can change."""
    cls = type(value)
    if not cls.__module__.startswith("safecompile") or isinstance(value, type | enum.Enum):
        return False
    params = getattr(cls, "__dataclass_params__", None)
    if params is not None and params.frozen:
        return False
    slots = [s for k in cls.__mro__ for s in getattr(k, "__slots__", ())]
    return bool(getattr(value, "__dict__", None)) or bool(slots)


_KINDS: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("lock", _LOCKS),
    ("thread-local", (threading.local,)),
    ("context-var", (contextvars.ContextVar,)),
)


def _kind(value: object, name: str, mutated: set[str]) -> str | None:
    kind = next((k for k, types in _KINDS if isinstance(value, types)), None)
    if kind is None and callable(value) and hasattr(value, "cache_info"):
        kind = "cache"
    elif kind is None and isinstance(value, _CONTAINERS):
        kind = "container" if name in mutated else "table"
    elif kind is None and _has_state(value):
        kind = "object"
    return kind


def scan(*, tables: bool = False) -> list[Found]:
    """Every state global of the package (and its constant tables if ``tables``)."""
    found = []
    for dotted, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        mutated, rebound = _mutated(tree)
        names = _top_level(tree.body)
        module: Any = None if dotted in NOT_IMPORTED else importlib.import_module(dotted)
        for name in sorted((set(names) | _defined(tree.body)) - {"__all__"}):
            if module is None:
                kind = _static_kind(names.get(name), name, mutated, tree)
            else:
                kind = _kind(getattr(module, name, None), name, mutated)
            if kind is None and name in rebound and name in names:
                kind = "rebound"
            if kind is not None and (tables or kind != "table"):
                found.append(Found(dotted, name, kind))
    return found


def _static_kind(
    expr: ast.AST | None, name: str, mutated: set[str], tree: ast.Module
) -> str | None:
    """A guess from the source alone: a call of a lock, a container literal, an instance of
    a class that sets attributes on itself."""
    if isinstance(expr, ast.Dict | ast.List | ast.Set):
        return "container" if name in mutated else "table"
    if isinstance(expr, ast.Call):
        called = ast.unparse(expr.func)
        if called.split(".")[-1] in {"Lock", "RLock", "Condition", "Event", "Semaphore"}:
            return "lock"
        if called in {"dict", "list", "set", "collections.deque"}:
            return "container" if name in mutated else "table"
        classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}
        if called in classes:
            sets = [
                n
                for n in ast.walk(classes[called])
                if isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
            ]
            return "object" if sets else None
        if called[:1].isupper() or (called.startswith("_") and called[1:2].isupper()):
            return "object"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", action="store_true", help="list the constant tables too")
    args = parser.parse_args()
    found = scan(tables=args.tables)
    by_package: dict[str, list[Found]] = collections.defaultdict(list)
    for item in found:
        by_package[item.subpackage].append(item)
    for package, items in sorted(by_package.items()):
        counted = [i for i in items if i.kind != "table"]
        kinds = collections.Counter(i.kind for i in counted)
        summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        print(f"{package}: {len(counted)}" + (f" ({summary})" if summary else ""))
        for item in items:
            print(f"    {item.key:<48} {item.kind}")
    state = [i for i in found if i.kind != "table"]
    locks = sum(i.kind == "lock" for i in state)
    print(f"total: {len(state)} ({len(state) - locks} objects, {locks} locks)")


if __name__ == "__main__":
    main()
