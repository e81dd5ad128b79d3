"""Shape buckets: pad bucketed argument dims up to a bucket size, cut outputs back.

A :class:`CutSpec` (learned against unpadded eager, declared by ``Buckets(outputs=...)``,
or restored) records every output tensor's padded shape, so an output that does not look
exactly as it did raises :class:`UnpadError` instead of being cut on a guess.
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

from safecompile.base import torchcompat
from safecompile.base.errors import ConfigError
from safecompile.base.policies import Buckets

__all__ = ["BucketError", "Bucketer", "CutSpec", "PadError", "Plan", "UnpadError"]

_Tensor = torch.Tensor
_TABLE_LIMIT = 1 << 16  # largest size served by a list lookup; bisect beyond
_MEMO_LIMIT = 4096  # distinct argument signatures remembered (cleared when full)
_MISS: Any = object()
_NO_EAGER: Any = object()  # a spec made without eager's output (declared or restored)
_PLAIN = (type(None), bool, int, float, complex, str, bytes)

Status = Literal["bucketed", "oversize", "unbucketable"]
Strategy = Literal["pad", "dynamic"]
_Form = Literal["seq", "map", "data"]
_Dims = tuple[tuple[int, int], ...]  # (dim, axis index) pairs
_T = TypeVar("_T")


class BucketError(Exception):
    """Padding or un-padding could not be done faithfully; run the call unpadded."""


class PadError(BucketError):
    """Raised by :meth:`Bucketer.pad` when the arguments do not match the plan."""


class UnpadError(BucketError):
    """An output cannot be cut back safely (padding changed it in a way cutting cannot
    undo, it contradicts ``Buckets(outputs=...)``, or it does not match its spec)."""


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
    """What to do with one call's bucketed arguments: ``"bucketed"`` (pad each axis's
    length up to its size), ``"oversize"`` or ``"unbucketable"`` (``reason``); then
    ``sizes == lengths``. ``key`` names one padded input signature (status, sizes, padded
    axes, top-level tensors' padded shapes and dtypes): one graph and cut serve a key."""

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
    def label(self) -> str:
        """The bucket (``"64"``, or ``"batch=8,seq=64"`` with named axes), or the status."""
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
            shown = f"length {self.lengths[0]}"
        else:
            shown = ", ".join(f"{a} {n}" for a, n in zip(self.axes, self.lengths, strict=True))
        tail = f": {self.reason}" if self.reason else ""
        return f"{self.label} ({shown}) [{args}]{tail}"


def _axes_text(axes: tuple[str | None, ...], values: tuple[int, ...]) -> str:
    """``"64"`` for the one unnamed axis, ``"batch=8,seq=64"`` for named ones."""
    if axes == (None,):
        return str(values[0])
    return ",".join(f"{a}={v}" for a, v in zip(axes, values, strict=True))


# ---------------------------------------------------------------- output cut specs


class _Node:
    __slots__ = ()
    cuts_any: bool  # whether anything below is cut (if not, the output is passed as it is)

    def apply(self, obj: Any, lengths: tuple[int, ...], path: str) -> Any:
        raise NotImplementedError


@dataclasses.dataclass(slots=True, eq=False)
class _TensorNode(_Node):
    """One output tensor: its padded shape, and each cut dim with the axis it follows."""

    shape: tuple[int, ...]
    cuts: tuple[int, ...]
    contiguous: bool
    axes: tuple[int, ...]
    ambiguous: bool = False  # a cut dim that matched several axes in this call
    cuts_any: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.cuts_any = bool(self.cuts)

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


@dataclasses.dataclass(slots=True, eq=False)
class _LeafNode(_Node):
    """A non-tensor value kept as it is (None, numbers, strings)."""

    kind: type[Any]
    cuts_any: bool = False

    def apply(self, obj: Any, lengths: tuple[int, ...], path: str) -> Any:
        if type(obj) is not self.kind:
            raise UnpadError(
                f"{_show(path)} is a {type(obj).__name__}, expected a {self.kind.__name__}"
            )
        return obj


class _Branch(_Node):
    """A container walked by its keys: a tuple or list (named, struct sequences) by
    index, a dict by key (in order), a dataclass (``ModelOutput``) by field."""

    __slots__ = ("children", "cuts_any", "form", "keys", "kind", "layout", "parts")

    def __init__(
        self, sample: object, form: _Form, keys: tuple[Any, ...], children: tuple[_Node, ...]
    ) -> None:
        self.kind: type[Any] = type(sample)
        self.form = form
        self.keys = keys
        self.children = children
        self.parts = _parts(self.kind, form, keys)
        self.layout = _layout(sample)  # for messages
        self.cuts_any = any(c.cuts_any for c in children)

    def apply(self, obj: Any, lengths: tuple[int, ...], path: str) -> Any:
        if type(obj) is not self.kind or not self._same_keys(obj):
            raise UnpadError(f"{_show(path)} is {_layout(obj)}, expected {self.layout}")
        values = (
            [getattr(obj, k) for k in self.keys]
            if self.form == "data"
            else [obj[k] for k in self.keys]
        )
        items = [
            c.apply(v, lengths, _join(path, part))
            for c, v, part in zip(self.children, values, self.parts, strict=True)
        ]
        if not self.cuts_any:
            return obj
        return self._rebuild(obj, values, items)

    def _same_keys(self, obj: Any) -> bool:
        if self.form == "seq":
            return len(obj) == len(self.keys)
        return self.form == "data" or tuple(obj.keys()) == self.keys

    def _rebuild(self, obj: Any, values: list[Any], items: list[Any]) -> Any:
        if self.form == "map":
            out = copy.copy(obj)  # keeps the subclass (OrderedDict, defaultdict's factory)
            for k, v in zip(self.keys, items, strict=True):
                out[k] = v
            return out
        if self.form == "data":
            changed = zip(self.keys, values, items, strict=True)
            return _replace(obj, {k: new for k, old, new in changed if new is not old})
        if self.kind is list:
            return items
        if self.kind is tuple:
            return tuple(items)
        if hasattr(self.kind, "_fields"):  # namedtuple
            return self.kind(*items)
        return self.kind(items)  # struct sequences (torch.return_types)


def _replace(obj: Any, changes: dict[str, Any]) -> Any:
    """A dataclass with some fields changed (the instance itself when none are)."""
    if not changes:
        return obj
    init = {f.name for f in dataclasses.fields(obj) if f.init}
    if init.issuperset(changes):
        return dataclasses.replace(obj, **changes)  # runs __post_init__ (ModelOutput)
    out = copy.copy(obj)
    for name, value in changes.items():
        object.__setattr__(out, name, value)
    return out


def _contents(obj: object) -> tuple[_Form, tuple[Any, ...]] | None:
    """A container's form and keys (fields, dict keys or indices); ``None`` otherwise."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return "data", tuple(f.name for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return "map", tuple(obj.keys())
    if isinstance(obj, list | tuple):
        return "seq", tuple(range(len(obj)))
    return None


def _child(obj: Any, form: _Form, key: Any) -> Any:
    return getattr(obj, key) if form == "data" else obj[key]


def _parts(kind: type[Any], form: _Form, keys: tuple[Any, ...]) -> tuple[Any, ...]:
    """Each child's path part: a namedtuple's field names, otherwise the keys."""
    fields = getattr(kind, "_fields", None)
    return fields if form == "seq" and isinstance(fields, tuple) else keys


def _layout(obj: object) -> str:
    """A value's type and keys, for messages: ``a tuple of 2``, ``a dict with keys ['h']``."""
    if isinstance(obj, dict):
        return f"a {type(obj).__name__} with keys {list(obj)}"
    if isinstance(obj, list | tuple):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__name__}"


