"""Shape buckets: pad bucketed argument dims up to a bucket size, cut outputs back.

The guard asks :meth:`Bucketer.plan` on every call (the hot path: a memo keyed by the
arguments' tensor shapes answers in well under a microsecond), pads with
:meth:`Bucketer.pad`, runs the compiled graph, and cuts the output back with
:meth:`Bucketer.unpad` using a :class:`CutSpec` made once per bucket key, either learned
from one padded output and unpadded eager's output (:meth:`Bucketer.learn_cuts`) or
from ``Buckets(outputs=...)`` (:meth:`Bucketer.declared_cuts`).

Un-padding is never silent about a mismatch: a spec is bound to one key and records
every output tensor's full padded shape, so an output that does not look exactly as it
did when the spec was made raises :class:`UnpadError` instead of being cut.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import inspect
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F

from safecompile.base import torchcompat
from safecompile.base.errors import ConfigError
from safecompile.base.policies import Buckets

__all__ = ["BucketError", "Bucketer", "CutSpec", "PadError", "Plan", "UnpadError"]

_Tensor = torch.Tensor
_TABLE_LIMIT = 1 << 16  # largest size served by a list lookup; bisect beyond
_MEMO_LIMIT = 4096  # distinct argument signatures remembered (cleared when full)
_MISS: Any = object()

Status = Literal["bucketed", "oversize", "unbucketable"]
_T = TypeVar("_T")


class BucketError(Exception):
    """Padding or un-padding could not be done faithfully; run the call unpadded."""


class PadError(BucketError):
    """Raised by :meth:`Bucketer.pad` when the arguments do not match the plan."""


class UnpadError(BucketError):
    """An output cannot be cut back safely.

    Raised by :meth:`Bucketer.learn_cuts` and :meth:`Bucketer.declared_cuts` when padding
    changed the output in a way that cutting cannot undo (or contradicts
    ``Buckets(outputs=...)``), and by :meth:`Bucketer.unpad` when an output does not
    match the spec it is cut with. The message names the output path and the shapes.
    """


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    """One bucketed tensor argument of a plan: where it is and how to pad it."""

    name: str
    where: int | str  # position in args, or keyword
    shape: tuple[int, ...]  # its unpadded shape
    pad: tuple[int, ...]  # F.pad's list (last dim first)
    value: float


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What to do with one call's bucketed arguments.

    ``lengths`` and ``sizes`` hold one value per axis of the policy (``Buckets.axes``;
    the short form has one). ``status`` is ``"bucketed"`` (pad each axis's length up
    to its size), ``"oversize"`` (a length is past its axis's largest size: run eager,
    or compile the shape as it is; ``sizes == lengths``) or ``"unbucketable"``
    (``reason`` says why: dims of one axis disagree, a dim out of range, a pad value
    the dtype cannot hold; run unpadded, ``sizes == lengths`` = the longest seen).

    ``key`` is hashable and names one padded input signature: the status, the sizes,
    with ``Buckets(strategy="pad")`` which axes are padded, and for each top-level
    tensor argument (by parameter name) its shape (bucketed dims at their bucket size)
    and dtype. Equal keys mean equal padded input shapes, so equal output shapes, and
    the same axes padded: one graph serves a key (a key whose lengths are exactly its
    sizes shares the graph of the padded keys), and a :class:`CutSpec` belongs to one
    key. Python scalars and tensors nested in containers are not part of the key.
    """

    key: tuple[Any, ...]
    status: Status
    lengths: tuple[int, ...]
    sizes: tuple[int, ...]
    reason: str | None = None
    targets: tuple[_Target, ...] = dataclasses.field(default=(), repr=False, compare=False)
    axes: tuple[str | None, ...] = dataclasses.field(default=(None,), repr=False, compare=False)

    @property
    def length(self) -> int:
        """The length of a one-axis plan (``ValueError`` with several axes)."""
        return self._only(self.lengths)

    @property
    def size(self) -> int:
        """The bucket size of a one-axis plan (``ValueError`` with several axes)."""
        return self._only(self.sizes)

    def _only(self, values: tuple[int, ...]) -> int:
        if len(values) != 1:
            raise ValueError(f"the plan has {len(values)} axes: read lengths/sizes")
        return values[0]

    @property
    def padded(self) -> bool:
        """Whether the call is padded (so its output needs cutting back)."""
        return self.sizes != self.lengths

    @property
    def padded_axes(self) -> tuple[bool, ...]:
        """For each axis, whether this call pads it."""
        return tuple(s != n for s, n in zip(self.sizes, self.lengths, strict=True))

    @property
    def label(self) -> str:
        """Short text for events and reports: the bucket (``"64"``, or ``"batch=8,seq=64"``
        with named axes), or the status."""
        if self.status == "bucketed":
            return _axes_text(self.axes, self.sizes)
        if self.status == "oversize":
            return f"oversize({_axes_text(self.axes, self.lengths)})"
        return "unbucketable"

    def describe(self) -> str:
        """The key as text: shapes and dtypes, never values."""
        args = ", ".join(
            f"{name}={'x'.join(map(str, shape))}:{str(dtype).removeprefix('torch.')}"
            for name, shape, dtype in self.key[-1]
        )
        if self.axes == (None,):
            head = f"{self.label} (length {self.lengths[0]})"
        else:
            shown = ", ".join(f"{a} {n}" for a, n in zip(self.axes, self.lengths, strict=True))
            head = f"{self.label} ({shown})"
        tail = f": {self.reason}" if self.reason else ""
        return f"{head} [{args}]{tail}"


def _axes_text(axes: tuple[str | None, ...], values: tuple[int, ...]) -> str:
    """``"64"`` for the one unnamed axis, ``"batch=8,seq=64"`` for named ones."""
    if axes == (None,):
        return str(values[0])
    return ",".join(f"{a}={v}" for a, v in zip(axes, values, strict=True))


# ---------------------------------------------------------------- output cut specs


class _Node:
    __slots__ = ("cuts_any",)
    cuts_any: bool

    def apply(self, obj: Any, lengths: tuple[int, ...], path: str) -> Any:
        raise NotImplementedError

    def items(self, path: str) -> list[tuple[str, tuple[int, ...]]]:
        return []


