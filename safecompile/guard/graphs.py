"""Graph identity: one record per graph torch compiles, and the backend that makes them.

The backend sees each graph as torch compiles it, gives it a :class:`GraphRecord` (its
id, its canary countdown and counters) and hands torch back the compiled graph wrapped in
a small function that tells the calling thread's :class:`~.slots.Slot` which graph served
the call and whether its check is due. Nothing is keyed by input shapes: memory is
bounded by the graphs (docs/design.md, "Graphs, not shapes").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import re
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from safecompile.base import torchcompat
from safecompile.base.options import CompilerFn
from safecompile.base.policies import FOREVER, Shadow
from safecompile.checks.compare import Comparison, compare
from safecompile.observe.log import torch_missing
from safecompile.observe.source import graph_breaks_of

from ._slots import CallState, Slot

__all__ = [
    "Call",
    "CallSlot",
    "Effect",
    "FirstRun",
    "GraphFacts",
    "GraphHooks",
    "GraphRecord",
    "GraphTable",
    "GuardBackend",
    "RecordedGraph",
    "Recorder",
    "find_effects",
    "mutates_in_place",
    "random_op",
    "read_facts",
    "time_tracing",
    "trace_started",
]


@dataclass(frozen=True, slots=True)
class Effect:
    """A Python object the graph's frame updates, by dynamo's record of its side effects
    (a KV cache layer, a config, a list argument): how to find it again at run time."""

    name: str  # dynamo's name for it, e.g. ``L['kwargs']['cache'].layers[0]``
    source: Any  # dynamo's ``Source``, read back against the running frame (``None``:
    # the frame's globals dict itself, for a ``global`` statement's store)
    keys: tuple[str, ...] | None  # the attributes (or globals) it stores; None: its items


@dataclass(frozen=True, slots=True)
class GraphFacts:
    """What the guard reads from a graph dynamo hands over (saved with a precompiled one)."""

    label: str  # its inputs as text
    code: str  # the function (or resume function) it belongs to
    unchecked: str | None  # why it can never be checked
    mutates: bool  # it may update a tensor in place
    effects: tuple[Effect, ...]  # Python objects its frame updates


@dataclass(slots=True, eq=False)
class GraphRecord:
    """What the guard knows about one graph torch compiled (see the module doc)."""

    id: int
    label: str  # its inputs as text: shapes (``s0`` for a dynamic dim) and dtypes
    code: str  # the function (or resume function, after a graph break) it belongs to
    compiled: bool  # False: past max_recompiles, the traced graph runs eagerly
    bucket: str | None = None
    watched: bool = False  # compiled, with shadow checks on: its checks count
    canary_left: int = 0
    countdown: int = FOREVER  # runs left before its next check is due (0: due now)
    counted_from: int = FOREVER  # the countdown when last set (runs since: the difference)
    runs: int = 0  # runs before the countdown was last set, and runs with a check due
    checks: int = 0
    compile_s: float = 0.0
    breaks: list[dict[str, Any]] = field(default_factory=list)
    unchecked: str | None = None  # why this graph is never checked (random numbers...)
    mutates: bool = False  # seen to update its inputs or module state in place
    prep: bool = False  # not the common path next run: a later graph of its calls is due
    # (snapshot state at this one), or its protected first run is to come
    effects: tuple[Effect, ...] = ()  # Python objects its frame updates (snapshotted)
    frame: tuple[str, str, int] | None = None  # its frame's code: name, file, first line

    @property
    def calls(self) -> int:
        """How many times it ran (the wrapper counts down, and counts only due runs)."""
        return self.runs + self.counted_from - self.countdown

    def set_countdown(self, value: int) -> None:
        """Runs left before its next check; the runs counted down so far are kept."""
        self.runs += self.counted_from - self.countdown
        self.countdown = self.counted_from = value

    def check(self) -> str:
        """Where its shadow checks stand: ``"checked"`` (its canary passed),
        ``"unchecked"`` (it cannot be checked: :attr:`unchecked` says why), ``"not_yet"``
        (canary checks left) or ``"off"`` (not watched: shadow checks off, or it runs
        eagerly past the recompile limit)."""
        if not self.watched:
            return "off"
        if self.unchecked is not None:
            return "unchecked"
        return "checked" if self.canary_left == 0 and self.checks > 0 else "not_yet"

    def to_dict(self) -> dict[str, Any]:
        """The record for ``report()``: counters and labels only, never values."""
        return {
            "id": self.id,
            "check": self.check(),
            "inputs": self.label,
            "code": self.code,
            "compiled": self.compiled,
            "bucket": self.bucket,
            "calls": self.calls,
            "checks": self.checks,
            "canary_left": self.canary_left,
            "compile_s": round(self.compile_s, 6),
            "graph_breaks": len(self.breaks),
            "unchecked": self.unchecked,
            "mutates_state": self.mutates,
            "updates_objects": [e.name for e in self.effects],
        }


CallSlot = Slot[GraphRecord]
"""A thread's call slot, holding this module's graph records."""


class Call(CallState[GraphRecord]):
    """One call down the slow path (:mod:`safecompile.guard._paths`). A subclass, not an
    alias: calling ``CallState[GraphRecord]`` costs a frame and a failed attribute write."""

    __slots__ = ()


class GraphTable:
    """Every graph of one guarded callable, in compile order (bounded by the graphs)."""

    def __init__(self, shadow: Shadow | None) -> None:
        self._shadow = shadow
        self._lock = threading.Lock()
        self._records: list[GraphRecord] = []
        self._ids = itertools.count(1)

    def add(self, facts: GraphFacts, *, compiled: bool, bucket: str | None) -> GraphRecord:
        canary = self._shadow.canary if self._shadow is not None and compiled else 0
        record = GraphRecord(
            id=next(self._ids),
            label=facts.label,
            code=facts.code,
            compiled=compiled,
            bucket=bucket,
            watched=self._shadow is not None and compiled,
            canary_left=canary if facts.unchecked is None else 0,
            unchecked=facts.unchecked,
            mutates=facts.mutates,
            effects=facts.effects,
        )
        record.set_countdown(self.countdown(record))
        with self._lock:
            self._records.append(record)
        return record

    def checks(self) -> dict[str, int]:
        """How many graphs stand where (see :meth:`GraphRecord.check`)."""
        statuses = [record.check() for record in self]
        return {status: statuses.count(status) for status in ("checked", "unchecked", "not_yet")}

    def tolerances(self) -> tuple[float | None, float | None]:
        """The shadow policy's ``(rtol, atol)`` (``None``: the per-dtype defaults)."""
        shadow = self._shadow
        return (shadow.rtol, shadow.atol) if shadow is not None else (None, None)

    def countdown(self, record: GraphRecord) -> int:
        """The record's next countdown, as the shadow policy decides."""
        if self._shadow is None or record.unchecked is not None or not record.compiled:
            return FOREVER
        return self._shadow.countdown(record.canary_left)

    def checked(self, record: GraphRecord) -> None:
        """One check of the record was made (or could not be made and never will)."""
        if record.canary_left > 0:
            record.canary_left -= 1
        record.checks += 1
        record.set_countdown(self.countdown(record))

    def clear(self) -> None:
        """Forget every graph (``reset()``): ids start again from 1."""
        with self._lock:
            self._records.clear()
            self._ids = itertools.count(1)

    def never_check(self, record: GraphRecord, why: str) -> None:
        record.unchecked = why
        record.canary_left = 0
        record.set_countdown(FOREVER)

    def restart_canary(self) -> None:
        """After a recovery, every compiled graph is watched again from the start."""
        for record in self:
            if record.compiled and record.unchecked is None and self._shadow is not None:
                record.canary_left = self._shadow.canary
                record.set_countdown(self.countdown(record))

    def __iter__(self) -> Iterator[GraphRecord]:
        with self._lock:
            return iter(list(self._records))

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


