"""How one guarded call walks through the guard's code: function entries, module crossings
and gate updates, counted by ``sys.setprofile``.

Counts instructions of nothing and times nothing: it reads the path. For each scenario a
fresh guarded callable runs one call under the profiler, which notes every Python
function entered in ``safecompile`` (``entries``), every call from one ``safecompile``
module into another (``crossings``), the crossings between two modules of
``safecompile.guard`` (``guard crossings``), the crossings between the call paths, the
engine, the graphs and the shadow checks (``role crossings``: each guard module counted
as the part it belongs to, :data:`ROLES`, so a part split into several files counts as
one), and how often the gate is recomputed
(``gate updates``: ``Engine.update_gate`` before the gate had a module of its own,
``Gate.update`` since). Scenarios:

- ``breach``: the first call of a graph whose compiled code is wrong (a backend that adds
  0.01 to every output), with ``Shadow()``: it compiles, the graph's checked first run
  breaches, eager answers, the callable rolls back;
- ``first``: the first call of a correct graph, ``Shadow()``;
- ``checked``: a later call whose check is due (``Shadow(every=1)``).

    python bench/call_path.py          # a table
    python bench/call_path.py --json   # the counts as JSON
    python bench/call_path.py --trace breach   # every guard crossing of a scenario, in order
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from safecompile import Shadow, safe_compile

warnings.filterwarnings("ignore")


def drifting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """A backend whose compiled code is off by 0.01 in every output."""

    def run(*args: Any) -> Any:
        out = gm.forward(*args)
        return tuple(o + 0.01 for o in out) if isinstance(out, tuple | list) else out + 0.01

    return run


def fn(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1


#: The part of the guard each module belongs to (modules before and after the guard's
#: reshaping: a call from ``_paths`` into ``_finish`` stays inside the call paths).
ROLES = {
    "_paths": "paths",
    "_hot": "paths",
    "_finish": "paths",
    "_buckets": "paths",
    "_engine": "engine",
    "_events": "engine",
    "_gate": "engine",
    "_speed": "engine",
    "graphs": "graphs",
    "_graph_backend": "graphs",
    "facts": "graphs",
    "_effects": "graphs",
    "_first_run": "graphs",
    "shadow": "shadow",
    "_compare": "shadow",
}


def _module(frame: types.FrameType) -> str | None:
    name = frame.f_globals.get("__name__")
    return name if isinstance(name, str) and name.startswith("safecompile") else None


class Counter:
    """The profile hook: entries, crossings and gate updates of ``safecompile`` code."""

    def __init__(self) -> None:
        self.entries = 0
        self.crossings = 0
        self.guard_crossings = 0
        self.role_crossings = 0
        self.gate_updates = 0
        self.by_module: collections.Counter[str] = collections.Counter()
        self.trace: list[str] = []

    def __call__(self, frame: types.FrameType, event: str, _arg: object) -> None:
        if event != "call":
            return
        callee = _module(frame)
        if callee is None:
            return
        self.entries += 1
        self.by_module[callee] += 1
        name = frame.f_code.co_name
        if name == "update_gate" or (callee.endswith("._gate") and name == "update"):
            self.gate_updates += 1
        back = frame.f_back
        caller = _module(back) if back is not None else None
        if caller is None or caller == callee:
            return
        self.crossings += 1
        if caller.startswith("safecompile.guard") and callee.startswith("safecompile.guard"):
            self.guard_crossings += 1
            roles = ROLES.get(caller.rsplit(".", 1)[1]), ROLES.get(callee.rsplit(".", 1)[1])
            if None not in roles and roles[0] != roles[1]:
                self.role_crossings += 1
            assert back is not None
            self.trace.append(
                f"{caller.rsplit('.', 1)[1]}.{back.f_code.co_name} -> "
                f"{callee.rsplit('.', 1)[1]}.{name}"
            )


def _scenario(name: str) -> tuple[Callable[..., Any], int]:
    """A fresh guarded callable, and how many calls to make before the counted one."""
    torch._dynamo.reset()
    if name == "breach":
        return safe_compile(fn, backend=drifting, shadow=Shadow()), 0
    if name == "first":
        return safe_compile(fn, backend="eager", shadow=Shadow()), 0
    if name == "checked":
        return safe_compile(fn, backend="eager", shadow=Shadow(canary=0, every=1)), 3
    raise SystemExit(f"unknown scenario {name!r}")


def count(name: str) -> Counter:
    guarded, before = _scenario(name)
    x = torch.randn(8)
    for _ in range(before):
        guarded(x)
    counter = Counter()
    sys.setprofile(counter)
    try:
        guarded(x)
    finally:
        sys.setprofile(None)
    if name == "breach":
        state = guarded.safecompile.state.value  # type: ignore[attr-defined]
        assert state == "rolled_back", state
    return counter


SCENARIOS = ("breach", "first", "checked")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--trace", choices=SCENARIOS)
    ns = parser.parse_args()
    if ns.trace:
        print("\n".join(count(ns.trace).trace))
        return
    results = {s: count(s) for s in SCENARIOS}
    if ns.json:
        figures = {
            s: {
                "entries": c.entries,
                "crossings": c.crossings,
                "guard_crossings": c.guard_crossings,
                "role_crossings": c.role_crossings,
                "gate_updates": c.gate_updates,
                "by_module": dict(c.by_module.most_common()),
            }
            for s, c in results.items()
        }
        print(json.dumps(figures, indent=2))
        return
    head = ("scenario", "entries", "crossings", "guard crossings", "role crossings", "gate")
    print(f"{head[0]:10} {head[1]:>8} {head[2]:>10} {head[3]:>16} {head[4]:>15} {head[5]:>5}")
    for s, c in results.items():
        figures = (c.entries, c.crossings, c.guard_crossings, c.role_crossings, c.gate_updates)
        print(
            f"{s:10} {figures[0]:8} {figures[1]:10} {figures[2]:16} {figures[3]:15} {figures[4]:5}"
        )


if __name__ == "__main__":
    main()
