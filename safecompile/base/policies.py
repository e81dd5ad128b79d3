"""Policies: small frozen, keyword-only dataclasses, validated when built."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ._frozen import FrozenMap
from .errors import ConfigError, unknown_options

__all__ = [
    "FOREVER",
    "Axis",
    "Buckets",
    "IgnoreWhere",
    "Rollback",
    "Shadow",
    "Warmup",
    "ignore_where",
    "pow2",
    "steps",
]

FOREVER = 1 << 62  # a countdown that never runs out
_WEEK = 7 * 24 * 3600.0  # the longest wait an option may ask for


def _check_number(
    owner: str,
    name: str,
    value: object,
    *,
    minimum: float,
    maximum: float | None = None,
    strict: bool = False,
    integer: bool = False,
    optional: bool = False,
) -> None:
    """Raise unless ``value`` is a finite number (an int with ``integer``) in bounds, or
    ``None`` where ``optional`` (the option's off value)."""
    if optional and value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (integer and not isinstance(value, int))
        or (not integer and not math.isfinite(value))  # an int may be too big for a float
        or not (value > minimum if strict else value >= minimum)
        or (maximum is not None and value > maximum)
    ):
        kind = "an int" if integer else "a finite number"
        bound = f"> {minimum}" if strict else f">= {minimum}"
        if maximum is not None:
            bound = f"from {minimum} to {maximum}" if integer else f"{bound} and <= {maximum:g}"
        raise ConfigError(f"{owner}({name}=...) must be {kind} {bound}, got {value!r}")