@dataclass(frozen=True, slots=True)
class GraphHooks:
    """What the backend needs from the engine (kept small, so both stay readable)."""

    table: GraphTable
    local: Any  # the callable's thread-locals, where each thread's slot lives
    limit: int  # graphs compiled per code object at most (the recompile limit)
    compiling: Callable[[], contextlib.AbstractContextManager[bool]]  # this thread compiles
    on_graph: Callable[[GraphRecord, torch.fx.GraphModule], None]
    snapshot: Callable[[tuple[Any, ...], GraphRecord], Any]
    bucket_label: Callable[[], str | None]
    clock: Callable[[], float]
    # (graph inputs as text, perf_counter at start) -> what to call when it ends
    announce: Callable[[str, float], Callable[[], None]]
    cudagraphs: bool = False  # compiled graphs run under CUDA graphs (their pool outputs)


class GuardBackend:
    """The backend handed to ``torch.compile``: records each graph, then compiles it."""

    def __init__(self, compiler: CompilerFn, hooks: GraphHooks, label: str) -> None:
        self._compiler = compiler
        self._hooks = hooks
        self._made: dict[tuple[Any, ...], tuple[GraphRecord, Callable[..., Any], _Pending]] = {}
        # every code object it made graphs for: the function, and its resume functions
        self._codes: weakref.WeakSet[types.CodeType] = weakref.WeakSet()
        self.__name__ = f"safecompile[{label}]"

    def restart(self) -> list[types.CodeType]:
        """Forget every graph made (``reset()``): the code objects whose cache entries the
        caller drops. One backend serves on, so nothing torch keeps per backend piles up."""
        self._made.clear()
        codes = list(self._codes)
        self._codes.clear()
        return codes

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        hooks = self._hooks
        started = trace_started() or time.perf_counter()
        with hooks.compiling(), contextlib.ExitStack() as announced:
            announced.callback(hooks.announce(describe_inputs(gm), started))  # slow: say so
            frame = torchcompat.frame_code()  # the function, or a resume function
            if frame is not None:
                self._codes.add(frame)
            code = _code_name(frame)
            twin = _twin_key(code, gm, example_inputs)
            made = self._made.get(twin)
            if made is not None:
                # Threads racing on one new input signature each made dynamo trace it;
                # torch does not de-duplicate: the first compile serves them all.
                return _instrument(made[0], made[1], hooks, made[2])
            # the recompile limit counts the graphs compiled per code object
            compiled = sum(1 for r in hooks.table if r.compiled and r.code == code) < hooks.limit
            pending = _Pending(None)
            if compiled:
                if PROTECT_FIRST_RUNS:  # its traced code, kept before the compiler sees it
                    pending = _Pending(
                        _traced_copy(gm), random_op(gm) is not None, _written_inputs(gm)
                    )
                # Compile the backward graph now, not lazily at .backward(): a failure
                # then surfaces here, on the guarded call, where eager can answer it.
                with _eager_backward():
                    inner = self._compiler(gm, example_inputs)
            else:
                inner = gm.forward  # past the recompile limit: the traced graph, eagerly
            record = hooks.table.add(read_facts(gm), compiled=compiled, bucket=hooks.bucket_label())
            record.compile_s = time.perf_counter() - started
            record.breaks = graph_breaks_of(gm, include_resumed=True)
            if frame is not None:  # as its running frame will show it
                record.frame = _frame_key(frame)
            record.prep = pending.traced is not None  # its first run leaves the common path
            self._made[twin] = (record, inner, pending)
            hooks.on_graph(record, gm)
        return _instrument(record, inner, hooks, pending)

    def adopt(self, inner: Callable[..., Any], facts: GraphFacts) -> Callable[..., Any]:
        """A graph an earlier process saved, loaded instead of traced: recorded and wrapped
        like one made here (checks, counts, timing)."""
        record = self._hooks.table.add(facts, compiled=True, bucket=None)
        return _instrument(record, inner, self._hooks, _Pending(None))