def _join(path: str, part: object) -> str:
    return f"{path}.{part}" if path else str(part)


def _show(path: str) -> str:
    return f"output.{path}" if path else "output"


def _walk(p: object, e: object, path: str, tensor: Callable[[_Tensor, Any, str], _Node]) -> _Node:
    """The spec node of padded output ``p``, ``tensor(p, e, path)`` for each tensor; ``e``
    is eager's output (of the same structure), or :data:`_NO_EAGER`."""
    if isinstance(p, _Tensor):
        return tensor(p, e, path)
    learning = e is not _NO_EAGER
    if learning and type(p) is not type(e):
        raise UnpadError(
            f"{_show(path)}: padded run gave a {type(p).__name__}, unpadded a {type(e).__name__}"
        )
    if isinstance(p, _PLAIN):
        if learning and isinstance(p, int) and p != e:
            raise UnpadError(
                f"{_show(path)}: padded run gave {p!r}, unpadded {e!r}: the output "
                "depends on the padded length"
            )
        return _LeafNode(type(p))
    found = _contents(p)
    if found is None:
        raise UnpadError(
            f"{_show(path)} is a {type(p).__name__}: safecompile cannot see inside it to "
            "cut padding back (return tensors, tuples, lists, dicts or dataclasses)"
        )
    form, keys = found
    if learning and _contents(e) != found:
        raise UnpadError(f"{_show(path)}: padded run gave {_layout(p)}, unpadded {_layout(e)}")
    children = tuple(
        _walk(
            _child(p, form, k),
            _child(e, form, k) if learning else _NO_EAGER,
            _join(path, part),
            tensor,
        )
        for k, part in zip(keys, _parts(type(p), form, keys), strict=True)
    )
    return _Branch(p, form, keys, children)


