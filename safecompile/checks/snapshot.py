"""State around a checked call: what the compiled run changed, undone before eager runs.

Eager reruns on the caller's own state, which the compiled run already updated (inputs
and buffers in place, a module's rebound buffers and attributes, Python objects its frame
stores into). A :class:`Snapshot` taken before the first graph tells what changed; the
check swaps it back, runs eager, compares both updates, and on a pass keeps the compiled
run's. Python objects are copied with tensors cloned (CUDA graphs reuse a pool).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from safecompile.base import torchcompat
from safecompile.base.torchcompat import pytree
from safecompile.observe.log import torch_missing

__all__ = ["After", "Snapshot", "contents_of"]


def _plain_attrs(module: torch.nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}


@dataclass(slots=True)
class _ModuleState:
    module: torch.nn.Module
    name: str  # its path from the guarded module's class, for messages
    buffers: dict[str, torch.Tensor | None]
    attrs: dict[str, Any]


@dataclass(slots=True)
class After:
    """The compiled run's state updates, set aside while eager runs."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # (live tensor, compiled's value)
    # (the object, what the compiled run left in it, what eager left in it); a module's
    # buffers and its plain attributes are two, keyed by the names a run rebound
    objects: list[tuple[_Object, Any, Any]]
    versions: tuple[int, ...] = ()  # each of ``tensors``' version after the compiled run

    def compiled_value(self, value: Any) -> Any:
        """``value`` as the compiled run left it: a tensor it updated in place (put back
        since, for eager) is read from the copy of its compiled value (a CUDA graph's
        static output fed back as state is compared with what the compiled run wrote)."""
        saved = {id(t): v for t, v in self.tensors}
        if not saved:
            return value
        return pytree.tree_map_only(torch.Tensor, lambda t: saved.get(id(t), t), value)

    def object_states(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What the compiled run and eager left in each Python object, by its name."""
        compiled = {o.name: _comparable(self.compiled_value(c)) for o, c, _ in self.objects}
        return compiled, {o.name: _comparable(e) for o, _, e in self.objects}

    def keep_compiled(self) -> None:
        """The check passed: the caller keeps the state its compiled outputs came with,
        and the version counters it left: the outputs' backward may have saved those
        tensors, and their bytes are the compiled run's again."""
        with torch.no_grad():
            for t, compiled in self.tensors:
                t.copy_(compiled)
        if self.versions:
            live = tuple(t for t, _ in self.tensors)
            missing = torchcompat.set_versions(live, self.versions)
            if missing is not None:
                torch_missing(missing)
        for o, compiled, _ in self.objects:
            _put(o.obj, o.keys, compiled)

    def tensor_states(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What the compiled run and eager left in the tensors updated in place."""
        moved = self._moved()
        kept = [(t, v) for t, v in self.tensors if id(t) not in moved]
        return [v for _, v in kept], [t for t, _ in kept]

    def _moved(self) -> set[int]:
        """Tensors updated in place whose place (a buffer, an object's attribute) either
        run rebound: compared by their place (the two runs may alias differently)."""
        moved: set[int] = set()
        for o, compiled, eager in self.objects:
            if isinstance(compiled, dict) and isinstance(eager, dict):
                moved.update(id(v) for k, v in compiled.items() if v is not eager.get(k, ABSENT))
                moved.update(
                    id(v)
                    for k, v in o.refs.items()
                    if v is not compiled.get(k, ABSENT) or v is not eager.get(k, ABSENT)
                )
        return moved


@dataclass(slots=True)
class Snapshot:
    """References, versions (and, for graphs known to update in place, values) of state."""

    tensors: list[tuple[torch.Tensor, int, torch.Tensor | None]] = field(default_factory=list)
    modules: list[_ModuleState] = field(default_factory=list)
    objects: list[_Object] = field(default_factory=list)
    problem: str | None = None  # a named object that could not be found or copied
    by_value: bool = False  # CUDA graphs: replays write inputs without a version bump
    _updated: list[tuple[torch.Tensor, int, torch.Tensor | None]] | None = None

    @classmethod
    def take(
        cls,
        graph_args: tuple[Any, ...],
        module: torch.nn.Module | None,
        *,
        copy: bool,
        by_value: bool = False,
    ) -> Snapshot:
        """Before the first graph of a checked call runs: the state it may change."""
        seen: set[int] = set()
        tensors: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []

        def add(t: object) -> None:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                keep = copy and not isinstance(t, torch.nn.Parameter)
                tensors.append((t, t._version, t.detach().clone() if keep else None))

        for arg in graph_args:
            add(arg)
        modules = []
        if module is not None:
            root = type(module).__name__
            for path, sub in module.named_modules():
                for buffer in sub._buffers.values():
                    add(buffer)
                name = f"{root}.{path}" if path else root
                modules.append(_ModuleState(sub, name, dict(sub._buffers), _plain_attrs(sub)))
        return cls(tensors, modules, by_value=by_value)

    def add_objects(self, found: list[tuple[str, Any, Keys]], lost: str | None = None) -> None:
        """Before a graph runs: copy the Python objects its frame will update; ``lost``
        names one that could not be found."""
        for name, obj, keys in found:
            if any(o.obj is obj and o.keys == keys for o in self.objects):
                continue  # an earlier graph of the call named it: its copy is older
            try:
                refs = contents_of(obj, keys)
            except TypeError:
                self.problem = self.problem or f"{name} ({type(obj).__name__})"
                continue
            self.objects.append(_Object(name, obj, keys, refs, _cloned(refs)))
        if lost is not None:
            self.problem = self.problem or lost

    def changed(self) -> bool:
        """Whether anything differs from when the snapshot was taken."""
        return (
            bool(self._in_place())
            or any(_moves(m) for m in self.modules)
            or any(_differs(o.refs, contents_of(o.obj, o.keys)) for o in self.objects)
        )

    def unrestorable(self) -> str | None:
        """Why the state cannot be put back (``None``: it can)."""
        for t, _, saved in self._in_place():
            if isinstance(t, torch.nn.Parameter):
                return "it updates a parameter in place"
            if saved is None:
                return "it updates a tensor in place"
        return None

    def swap_back(self) -> After:
        """Set the compiled run's updates aside and put the state back as it was."""
        tensors = []
        versions = []
        with torch.no_grad():
            for t, _, saved in self._in_place():
                assert saved is not None
                tensors.append((t, t.detach().clone()))
                versions.append(t._version)
                t.copy_(saved)
        moved = [o for m in self.modules for o in _moves(m)]
        objects = []
        for o in [*moved, *self.objects]:  # every named object: eager may update it alone
            objects.append((o, contents_of(o.obj, o.keys), None))
            _put(o.obj, o.keys, o.copies, unless=o.refs)
        return After(tensors, objects, tuple(versions))

    def settle(self, after: After) -> After:
        """After eager ran: fill in eager's side of every update, for the comparison; a
        module's buffer or attribute that eager alone rebound joins its place's keys."""
        objects = [(o, c) for o, c, _ in after.objects]
        for place in [o for m in self.modules for o in _moves(m)]:
            i = next((i for i, (o, _) in enumerate(objects) if o.obj is place.obj), None)
            if i is None:
                objects.append((place, place.refs))  # the compiled run left it as it was
                continue
            o, compiled = objects[i]
            if extra := {k: v for k, v in place.refs.items() if k not in (o.keys or ())}:
                o = _Object(o.name, o.obj, (*(o.keys or ()), *extra), {**o.refs, **extra}, None)
                objects[i] = (o, {**compiled, **extra})
        after.objects = [(o, c, contents_of(o.obj, o.keys)) for o, c in objects]
        return after

    def _in_place(self) -> list[tuple[torch.Tensor, int, torch.Tensor | None]]:
        """The tensors updated in place since the snapshot (version moved, or with
        ``by_value`` values differ); read once, before anything is put back."""
        if self._updated is None:
            self._updated = [
                (t, version, saved)
                for t, version, saved in self.tensors
                if t._version != version
                or (self.by_value and saved is not None and not _equal(t, saved))
            ]
        return self._updated


def _moves(m: _ModuleState) -> list[_Object]:
    """A module's places (its buffers, its plain attributes) with a name rebound since the
    snapshot, each as an object keyed by those names, holding what they held."""
    found = []
    for name, obj, before, now in (
        (f"{m.name}._buffers", m.module._buffers, m.buffers, m.module._buffers),
        (m.name, m.module, m.attrs, _plain_attrs(m.module)),
    ):
        changed = now.keys() | before.keys()
        keys = sorted(k for k in changed if now.get(k, ABSENT) is not before.get(k, ABSENT))
        if keys:
            held = {k: before.get(k, ABSENT) for k in keys}
            found.append(_Object(name, obj, tuple(keys), held, held))
    return found


# ---------------------------------------------------------------- Python objects

ABSENT = "<absent>"  # an attribute, global or key the object did not have
Keys = tuple[str, ...] | None


@dataclass(slots=True)
class _Object:
    """A Python object the graph's frame updates, and what it held before the call."""

    name: str  # dynamo's name for it
    obj: Any
    keys: Keys  # the attributes (or dict keys) its frame stores; None: all its items
    refs: Any  # what it held (references): a dict of keys, or a list
    copies: Any  # the same with tensors cloned: what eager reruns on


def contents_of(obj: Any, keys: Keys) -> Any:
    """What an object holds, as references: a list's or set's items, a dict's (or its
    ``keys``), or the attributes ``keys`` (all of ``vars()`` when ``None``); else
    ``TypeError``."""
    if isinstance(obj, list):
        return list(obj)
    if isinstance(obj, set):
        return set(obj)
    if isinstance(obj, dict):
        return dict(obj) if keys is None else {k: obj.get(k, ABSENT) for k in keys}
    held = getattr(obj, "__dict__", None)
    if keys is None:
        if isinstance(held, dict):
            return dict(held)
        raise TypeError(f"{type(obj).__name__} has no attributes to copy")
    if isinstance(held, dict):
        return {k: held[k] if k in held else getattr(obj, k, ABSENT) for k in keys}
    return {k: getattr(obj, k, ABSENT) for k in keys}


def _put(obj: Any, keys: Keys, target: Any, *, unless: Any = None) -> None:
    """Make the object hold ``target`` again, writing only what differs. An entry still
    holding its value from ``unless`` is left alone: a tensor updated in place is put
    back by value, and eager must update that very tensor."""
    if isinstance(obj, list | set):
        if unless is None or _differs(unless, contents_of(obj, keys)):
            obj.clear()
            if isinstance(obj, list):
                obj.extend(target)
            else:
                obj.update(target)
        return
    now = contents_of(obj, keys)
    held = obj if isinstance(obj, dict) else getattr(obj, "__dict__", None)
    for k in now.keys() | target.keys():
        value = target.get(k, ABSENT)
        current = now.get(k, ABSENT)
        if current is value or (unless is not None and current is unless.get(k, ABSENT)):
            continue
        if isinstance(held, dict):
            if value is ABSENT:
                held.pop(k, None)
            else:
                held[k] = value
        elif value is ABSENT:
            delattr(obj, k)  # a class's attribute, or a slot
        else:
            setattr(obj, k, value)


def _equal(t: torch.Tensor, saved: torch.Tensor) -> bool:
    try:
        return bool(torch.equal(t, saved))
    except Exception:  # a tensor that cannot be read back: count it as updated
        return False


def _cloned(contents: Any) -> Any:
    def clone(v: Any) -> Any:
        return v.detach().clone() if isinstance(v, torch.Tensor) else v

    if isinstance(contents, list):
        return [clone(v) for v in contents]
    if isinstance(contents, set):
        return set(contents)
    return {k: clone(v) for k, v in contents.items()}


def _same(a: Any, b: Any) -> bool:
    """The same object, or an equal plain value (a setting stored again is no update)."""
    if a is b:
        return True
    if type(a) is not type(b) or not isinstance(a, str | int | float | bool | bytes | tuple):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def _differs(before: Any, now: Any) -> bool:
    if isinstance(before, set):
        return bool(before != now)
    if isinstance(before, list):
        return len(before) != len(now) or any(
            not _same(a, b) for a, b in zip(before, now, strict=True)
        )
    return any(not _same(before.get(k, ABSENT), now.get(k, ABSENT)) for k in before.keys() | now)


def _comparable(contents: Any) -> Any:
    """Contents as :func:`~safecompile.checks.compare.compare` walks them (a set frozen)."""
    return frozenset(contents) if isinstance(contents, set) else contents