def read_facts(gm: torch.fx.GraphModule) -> GraphFacts:
    """A graph's facts as dynamo hands it over (its side-effect record is live then);
    ``unchecked`` says why a shadow check must skip it (``None``: it need not)."""
    effects, lost = outside_effects()
    random = random_op(gm)
    unchecked: str | None = None
    if random is not None:
        unchecked = f"the graph draws random numbers ({random}): compiled and eager streams differ"
    elif lost is not None:
        unchecked = (
            f"the call updates a Python object that cannot be found again to copy "
            f"({lost}): eager cannot rerun it without applying the update twice"
        )
    code = _code_name(torchcompat.frame_code())
    return GraphFacts(describe_inputs(gm), code, unchecked, mutates_in_place(gm), effects)


def _instrument(
    record: GraphRecord, inner: Callable[..., Any], hooks: GraphHooks, pending: _Pending
) -> Callable[..., Any]:
    """The compiled graph as torch will run it: first note the run in the caller's slot.
    Its first run is protected (:func:`_first_run`) while ``pending`` holds its traced code."""
    inner = torchcompat.undisabled(inner)  # dynamo disables around this wrapper
    if hooks.cudagraphs:
        inner = _launched_live(inner)
    local = hooks.local
    snapshot = hooks.snapshot
    clock = hooks.clock
    table = hooks.table

    def run(*args: Any) -> Any:
        try:
            slot: CallSlot = local.slot
        except AttributeError:  # not called through the guard (torch internals): just run
            return inner(*args)
        if slot.first is None and record.countdown > 0 and not slot.force and not record.prep:
            slot.first = record  # the common case: the call's first graph, nothing due
            slot.snapshot = None
            record.countdown -= 1
            return inner(*args)
        due = record.countdown <= 0 or slot.force
        if slot.first is None:
            slot.first = record
            if due or record.prep:
                slot.snapshot = snapshot(args, record)
                slot.started = clock()
            else:
                slot.snapshot = None
        elif record.effects and slot.snapshot is not None:
            slot.snapshot.add_objects(*find_effects(record))  # a later graph's objects
        if due:
            record.runs += 1
            if slot.due is None:
                slot.due = [record]
            else:
                slot.due.append(record)
        else:
            record.countdown -= 1
        traced = pending.traced
        if traced is None:
            return inner(*args)
        return _protected(record, inner, traced, pending, table, args, slot)

    run.__name__ = f"safecompile_graph_{record.id}"
    if record.compiled:
        return run

    def limited(*args: Any) -> Any:  # past the recompile limit: a due list, even empty,
        out = run(*args)  # sends the call to the slow path, which counts it as eager
        slot: CallSlot | None = getattr(local, "slot", None)
        if slot is not None and slot.due is None:
            slot.due = []
        return out

    limited.__name__ = run.__name__
    return limited