def _check_choice(owner: str, name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{owner}({name}=...) must be one of {allowed}, got {value!r}")


def pow2(lo: int, hi: int) -> tuple[int, ...]:
    """The powers of two from ``lo`` to ``hi`` (both rounded outward to a power of two).

    ``pow2(16, 2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)``.
    """
    _check_number("pow2", "lo", lo, minimum=1, integer=True)
    _check_number("pow2", "hi", hi, minimum=lo, integer=True)
    return tuple(1 << e for e in range((lo - 1).bit_length(), (hi - 1).bit_length() + 1))


def steps(lo: int, hi: int, step: int) -> tuple[int, ...]:
    """Every ``step`` from ``lo`` up to the first value that holds ``hi``.

    ``steps(8, 32, 8) == (8, 16, 24, 32)``. Finer than :func:`pow2`, so less padded
    work for more graphs; concatenate ranges for vLLM-like lists:
    ``pow2(1, 4) + steps(8, 256, 8) + steps(272, 512, 16)``.
    """
    _check_number("steps", "lo", lo, minimum=1, integer=True)
    _check_number("steps", "hi", hi, minimum=lo, integer=True)
    _check_number("steps", "step", step, minimum=1, integer=True)
    count = -(-(hi - lo) // step)  # ceil: the last value holds hi
    return tuple(lo + i * step for i in range(count + 1))


OutputDims = int | tuple[int, ...]
AxisDims = Mapping[int, str]  # dim -> axis name: the named form of dims and outputs
DimSpec = int | tuple[int, ...] | AxisDims
OutputSpec = OutputDims | AxisDims | Mapping[str, OutputDims | AxisDims] | None


@dataclass(frozen=True, slots=True)
class Axis:
    """One independent length that :class:`Buckets` pads, and its sizes (``name`` is
    ``None`` in the one-length form, ``dims={"x": 1}``)."""

    name: str | None
    sizes: tuple[int, ...]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _normal_dims(value: object) -> tuple[int, ...] | None:
    """``value`` as a tuple of distinct int dims, or ``None`` if it is not one."""
    dims = (value,) if _is_int(value) else value
    if (
        not isinstance(dims, tuple)
        or not all(_is_int(d) for d in dims)
        or len(set(dims)) != len(dims)
    ):
        return None
    return dims


def _axis_dims(
    value: Mapping[Any, Any], names: Sequence[str | None] | None
) -> FrozenMap[int, str] | None:
    """A ``{dim: axis name}`` mapping frozen, or ``None`` if it is not one (``names``:
    the axis names it may use; ``None``: any identifier)."""
    for dim, axis in value.items():
        if not _is_int(dim) or not isinstance(axis, str) or not axis.isidentifier():
            return None
    return FrozenMap(value) if names is None or set(value.values()) <= set(names) else None


def _sizes_or_none(value: object) -> tuple[int, ...] | None:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        return None
    sizes = tuple(value)
    if (
        not sizes
        or any(not _is_int(s) or s < 1 for s in sizes)
        or any(sizes[i] >= sizes[i + 1] for i in range(len(sizes) - 1))
    ):
        return None
    return sizes


def _named(names: Sequence[str | None]) -> str:
    return ", ".join(repr(n) for n in names)


def _normal_output_dims(
    path: str | None, dims: object, names: tuple[str | None, ...]
) -> tuple[int, ...] | FrozenMap[int, str]:
    """One entry of ``outputs``: plain dims (one axis only) or ``{dim: axis}``."""
    where = "Buckets(outputs=...)" + (f" for {path!r}" if path is not None else "")
    if isinstance(dims, Mapping):
        if names == (None,):
            raise ConfigError(
                f"{where} names axes ({dims!r}), but dims names none: give the dims to cut "
                "as an int or a tuple, or name the axes in dims too"
            )
        found = _axis_dims(dims, names)
        if found is None:
            raise ConfigError(
                f"{where} must map each output dim (int) to one of the axes {_named(names)}, "
                f"got {dims!r}"
            )
        return found
    plain = _normal_dims(dims)
    if plain is None:
        raise ConfigError(
            f"{where} values must be a dim (int) or a tuple of distinct dims (() for none), "
            f"got {dims!r}"
        )
    if plain and len(names) > 1:
        raise ConfigError(
            f"{where} must say which axis each cut dim belongs to ({_named(names)}): "
            f"write {{dim: axis}}, e.g. {{1: {names[-1]!r}}}, got {dims!r}"
        )
    return plain


def _normal_outputs(outputs: object, names: tuple[str | None, ...]) -> Any:
    """``outputs`` frozen: ``None``, dims, ``{dim: axis}``, or ``{path: either}``."""
    if outputs is None:
        return None
    if isinstance(outputs, Mapping) and outputs and all(_is_int(k) for k in outputs):
        return _normal_output_dims(None, outputs, names)  # {dim: axis} for every output
    if isinstance(outputs, Mapping):
        normal: dict[str, tuple[int, ...] | FrozenMap[int, str]] = {}
        for path, dims in outputs.items():
            if not isinstance(path, str):
                raise ConfigError(
                    "Buckets(outputs=...) keys must be output paths as text ('' for the "
                    f"output itself, '0', 'logits', '1.attn'), got {path!r}"
                )
            normal[path] = _normal_output_dims(path, dims, names)
        return FrozenMap(normal)
    found = _normal_dims(outputs)
    if not found:
        raise ConfigError(
            "Buckets(outputs=...) must be None (learn the cut per bucket), a dim or tuple of "
            "dims to cut in every output tensor, a {dim: axis} mapping, or a mapping of output "
            f"path to either, got {outputs!r}"
        )
    return _normal_output_dims(None, found, names)


@dataclass(frozen=True, kw_only=True)
class Buckets:
    """Pad variable dims up to a bounded set of sizes, so recompiles stay bounded.

    **One length** (the short form): ``dims`` maps an argument name to the dim (or
    tuple of dims) to pad, and every bucketed dim of one call shares one length
    (``x`` and ``mask`` below); ``sizes`` is an increasing sequence of lengths:

        Buckets(dims={"x": 1, "mask": 1}, sizes=pow2(16, 2048))

    **Several independent lengths** (batch and sequence): name an axis per dim, and
    give each axis its sizes. Graphs stay bounded by the product of the counts (7 x 6
    here); labels read ``"batch=8,seq=64"``:

        Buckets(
            dims={"x": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}},
            sizes={"batch": pow2(1, 64), "seq": pow2(16, 512)},
        )

    A dim may appear under one axis only; one axis may span several dims (a square
    ``bias`` as ``{1: "seq", 2: "seq"}``). With a single named axis, ``sizes`` may be
    one sequence.

    ``strategy``: ``"pad"`` pads to static shapes, one graph per combination of sizes
    (what CUDA graphs need). ``"dynamic"`` pads nothing: each range between two sizes
    (per axis) gets one dynamic graph bounded by ``torch._dynamo.mark_dynamic(min=...,
    max=...)``; lengths 0 and 1, which torch always specialises, get static graphs of
    their own (:meth:`max_graphs`). ``"auto"`` (default) picks ``"pad"`` where the
    compiled code needs static shapes (CUDA graphs: ``mode="reduce-overhead"`` or
    ``"max-autotune"``, ``options={"triton.cudagraphs": True}``, the ``"cudagraphs"``
    backend) or ``dynamic=False``, and ``"dynamic"`` otherwise (on CPU it ran at 1.00x
    ``torch.compile``'s default speed, padding at 0.65x). ``report()["bucketing"]``
    says which.

    ``outputs`` says which output dims are cut back to the original length. ``None``
    learns it per bucket: a dim is cut where padding changed it from the length to the
    bucket size. An int or tuple cuts those dims of every output tensor (one axis only);
    with named axes, ``{dim: axis}`` says which axis each cut dim follows. A mapping
    names output paths (``""`` the output itself, ``"0"``, ``"logits"``, ``"1.attn"``)
    and their dims in either form (``()``: never cut); the others are not cut. Every cut
    is checked against what padding changed, so a hidden size that equals the bucket,
    or a square attention map, is never cut silently.

    Values are kept frozen and hashable: changing the dict you passed changes nothing.

    :param dims: argument name to the dim (or dims, or ``{dim: axis}``) to pad.
    :param sizes: the increasing lengths (``pow2(16, 2048)``), or one sequence per axis.
    :param pad_value: what padding fills with: one number, or one per argument.
    :param oversize: an input longer than the largest size runs eager (``"eager"``) or
        compiles its own shape (``"compile"``).
    :param outputs: which output dims are cut back to the original length; ``None``:
        learned per bucket.
    :param strategy: ``"pad"`` (static shapes), ``"dynamic"`` (bounded dynamic ranges),
        or ``"auto"``: ``"pad"`` where CUDA graphs need it, ``"dynamic"`` otherwise.
    """

    dims: Mapping[str, DimSpec]
    sizes: Sequence[int] | Mapping[str, Sequence[int]]
    pad_value: float | Mapping[str, float] = 0
    oversize: Literal["eager", "compile"] = "eager"
    outputs: OutputSpec = None
    strategy: Literal["auto", "pad", "dynamic"] = "auto"
    axes: tuple[Axis, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dims, named = self._check_dims()
        object.__setattr__(self, "dims", dims)
        axes = self._check_sizes(dims, named)
        object.__setattr__(self, "axes", axes)
        sizes = FrozenMap({a.name: a.sizes for a in axes}) if named else axes[0].sizes
        object.__setattr__(self, "sizes", sizes)
        self._check_pad_value(dims)
        _check_choice("Buckets", "strategy", self.strategy, ("auto", "pad", "dynamic"))
        _check_choice("Buckets", "oversize", self.oversize, ("eager", "compile"))
        names = tuple(a.name for a in axes)
        object.__setattr__(self, "outputs", _normal_outputs(self.outputs, names))

    def _check_dims(self) -> tuple[FrozenMap[str, Any], bool]:
        """``dims`` frozen, and whether it names axes."""
        if not isinstance(self.dims, Mapping) or not self.dims:
            raise ConfigError(
                "Buckets(dims=...) must be a non-empty mapping of argument name to dim, "
                f"dims or {{dim: axis name}}, got {self.dims!r}"
            )
        normal: dict[str, Any] = {}
        for arg, dim in self.dims.items():
            if not isinstance(arg, str) or not arg.isidentifier():
                raise ConfigError(f"Buckets(dims=...) keys must be argument names, got {arg!r}")
            found: FrozenMap[int, str] | tuple[int, ...] | None = None
            if isinstance(dim, Mapping):
                found = _axis_dims(dim, None) if dim else None
            else:
                found = _normal_dims(dim) or None
            if found is None:
                raise ConfigError(
                    "Buckets(dims=...) values must be a dim (int), a tuple of distinct dims, "
                    f"or a mapping of dim to axis name ({{0: 'batch', 1: 'seq'}}), got "
                    f"{arg!r}: {dim!r}"
                )
            normal[arg] = found
        kinds = {isinstance(v, Mapping) for v in normal.values()}
        if len(kinds) > 1:
            plain = next(a for a, v in normal.items() if not isinstance(v, Mapping))
            raise ConfigError(
                f"Buckets(dims=...) mixes plain dims ({plain!r}) with named axes: name the "
                f"axes of every argument, e.g. {{{plain!r}: {{1: 'seq'}}}}"
            )
        return FrozenMap(normal), kinds == {True}

    def _check_sizes(self, dims: Mapping[str, Any], named: bool) -> tuple[Axis, ...]:
        """One :class:`Axis` per independent length, in ``sizes`` order."""
        given: Any = self.sizes  # checked here: callers may pass anything
        if not named and isinstance(given, Mapping):
            raise ConfigError(
                "Buckets(sizes=...) maps axis names to sizes, but dims names no axes: "
                "name them, e.g. dims={'x': {0: 'batch', 1: 'seq'}}, or give sizes as one "
                "sequence"
            )
        used: list[str | None] = [None]  # the one unnamed length
        if named:
            used = list(dict.fromkeys(a for v in dims.values() for a in v.values()))
        if not isinstance(given, Mapping):
            if len(used) > 1:
                raise ConfigError(
                    f"Buckets(sizes=...) must map each axis ({_named(used)}) to its sizes, "
                    f"e.g. sizes={{{used[0]!r}: pow2(1, 64), {used[1]!r}: pow2(16, 512)}}, "
                    f"got {given!r}"
                )
            given = {used[0]: given}
        unknown = [a for a in given if a not in used]
        if unknown:
            raise ConfigError(
                f"Buckets(sizes=...) names axis {unknown[0]!r}, which no dim in dims uses "
                f"(axes: {_named(used)})"
            )
        missing = [a for a in used if a not in given]
        if missing:
            raise ConfigError(f"Buckets(sizes=...) has no sizes for axis {missing[0]!r}")
        axes = []
        for name, value in given.items():
            sizes = _sizes_or_none(value)
            if sizes is None:
                where = f" for axis {name!r}" if name is not None else ""
                raise ConfigError(
                    f"Buckets(sizes=...){where} must be a non-empty, strictly increasing "
                    f"sequence of positive ints (pow2(lo, hi) makes one), got {value!r}"
                )
            axes.append(Axis(name, sizes))
        return tuple(axes)

    def _check_pad_value(self, dims: Mapping[str, Any]) -> None:
        pads = self.pad_value if isinstance(self.pad_value, Mapping) else {"*": self.pad_value}
        for arg, value in pads.items():
            if arg != "*" and arg not in dims:
                raise ConfigError(
                    f"Buckets(pad_value=...) names {arg!r}, which is not in dims "
                    f"({', '.join(sorted(dims))})"
                )
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
                raise ConfigError(
                    "Buckets(pad_value=...) must be a number (not NaN: it would reach "
                    "every sum over the padded dim) or a mapping of argument name to number, "
                    f"got {value!r}"
                )
        if isinstance(self.pad_value, Mapping):
            object.__setattr__(self, "pad_value", FrozenMap(self.pad_value))

    @property
    def bucket_count(self) -> int:
        """How many buckets there are: the product of each axis's number of sizes."""
        return math.prod(len(a.sizes) for a in self.axes)

    def max_graphs(self, strategy: str) -> int:
        """The most graphs these buckets make under a resolved ``strategy``: one per
        bucket when padding; with dynamic ranges, lengths 0 and 1 below an axis's first
        size each get a static graph too (torch always specialises them)."""
        if strategy == "pad":
            return self.bucket_count
        return math.prod(len(a.sizes) + min(a.sizes[0], 2) for a in self.axes)

    def dims_of(self, arg: str) -> tuple[tuple[int, int], ...]:
        """One argument's bucketed dims, each with the index of its axis in ``axes``."""
        spec = self.dims[arg]
        if isinstance(spec, Mapping):
            index = {a.name: i for i, a in enumerate(self.axes)}
            return tuple((dim, index[axis]) for dim, axis in spec.items())
        return tuple((dim, 0) for dim in _normal_dims(spec) or ())

    def pad_for(self, arg: str) -> float:
        """The pad value for one argument."""
        if isinstance(self.pad_value, Mapping):
            return self.pad_value.get(arg, 0)
        return self.pad_value


WarmupInputs = Sequence[tuple[Any, ...]] | Callable[[], Sequence[tuple[Any, ...]]]


@dataclass(frozen=True, kw_only=True)
class Warmup:
    """Compile ahead of traffic on example inputs.

    :param inputs: a sequence of argument tuples, or a callable returning one (called
        when warmup runs, so large tensors need not live for the process's lifetime).
    :param background: compile on a worker thread while eager serves; then no live call
        waits for a compile: one that would make a graph no warmup covered is served
        eager, and that graph compiles on a worker with a copy of its inputs.
    :param nice: the worker thread's CPU priority on Linux (and its compiler processes'),
        0-19: 19, the lowest, lets live traffic keep the CPU first; ``None`` or ``0``
        leaves it at the caller's (docs/speed.md, "Background warmup").
    :param queue_size: with ``background``, live calls' new graphs waiting to compile at
        most (more are served eager, and counted).
    """

    inputs: WarmupInputs
    background: bool = False
    nice: int | None = 19
    queue_size: int = 8

    def __post_init__(self) -> None:
        inputs: object = self.inputs  # checked at run time: callers may pass anything
        if not callable(inputs):
            if isinstance(inputs, str | bytes) or not isinstance(inputs, Sequence):
                raise ConfigError(
                    "Warmup(inputs=...) must be a sequence of argument tuples or a callable "
                    f"returning one, got {type(inputs).__name__}"
                )
            object.__setattr__(self, "inputs", _argument_tuples(inputs))
        if not isinstance(self.background, bool):
            raise ConfigError(f"Warmup(background=...) must be a bool, got {self.background!r}")
        if self.nice is not None:  # None: leave the worker's priority alone
            _check_number("Warmup", "nice", self.nice, minimum=0, maximum=19, integer=True)
        _check_number("Warmup", "queue_size", self.queue_size, minimum=1, integer=True)

    def resolve(self) -> tuple[tuple[Any, ...], ...]:
        """The example argument tuples (calling ``inputs`` if it is a callable)."""
        return _argument_tuples(self.inputs() if callable(self.inputs) else self.inputs)


def _argument_tuples(items: Iterable[object]) -> tuple[tuple[Any, ...], ...]:
    out = []
    for item in items:
        if not isinstance(item, tuple):
            raise ConfigError(
                "Warmup(inputs=...) items must be tuples of positional arguments, "
                f"e.g. [(torch.randn(8, 16),)], got {type(item).__name__}"
            )
        out.append(item)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class IgnoreWhere:
    """A declared comparison (:func:`ignore_where`): output positions where the input
    ``arg`` equals ``equals`` are not compared."""

    arg: str
    equals: bool | float = True
    dims: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.arg, str) or not self.arg.isidentifier():
            raise ConfigError(
                f"ignore_where(arg=...) must name an argument of the function, got {self.arg!r}"
            )
        if not isinstance(self.equals, bool | int | float) or math.isnan(self.equals):
            raise ConfigError(
                "ignore_where(equals=...) must be a bool or a number (the mask value of the "
                f"positions to ignore: True, or 0 for a 1-keep/0-pad attention mask), got "
                f"{self.equals!r}"
            )
        if self.dims is not None:
            dims = _normal_dims(self.dims)
            if not dims or any(d < 0 for d in dims):
                raise ConfigError(
                    "ignore_where(dims=...) must be a tuple of distinct non-negative output "
                    "dims, one per dim of the mask (mask dim i lines up with output dim "
                    f"dims[i]), got {self.dims!r}"
                )
            object.__setattr__(self, "dims", dims)

    @property
    def label(self) -> str:
        """How ``report()`` and events show it."""
        dims = f", dims={self.dims!r}" if self.dims is not None else ""
        equals = f", equals={self.equals!r}" if self.equals is not True else ""
        return f"ignore_where({self.arg!r}{equals}{dims})"


def ignore_where(
    arg: str, *, equals: bool | float = True, dims: tuple[int, ...] | None = None
) -> IgnoreWhere:
    """A declared comparison for :class:`Shadow`: outputs are compared everywhere except
    where the input ``arg`` equals ``equals`` (positions the model's caller ignores, such as
    padding). ``Shadow(compare=ignore_where("src_key_padding_mask"))``.

    The mask lines up with the leading dims of each output tensor whose shape starts with
    the mask's (a ``(batch, seq)`` mask and a ``(batch, seq, dim)`` output); ``dims`` says
    otherwise: ``dims=(1, 0)`` lines a ``(batch, seq)`` mask up with a ``(seq, batch, dim)``
    output. Output tensors it does not line up with are compared whole. ``arg`` must be a
    parameter of the guarded function (checked at decoration).

    :param arg: the parameter whose tensor marks the positions to ignore.
    :param equals: the mask value of ignored positions (``0`` for a Hugging Face
        ``attention_mask``, where 1 keeps and 0 pads).
    :param dims: the output dim each mask dim lines up with; ``None``: the leading dims.
    """
    return IgnoreWhere(arg=arg, equals=equals, dims=dims)


CompareFn = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], object]


