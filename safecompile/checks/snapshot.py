"""State around a checked call: what the compiled run changed, undone before eager runs.

A shadow check runs eager *after* the compiled call, on the caller's own tensors (so a
fallback result carries the caller's gradients). When the compiled run updated state —
a module buffer in place (a step counter), a rebound buffer (a KV cache grown by
``torch.cat``), a plain module attribute, an input tensor in place — running eager on
top would apply the update twice. A :class:`Snapshot`, taken just before the first graph
of a checked call runs, tells what changed; the check then swaps the state back to how
it was, runs eager once, and compares the two updates as it compares outputs.

Tensor values are copied only for graphs seen to update tensors in place (learnt on
their first checked run, whose check is skipped); otherwise a snapshot holds
references and version counters only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["After", "Snapshot"]

_SKIP_ATTRS = frozenset({"_parameters", "_buffers", "_modules", "training"})


def _plain_attrs(module: torch.nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k not in _SKIP_ATTRS}


@dataclass(slots=True)
class _ModuleState:
    module: torch.nn.Module
    buffers: dict[str, torch.Tensor | None]
    attrs: dict[str, Any]


@dataclass(slots=True)
class After:
    """The compiled run's state updates, set aside while eager runs."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # (live tensor, compiled's value)
    # (module, name, compiled's value, eager's value), for rebound buffers and attributes
    rebound: list[tuple[torch.nn.Module, str, torch.Tensor | None, torch.Tensor | None]]
    attrs: list[tuple[torch.nn.Module, str, Any, Any]]

    def compiled_tensors(self) -> list[torch.Tensor | None]:
        return [v for _, v in self.tensors] + [c for _, _, c, _ in self.rebound]

    def eager_tensors(self) -> list[torch.Tensor | None]:
        return [t for t, _ in self.tensors] + [e for _, _, _, e in self.rebound]

    def attrs_differ(self) -> str | None:
        for _, name, compiled, eager in self.attrs:
            if isinstance(compiled, torch.Tensor) or isinstance(eager, torch.Tensor):
                continue
            try:
                same = bool(compiled == eager)
            except Exception:
                same = compiled is eager
            if not same:
                return f"module attribute {name} differs after the call"
        return None


@dataclass(slots=True)
class Snapshot:
    """References, versions (and, for graphs known to update in place, values) of state."""

    tensors: list[tuple[torch.Tensor, int, torch.Tensor | None]] = field(default_factory=list)
    modules: list[_ModuleState] = field(default_factory=list)

    @classmethod
    def take(
        cls, graph_args: tuple[Any, ...], module: torch.nn.Module | None, *, copy: bool
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
            for sub in module.modules():
                for buffer in sub._buffers.values():
                    add(buffer)
                modules.append(_ModuleState(sub, dict(sub._buffers), _plain_attrs(sub)))
        return cls(tensors, modules)

    def changed(self) -> bool:
        """Whether anything differs from when the snapshot was taken."""
        return bool(self._in_place()) or any(_rebound(m) or _changed_attrs(m) for m in self.modules)

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
        with torch.no_grad():
            for t, _, saved in self._in_place():
                assert saved is not None
                tensors.append((t, t.detach().clone()))
                t.copy_(saved)
        rebound: list[tuple[torch.nn.Module, str, torch.Tensor | None, torch.Tensor | None]]
        rebound = []
        attrs: list[tuple[torch.nn.Module, str, Any, Any]] = []
        for m in self.modules:
            now = m.module._buffers
            rebound.extend((m.module, name, now.get(name), None) for name in _rebound(m))
            now.clear()
            now.update(m.buffers)
            for name in _changed_attrs(m):
                attrs.append((m.module, name, getattr(m.module, name, None), None))
                if name in m.attrs:
                    object.__setattr__(m.module, name, m.attrs[name])
        return After(tensors, rebound, attrs)

    def settle(self, after: After) -> After:
        """After eager ran: fill in eager's side of every update, for the comparison."""
        after.rebound = [(m, n, c, m._buffers.get(n)) for m, n, c, _ in after.rebound]
        after.attrs = [(m, n, c, getattr(m, n, None)) for m, n, c, _ in after.attrs]
        return after

    def _in_place(self) -> list[tuple[torch.Tensor, int, torch.Tensor | None]]:
        return [entry for entry in self.tensors if entry[0]._version != entry[1]]


def _changed_attrs(m: _ModuleState) -> list[str]:
    now = _plain_attrs(m.module)
    return [k for k in now.keys() | m.attrs.keys() if now.get(k, m) is not m.attrs.get(k, m)]


def _rebound(m: _ModuleState) -> list[str]:
    now = m.module._buffers
    return [k for k in now.keys() | m.buffers.keys() if now.get(k) is not m.buffers.get(k)]