def _launched_live(inner: Callable[..., Any]) -> Callable[..., Any]:
    """Under CUDA graphs: the compiled graph, run only on tensors whose memory torch still
    lets be read. torch frees a CUDA-graph output that a later replay overwrote and marks
    its storage so that reading its address raises (``RuntimeError: accessing tensor
    output of CUDAGraphs that has been overwritten``); Triton's kernel launcher reads each
    argument's address with ``data_ptr()`` and does not check for that error: the process
    dies in the launch (docs/design.md, "Known limits"). Reading the addresses first
    raises torch's error on our path instead, where eager answers or raises it too.
    Parameters are left out: they are never a graph's output."""

    def launched(*args: Any) -> Any:
        for a in args:
            if type(a) is torch.Tensor:
                a.data_ptr()  # raises torch's error for an output overwritten since
        return inner(*args)

    return launched


# ---------------------------------------------------------------- a graph's first run

PROTECT_FIRST_RUNS = True
"""Whether a compiled graph's first run is protected (:func:`_first_run`). Only
``bench/first_call.py`` turns it off, to measure what the protection costs."""


@dataclass(slots=True)
class _Pending:
    """A compiled graph whose first run is still to come: its traced code (``None``: not
    protected, or its effects are known) and whether it draws random numbers."""

    traced: Callable[..., Any] | None
    random: bool = False
    written: frozenset[int] | None = frozenset()  # inputs its code updates (None: unknown)


@dataclass(frozen=True, slots=True)
class FirstRun:
    """What a graph's protected first run showed (:func:`_first_run`): ``seen`` is its
    comparison with eager (``None``: not compared: random numbers, or never checked)."""

    graph: GraphRecord
    seen: Comparison | None