def _check_compare(compare: object) -> None:
    """``Shadow(compare=...)``: ``None``, an :class:`IgnoreWhere`, or a callable that takes
    ``(eager_out, compiled_out, args, kwargs)``."""
    if compare is None or isinstance(compare, IgnoreWhere):
        return
    if not callable(compare):
        raise ConfigError(
            "Shadow(compare=...) must be None, safecompile.ignore_where(...) or a callable "
            f"(eager_out, compiled_out, args, kwargs) -> bool, got {type(compare).__name__}"
        )
    try:
        signature = inspect.signature(compare)
    except (TypeError, ValueError):
        return  # a builtin or extension callable: its call will tell
    try:
        signature.bind(None, None, (), {})
    except TypeError as exc:
        raise ConfigError(
            f"Shadow(compare=...) must take four positional arguments (eager_out, "
            f"compiled_out, args, kwargs) and return a bool; {compare_label(compare)}"
            f"{signature} cannot: {exc}"
        ) from None


def compare_label(compare: object) -> str | None:
    """A declared comparison as ``report()`` and events show it (stable across runs)."""
    if compare is None:
        return None
    if isinstance(compare, IgnoreWhere):
        return compare.label
    module = getattr(compare, "__module__", None)
    name = getattr(compare, "__qualname__", None) or type(compare).__qualname__
    return f"{module}.{name}" if module else name


