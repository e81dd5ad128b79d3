"""A compiled graph's first run: its compiled code on copies, its traced code on the
caller's own tensors, the two compared (docs/design.md, "A graph's first run").

Before a graph has run once, nothing is known of what its compiled code writes: the
wrapper (:mod:`.backend`) hands its first run here, and leaves what it showed in the
caller's slot for the call path (``_finish.finish``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from safecompile.checks.compare import Comparison, compare

from .graphs import GraphRecord

__all__ = ["FirstRun", "Pending", "prepare", "protected"]


@dataclass(slots=True)
class Pending:
    """A compiled graph whose first run is still to come: its traced code (``None``: not
    protected, or its effects are known) and whether it draws random numbers."""

    traced: Callable[..., Any] | None
    random: bool = False
    written: frozenset[int] | None = frozenset()  # inputs its code updates (None: unknown)


def prepare(gm: torch.fx.GraphModule, random: bool, written: frozenset[int] | None) -> Pending:
    """A graph to protect at its first run: its traced code, kept before the compiler sees
    it (``random``: it draws random numbers; ``written``: the inputs it may update)."""
    return Pending(traced_copy(gm), random, written)


@dataclass(frozen=True, slots=True)
class FirstRun:
    """What a graph's protected first run showed (:func:`_first_run`): ``seen`` is its
    comparison with eager (``None``: not compared: random numbers, or never checked)."""

    graph: GraphRecord
    seen: Comparison | None


def protected(
    record: GraphRecord,
    inner: Callable[..., Any],
    traced: Callable[..., Any],
    pending: Pending,
    tolerances: tuple[float | None, float | None],
    args: tuple[Any, ...],
) -> tuple[Any, FirstRun]:
    """A graph's first run, protected: its outputs (eager's), and what it showed, which
    the wrapper leaves in the caller's slot for ``_finish.finish``."""
    out, seen = _first_run(record, inner, traced, args, tolerances, pending)
    if seen is None or seen.ok:
        pending.traced = None  # its effects are known: later runs take the common path
        record.prep = False
    return out, FirstRun(record, seen)


def _first_run(
    record: GraphRecord,
    inner: Callable[..., Any],
    traced: Callable[..., Any],
    args: tuple[Any, ...],
    tolerances: tuple[float | None, float | None],
    pending: Pending,
) -> tuple[Any, Comparison | None]:
    """A compiled graph's first run, before anything is known of what its code writes:
    the compiled code runs on copies of the tensors it is given, its traced graph eagerly
    on the caller's own, and the caller gets the eager run's outputs (its values, views
    of its inputs, gradients, in-place updates made once). The compiled run's outputs,
    and what it left in the copies, are compared with the eager run's (shadow checks on
    or off, like a bucket's padding; not for a graph that draws random numbers or is
    never checked). A parameter is copied only where the traced code updates it in place
    (a model's weights twice may not fit); a compiled write into another is seen by its
    version."""
    random = pending.random
    copies, pairs, params = _copies(args, pending.written)
    with _rng_kept(args) if random else contextlib.nullcontext():
        compiled_out = inner(*copies)
    wrote = any(c._version != v for _, c, v in pairs) or any(p._version != v for p, v in params)
    written = [p for p, v in params if p._version != v]
    eager_out = traced(*args)
    if wrote:
        record.mutates = True  # its later checks copy the state first
    if record.unchecked is not None or random:
        return eager_out, None
    rtol, atol = tolerances
    seen = compare(_outputs(compiled_out), _outputs(eager_out), rtol=rtol, atol=atol)
    differ = [(a, c) for a, c, _ in pairs if not _same_bytes(a, c)]  # a cheap pass first
    if seen.ok and differ:
        state = compare([c for _, c in differ], [a for a, _ in differ], rtol=rtol, atol=atol)
        if not state.ok:
            why = f"its inputs after the run differ from eager's: {state.reason}"
            seen = Comparison(False, state.max_abs, state.max_rel, why, state.leaves)
    if seen.ok and written:
        why = f"it wrote into {len(written)} parameter(s) that eager leaves as they are"
        seen = Comparison(False, 0.0, float("inf"), why, seen.leaves)
    return eager_out, seen


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return bool(torch.equal(a, b))
    except Exception:  # a tensor that cannot be compared so: compare it fully
        return False


def _outputs(out: Any) -> Any:
    """A graph's outputs as one type: a compiled graph may give a list where its traced
    code gives a tuple."""
    return tuple(out) if isinstance(out, list | tuple) else out


def _copies(
    args: tuple[Any, ...], written: frozenset[int] | None
) -> tuple[list[Any], list[tuple[torch.Tensor, torch.Tensor, int]], list[tuple[torch.Tensor, int]]]:
    """The graph's arguments with each tensor replaced by a copy: its storage copied
    (once for tensors sharing one), viewed with the same offset, sizes and strides, so
    aliasing and layout are what the compiled code was made for; a parameter only if its
    position is in ``written`` (``None``: every one). Also the (tensor, copy, copy's
    version) pairs, and the parameters left uncopied with their versions."""
    storages: dict[int, torch.UntypedStorage] = {}
    out: list[Any] = []
    pairs: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    params: list[tuple[torch.Tensor, int]] = []
    with torch.no_grad():
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                out.append(a)
                continue
            if isinstance(a, torch.nn.Parameter) and written is not None and i not in written:
                params.append((a, a._version))
                out.append(a)
                continue
            c = _copy(a, storages)
            pairs.append((a, c, c._version))
            out.append(c)
    return out, pairs, params


def _copy(t: torch.Tensor, storages: dict[int, torch.UntypedStorage]) -> torch.Tensor:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
        return t.detach().clone()  # a subclass, a sparse tensor: its own clone
    storage = t.untyped_storage()
    key = storage._cdata
    copied = storages.get(key)
    if copied is None:
        copied = storages[key] = storage.clone()  # type: ignore[no-untyped-call]
    c = torch.empty(0, dtype=t.dtype, device=t.device)
    return c.set_(copied, t.storage_offset(), t.size(), t.stride())


@contextlib.contextmanager
def _rng_kept(args: tuple[Any, ...]) -> Iterator[None]:
    """Random state put back after the block: a random graph's eager run then draws
    what eager would have drawn."""
    devices = sorted(
        {a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda}
    )
    with torch.random.fork_rng(devices=devices):
        yield


def traced_copy(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """The graph's traced code, to run eagerly: its own copy of the graph (a compiler may
    rewrite the one it is handed), sharing the module's attributes."""
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph).forward