class _TensorNode(_Node):
    """One output tensor: its padded shape, and each cut dim with the axis it follows."""

    __slots__ = ("ambiguous", "axes", "contiguous", "cuts", "shape")

    def __init__(
        self,
        shape: tuple[int, ...],
        cuts: tuple[int, ...],
        contiguous: bool,
        axes: tuple[int, ...] | None = None,
        *,
        ambiguous: bool = False,
    ) -> None:
        self.shape = shape
        self.cuts = cuts
        self.axes = axes if axes is not None else (0,) * len(cuts)
        self.contiguous = contiguous
        self.cuts_any = bool(cuts)
        self.ambiguous = ambiguous  # a cut dim that matched several axes in this call

    def apply(self, obj: Any, lengths: tuple[int, ...], path: str) -> Any:
        if not isinstance(obj, _Tensor):
            raise UnpadError(f"{_show(path)} is a {type(obj).__name__}, expected a tensor")
        if obj.shape != self.shape:
            raise UnpadError(
                f"{_show(path)} has shape {tuple(obj.shape)}, but the cut was made for "
                f"{self.shape}; not cut"
            )
        for dim, axis in zip(self.cuts, self.axes, strict=True):
            obj = obj.narrow(dim, 0, lengths[axis])
        if self.contiguous and self.cuts and not obj.is_contiguous():
            obj = obj.contiguous()  # eager's output was contiguous: keep .view() working
        return obj

    def items(self, path: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(path, self.cuts)] if self.cuts else []

    def axis_items(self, path: str) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
        if not self.cuts:
            return []
        return [(path, tuple(zip(self.cuts, self.axes, strict=True)))]


class _LeafNode(_Node):
    """A non-tensor value kept as it is (None, numbers, strings)."""

    __slots__ = ("kind",)

    def __init__(self, kind: type[Any]) -> None:
        self.kind = kind
        self.cuts_any = False

    def apply(self, obj: Any, lengths: tuple[int, ...], path: str) -> Any:
        if type(obj) is not self.kind:
            raise UnpadError(
                f"{_show(path)} is a {type(obj).__name__}, expected a {self.kind.__name__}"
            )
        return obj


class _SeqNode(_Node):
    """A tuple (plain, named or struct sequence) or a list."""

    __slots__ = ("children", "kind")

    def __init__(self, kind: type[Any], children: tuple[_Node, ...]) -> None:
        self.kind = kind
        self.children = children
        self.cuts_any = any(c.cuts_any for c in children)

    def apply(self, obj: Any, lengths: tuple[int, ...], path: str) -> Any:
        if type(obj) is not self.kind or len(obj) != len(self.children):
            raise UnpadError(
                f"{_show(path)} is a {type(obj).__name__} of {_len(obj)}, expected a "
                f"{self.kind.__name__} of {len(self.children)}"
            )
        items = [
            c.apply(o, lengths, _join(path, _part(self.kind, i)))
            for i, (c, o) in enumerate(zip(self.children, obj, strict=True))
        ]
        if not self.cuts_any:
            return obj
        if self.kind is list:
            return items
        if self.kind is tuple:
            return tuple(items)
        if hasattr(self.kind, "_fields"):  # namedtuple
            return self.kind(*items)
        return self.kind(items)  # struct sequences (torch.return_types)

    def items(self, path: str) -> list[tuple[str, tuple[int, ...]]]:
        return [
            x
            for i, c in enumerate(self.children)
            for x in c.items(_join(path, _part(self.kind, i)))
        ]


class _MapNode(_Node):
    """A dict or dict subclass (keys compared in order)."""

    __slots__ = ("children", "keys", "kind")

    def __init__(self, kind: type[Any], keys: tuple[Any, ...], children: tuple[_Node, ...]) -> None:
        self.kind = kind
        self.keys = keys
        self.children = children
        self.cuts_any = any(c.cuts_any for c in children)

    def apply(self, obj: Any, lengths: tuple[int, ...], path: str) -> Any:
        if type(obj) is not self.kind or tuple(obj.keys()) != self.keys:
            raise UnpadError(
                f"{_show(path)} is a {type(obj).__name__} with keys {_keys(obj)}, expected "
                f"a {self.kind.__name__} with keys {list(self.keys)}"
            )
        items = [
            c.apply(obj[k], lengths, _join(path, k))
            for k, c in zip(self.keys, self.children, strict=True)
        ]
        if not self.cuts_any:
            return obj
        out = copy.copy(obj)  # keeps the subclass (OrderedDict, defaultdict's factory)
        for k, v in zip(self.keys, items, strict=True):
            out[k] = v
        return out

    def items(self, path: str) -> list[tuple[str, tuple[int, ...]]]:
        return [
            x
            for k, c in zip(self.keys, self.children, strict=True)
            for x in c.items(_join(path, k))
        ]


class _DataNode(_Node):
    """A dataclass instance (including ``transformers`` ``ModelOutput``)."""

    __slots__ = ("children", "kind", "names")

    def __init__(
        self, kind: type[Any], names: tuple[str, ...], children: tuple[_Node, ...]
    ) -> None:
        self.kind = kind
        self.names = names
        self.children = children
        self.cuts_any = any(c.cuts_any for c in children)

    def apply(self, obj: Any, lengths: tuple[int, ...], path: str) -> Any:
        if type(obj) is not self.kind:
            raise UnpadError(
                f"{_show(path)} is a {type(obj).__name__}, expected a {self.kind.__name__}"
            )
        changes = {}
        for name, child in zip(self.names, self.children, strict=True):
            value = getattr(obj, name)
            new = child.apply(value, lengths, _join(path, name))
            if new is not value:
                changes[name] = new
        if not changes:
            return obj
        init = {f.name for f in dataclasses.fields(obj) if f.init}
        if init.issuperset(changes):
            return dataclasses.replace(obj, **changes)  # runs __post_init__ (ModelOutput)
        out = copy.copy(obj)
        for name, value in changes.items():
            object.__setattr__(out, name, value)
        return out

    def items(self, path: str) -> list[tuple[str, tuple[int, ...]]]:
        return [
            x
            for n, c in zip(self.names, self.children, strict=True)
            for x in c.items(_join(path, n))
        ]


def _join(path: str, part: object) -> str:
    return f"{path}.{part}" if path else str(part)