@dataclass(frozen=True, kw_only=True)
class Shadow:
    """Compare compiled outputs with eager's on live traffic.

    :param canary: calls of each new graph compared with eager before it counts as passed.
    :param every: after the canary, one call in ``every`` is compared (0: none).
    :param mode: ``"sync"`` compares before returning and returns eager's result on a
        breach; ``"async"`` compares on a worker and never blocks the caller.
    :param rtol: relative tolerance; ``None``: the per-dtype default (docs/tolerances.md).
    :param atol: absolute tolerance; ``None``: the per-dtype default.
    :param queue_size: calls waiting for an ``"async"`` check at most (more are not checked).
    :param compare: a declared comparison, for outputs that are partly don't-care, used by
        every check (canary, sampled, a bucket's first call; sync and async):
        :func:`ignore_where` (positions an input masks are not compared), or a callable
        ``(eager_out, compiled_out, args, kwargs) -> bool`` (``True``: they agree), like
        GitHub scientist's ``compare``. ``None``: every output element is compared
        (docs/declared-comparisons.md).
    """

    canary: int = 8
    every: int = 256
    mode: Literal["sync", "async"] = "sync"
    rtol: float | None = None
    atol: float | None = None
    queue_size: int = 16
    compare: IgnoreWhere | CompareFn | None = None

    def __post_init__(self) -> None:
        _check_number("Shadow", "canary", self.canary, minimum=0, integer=True)
        _check_number("Shadow", "every", self.every, minimum=0, integer=True)
        _check_choice("Shadow", "mode", self.mode, ("sync", "async"))
        _check_number("Shadow", "rtol", self.rtol, minimum=0.0, optional=True)
        _check_number("Shadow", "atol", self.atol, minimum=0.0, optional=True)
        _check_number("Shadow", "queue_size", self.queue_size, minimum=1, integer=True)
        _check_compare(self.compare)

    def countdown(self, canary_left: int) -> int:
        """Calls of a graph to serve unchecked before its next check is due."""
        if canary_left > 0:
            return 0
        return FOREVER if self.every == 0 else self.every - 1