def _tensor_nodes(node: _Node, path: str = "") -> Iterator[tuple[str, _TensorNode]]:
    """Every tensor in a spec, with its path."""
    if isinstance(node, _TensorNode):
        yield path, node
    elif isinstance(node, _Branch):
        for part, child in zip(node.parts, node.children, strict=True):
            yield from _tensor_nodes(child, _join(path, part))


@dataclasses.dataclass(frozen=True, eq=False)
class CutSpec:
    """Which output dims to cut back, for the one plan key it was made for."""

    key: tuple[Any, ...]
    sizes: tuple[int, ...]
    source: Literal["learned", "declared"]
    root: _Node = dataclasses.field(repr=False)
    axes: tuple[str | None, ...] = (None,)

    @property
    def cuts(self) -> dict[str, tuple[int, ...]]:
        """Output path (``""`` the output itself) to the dims cut there."""
        return {path: n.cuts for path, n in _tensor_nodes(self.root) if n.cuts}

    @property
    def cut_axes(self) -> dict[str, tuple[tuple[int, str | None], ...]]:
        """Output path to each cut dim with the name of the axis it follows."""
        return {
            path: tuple((d, self.axes[a]) for d, a in zip(n.cuts, n.axes, strict=True))
            for path, n in _tensor_nodes(self.root)
            if n.cuts
        }

    @property
    def ambiguous(self) -> bool:
        """Whether a cut dim matched several axes when learned (right for that call only)."""
        return any(n.ambiguous for _, n in _tensor_nodes(self.root))

    def saved(self) -> list[list[Any]]:
        """Every output tensor as JSON for :meth:`Bucketer.restored_cuts` in a later process:
        ``[path, padded shape, [[dim, axis], ...], contiguous]``."""
        return [
            [path, list(n.shape), [list(c) for c in zip(n.cuts, n.axes, strict=True)], n.contiguous]
            for path, n in _tensor_nodes(self.root)
        ]

    def describe(self) -> str:
        """The cuts as text, for events."""
        named = self.axes != (None,)
        return (
            "; ".join(
                f"{_show(p)} dims [{', '.join(f'{d}:{a}' if named else str(d) for d, a in c)}]"
                for p, c in self.cut_axes.items()
            )
            or "nothing cut"
        )


def _learn_tensor(p: _Tensor, e: object, path: str, plan: Plan) -> _TensorNode:
    """The cut for one output tensor: the dims at a padded axis's size, its length in ``e``."""
    if not isinstance(e, _Tensor):
        raise UnpadError(f"{_show(path)}: padded run gave a tensor, unpadded a {type(e).__name__}")
    ps, es = tuple(p.shape), tuple(e.shape)
    if len(ps) != len(es):
        raise UnpadError(
            f"{_show(path)}: padded run gave shape {ps}, unpadded {es}; cannot cut back"
        )
    cuts, axes = [], []
    ambiguous = False
    for d, (a, b) in enumerate(zip(ps, es, strict=True)):
        if a == b:
            continue
        match = [
            i
            for i, (s, n) in enumerate(zip(plan.sizes, plan.lengths, strict=True))
            if s != n and a == s and b == n
        ]
        if not match:
            raise UnpadError(
                f"{_show(path)} dim {d}: padded run gave {a}, unpadded {b}; only a dim "
                f"that is the length ({_axes_text(plan.axes, plan.lengths)}) unpadded and the "
                f"bucket size ({_axes_text(plan.axes, plan.sizes)}) padded can be cut back"
            )
        cuts.append(d)
        axes.append(match[0])
        ambiguous = ambiguous or len(match) > 1
    return _TensorNode(ps, tuple(cuts), e.is_contiguous(), tuple(axes), ambiguous=ambiguous)