def _part(kind: type[Any], i: int) -> str | int:
    """A sequence item's path part: a namedtuple's field name, otherwise the index."""
    fields = getattr(kind, "_fields", None)
    return fields[i] if isinstance(fields, tuple) else i


def _show(path: str) -> str:
    return f"output.{path}" if path else "output"


def _len(obj: Any) -> str:
    try:
        return str(len(obj))
    except TypeError:
        return "?"


def _keys(obj: Any) -> str:
    try:
        return str(list(obj.keys()))
    except (AttributeError, TypeError):
        return "?"


def _is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


_PLAIN = (type(None), bool, int, float, complex, str, bytes)


@dataclasses.dataclass(frozen=True, eq=False)
class CutSpec:
    """Which output dims to cut back, for the one plan key it was made for.

    Records every output tensor's full padded shape: :meth:`Bucketer.unpad` refuses an
    output that differs in structure or in any shape.
    """

    key: tuple[Any, ...]
    sizes: tuple[int, ...]
    source: Literal["learned", "declared"]
    root: _Node = dataclasses.field(repr=False)
    axes: tuple[str | None, ...] = (None,)

    @property
    def cuts(self) -> dict[str, tuple[int, ...]]:
        """Output path (``""`` the output itself) to the dims cut there."""
        return dict(self.root.items(""))

    @property
    def cut_axes(self) -> dict[str, tuple[tuple[int, str | None], ...]]:
        """Output path to each cut dim with the name of the axis it follows."""
        return {
            path: tuple((d, self.axes[a]) for d, a in zip(n.cuts, n.axes, strict=True))
            for path, n in _tensor_nodes(self.root, "")
            if n.cuts
        }

    @property
    def ambiguous(self) -> bool:
        """Whether a cut dim matched several axes (equal sizes and lengths) when learned:
        right for that call, but not known for the key's other calls."""
        return any(n.ambiguous for _, n in _tensor_nodes(self.root, ""))

    def saved(self) -> list[list[Any]]:
        """Every output tensor as ``[path, padded shape, [[dim, axis], ...], contiguous]``:
        plain JSON, for :meth:`Bucketer.restored_cuts` in a later process."""
        return [
            [path, list(n.shape), [list(c) for c in zip(n.cuts, n.axes, strict=True)], n.contiguous]
            for path, n in _tensor_nodes(self.root, "")
        ]

    def describe(self) -> str:
        """The cuts as text, for events."""
        found = self.cut_axes
        if not found:
            return "nothing cut"
        if self.axes == (None,):
            return "; ".join(f"{_show(p)} dims {[d for d, _ in c]}" for p, c in found.items())
        return "; ".join(
            f"{_show(p)} dims [{', '.join(f'{d}:{a}' for d, a in c)}]" for p, c in found.items()
        )


# ---------------------------------------------------------------- the bucketer


@dataclasses.dataclass(frozen=True, slots=True)
class _Slot:
    name: str
    position: int | None  # None: keyword only
    keyword: bool  # may be passed by keyword
    dims: tuple[tuple[int, int], ...]  # (dim, axis index)


_Found = list[tuple[_Slot, int | str, _Tensor]]  # what Bucketer._find returns
Strategy = Literal["pad", "dynamic"]

# Modes and options under which inductor runs CUDA graphs (static shapes only).
_CUDAGRAPH_BACKENDS = ("cudagraphs",)


def resolve_strategy(
    policy: Buckets,
    *,
    backend: str = "inductor",
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
    dynamic: bool | None = None,
) -> Strategy:
    """The strategy ``Buckets(strategy="auto")`` means for these compile options.

    ``"pad"`` where the compiled code needs static shapes: CUDA graphs (the
    ``"cudagraphs"`` backend, a ``mode`` that turns on ``triton.cudagraphs`` —
    ``"reduce-overhead"``, ``"max-autotune"`` — or that option itself), or
    ``dynamic=False``; ``"dynamic"`` otherwise. An explicit ``"pad"`` or ``"dynamic"``
    is returned as it is.
    """
    if policy.strategy != "auto":
        return policy.strategy
    if dynamic is False or backend in _CUDAGRAPH_BACKENDS:
        return "pad"
    if dynamic is True:
        return "dynamic"
    return "pad" if uses_cudagraphs(backend, mode, options) else "dynamic"


def uses_cudagraphs(
    backend: str, mode: str | None = None, options: Mapping[str, Any] | None = None
) -> bool:
    """Whether these compile options run CUDA graphs: the ``"cudagraphs"`` backend, or
    inductor with a ``mode`` that turns on ``triton.cudagraphs`` (``"reduce-overhead"``,
    ``"max-autotune"``) or that option itself."""
    if backend in _CUDAGRAPH_BACKENDS:
        return True
    settings: dict[str, Any] = {}
    if mode is not None and backend == "inductor":
        try:
            settings.update(torchcompat.mode_options(mode))
        except Exception:  # pragma: no cover - an unknown mode is refused elsewhere
            settings["triton.cudagraphs"] = mode in ("reduce-overhead", "max-autotune")
    settings.update(options or {})
    return bool(settings.get("triton.cudagraphs"))