@dataclass(frozen=True, kw_only=True)
class Rollback:
    """When to leave the compiled path, and when to try it again.

    The speed verdict (``slower_ratio``) times the whole call the user makes against the
    original function, on paired live calls: a bounded share of them (at most 1% at
    steady state, at most 512 pairs a verdict), measured again later with backoff
    (docs/speed.md). After a trip the compiled path is tried again with one call (a
    half-open trial). With ``safe_compile(group=...)``, ranks agree on trips at safe
    points and at ``sync()`` (docs/fleet.md, "Ranks that agree").

    :param max_recompiles: graphs at most; past it new shapes run eager while the graphs
        made keep serving (``recompile_limit``); ``None``: 8, or one graph for every bucket.
    :param slower_ratio: roll back (``slower``) a compiled path measured slower than
        eager by more than this ratio; ``None``: never.
    :param slower_min_samples: timing pairs a speed verdict reads at least.
    :param retry_after: seconds after a trip before the compiled path is tried again;
        ``0``: the next call; ``None``: never, until ``reset()``.
    :param max_retry_after: the longest wait between trials (each failed one doubles it).
    :param sync_every: with ``group=``, calls between the ranks' safe points.
    :param sync_timeout: seconds a safe point waits for its peers (at most a week).
    """

    max_recompiles: int | None = None
    slower_ratio: float | None = 1.05
    slower_min_samples: int = 16
    retry_after: float | None = None
    max_retry_after: float = 3600.0
    sync_every: int = 64
    sync_timeout: float = 300.0

    def __post_init__(self) -> None:
        check = functools.partial(_check_number, "Rollback")
        check("max_recompiles", self.max_recompiles, minimum=1, integer=True, optional=True)
        check("sync_every", self.sync_every, minimum=1, integer=True)
        check("sync_timeout", self.sync_timeout, minimum=0.0, strict=True, maximum=_WEEK)
        check("slower_ratio", self.slower_ratio, minimum=1.0, optional=True)
        # the speed verdict's last read is at 128 pairs (SpeedPolicy.max_pairs)
        check("slower_min_samples", self.slower_min_samples, minimum=1, maximum=128, integer=True)
        check("retry_after", self.retry_after, minimum=0.0, optional=True)
        check("max_retry_after", self.max_retry_after, minimum=0.0, strict=True)
        if self.retry_after is not None and self.max_retry_after < self.retry_after:
            raise ConfigError(
                "Rollback(max_retry_after=...) must be >= retry_after "
                f"({self.retry_after!r}), got {self.max_retry_after!r}"
            )

    @property
    def recompile_limit(self) -> int:
        """``max_recompiles``, or 8 where it was left to the decorator and not fitted."""
        return self.max_recompiles if self.max_recompiles is not None else 8

    def next_wait(self, previous: float | None, *, failing: bool) -> float | None:
        """Seconds to wait before the next trial after a trip (``None``: never).

        ``failing`` means the compiled path failed again soon after it last came back
        (a failed trial, or a trip within twice the last wait): the wait doubles, up to
        ``max_retry_after``. Otherwise it starts again from ``retry_after``.
        """
        if self.retry_after is None:
            return None
        if not failing or previous is None:
            return self.retry_after
        return min(max(previous * 2, self.retry_after), self.max_retry_after)


def _refuse_unknown(cls: type) -> None:
    """Have ``cls(...)`` answer an option it does not take with a :class:`ConfigError`
    naming it (with a did-you-mean), as ``safe_compile()`` does, not a bare ``TypeError``.
    Whatever fields the policy has: the check reads them from the dataclass."""
    init: Callable[..., None] = cls.__dict__["__init__"]  # the dataclass-made one
    known = tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @functools.wraps(init)
    def __init__(self: object, *args: Any, **kwargs: Any) -> None:
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            raise unknown_options(f"{cls.__name__}()", unknown, known)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]


for _policy in (Buckets, Warmup, Shadow, Rollback):
    _refuse_unknown(_policy)