# ---------------------------------------------------------------- the bucketer


def resolve_strategy(
    policy: Buckets,
    *,
    backend: str = "inductor",
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
    dynamic: bool | None = None,
) -> Strategy:
    """What ``strategy="auto"`` means for these compile options: ``"pad"`` where the
    compiled code needs static shapes (CUDA graphs, ``dynamic=False``), else ``"dynamic"``."""
    if policy.strategy != "auto":
        return policy.strategy
    if dynamic is None:
        return "pad" if uses_cudagraphs(backend, mode, options) else "dynamic"
    return "pad" if dynamic is False or backend == "cudagraphs" else "dynamic"


def uses_cudagraphs(
    backend: str, mode: str | None = None, options: Mapping[str, Any] | None = None
) -> bool:
    """Whether these compile options run CUDA graphs: the ``"cudagraphs"`` backend, or
    inductor with ``triton.cudagraphs`` on (set by itself or by the ``mode``)."""
    if backend == "cudagraphs":
        return True
    # mode_options gives a fresh dict; safe_compile validated the mode against its keys
    settings = torchcompat.mode_options(mode) if mode is not None and backend == "inductor" else {}
    settings.update(options or {})
    return bool(settings.get("triton.cudagraphs"))


@dataclasses.dataclass(frozen=True, slots=True)
class _Param:
    """A bucketed parameter: how a call passes it, and its bucketed dims."""

    name: str
    position: int | None  # None: keyword only
    keyword: bool  # may be passed by keyword
    dims: _Dims


_Found = list[tuple[_Param, int | str, _Tensor]]  # each bucketed tensor, and where it was passed