def _protected(
    record: GraphRecord,
    inner: Callable[..., Any],
    traced: Callable[..., Any],
    pending: _Pending,
    table: GraphTable,
    args: tuple[Any, ...],
    slot: CallSlot,
) -> Any:
    """The graph wrapper's part of a first run: run it protected, and leave what it
    showed in the caller's slot for :func:`~._paths.finish`."""
    out, seen = _first_run(record, inner, traced, args, table, pending)
    if seen is None or seen.ok:
        pending.traced = None  # its effects are known: later runs take the common path
        record.prep = False
    first_run = FirstRun(record, seen)
    slot.fresh = [first_run] if slot.fresh is None else [*slot.fresh, first_run]
    if slot.due is None:
        slot.due = []  # the hot path hands the call to finish(), which reads it
    return out


def _first_run(
    record: GraphRecord,
    inner: Callable[..., Any],
    traced: Callable[..., Any],
    args: tuple[Any, ...],
    table: GraphTable,
    pending: _Pending,
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
    rtol, atol = table.tolerances()
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


def _traced_copy(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """The graph's traced code, to run eagerly: its own copy of the graph (a compiler may
    rewrite the one it is handed), sharing the module's attributes."""
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph).forward


# ---------------------------------------------------------------- compile timing


class _Trace(threading.local):
    started: float | None = None  # when dynamo started tracing on this thread


_TRACE = _Trace()


def _on_trace_start(_args: object) -> None:
    _TRACE.started = time.perf_counter()


def trace_started() -> float | None:
    """When dynamo started tracing the frame now being compiled on this thread (once)."""
    started = _TRACE.started
    _TRACE.started = None
    return started


def time_tracing() -> None:
    """Have dynamo's compile callbacks time tracing too, not only the backend (again
    after ``torch._dynamo.reset()``, which clears them)."""
    handler = torchcompat.compile_callbacks()
    if handler is not None and _on_trace_start not in handler.start_callbacks:
        handler.register_start_callback(_on_trace_start)


def _eager_backward() -> contextlib.AbstractContextManager[Any]:
    """Where torch allows it, compile the backward graph with the forward one."""
    lowering = torchcompat.eager_backward()
    if isinstance(lowering, torchcompat.Missing):
        torch_missing(lowering)
        return contextlib.nullcontext()
    return lowering


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
    record: GraphRecord,
) -> tuple[list[tuple[str, object, tuple[str, ...] | None]], str | None]:
    """At run time, just before the graph runs: the objects its frame will update, read
    back from the running frame (dynamo's transformed code keeps the frame's locals and
    globals). Also the name of the first one that could not be found (``None``: all)."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(_FRAME_DEPTH):
        if frame is None or _frame_key(frame.f_code) == record.frame:
            break
        frame = frame.f_back
    if frame is None or _frame_key(frame.f_code) != record.frame:
        return [], f"the frame of {record.code} (not found on the stack)"
    scope: dict[str, Any] = {"L": frame.f_locals, "G": frame.f_globals}
    names = _closure_names()
    cache: dict[Any, Any] = {}
    found: list[tuple[str, object, tuple[str, ...] | None]] = []
    for effect in record.effects:
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


def _frame_key(code: types.CodeType) -> tuple[str, str, int]:
    return (code.co_name, code.co_filename, code.co_firstlineno)


def _code_name(code: types.CodeType | None) -> str:
    if code is None:
        return "?"
    return f"{code.co_name}@{code.co_filename}:{code.co_firstlineno}"


# ---------------------------------------------------------------- what a graph is


def _twin_key(code: str, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> tuple[Any, ...]:
    """What makes two graphs the same compile: code, graph, inputs' metadata, grad mode."""
    inputs = tuple(
        (
            str(tuple(t.shape)),
            str(t.stride()) if t.layout == torch.strided else "",
            t.dtype,
            t.device,
            t.requires_grad,
        )
        if isinstance(t, torch.Tensor)
        else str(t)
        for t in example_inputs
    )
    return (code, gm.code, inputs, torch.is_grad_enabled())


_IN_PLACE_FUNCTIONS = frozenset({"setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv"})


