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
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F

from ._errors import ConfigError
from ._policies import Buckets

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

    ``status`` is ``"bucketed"`` (pad ``length`` up to ``size``), ``"oversize"`` (the
    length is past the largest size: run eager, or compile the shape as it is;
    ``size == length``) or ``"unbucketable"`` (``reason`` says why: bucketed dims
    disagree, a dim out of range, a pad value the dtype cannot hold; run unpadded,
    ``size == length`` = the longest length seen).

    ``key`` is hashable and names one padded input signature: the status, the size and,
    for each top-level tensor argument (by parameter name), its shape (bucketed dims at
    the bucket size) and dtype. Equal keys mean equal padded input shapes, so equal
    output shapes: one key is one static graph, and a :class:`CutSpec` belongs to one
    key. Python scalars and tensors nested in containers are not part of the key.
    """

    key: tuple[Any, ...]
    status: Status
    length: int
    size: int
    reason: str | None = None
    targets: tuple[_Target, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def padded(self) -> bool:
        """Whether the call is padded (so its output needs cutting back)."""
        return self.size != self.length

    @property
    def label(self) -> str:
        """Short text for events and reports: the bucket size, or the status."""
        if self.status == "bucketed":
            return str(self.size)
        if self.status == "oversize":
            return f"oversize({self.length})"
        return "unbucketable"

    def describe(self) -> str:
        """The key as text: shapes and dtypes, never values."""
        args = ", ".join(
            f"{name}={'x'.join(map(str, shape))}:{str(dtype).removeprefix('torch.')}"
            for name, shape, dtype in self.key[2]
        )
        head = f"{self.label} (length {self.length})"
        tail = f": {self.reason}" if self.reason else ""
        return f"{head} [{args}]{tail}"


# ---------------------------------------------------------------- output cut specs


class _Node:
    __slots__ = ("cuts_any",)
    cuts_any: bool

    def apply(self, obj: Any, length: int, path: str) -> Any:
        raise NotImplementedError

    def items(self, path: str) -> list[tuple[str, tuple[int, ...]]]:
        return []


class _TensorNode(_Node):
    __slots__ = ("contiguous", "cuts", "shape")

    def __init__(self, shape: tuple[int, ...], cuts: tuple[int, ...], contiguous: bool) -> None:
        self.shape = shape
        self.cuts = cuts
        self.contiguous = contiguous
        self.cuts_any = bool(cuts)

    def apply(self, obj: Any, length: int, path: str) -> Any:
        if not isinstance(obj, _Tensor):
            raise UnpadError(f"{_show(path)} is a {type(obj).__name__}, expected a tensor")
        if obj.shape != self.shape:
            raise UnpadError(
                f"{_show(path)} has shape {tuple(obj.shape)}, but the cut was made for "
                f"{self.shape}; not cut"
            )
        for dim in self.cuts:
            obj = obj.narrow(dim, 0, length)
        if self.contiguous and self.cuts and not obj.is_contiguous():
            obj = obj.contiguous()  # eager's output was contiguous: keep .view() working
        return obj

    def items(self, path: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(path, self.cuts)] if self.cuts else []


class _LeafNode(_Node):
    """A non-tensor value kept as it is (None, numbers, strings)."""

    __slots__ = ("kind",)

    def __init__(self, kind: type[Any]) -> None:
        self.kind = kind
        self.cuts_any = False

    def apply(self, obj: Any, length: int, path: str) -> Any:
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

    def apply(self, obj: Any, length: int, path: str) -> Any:
        if type(obj) is not self.kind or len(obj) != len(self.children):
            raise UnpadError(
                f"{_show(path)} is a {type(obj).__name__} of {_len(obj)}, expected a "
                f"{self.kind.__name__} of {len(self.children)}"
            )
        items = [
            c.apply(o, length, _join(path, _part(self.kind, i)))
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

    def apply(self, obj: Any, length: int, path: str) -> Any:
        if type(obj) is not self.kind or tuple(obj.keys()) != self.keys:
            raise UnpadError(
                f"{_show(path)} is a {type(obj).__name__} with keys {_keys(obj)}, expected "
                f"a {self.kind.__name__} with keys {list(self.keys)}"
            )
        items = [
            c.apply(obj[k], length, _join(path, k))
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

    def apply(self, obj: Any, length: int, path: str) -> Any:
        if type(obj) is not self.kind:
            raise UnpadError(
                f"{_show(path)} is a {type(obj).__name__}, expected a {self.kind.__name__}"
            )
        changes = {}
        for name, child in zip(self.names, self.children, strict=True):
            value = getattr(obj, name)
            new = child.apply(value, length, _join(path, name))
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
    size: int
    source: Literal["learned", "declared"]
    root: _Node = dataclasses.field(repr=False)

    @property
    def cuts(self) -> dict[str, tuple[int, ...]]:
        """Output path (``""`` the output itself) to the dims cut there."""
        return dict(self.root.items(""))

    def describe(self) -> str:
        """The cuts as text, for events."""
        found = self.root.items("")
        if not found:
            return "nothing cut"
        return "; ".join(f"{_show(p)} dims {list(d)}" for p, d in found)


# ---------------------------------------------------------------- the bucketer


@dataclasses.dataclass(frozen=True, slots=True)
class _Slot:
    name: str
    position: int | None  # None: keyword only
    keyword: bool  # may be passed by keyword
    dims: tuple[int, ...]


_Found = list[tuple[_Slot, int | str, _Tensor]]  # what Bucketer._find returns


class Bucketer:
    """Pads one callable's bucketed arguments and cuts its outputs back.

    ``fn`` is what the arguments given to :meth:`plan` are for: a function (a method
    defined in a class body takes ``self`` first), a bound method (no ``self``) or an
    ``nn.Module`` (the arguments of ``module(...)``, i.e. its ``forward`` without
    ``self``). Each name in ``policy.dims`` must be one of its parameters (or ``fn``
    must take ``**kwargs``), otherwise :class:`ConfigError`.

    Thread-safe: the only shared state is a memo dict, filled idempotently.
    """

    def __init__(self, policy: Buckets, fn: Callable[..., Any]) -> None:
        self.policy = policy
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
        for name, dims in policy.dims.items():
            param = signature.parameters.get(name)
            if param is None and var_keyword:
                slots.append(_Slot(name, None, True, _as_dims(dims)))
                continue
            if param is None or param.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD):
                what = "is not a parameter" if param is None else "is a variadic parameter"
                raise ConfigError(
                    f"Buckets(dims=...) names {name!r}, which {what} of {_name(fn)}"
                    f"{signature}; name a tensor parameter"
                )
            position = self._positional.index(name) if name in self._positional else None
            keyword = param.kind is not kinds.POSITIONAL_ONLY
            slots.append(_Slot(name, position, keyword, _as_dims(dims)))
        self._slots = tuple(slots)
        self.sizes = policy.sizes
        largest = policy.sizes[-1]
        self._table: list[int] | None = None
        if largest <= _TABLE_LIMIT:
            table: list[int] = []
            for size in policy.sizes:
                table.extend([size] * (size + 1 - len(table)))
            self._table = table
        self._memo: dict[tuple[Any, ...], Plan | None] = {}

    # -- per call

    def bucket(self, length: int) -> int | None:
        """The smallest size that holds ``length``, or ``None`` when it is too long."""
        table = self._table
        if table is not None:
            return table[length] if length < len(table) else None
        i = bisect.bisect_left(self.sizes, length)
        return self.sizes[i] if i < len(self.sizes) else None

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

        norm, lengths, problem = _normalize_dims(found, problem)
        distinct = {n for _, _, n in lengths}
        if problem is None and len(distinct) > 1:
            shown = ", ".join(f"{name}[{d}]={n}" for name, d, n in lengths)
            problem = f"bucketed dims have different lengths: {shown}"
        length = max(distinct, default=0)
        size = self.bucket(length) if problem is None else None

        status: Status
        if problem is not None:
            status, size = "unbucketable", length
        elif size is None:
            status, size = "oversize", length
        else:
            status = "bucketed"

        targets: tuple[_Target, ...] = ()
        if status == "bucketed" and size != length:
            targets, pad_problem = self._targets(found, norm, size)
            if pad_problem is not None:
                problem = pad_problem
                status, size = "unbucketable", length

        padded_dims = norm if status == "bucketed" else {}
        key = (status, size, self._entries(args, kwargs, padded_dims, size))
        return Plan(key, status, length, size, problem, targets)

    def _targets(
        self, found: _Found, norm: Mapping[str, tuple[int, ...]], size: int
    ) -> tuple[tuple[_Target, ...], str | None]:
        """How to pad each bucketed tensor up to ``size``, or a pad value that cannot be
        used (then no targets)."""
        targets = []
        for slot, where, tensor in found:
            value = self.policy.pad_for(slot.name)
            if not _fits(value, tensor.dtype):
                return (), (
                    f"pad value {value!r} for {slot.name} does not fit its dtype "
                    f"{str(tensor.dtype).removeprefix('torch.')}"
                )
            shape = tuple(tensor.shape)
            pad = _pad_widths(shape, norm[slot.name], size)
            targets.append(_Target(slot.name, where, shape, pad, value))
        return tuple(targets), None

    def _entries(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        padded_dims: Mapping[str, tuple[int, ...]],
        size: int,
    ) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """The key's part for the call's top-level tensors, by parameter name."""
        entries = []
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                name = self._positional[i] if i < len(self._positional) else f"*{i}"
                entries.append(_entry(name, a, padded_dims.get(name, ()), size))
        for k, v in kwargs.items():
            if isinstance(v, _Tensor):
                entries.append(_entry(k, v, padded_dims.get(k, ()), size))
        entries.sort(key=lambda e: e[0])
        return tuple(entries)

    def pad(
        self, plan: Plan, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments with bucketed dims padded up to ``plan.size``.

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

    def warmup_lengths(self) -> tuple[int, ...]:
        """One length per size, for warmup: ``size - 1`` (padded by one, so the bucket's
        output cut can be learned and its padding checked against eager before any
        traffic), or the size itself when its bucket holds that one length only."""
        out = []
        previous = 0
        for size in self.sizes:
            out.append(size - 1 if size - 1 > previous else size)
            previous = size
        return tuple(out)

    def resize(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], length: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """An example call with every bucketed dim made ``length`` long: cut when longer,
        tiled (the example repeated) when shorter, so masks and ids stay realistic. Other
        arguments are untouched. For warmup: ``resize(*example, n)`` for each ``n`` in
        :meth:`warmup_lengths` gives a call in each bucket."""
        found, problem = self._find(args, kwargs)
        if problem is not None:
            raise PadError(f"cannot resize the example: {problem}")
        new_args = list(args)
        new_kwargs = dict(kwargs)
        for slot, where, tensor in found:
            t = tensor
            for d in slot.dims:
                n = t.shape[d]
                if n == 0:
                    shape = list(t.shape)
                    shape[d] = length
                    t = t.new_full(shape, self.policy.pad_for(slot.name))
                    continue
                if n < length:
                    t = torch.cat([t] * -(-length // n), dim=d)
                t = t.narrow(d, 0, length)
            t = t.contiguous()
            if isinstance(where, int):
                new_args[where] = t
            else:
                new_kwargs[where] = t
        return tuple(new_args), new_kwargs

    # -- outputs

    def learn_cuts(self, plan: Plan, padded_out: object, eager_out: object) -> CutSpec:
        """Learn the cut for ``plan.key`` from one padded output and eager's output.

        A dim is cut where the padded output has ``plan.size`` and eager's has
        ``plan.length``; dims equal in both are kept (a hidden size that equals the
        bucket stays, both dims of a square attention map are cut). Any other
        difference (structure, rank, a dim that is neither) raises :class:`UnpadError`:
        such a bucket cannot be un-padded. With ``Buckets(outputs=...)`` the result must
        also match the declaration. The values are not compared: that is the shadow
        check's job (a sum over the padded dim keeps its shape and is not cut).

        Needs a padded plan (``plan.padded``): when the length is the bucket size there
        is nothing to learn from, and nothing to cut (:meth:`unpad` passes it through).
        """
        if not plan.padded:
            raise ValueError(
                f"nothing to learn: length {plan.length} is the bucket size, so padding "
                "changed no shape (such a call needs no cut)"
            )
        root = self._learn(padded_out, eager_out, "", plan)
        spec = CutSpec(plan.key, plan.size, "learned", root)
        if self.policy.outputs is not None:
            self._check_declared(spec)
        return spec

    def declared_cuts(self, plan: Plan, padded_out: object) -> CutSpec:
        """The cut for ``plan.key`` from ``Buckets(outputs=...)``, without eager.

        Each declared dim must have ``plan.size`` in ``padded_out``; also valid for a
        call whose length is the bucket size (the spec then serves the key's later,
        shorter calls). Raises :class:`UnpadError` on a mismatch, ``ValueError`` when
        the policy declares nothing.
        """
        if self.policy.outputs is None:
            raise ValueError("Buckets(outputs=...) is None: the cut must be learned")
        seen: set[str] = set()
        root = self._declare(padded_out, "", plan, seen)
        self._check_unknown_paths(seen)
        return CutSpec(plan.key, plan.size, "declared", root)

    def unpad(self, plan: Plan, out: _T, cuts: CutSpec | None) -> _T:
        """``out`` with the spec's dims cut to ``plan.length`` (views where they are
        contiguous like eager's; a copy otherwise).

        An unpadded plan returns ``out`` as it is (``cuts`` may be ``None``). Raises
        :class:`UnpadError` when the spec was made for another key or the output's
        structure or shapes differ from the spec's: nothing is ever cut on a guess.
        """
        if not plan.padded:
            return out
        if cuts is None:
            raise UnpadError(f"bucket {plan.label}: the output cut is not known yet")
        if cuts.key is not plan.key and cuts.key != plan.key:
            raise UnpadError(
                f"the cut was made for bucket {cuts.size} with other shapes, not for "
                f"{plan.describe()}"
            )
        return cuts.root.apply(out, plan.length, "")  # type: ignore[no-any-return]

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

    def _declared_for(self, path: str) -> tuple[int, ...]:
        declared = self.policy.outputs
        if isinstance(declared, Mapping):
            return _as_dims(declared.get(path, ()))
        assert declared is not None
        return _as_dims(declared)

    def _declare(self, p: object, path: str, plan: Plan, seen: set[str]) -> _Node:
        if isinstance(p, _Tensor):
            seen.add(path)
            shape = tuple(p.shape)
            cuts = []
            for d in self._declared_for(path):
                n = d + len(shape) if d < 0 else d
                if not 0 <= n < len(shape):
                    raise UnpadError(
                        f"Buckets(outputs=...) cuts {_show(path)} at dim {d}, but it has "
                        f"shape {shape}"
                    )
                if shape[n] != plan.size:
                    raise UnpadError(
                        f"Buckets(outputs=...) cuts {_show(path)} at dim {d}, but it has "
                        f"{shape[n]} there, not the bucket size {plan.size} (shape {shape})"
                    )
                cuts.append(n)
            return _TensorNode(shape, tuple(sorted(cuts)), p.is_contiguous())
        if _is_dataclass_instance(p):
            names = tuple(f.name for f in dataclasses.fields(p))  # type: ignore[arg-type]
            children = tuple(
                self._declare(getattr(p, n), _join(path, n), plan, seen) for n in names
            )
            return _DataNode(type(p), names, children)
        if isinstance(p, dict):
            keys = tuple(p.keys())
            children = tuple(self._declare(p[k], _join(path, k), plan, seen) for k in keys)
            return _MapNode(type(p), keys, children)
        if isinstance(p, list | tuple):
            children = tuple(
                self._declare(a, _join(path, _part(type(p), i)), plan, seen)
                for i, a in enumerate(p)
            )
            return _SeqNode(type(p), children)
        if isinstance(p, _PLAIN):
            return _LeafNode(type(p))
        raise UnpadError(
            f"{_show(path)} is a {type(p).__name__}: safecompile cannot see inside it to "
            "cut padding back (return tensors, tuples, lists, dicts or dataclasses)"
        )

    def _check_declared(self, spec: CutSpec) -> None:
        nodes = dict(_tensor_nodes(spec.root, ""))
        self._check_unknown_paths(set(nodes))
        for path, node in nodes.items():
            want = self._declared_for(path)
            rank = len(node.shape)
            if sorted(d + rank if d < 0 else d for d in want) != list(node.cuts):
                raise UnpadError(
                    f"Buckets(outputs=...) cuts {_show(path)} at dims {list(want)}, but "
                    f"padding changed dims {list(node.cuts)} (padded shape {node.shape})"
                )

    def _check_unknown_paths(self, seen: set[str]) -> None:
        declared = self.policy.outputs
        if isinstance(declared, dict):
            unknown = sorted(set(declared) - seen)
            if unknown:
                raise UnpadError(
                    f"Buckets(outputs=...) names {unknown}, which the output does not have "
                    f"as tensors; its tensor paths are {sorted(seen)} ('' is the output itself)"
                )


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
) -> tuple[dict[str, tuple[int, ...]], list[tuple[str, int, int]], str | None]:
    """Each bucketed tensor's dims made non-negative (by name), the length of each
    (name, dim, length), and the first problem: ``problem``, or a dim out of range."""
    lengths: list[tuple[str, int, int]] = []  # name, dim, length
    norm: dict[str, tuple[int, ...]] = {}
    for slot, _, tensor in found:
        ndim = tensor.dim()
        dims = tuple(d + ndim if d < 0 else d for d in slot.dims)
        bad = [d for d, n in zip(slot.dims, dims, strict=True) if not 0 <= n < ndim]
        if bad:
            problem = problem or (
                f"{slot.name} has {ndim} dims; bucketed dim {bad[0]} is out of range"
            )
            continue
        norm[slot.name] = dims
        lengths.extend((slot.name, d, int(tensor.shape[d])) for d in dims)
    return norm, lengths, problem


def _pad_widths(shape: tuple[int, ...], dims: tuple[int, ...], size: int) -> tuple[int, ...]:
    """``F.pad``'s list (last dim first) that pads ``dims`` of ``shape`` up to ``size`` at
    the end, with trailing all-zero pairs dropped."""
    pad = [0] * (2 * len(shape))
    for d in dims:
        pad[2 * (len(shape) - 1 - d) + 1] = size - shape[d]
    while pad and pad[-1] == 0 and pad[-2] == 0:
        del pad[-2:]
    return tuple(pad)


def _learn_tensor(p: _Tensor, e: object, path: str, plan: Plan) -> _TensorNode:
    """The cut for one output tensor: the dims that are ``plan.size`` padded and
    ``plan.length`` in eager's ``e``; any other difference raises :class:`UnpadError`."""
    if not isinstance(e, _Tensor):
        raise UnpadError(f"{_show(path)}: padded run gave a tensor, unpadded a {type(e).__name__}")
    ps, es = tuple(p.shape), tuple(e.shape)
    if len(ps) != len(es):
        raise UnpadError(
            f"{_show(path)}: padded run gave shape {ps}, unpadded {es}; cannot cut back"
        )
    cuts = []
    for d, (a, b) in enumerate(zip(ps, es, strict=True)):
        if a == b:
            continue
        if a == plan.size and b == plan.length:
            cuts.append(d)
            continue
        raise UnpadError(
            f"{_show(path)} dim {d}: padded run gave {a}, unpadded {b}; only a dim "
            f"that is the length ({plan.length}) unpadded and the bucket size "
            f"({plan.size}) padded can be cut back"
        )
    return _TensorNode(ps, tuple(cuts), e.is_contiguous())


def _entry(
    name: str, tensor: _Tensor, dims: tuple[int, ...], size: int
) -> tuple[str, tuple[int, ...], torch.dtype]:
    shape = list(tensor.shape)
    for d in dims:
        shape[d] = size
    return (name, tuple(shape), tensor.dtype)


def _as_dims(dims: int | tuple[int, ...]) -> tuple[int, ...]:
    return (dims,) if isinstance(dims, int) else tuple(dims)


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