class Bucketer:
    """Pads one callable's bucketed arguments and cuts its outputs back.

    ``fn`` (a function, bound method or ``nn.Module``) must have a parameter for each
    name in ``policy.dims`` (or take ``**kwargs``), else :class:`ConfigError`.
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
        kinds = inspect.Parameter
        params = signature.parameters.values()
        self._positional = tuple(
            p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
        )
        var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in params)
        found = []
        for name in policy.dims:
            dims = policy.dims_of(name)
            param = signature.parameters.get(name)
            if param is None and var_keyword:
                found.append(_Param(name, None, True, dims))
                continue
            if param is None or param.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD):
                what = "is not a parameter" if param is None else "is a variadic parameter"
                raise ConfigError(
                    f"Buckets(dims=...) names {name!r}, which {what} of {_name(fn)}"
                    f"{signature}; name a tensor parameter"
                )
            position = self._positional.index(name) if name in self._positional else None
            found.append(_Param(name, position, param.kind is not kinds.POSITIONAL_ONLY, dims))
        self._params = tuple(found)
        self._sizes = tuple(a.sizes for a in policy.axes)
        self._tables = tuple(_lookup_table(sizes) for sizes in self._sizes)
        self._memo: dict[tuple[Any, ...], Plan | None] = {}
        self._declared = _declared(policy)

    @property
    def _table(self) -> list[int] | None:  # the first axis's lookup table (tests read it)
        return self._tables[0]

    def bucket(self, length: int, axis: int = 0) -> int | None:
        """The smallest size of ``axis`` that holds ``length`` (``None``: too long)."""
        table = self._tables[axis]
        if table is not None:
            return table[length] if length < len(table) else None
        sizes = self._sizes[axis]
        i = bisect.bisect_left(sizes, length)
        return sizes[i] if i < len(sizes) else None

    def plan(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Plan | None:
        """The plan for one call, or ``None`` when no bucketed argument is a tensor.
        A dict lookup on the arguments' shapes and dtypes when seen before."""
        # The memo key is a prefix-free code of the signature (see _signature_key),
        # hand-unrolled for the common arities: this runs on every call.
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

    def _find(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[_Found, str | None]:
        """The bucketed tensors of a call (param, where, tensor), and a problem if any."""
        found: _Found = []
        problem = None
        for param in self._params:
            where: int | str
            if param.position is not None and param.position < len(args):
                where = param.position
                value = args[param.position]
            elif param.keyword and param.name in kwargs:
                where = param.name
                value = kwargs[param.name]
            else:
                continue
            if value is None:
                continue
            if not isinstance(value, _Tensor):
                problem = problem or f"{param.name} is a {type(value).__name__}, not a tensor"
                continue
            found.append((param, where, value))
        return found, problem

    def _plan(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Plan | None:
        found, problem = self._find(args, kwargs)
        if not found and problem is None:
            return None

        norm, seen, problem = _normalize_dims(found, problem)
        lengths = [0] * len(self.axes)
        for axis in range(len(self.axes)):
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
        self, found: _Found, norm: Mapping[str, _Dims], sizes: tuple[int, ...]
    ) -> tuple[tuple[_Target, ...], str | None]:
        """How to pad each bucketed tensor, or why its pad value cannot be used."""
        targets = []
        for param, where, tensor in found:
            value = self.policy.pad_for(param.name)
            if not _fits(value, tensor.dtype):
                return (), (
                    f"pad value {value!r} for {param.name} does not fit its dtype "
                    f"{str(tensor.dtype).removeprefix('torch.')}"
                )
            shape = tuple(tensor.shape)
            pad = _pad_widths(shape, norm[param.name], sizes)
            if pad:  # else already its bucket's size: passed as it is, not copied
                targets.append(_Target(param.name, where, shape, pad, value))
        return tuple(targets), None

    def _entries(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        padded_dims: Mapping[str, _Dims],
        sizes: tuple[int, ...],
    ) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """The key's part for the call's top-level tensors, by parameter name."""
        named = [
            (self._positional[i] if i < len(self._positional) else f"*{i}", a)
            for i, a in enumerate(args)
        ]
        entries = []
        for name, value in [*named, *kwargs.items()]:
            if isinstance(value, _Tensor):
                shape = list(value.shape)
                for d, axis in padded_dims.get(name, ()):
                    shape[d] = sizes[axis]
                entries.append((name, tuple(shape), value.dtype))
        entries.sort(key=lambda e: e[0])
        return tuple(entries)

    def pad(
        self, plan: Plan, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments with bucketed dims padded up to their axes' ``plan.sizes`` (one
        new tensor each, written once by ``constant_pad_nd``: autograd flows back through
        it); other arguments, and tensors already at their bucket's size, are passed
        through untouched. ``kwargs`` is returned as it is when no keyword is padded."""
        new_args: list[Any] | None = None
        new_kwargs = kwargs if isinstance(kwargs, dict) else dict(kwargs)
        copied = new_kwargs is not kwargs
        for t in plan.targets:
            where = t.where
            tensor = args[where] if isinstance(where, int) else kwargs[where]
            if not isinstance(tensor, _Tensor) or tensor.shape != t.shape:
                raise PadError(
                    f"{t.name} does not match the plan: expected shape {t.shape}, got "
                    f"{getattr(tensor, 'shape', type(tensor).__name__)}"
                )
            padded = _constant_pad(tensor, t.pad, t.value)
            if isinstance(where, int):
                if new_args is None:
                    new_args = list(args)
                new_args[where] = padded
            else:
                if not copied:
                    new_kwargs, copied = dict(kwargs), True
                new_kwargs[where] = padded
        return (tuple(new_args) if new_args is not None else args), new_kwargs

    def warmup_lengths(self, axis: int = 0) -> tuple[int, ...]:
        """One length per size of ``axis``: ``size - 1``, padded by one so the bucket's
        cut is learned and checked before traffic (the size where it is alone)."""
        out = []
        previous = 0
        for size in self._sizes[axis]:
            out.append(size - 1 if size - 1 > previous else size)
            previous = size
        return tuple(out)

    def warmup_calls(self) -> tuple[tuple[int, ...], ...]:
        """The lengths (one per axis) of the warmup calls: each combination of sizes, and
        with ``strategy="pad"`` each mix of padded and fitting axes, no two padded axes
        sharing a size and a length (their output dims would be ambiguous)."""
        if self.strategy == "dynamic":
            return tuple(itertools.product(*map(self.warmup_lengths, range(len(self.axes)))))
        per_axis = [list(zip(sizes, [0, *sizes[:-1]], strict=True)) for sizes in self._sizes]
        calls: list[tuple[int, ...]] = []
        for combo in itertools.product(*per_axis):
            paddable = [size - 1 > low for size, low in combo]
            choices = [(True, False) if p else (False,) for p in paddable]
            for mask in itertools.product(*choices):
                if any(paddable) and not any(mask):
                    continue  # nothing padded: no cut to learn, the graph is the same
                lengths = _distinct_lengths(combo, mask)
                if lengths is not None:
                    calls.append(lengths)
        return tuple(calls)

    def warmup_specialised(self) -> tuple[tuple[int, ...], ...]:
        """``strategy="dynamic"``: the warmup calls with length 1 on an axis whose first
        size is larger (torch specialises 1: a static graph of its own)."""
        if self.strategy != "dynamic":
            return ()
        per_axis = [
            [*([1] if sizes[0] > 1 else []), *self.warmup_lengths(axis)]
            for axis, sizes in enumerate(self._sizes)
        ]
        return tuple(
            c
            for c in itertools.product(*per_axis)
            if any(n == 1 and self._sizes[a][0] > 1 for a, n in enumerate(c))
        )

    def check_dims(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Raise :class:`ConfigError` when a bucketed dim is beyond its argument's rank."""
        found, _ = self._find(args, kwargs)
        for param, _, tensor in found:
            rank = tensor.dim()
            wrong = [d for d, _ in param.dims if not -rank <= d < rank]
            if wrong:
                raise ConfigError(
                    f"Buckets(dims=...) pads dim {wrong[0]} of {param.name}, which has "
                    f"{rank} dim(s) (shape {tuple(tensor.shape)}) in this call: name a dim "
                    f"it has (0 to {rank - 1}, or -1 for the last)"
                )

    def resize(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], lengths: int | tuple[int, ...]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """An example call with each bucketed dim made its axis's length (tiled, then cut:
        masks and ids stay realistic)."""
        if isinstance(lengths, int):
            lengths = (lengths,) * len(self.axes)
        self.check_dims(args, kwargs)
        found, problem = self._find(args, kwargs)
        if problem is not None:
            raise PadError(f"cannot resize the example: {problem}")
        resized = []
        for param, where, tensor in found:
            t = tensor
            for d, axis in param.dims:
                length = lengths[axis]
                n = t.shape[d]
                if n == 0:
                    shape = list(t.shape)
                    shape[d] = length
                    t = t.new_full(shape, self.policy.pad_for(param.name))
                    continue
                if n < length:
                    t = torch.cat([t] * -(-length // n), dim=d)
                t = t.narrow(d, 0, length)
            # plain strides, like live traffic's: a view would compile graphs of its own
            resized.append((where, t.clone(memory_format=torch.contiguous_format)))
        return _replaced(args, kwargs, resized)

    def learn_cuts(self, plan: Plan, padded_out: object, eager_out: object) -> CutSpec:
        """The cut for ``plan.key`` from one padded output and eager's: a dim is cut where
        the padded output has a padded axis's size and eager's its length; any other
        difference raises :class:`UnpadError`. Values are the shadow check's business."""
        if not plan.padded:
            raise ValueError(
                f"nothing to learn: length {_axes_text(plan.axes, plan.lengths)} is the bucket "
                "size, so padding changed no shape (such a call needs no cut)"
            )
        root = _walk(padded_out, eager_out, "", lambda p, e, path: _learn_tensor(p, e, path, plan))
        if self.policy.outputs is not None:  # the guard takes declared_cuts instead
            learned = {path: list(n.cuts) for path, n in _tensor_nodes(root)}
            for path, n in _tensor_nodes(self.declared_cuts(plan, padded_out).root):
                padded = zip(n.cuts, n.axes, strict=True)
                want = [d for d, a in padded if plan.sizes[a] != plan.lengths[a]]
                if want != learned[path]:
                    raise UnpadError(
                        f"Buckets(outputs=...) cuts {_show(path)} at dims {want}, but padding "
                        f"changed dims {learned[path]} (padded shape {n.shape})"
                    )
        return CutSpec(plan.key, plan.sizes, "learned", root, self.axes)

    def declared_cuts(self, plan: Plan, padded_out: object) -> CutSpec:
        """The cut for ``plan.key`` from ``Buckets(outputs=...)``, without eager."""
        if self.policy.outputs is None:
            raise ValueError("Buckets(outputs=...) is None: the cut must be learned")
        root = _walk(
            padded_out, _NO_EAGER, "", lambda p, _, path: self._declared_node(p, path, plan)
        )
        seen = {path for path, _ in _tensor_nodes(root)}
        if isinstance(self._declared, dict) and (unknown := sorted(set(self._declared) - seen)):
            raise UnpadError(
                f"Buckets(outputs=...) names {unknown}, which the output does not have "
                f"as tensors; its tensor paths are {sorted(seen)} ('' is the output itself)"
            )
        return CutSpec(plan.key, plan.sizes, "declared", root, self.axes)

    def restored_cuts(self, plan: Plan, padded_out: object, saved: list[Any]) -> CutSpec:
        """The cut for ``plan.key`` from :meth:`CutSpec.saved` of an earlier process;
        :class:`UnpadError` unless it is well formed, fits the plan, and the output has
        exactly the tensors saved."""
        nodes = dict(_saved_node(plan, item) for item in saved)
        padded = [
            a for a, (size, n) in enumerate(zip(plan.sizes, plan.lengths, strict=True)) if n < size
        ]
        kept = {
            a
            for node in nodes.values()
            for a in padded
            for d, size in enumerate(node.shape)
            if d not in node.cuts and size == plan.sizes[a]
        }
        if kept - {a for node in nodes.values() for a in node.axes}:
            # pad rows of an axis it never cuts would reach the caller
            raise UnpadError(f"the saved cut keeps padding of {plan.label} it never cuts")

        def restore(p: _Tensor, _: object, path: str) -> _Node:
            node = nodes.get(path)
            if node is None or tuple(p.shape) != node.shape:
                raise UnpadError(
                    f"{_show(path)} has shape {tuple(p.shape)}, not the saved "
                    f"{node.shape if node is not None else 'nothing'}"
                )
            return node

        root = _walk(padded_out, _NO_EAGER, "", restore)
        seen = {path for path, _ in _tensor_nodes(root)}
        if seen != set(nodes):
            raise UnpadError(f"output tensors {sorted(seen)}, saved {sorted(nodes)}")
        return CutSpec(plan.key, plan.sizes, "learned", root, self.axes)

    def unpad(self, plan: Plan, out: _T, cuts: CutSpec | None) -> _T:
        """``out`` with the spec's dims cut back to ``plan.lengths``; :class:`UnpadError`
        when the spec was made for another key or the output differs from it."""
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

    def _declared_node(self, p: _Tensor, path: str, plan: Plan) -> _TensorNode:
        """One output tensor's node from the declaration; each dim must be its axis's size."""
        shape = tuple(p.shape)
        declared = self._declared
        cuts = []
        for d, axis in declared.get(path, ()) if isinstance(declared, dict) else declared or ():
            n = d + len(shape) if d < 0 else d
            if not 0 <= n < len(shape):
                raise UnpadError(
                    f"Buckets(outputs=...) cuts {_show(path)} at dim {d}, but it has shape {shape}"
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


def _replaced(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], new: list[tuple[int | str, _Tensor]]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with some replaced, each by its position or keyword."""
    new_args = list(args)
    new_kwargs = dict(kwargs)
    for where, value in new:
        if isinstance(where, int):
            new_args[where] = value
        else:
            new_kwargs[where] = value
    return tuple(new_args), new_kwargs


def _saved_node(plan: Plan, item: Any) -> tuple[str, _TensorNode]:
    """One tensor of a saved cut, once well formed: each cut a distinct dim of its padded
    shape that holds its axis's size."""
    path, shape, cuts, contiguous = item
    if not isinstance(path, str) or not isinstance(contiguous, bool):
        raise UnpadError("a saved cut's path is text and its contiguity a boolean")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise UnpadError(f"the saved shape of {_show(path)} is not a list of sizes")
    dims: dict[int, int] = {}
    for d, a in cuts:
        if type(d) is not int or type(a) is not int or not 0 <= d < len(shape) or d in dims:
            raise UnpadError(f"saved cut dim {d!r} is not a distinct dim of shape {shape}")
        if not 0 <= a < len(plan.sizes) or shape[d] != plan.sizes[a]:
            raise UnpadError(f"the saved cut of {_show(path)} does not fit {plan.label}")
        dims[d] = a
    return path, _TensorNode(tuple(shape), tuple(dims), contiguous, tuple(dims.values()))


def _key(key: tuple[Any, ...], declared: bool) -> tuple[Any, ...]:
    """A plan key to match a spec by: a declared cut serves whichever axes a call pads."""
    return (key[0], key[1], key[3]) if declared else key


def _signature_key(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """The memo key of any call: each argument as (shape, dtype) or its type, keywords
    with their names; a prefix-free code, so equal keys mean equal signatures."""
    sig: list[Any] = []
    for a in args:
        sig.extend((a.shape, a.dtype) if isinstance(a, _Tensor) else (type(a),))
    for k, v in kwargs.items():
        sig.append(k)
        sig.extend((v.shape, v.dtype) if isinstance(v, _Tensor) else (type(v),))
    return tuple(sig)


def _normalize_dims(
    found: _Found, problem: str | None
) -> tuple[dict[str, _Dims], list[tuple[str, int, int, int]], str | None]:
    """Each bucketed tensor's (dim, axis) pairs, dims non-negative, by name; each
    (name, dim, axis, length); and the first problem (a dim out of range or twice)."""
    lengths: list[tuple[str, int, int, int]] = []
    norm: dict[str, _Dims] = {}
    for param, _, tensor in found:
        ndim = tensor.dim()
        dims = tuple((d + ndim if d < 0 else d, a) for d, a in param.dims)
        bad = [d for (d, _), (n, _) in zip(param.dims, dims, strict=True) if not 0 <= n < ndim]
        if bad:
            problem = problem or (
                f"{param.name} has {ndim} dims; bucketed dim {bad[0]} is out of range"
            )
            continue
        if len({d for d, _ in dims}) != len(dims):
            problem = problem or f"{param.name}: one dim is bucketed twice ({list(param.dims)})"
            continue
        norm[param.name] = dims
        lengths.extend((param.name, d, a, int(tensor.shape[d])) for d, a in dims)
    return norm, lengths, problem


def _pad_widths(shape: tuple[int, ...], dims: _Dims, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """``F.pad``'s list (last dim first) padding each dim up to its axis's size."""
    pad = [0] * (2 * len(shape))
    for d, axis in dims:
        pad[2 * (len(shape) - 1 - d) + 1] = sizes[axis] - shape[d]
    while pad and pad[-1] == 0 and pad[-2] == 0:
        del pad[-2:]
    return tuple(pad)


# F.pad's constant mode without its Python wrapper (mode and torch-function checks).
_constant_pad: Callable[[torch.Tensor, tuple[int, ...], float], torch.Tensor] = (
    torch.constant_pad_nd
)


def _lookup_table(sizes: tuple[int, ...]) -> list[int] | None:
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
    """Warmup lengths for (size, exclusive lower bound) per axis: the size where
    ``mask`` is off, else the longest length no earlier padded axis has with that size."""
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


def _declared(policy: Buckets) -> dict[str, _Dims] | _Dims | None:
    """``Buckets(outputs=...)`` as (dim, axis index) pairs, or a dict of them by path."""
    index = {a.name: i for i, a in enumerate(policy.axes)}

    def pairs(dims: Any) -> _Dims:
        if isinstance(dims, Mapping):
            return tuple((d, index[a]) for d, a in dims.items())
        return tuple((d, 0) for d in ((dims,) if isinstance(dims, int) else dims))

    declared = policy.outputs
    if declared is None:
        return None
    if isinstance(declared, Mapping) and all(isinstance(k, str) for k in declared):
        return {str(path): pairs(dims) for path, dims in declared.items()}
    return pairs(declared)


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