def mutates_in_place(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph may update a tensor in place (an input, a buffer, a parameter).

    Conservative: any in-place op counts (``add_``, ``x[i] = v``, ``+=``, ``inplace=True``,
    batch norm while training); a check of such a graph copies that state first.
    """
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = _target_name(node.target)
        if name in _IN_PLACE_FUNCTIONS or node.kwargs.get("inplace") is True:
            return True
        if name.endswith("_") and not name.endswith("__"):
            return True
        if name == "batch_norm" and (
            node.kwargs.get("training") is True or (len(node.args) > 5 and node.args[5] is True)
        ):
            return True
    return False


# Ops whose result may be a view of their first argument (a write into it writes there).
_VIEWS = frozenset(
    {
        "getitem", "getattr", "view", "view_as", "reshape", "reshape_as", "transpose",
        "permute", "t", "T", "mT", "H", "mH", "expand", "expand_as", "narrow", "select",
        "squeeze", "unsqueeze", "flatten", "unflatten", "as_strided", "split", "chunk",
        "unbind", "split_with_sizes", "tensor_split", "diagonal", "detach", "contiguous",
        "movedim", "moveaxis", "swapaxes", "swapdims", "unfold", "real", "imag",
        "view_as_real", "view_as_complex", "alias", "to", "type_as", "float", "half",
    }
)  # fmt: skip


def _written_inputs(gm: torch.fx.GraphModule) -> frozenset[int] | None:
    """The positions of the graph's inputs its code may update in place (an in-place op on
    an input or a view of one); ``None`` when one cannot be traced back to its tensor."""
    inputs = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written: set[int] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = _target_name(node.target)
        targets: list[Any] = []
        if name == "batch_norm":
            targets = [
                *node.args[1:3],
                node.kwargs.get("running_mean"),
                node.kwargs.get("running_var"),
            ]
        elif (
            name in _IN_PLACE_FUNCTIONS
            or node.kwargs.get("inplace") is True
            or (name.endswith("_") and not name.endswith("__"))
        ):
            targets = list(node.args[:1])
        if "out" in node.kwargs:
            targets.append(node.kwargs["out"])
        for target in _leaves(targets):
            base = _input_of(target, inputs)
            if base is _UNKNOWN:
                return None
            if isinstance(base, int):
                written.add(base)
    return frozenset(written)


_UNKNOWN = object()


def _input_of(value: Any, inputs: dict[Any, int]) -> int | object | None:
    """The input ``value`` is, or is a view of (its position); ``None`` for a tensor the
    graph made; ``_UNKNOWN`` when it cannot tell (a module's attribute...)."""
    for _ in range(64):
        if not isinstance(value, torch.fx.Node):
            return None  # a constant
        if value.op == "placeholder":
            return inputs[value]
        if value.op not in ("call_function", "call_method"):
            return _UNKNOWN
        if _target_name(value.target) not in _VIEWS or not value.args:
            return None  # a new tensor
        value = value.args[0]
    return _UNKNOWN


def _leaves(value: Any) -> list[Any]:
    """The leaves of nested lists and tuples (an op's list argument: ``_foreach_add_``)."""
    if isinstance(value, list | tuple):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


_SYMBOL = re.compile(r"\b[su]\d+\b")
#: What a dim that varies is called in a graph's description, in order of appearance.
DIM_LETTERS = "NMKLPQRT"


def describe_inputs(gm: torch.fx.GraphModule) -> str:
    """The graph's user inputs as text (parameters, buffers and the sizes dynamo lifts
    out of tensors left out): ``Nx32:float32, int``, a dim that varies as a letter."""
    parts = []
    letters: dict[str, str] = {}  # torch's symbol (``s77``) -> its letter: equal dims read equal

    def letter(match: re.Match[str]) -> str:
        n = len(letters)
        return letters.setdefault(match[0], DIM_LETTERS[n] if n < len(DIM_LETTERS) else f"N{n}")

    def dims(dim: object) -> str:
        return _SYMBOL.sub(letter, str(dim)).replace(" ", "")

    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = str(node.target)
        if "_parameters_" in name or "_buffers_" in name:
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            shape = "x".join(dims(d) for d in value.shape) or "scalar"
            parts.append(f"{shape}:{str(value.dtype).removeprefix('torch.')}")
        elif torchcompat.is_tensor_property(getattr(node.meta.get("grapharg"), "source", None)):
            continue  # a size dynamo lifted out of a tensor: not an argument of the user's
        elif isinstance(value, torch.SymInt | int | float | bool):
            parts.append("int" if isinstance(value, torch.SymInt) else type(value).__name__)
    text = ", ".join(parts) or "no tensor inputs"
    return text if len(text) <= 160 else text[:157] + "..."


_DROPOUTS = frozenset(
    {
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "feature_dropout",
        "feature_alpha_dropout",
        "native_dropout",
        "rrelu",
        "scaled_dot_product_attention",
    }
)
# Positional names where a builtin's signature cannot be read.
_POSITIONAL = {
    "scaled_dot_product_attention": ("query", "key", "value", "attn_mask", "dropout_p"),
    "rrelu": ("input", "lower", "upper", "training"),
}


@functools.cache
def _seeded(name: str) -> bool:
    """Whether ATen's op of this name draws random numbers (its own tag says so)."""
    packet = getattr(torch.ops.aten, name, None)
    try:
        return packet is not None and any(
            torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads()
        )
    except Exception:
        return False


def _target_name(target: object) -> str:
    if isinstance(target, str):
        return target
    if torchcompat.is_op_overload(target):
        return str(getattr(target, "_opname", ""))
    return str(getattr(target, "__name__", "")).removeprefix("_")


def _dropout_draws(
    name: str, target: object, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether a dropout-like call draws: ``p > 0`` and training; ``rrelu``: training."""
    try:
        bound = inspect.signature(target).bind(*args, **kwargs)  # type: ignore[arg-type]
        bound.apply_defaults()
        values = dict(bound.arguments)
    except (TypeError, ValueError):
        names = _POSITIONAL.get(name, ("input", "p", "training"))  # torch.dropout(x, p, train)
        values = dict(zip(names, args, strict=False)) | kwargs
    if name == "rrelu":
        return values.get("training", False) is not False
    training = values.get("training", values.get("train", True))
    if training is False:
        return False
    p = values.get("p", values.get("dropout_p", 0.0 if name.startswith("scaled") else None))
    return not (isinstance(p, int | float) and p == 0)


def random_op(gm: torch.fx.GraphModule) -> str | None:
    """The first op of the graph that draws random numbers, or ``None``: ATen tags every
    op that draws ``nondeterministic_seeded``; the dropout family draws only with ``p > 0``
    while training."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = _target_name(node.target)
        if name.rstrip("_") in _DROPOUTS:
            if node.op == "call_function" and _dropout_draws(
                name.rstrip("_"), node.target, node.args, node.kwargs
            ):
                return name
            continue
        if name and _seeded(name):
            return name
    return None


@dataclass(frozen=True, slots=True)
class RecordedGraph:
    """What a :class:`Recorder` noted about one graph."""

    breaks: tuple[dict[str, object], ...]  # its graph breaks, the resumed side included
    random_op: str | None  # an op that draws random numbers, if any
    compile_s: float  # time in the wrapped compiler
    unchecked: str | None = None  # why safe_compile's shadow checks would skip it


class Recorder:
    """A backend for the tools (the doctor, ``assert_compiles``): notes each graph, then
    compiles it with ``compiler``. The guard's own backend is :class:`GuardBackend`."""

    def __init__(self, compiler: Callable[..., Any], label: str = "recorder") -> None:
        self.graphs: list[RecordedGraph] = []
        self._compiler = compiler
        self.__name__ = label

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        breaks = tuple(graph_breaks_of(gm, include_resumed=True))
        unchecked = read_facts(gm).unchecked  # the guard's own words
        started = time.perf_counter()
        try:
            return self._compiler(gm, example_inputs)
        finally:
            elapsed = time.perf_counter() - started
            self.graphs.append(RecordedGraph(breaks, random_op(gm), elapsed, unchecked))