class Bucketer:
    """Pads one callable's bucketed arguments and cuts its outputs back.

    ``fn`` is what the arguments given to :meth:`plan` are for: a function (a method
    defined in a class body takes ``self`` first), a bound method (no ``self``) or an
    ``nn.Module`` (the arguments of ``module(...)``, i.e. its ``forward`` without
    ``self``). Each name in ``policy.dims`` must be one of its parameters (or ``fn``
    must take ``**kwargs``), otherwise :class:`ConfigError`. ``strategy`` is the
    resolved one (:func:`resolve_strategy`; default: resolved without compile options).

    Thread-safe: the only shared state is a memo dict, filled idempotently.
    """

    def __init__(
        self, policy: Buckets, fn: Callable[..., Any], *, strategy: Strategy | None = None
    ) -> None:
        self.policy = policy
        self.strategy: Strategy = strategy or resolve_strategy(policy)
        self.axes = tuple(a.name for a in policy.axes)
        target: Callable[..., Any] = fn.forward if isinstance(fn, torch.nn.Module) else fn
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"Buckets(dims=...) needs the parameters of {_name(fn)}, but its signature "
                f"cannot be read: {exc}"
            ) from None
        params = list(signature.parameters.values())
        kinds = inspect.Parameter
        self._positional = tuple(
            p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
        )
        var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in params)
        slots = []
        for name in policy.dims:
            dims = policy.dims_of(name)
            param = signature.parameters.get(name)
            if param is None and var_keyword:
                slots.append(_Slot(name, None, True, dims))
                continue
            if param is None or param.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD):
                what = "is not a parameter" if param is None else "is a variadic parameter"
                raise ConfigError(
                    f"Buckets(dims=...) names {name!r}, which {what} of {_name(fn)}"
                    f"{signature}; name a tensor parameter"
                )
            position = self._positional.index(name) if name in self._positional else None
            keyword = param.kind is not kinds.POSITIONAL_ONLY
            slots.append(_Slot(name, position, keyword, dims))
        self._slots = tuple(slots)
        self._sizes = tuple(a.sizes for a in policy.axes)
        self._tables = tuple(_table(sizes) for sizes in self._sizes)
        self._memo: dict[tuple[Any, ...], Plan | None] = {}
        self._declared_all, self._declared_paths = _declared(policy)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes of the one axis (``ValueError`` with several: read ``policy.axes``)."""
        if len(self._sizes) != 1:
            raise ValueError(f"{len(self._sizes)} axes: read policy.axes")
        return self._sizes[0]

    @property
    def _table(self) -> list[int] | None:  # the first axis's lookup table (tests read it)
        return self._tables[0]

    # -- per call

    def bucket(self, length: int, axis: int = 0) -> int | None:
        """The smallest size of ``axis`` (an index into ``policy.axes``) that holds
        ``length``, or ``None`` when it is too long."""
        table = self._tables[axis]
        if table is not None:
            return table[length] if length < len(table) else None
        sizes = self._sizes[axis]
        i = bisect.bisect_left(sizes, length)
        return sizes[i] if i < len(sizes) else None

    def plan(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Plan | None:
        """The plan for one call, or ``None`` when no bucketed argument is a tensor.

        Cheap when the arguments' shapes were seen before (a dict lookup on their
        shapes and dtypes); otherwise a few microseconds.
        """
        # The memo key spells each positional argument as (shape, dtype) for a tensor
        # or its type otherwise, then each keyword as name, (shape, dtype) or type: a
        # prefix-free code, so equal keys mean equal signatures. Hand-unrolled for the
        # common arities: this runs on every call.
        memo_key: tuple[Any, ...]
        n = len(args)
        if n == 1 and not kwargs:
            a = args[0]
            memo_key = (a.shape, a.dtype) if isinstance(a, _Tensor) else (type(a),)
        elif n == 2 and not kwargs:
            a, b = args
            if isinstance(a, _Tensor):
                if isinstance(b, _Tensor):
                    memo_key = (a.shape, a.dtype, b.shape, b.dtype)
                else:
                    memo_key = (a.shape, a.dtype, type(b))
            elif isinstance(b, _Tensor):
                memo_key = (type(a), b.shape, b.dtype)
            else:
                memo_key = (type(a), type(b))
        else:
            memo_key = _signature_key(args, kwargs)
        found = self._memo.get(memo_key, _MISS)
        if found is _MISS:
            found = self._plan(args, kwargs)
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            self._memo[memo_key] = found
        return found  # type: ignore[no-any-return]

    def _find(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[list[tuple[_Slot, int | str, _Tensor]], str | None]:
        """The bucketed tensors of a call (slot, where, tensor), and a problem if any."""
        found: list[tuple[_Slot, int | str, _Tensor]] = []
        problem = None
        for slot in self._slots:
            where: int | str
            if slot.position is not None and slot.position < len(args):
                where = slot.position
                value = args[slot.position]
            elif slot.keyword and slot.name in kwargs:
                where = slot.name
                value = kwargs[slot.name]
            else:
                continue
            if value is None:
                continue
            if not isinstance(value, _Tensor):
                problem = problem or f"{slot.name} is a {type(value).__name__}, not a tensor"
                continue
            found.append((slot, where, value))
        return found, problem

    def _plan(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Plan | None:
        found, problem = self._find(args, kwargs)
        if not found and problem is None:
            return None

        norm, seen, problem = _normalize_dims(found, problem)
        count = len(self.axes)
        lengths = [0] * count
        for axis in range(count):
            on_axis = [(name, d, n) for name, d, a, n in seen if a == axis]
            distinct = {n for _, _, n in on_axis}
            if problem is None and len(distinct) > 1:
                shown = ", ".join(f"{name}[{d}]={n}" for name, d, n in on_axis)
                of = "" if self.axes == (None,) else f" of axis {self.axes[axis]!r}"
                problem = f"bucketed dims{of} have different lengths: {shown}"
            lengths[axis] = max(distinct, default=0)
        found_sizes = [self.bucket(n, a) for a, n in enumerate(lengths)]

        status: Status
        sizes = tuple(lengths)
        if problem is not None:
            status = "unbucketable"
        elif any(s is None for s in found_sizes):
            status = "oversize"
        else:
            status = "bucketed"
            sizes = tuple(s for s in found_sizes if s is not None)
            if self.strategy == "dynamic":  # torch specialises 0 and 1: their own graphs
                sizes = tuple(n if n < 2 else s for s, n in zip(sizes, lengths, strict=True))

        targets: tuple[_Target, ...] = ()
        if status == "bucketed" and sizes != tuple(lengths):
            targets, pad_problem = self._targets(found, norm, sizes)
            if pad_problem is not None:
                problem = pad_problem
                status, sizes = "unbucketable", tuple(lengths)

        padded_dims = norm if status == "bucketed" else {}
        mask: tuple[bool, ...] = ()
        if status == "bucketed" and self.strategy == "pad":
            mask = tuple(s != n for s, n in zip(sizes, lengths, strict=True))
        key = (status, sizes, mask, self._entries(args, kwargs, padded_dims, sizes))
        return Plan(key, status, tuple(lengths), sizes, problem, targets, self.axes)

    def _targets(
        self, found: _Found, norm: Mapping[str, tuple[tuple[int, int], ...]], sizes: tuple[int, ...]
    ) -> tuple[tuple[_Target, ...], str | None]:
        """How to pad each bucketed tensor up to its axes' ``sizes``, or a pad value that
        cannot be used (then no targets)."""
        targets = []
        for slot, where, tensor in found:
            value = self.policy.pad_for(slot.name)
            if not _fits(value, tensor.dtype):
                return (), (
                    f"pad value {value!r} for {slot.name} does not fit its dtype "
                    f"{str(tensor.dtype).removeprefix('torch.')}"
                )
            shape = tuple(tensor.shape)
            pad = _pad_widths(shape, norm[slot.name], sizes)
            targets.append(_Target(slot.name, where, shape, pad, value))
        return tuple(targets), None

    def _entries(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        padded_dims: Mapping[str, tuple[tuple[int, int], ...]],
        sizes: tuple[int, ...],
    ) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """The key's part for the call's top-level tensors, by parameter name."""
        entries = []
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                name = self._positional[i] if i < len(self._positional) else f"*{i}"
                entries.append(_entry(name, a, padded_dims.get(name, ()), sizes))
        for k, v in kwargs.items():
            if isinstance(v, _Tensor):
                entries.append(_entry(k, v, padded_dims.get(k, ()), sizes))
        entries.sort(key=lambda e: e[0])
        return tuple(entries)

    def pad(
        self, plan: Plan, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments with bucketed dims padded up to their axes' ``plan.sizes``.

        Other arguments are passed through untouched; an unpadded plan returns the
        arguments as they are. Padding copies (autograd flows back through it); a
        function that mutates a bucketed argument in place mutates the copy.
        """
        if not plan.targets:
            return args, kwargs if isinstance(kwargs, dict) else dict(kwargs)
        new_args = list(args)
        new_kwargs = dict(kwargs)
        for t in plan.targets:
            tensor = args[t.where] if isinstance(t.where, int) else kwargs[t.where]
            if not isinstance(tensor, _Tensor) or tensor.shape != t.shape:
                raise PadError(
                    f"{t.name} does not match the plan: expected shape {t.shape}, got "
                    f"{getattr(tensor, 'shape', type(tensor).__name__)}"
                )
            padded = F.pad(tensor, t.pad, value=t.value)
            if isinstance(t.where, int):
                new_args[t.where] = padded
            else:
                new_kwargs[t.where] = padded
        return tuple(new_args), new_kwargs

    # -- warmup

    def warmup_lengths(self, axis: int = 0) -> tuple[int, ...]:
        """One length per size of ``axis``, for warmup: ``size - 1`` (padded by one, so
        the bucket's output cut can be learned and its padding checked against eager
        before any traffic), or the size itself when its bucket holds that one length."""
        out = []
        previous = 0
        for size in self._sizes[axis]:
            out.append(size - 1 if size - 1 > previous else size)
            previous = size
        return tuple(out)

    def warmup_calls(self) -> tuple[tuple[int, ...], ...]:
        """The lengths (one per axis) of the calls that warm every bucket up: each
        combination of sizes (the product over axes). With ``strategy="pad"``, every
        padded key of a combination is verified too — all axes padded, and each mix of
        padded and exactly fitting axes — with lengths picked so that no two padded axes
        share a size and a length (which would leave their output dims ambiguous)."""
        per_axis = []
        for sizes in self._sizes:
            bounds = [0, *sizes[:-1]]
            per_axis.append(list(zip(sizes, bounds, strict=True)))
        calls: list[tuple[int, ...]] = []
        for combo in itertools.product(*per_axis):
            paddable = [size - 1 > low for size, low in combo]
            if self.strategy == "dynamic":
                calls.append(
                    tuple(s - 1 if p else s for (s, _), p in zip(combo, paddable, strict=True))
                )
                continue
            choices = [(True, False) if p else (False,) for p in paddable]
            for mask in itertools.product(*choices):
                if any(paddable) and not any(mask):
                    continue  # nothing padded: no cut to learn, the graph is the same
                lengths = _distinct_lengths(combo, mask)
                if lengths is not None:
                    calls.append(lengths)
        return tuple(calls)

    def warmup_specialised(self) -> tuple[tuple[int, ...], ...]:
        """With ``strategy="dynamic"``, the extra warmup calls for length 1 on each axis
        whose first size is larger (torch specialises it: a static graph of its own), in
        every combination with the other axes' ranges; none when padding. Best effort:
        an example the function cannot take at length 1 is skipped."""
        if self.strategy != "dynamic":
            return ()
        per_axis = []
        for axis, sizes in enumerate(self._sizes):
            per_axis.append([*([1] if sizes[0] > 1 else []), *self.warmup_lengths(axis)])
        return tuple(
            c
            for c in itertools.product(*per_axis)
            if any(n == 1 and self._sizes[a][0] > 1 for a, n in enumerate(c))
        )

    def check_dims(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Raise :class:`ConfigError` when a bucketed dim is beyond its argument's rank:
        ``Buckets(dims=...)`` does not fit the function's inputs (warmup, a first call)."""
        found, _ = self._find(args, kwargs)
        for slot, _, tensor in found:
            rank = tensor.dim()
            wrong = [d for d, _ in slot.dims if not -rank <= d < rank]
            if wrong:
                raise ConfigError(
                    f"Buckets(dims=...) pads dim {wrong[0]} of {slot.name}, which has "
                    f"{rank} dim(s) (shape {tuple(tensor.shape)}) in this call: name a dim "
                    f"it has (0 to {rank - 1}, or -1 for the last)"
                )

    def resize(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], lengths: int | tuple[int, ...]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """An example call with each bucketed dim made its axis's length (``lengths``:
        one per axis, or one int for all): cut when longer, tiled (the example repeated)
        when shorter, so masks and ids stay realistic. Other arguments are untouched.
        For warmup: ``resize(*example, n)`` for each ``n`` in :meth:`warmup_calls`
        gives a call in each bucket."""
        if isinstance(lengths, int):
            lengths = (lengths,) * len(self.axes)
        self.check_dims(args, kwargs)
        found, problem = self._find(args, kwargs)
        if problem is not None:
            raise PadError(f"cannot resize the example: {problem}")
        new_args = list(args)
        new_kwargs = dict(kwargs)
        for slot, where, tensor in found:
            t = tensor
            for d, axis in slot.dims:
                length = lengths[axis]
                n = t.shape[d]
                if n == 0:
                    shape = list(t.shape)
                    shape[d] = length
                    t = t.new_full(shape, self.policy.pad_for(slot.name))
                    continue
                if n < length:
                    t = torch.cat([t] * -(-length // n), dim=d)
                t = t.narrow(d, 0, length)
            # A fresh tensor with plain strides, like live traffic's: dynamo guards on a
            # view's base and on strides, so a view would compile graphs of its own.
            t = t.clone(memory_format=torch.contiguous_format)
            if isinstance(where, int):
                new_args[where] = t
            else:
                new_kwargs[where] = t
        return tuple(new_args), new_kwargs

    # -- outputs

    def learn_cuts(self, plan: Plan, padded_out: object, eager_out: object) -> CutSpec:
        """Learn the cut for ``plan.key`` from one padded output and eager's output.

        A dim is cut where the padded output has an axis's size and eager's has that
        axis's length (the axis must be padded in this call); dims equal in both are
        kept (a hidden size that equals the bucket stays, both dims of a square
        attention map are cut). Any other difference (structure, rank, a dim that is
        neither) raises :class:`UnpadError`:
        such a bucket cannot be un-padded. With ``Buckets(outputs=...)`` the result must
        also match the declaration. The values are not compared: that is the shadow
        check's job (a sum over the padded dim keeps its shape and is not cut).

        Needs a padded plan (``plan.padded``): when the length is the bucket size there
        is nothing to learn from, and nothing to cut (:meth:`unpad` passes it through).
        Two padded axes with equal sizes and equal lengths in this call make their dims
        indistinguishable: the spec is then right for this call only
        (:attr:`CutSpec.ambiguous`), and a later call must learn again.
        """
        if not plan.padded:
            raise ValueError(
                f"nothing to learn: length {_axes_text(plan.axes, plan.lengths)} is the bucket "
                "size, so padding changed no shape (such a call needs no cut)"
            )
        root = self._learn(padded_out, eager_out, "", plan)
        spec = CutSpec(plan.key, plan.sizes, "learned", root, self.axes)
        if self.policy.outputs is not None:
            self._check_declared(spec, plan)
        return spec

    def declared_cuts(self, plan: Plan, padded_out: object) -> CutSpec:
        """The cut for ``plan.key`` from ``Buckets(outputs=...)``, without eager.

        Each declared dim must have its axis's size in ``padded_out``; also valid for a
        call whose length is the bucket size (the spec then serves the key's later,
        shorter calls). Raises :class:`UnpadError` on a mismatch, ``ValueError`` when
        the policy declares nothing.
        """
        if self.policy.outputs is None:
            raise ValueError("Buckets(outputs=...) is None: the cut must be learned")
        seen: set[str] = set()
        root = self._declare(padded_out, "", plan, seen)
        self._check_unknown_paths(seen)
        return CutSpec(plan.key, plan.sizes, "declared", root, self.axes)

    def restored_cuts(self, plan: Plan, padded_out: object, saved: list[Any]) -> CutSpec:
        """The cut for ``plan.key`` from :meth:`CutSpec.saved` of an earlier process,
        without eager. ``padded_out`` must hold exactly the tensors and padded shapes
        saved, each cut dim at its axis's size; anything else raises :class:`UnpadError`
        (the code's outputs changed: learn again)."""
        nodes: dict[str, _TensorNode] = {}
        for path, shape, cuts, contiguous in saved:
            node = _TensorNode(
                tuple(int(n) for n in shape),
                tuple(int(d) for d, _ in cuts),
                bool(contiguous),
                tuple(int(a) for _, a in cuts),
            )
            if any(
                node.shape[d] != plan.sizes[a] for d, a in zip(node.cuts, node.axes, strict=True)
            ):
                raise UnpadError(f"the saved cut of {_show(str(path))} does not fit {plan.label}")
            nodes[str(path)] = node

        def restore(p: _Tensor, path: str) -> _Node:
            node = nodes.get(path)
            if node is None or tuple(p.shape) != node.shape:
                raise UnpadError(
                    f"{_show(path)} has shape {tuple(p.shape)}, not the saved "
                    f"{node.shape if node is not None else 'nothing'}"
                )
            return node

        seen: set[str] = set()
        root = self._declare(padded_out, "", plan, seen, restore)
        if seen != set(nodes):
            raise UnpadError(f"output tensors {sorted(seen)}, saved {sorted(nodes)}")
        return CutSpec(plan.key, plan.sizes, "learned", root, self.axes)

    def unpad(self, plan: Plan, out: _T, cuts: CutSpec | None) -> _T:
        """``out`` with the spec's dims cut to their axes' ``plan.lengths`` (views where they are
        contiguous like eager's; a copy otherwise).

        An unpadded plan returns ``out`` as it is (``cuts`` may be ``None``). Raises
        :class:`UnpadError` when the spec was made for another key or the output's
        structure or shapes differ from the spec's: nothing is ever cut on a guess.
        """
        if not plan.padded:
            return out
        if cuts is None:
            raise UnpadError(f"bucket {plan.label}: the output cut is not known yet")
        declared = cuts.source == "declared"
        if cuts.key is not plan.key and _key(cuts.key, declared) != _key(plan.key, declared):
            raise UnpadError(
                f"the cut was made for bucket {_axes_text(cuts.axes, cuts.sizes)} with other "
                f"shapes, not for {plan.describe()}"
            )
        return cuts.root.apply(out, plan.lengths, "")  # type: ignore[no-any-return]

    # -- helpers

    def _learn(self, p: object, e: object, path: str, plan: Plan) -> _Node:
        if isinstance(p, _Tensor):
            return _learn_tensor(p, e, path, plan)
        if type(p) is not type(e):
            raise UnpadError(
                f"{_show(path)}: padded run gave a {type(p).__name__}, unpadded a "
                f"{type(e).__name__}"
            )
        if _is_dataclass_instance(p):
            names = tuple(f.name for f in dataclasses.fields(p))  # type: ignore[arg-type]
            children = tuple(
                self._learn(getattr(p, n), getattr(e, n), _join(path, n), plan) for n in names
            )
            return _DataNode(type(p), names, children)
        if isinstance(p, dict):
            assert isinstance(e, dict)
            keys = tuple(p.keys())
            if keys != tuple(e.keys()):
                raise UnpadError(
                    f"{_show(path)}: padded run gave keys {list(keys)}, unpadded {list(e)}"
                )
            children = tuple(self._learn(p[k], e[k], _join(path, k), plan) for k in keys)
            return _MapNode(type(p), keys, children)
        if isinstance(p, list | tuple):
            assert isinstance(e, list | tuple)
            if len(p) != len(e):
                raise UnpadError(
                    f"{_show(path)}: padded run gave {len(p)} items, unpadded {len(e)}"
                )
            children = tuple(
                self._learn(a, b, _join(path, _part(type(p), i)), plan)
                for i, (a, b) in enumerate(zip(p, e, strict=True))
            )
            return _SeqNode(type(p), children)
        if isinstance(p, _PLAIN):
            if isinstance(p, int) and p != e:
                raise UnpadError(
                    f"{_show(path)}: padded run gave {p!r}, unpadded {e!r}: the output "
                    "depends on the padded length"
                )
            return _LeafNode(type(p))
        raise UnpadError(
            f"{_show(path)} is a {type(p).__name__}: safecompile cannot see inside it to "
            "cut padding back (return tensors, tuples, lists, dicts or dataclasses)"
        )

    def _declared_for(self, path: str) -> tuple[tuple[int, int], ...]:
        """The declared cut dims of one output path, each with its axis index."""
        if self._declared_paths is not None:
            return self._declared_paths.get(path, ())
        assert self._declared_all is not None
        return self._declared_all

    def _declare(
        self,
        p: object,
        path: str,
        plan: Plan,
        seen: set[str],
        tensor: Callable[[_Tensor, str], _Node] | None = None,
    ) -> _Node:
        """The spec's node for ``p``: each tensor's cut declared by the policy, or made by
        ``tensor(p, path)`` when given (:meth:`restored_cuts`)."""
        if isinstance(p, _Tensor):
            seen.add(path)
            if tensor is not None:
                return tensor(p, path)
            shape = tuple(p.shape)
            cuts = []
            for d, axis in self._declared_for(path):
                n = d + len(shape) if d < 0 else d
                if not 0 <= n < len(shape):
                    raise UnpadError(
                        f"Buckets(outputs=...) cuts {_show(path)} at dim {d}, but it has "
                        f"shape {shape}"
                    )
                size = plan.sizes[axis]
                if shape[n] != size:
                    bucket = _axes_text((self.axes[axis],), (size,))
                    raise UnpadError(
                        f"Buckets(outputs=...) cuts {_show(path)} at dim {d}, but it has "
                        f"{shape[n]} there, not the bucket size {bucket} (shape {shape})"
                    )
                cuts.append((n, axis))
            cuts.sort()
            return _TensorNode(
                shape, tuple(d for d, _ in cuts), p.is_contiguous(), tuple(a for _, a in cuts)
            )
        if _is_dataclass_instance(p):
            names = tuple(f.name for f in dataclasses.fields(p))  # type: ignore[arg-type]
            children = tuple(
                self._declare(getattr(p, n), _join(path, n), plan, seen, tensor) for n in names
            )
            return _DataNode(type(p), names, children)
        if isinstance(p, dict):
            keys = tuple(p.keys())
            children = tuple(self._declare(p[k], _join(path, k), plan, seen, tensor) for k in keys)
            return _MapNode(type(p), keys, children)
        if isinstance(p, list | tuple):
            children = tuple(
                self._declare(a, _join(path, _part(type(p), i)), plan, seen, tensor)
                for i, a in enumerate(p)
            )
            return _SeqNode(type(p), children)
        if isinstance(p, _PLAIN):
            return _LeafNode(type(p))
        raise UnpadError(
            f"{_show(path)} is a {type(p).__name__}: safecompile cannot see inside it to "
            "cut padding back (return tensors, tuples, lists, dicts or dataclasses)"
        )

    def _check_declared(self, spec: CutSpec, plan: Plan) -> None:
        """A learned spec against the declaration (only axes this call pads can show)."""
        nodes = dict(_tensor_nodes(spec.root, ""))
        self._check_unknown_paths(set(nodes))
        padded = plan.padded_axes
        for path, node in nodes.items():
            want = [d for d, axis in self._declared_for(path) if padded[axis]]
            rank = len(node.shape)
            if sorted(d + rank if d < 0 else d for d in want) != list(node.cuts):
                raise UnpadError(
                    f"Buckets(outputs=...) cuts {_show(path)} at dims {want}, but "
                    f"padding changed dims {list(node.cuts)} (padded shape {node.shape})"
                )

    def _check_unknown_paths(self, seen: set[str]) -> None:
        declared = self._declared_paths
        if declared is not None:
            unknown = sorted(set(declared) - seen)
            if unknown:
                raise UnpadError(
                    f"Buckets(outputs=...) names {unknown}, which the output does not have "
                    f"as tensors; its tensor paths are {sorted(seen)} ('' is the output itself)"
                )


def _key(key: tuple[Any, ...], declared: bool) -> tuple[Any, ...]:
    """A plan key to match a spec by: a declared cut holds whichever axes a call pads
    (cutting an exactly fitting axis is a no-op), so it leaves out which are padded."""
    return (key[0], key[1], key[3]) if declared else key


def _tensor_nodes(node: _Node, path: str) -> Iterator[tuple[str, _TensorNode]]:
    """Every tensor in a spec, with its path."""
    if isinstance(node, _TensorNode):
        yield path, node
    elif isinstance(node, _SeqNode):
        for i, c in enumerate(node.children):
            yield from _tensor_nodes(c, _join(path, _part(node.kind, i)))
    elif isinstance(node, _MapNode):
        for k, c in zip(node.keys, node.children, strict=True):
            yield from _tensor_nodes(c, _join(path, k))
    elif isinstance(node, _DataNode):
        for n, c in zip(node.names, node.children, strict=True):
            yield from _tensor_nodes(c, _join(path, n))


def _signature_key(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """The memo key of a call of any arity: each positional argument as (shape, dtype)
    for a tensor or its type otherwise, then each keyword as name, (shape, dtype) or
    type."""
    sig: list[Any] = []
    for a in args:
        if isinstance(a, _Tensor):
            sig.append(a.shape)
            sig.append(a.dtype)
        else:
            sig.append(type(a))
    for k, v in kwargs.items():
        sig.append(k)
        if isinstance(v, _Tensor):
            sig.append(v.shape)
            sig.append(v.dtype)
        else:
            sig.append(type(v))
    return tuple(sig)


def _normalize_dims(
    found: _Found, problem: str | None
) -> tuple[dict[str, tuple[tuple[int, int], ...]], list[tuple[str, int, int, int]], str | None]:
    """Each bucketed tensor's (dim, axis) pairs with dims made non-negative (by name), the
    length of each (name, dim, axis, length), and the first problem: ``problem``, a dim
    out of range, or one dim named twice."""
    lengths: list[tuple[str, int, int, int]] = []  # name, dim, axis, length
    norm: dict[str, tuple[tuple[int, int], ...]] = {}
    for slot, _, tensor in found:
        ndim = tensor.dim()
        dims = tuple((d + ndim if d < 0 else d, a) for d, a in slot.dims)
        bad = [d for (d, _), (n, _) in zip(slot.dims, dims, strict=True) if not 0 <= n < ndim]
        if bad:
            problem = problem or (
                f"{slot.name} has {ndim} dims; bucketed dim {bad[0]} is out of range"
            )
            continue
        if len({d for d, _ in dims}) != len(dims):
            problem = problem or f"{slot.name}: one dim is bucketed twice ({list(slot.dims)})"
            continue
        norm[slot.name] = dims
        lengths.extend((slot.name, d, a, int(tensor.shape[d])) for d, a in dims)
    return norm, lengths, problem


def _pad_widths(
    shape: tuple[int, ...], dims: tuple[tuple[int, int], ...], sizes: tuple[int, ...]
) -> tuple[int, ...]:
    """``F.pad``'s list (last dim first) that pads each (dim, axis) of ``shape`` up to its
    axis's size at the end, with trailing all-zero pairs dropped."""
    pad = [0] * (2 * len(shape))
    for d, axis in dims:
        pad[2 * (len(shape) - 1 - d) + 1] = sizes[axis] - shape[d]
    while pad and pad[-1] == 0 and pad[-2] == 0:
        del pad[-2:]
    return tuple(pad)


def _learn_tensor(p: _Tensor, e: object, path: str, plan: Plan) -> _TensorNode:
    """The cut for one output tensor: the dims that are a padded axis's size padded and
    its length in eager's ``e``; any other difference raises :class:`UnpadError`."""
    if not isinstance(e, _Tensor):
        raise UnpadError(f"{_show(path)}: padded run gave a tensor, unpadded a {type(e).__name__}")
    ps, es = tuple(p.shape), tuple(e.shape)
    if len(ps) != len(es):
        raise UnpadError(
            f"{_show(path)}: padded run gave shape {ps}, unpadded {es}; cannot cut back"
        )
    cuts, axes = [], []
    ambiguous = False
    padded = plan.padded_axes
    for d, (a, b) in enumerate(zip(ps, es, strict=True)):
        if a == b:
            continue
        match = [
            i
            for i, (s, n) in enumerate(zip(plan.sizes, plan.lengths, strict=True))
            if padded[i] and a == s and b == n
        ]
        if match:
            cuts.append(d)
            axes.append(match[0])
            ambiguous = ambiguous or len(match) > 1
            continue
        raise UnpadError(
            f"{_show(path)} dim {d}: padded run gave {a}, unpadded {b}; only a dim "
            f"that is the length ({_axes_text(plan.axes, plan.lengths)}) unpadded and the "
            f"bucket size ({_axes_text(plan.axes, plan.sizes)}) padded can be cut back"
        )
    return _TensorNode(ps, tuple(cuts), e.is_contiguous(), tuple(axes), ambiguous=ambiguous)


def _entry(
    name: str, tensor: _Tensor, dims: tuple[tuple[int, int], ...], sizes: tuple[int, ...]
) -> tuple[str, tuple[int, ...], torch.dtype]:
    shape = list(tensor.shape)
    for d, axis in dims:
        shape[d] = sizes[axis]
    return (name, tuple(shape), tensor.dtype)


def _table(sizes: tuple[int, ...]) -> list[int] | None:
    """A list lookup from length to bucket size, or ``None`` when sizes are too large."""
    if sizes[-1] > _TABLE_LIMIT:
        return None
    table: list[int] = []
    for size in sizes:
        table.extend([size] * (size + 1 - len(table)))
    return table


def _distinct_lengths(
    combo: tuple[tuple[int, int], ...], mask: tuple[bool, ...]
) -> tuple[int, ...] | None:
    """Warmup lengths for one combination of (size, exclusive lower bound): the size
    where ``mask`` is off, else the longest padded length whose (size, length) no
    earlier padded axis has; ``None`` when an axis has no such length left."""
    taken: set[tuple[int, int]] = set()
    out = []
    for (size, low), padded in zip(combo, mask, strict=True):
        if not padded:
            out.append(size)
            continue
        length = size - 1
        while length > low and (size, length) in taken:
            length -= 1
        if length <= low:
            return None
        taken.add((size, length))
        out.append(length)
    return tuple(out)


def _declared(
    policy: Buckets,
) -> tuple[tuple[tuple[int, int], ...] | None, Mapping[str, tuple[tuple[int, int], ...]] | None]:
    """``Buckets(outputs=...)`` as (dim, axis index) pairs: one set for every output
    tensor, or one per output path (the other of the two is ``None``)."""
    index = {a.name: i for i, a in enumerate(policy.axes)}

    def pairs(dims: Any) -> tuple[tuple[int, int], ...]:
        if isinstance(dims, Mapping):
            return tuple((d, index[a]) for d, a in dims.items())
        return tuple((d, 0) for d in ((dims,) if isinstance(dims, int) else dims))

    declared = policy.outputs
    if declared is None:
        return None, None
    if isinstance(declared, Mapping) and all(isinstance(k, str) for k in declared):
        return None, {str(path): pairs(dims) for path, dims in declared.items()}
    return pairs(declared), None


def _fits(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` is exactly representable as a pad value of ``dtype``."""
    if dtype.is_floating_point or dtype.is_complex:
        return True
    if dtype == torch.bool:
        return value in (0, 1)
    if not math.isfinite(value) or value != int(value):
        return False
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__
