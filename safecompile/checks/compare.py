"""Compare a compiled output with eager's reference, whatever its structure.

A float tensor is judged against its own magnitude (:func:`verdict`), never elementwise
(meaningless near zero); ``docs/tolerances.md`` has the criterion and the measurements
behind the per-dtype defaults. Messages name paths, shapes, dtypes, devices, counts and
figures of difference, never a value from the user's tensors or objects.
"""

from __future__ import annotations

import cmath
import dataclasses
import itertools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PEAK_FACTOR",
    "SCALE_SHARE",
    "SCALE_SIGMAS",
    "Comparison",
    "TensorFigures",
    "compare",
    "default_tolerances",
    "expand_mask",
    "locate",
    "mask_alignments",
    "verdict",
]

SCALE_SHARE = 0.25
"""A systematic scale error may reach this share of ``rtol`` (see :func:`verdict`)."""
SCALE_SIGMAS = 1.5
"""Allowance for the scale error that noise alone shows on small tensors (see :func:`verdict`)."""
PEAK_FACTOR = 4.0
"""The peak error may reach this multiple of ``rtol`` (see :func:`verdict`)."""

_MAX_SHOWN_KEYS = 5
_PLAIN = (str, bytes, numbers.Number)  # compared as Python scalars

# (rtol, atol): atol is a floor on the RMS difference, small so that a 1% drift still shows
# on outputs of RMS down to ~1e-4 (float32: ~1e-6); low-precision rtols are about four unit
# roundoffs (bf16 2^-8, fp16 and tf32 2^-11, fp8 e4m3 2^-4, e5m2 2^-3): docs/tolerances.md.
_DEFAULTS: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-12),
    torch.float32: (1e-4, 1e-8),
    torch.float16: (2e-3, 1e-7),
    torch.bfloat16: (1.6e-2, 1e-7),
    torch.float8_e4m3fn: (0.25, 1e-4),
    torch.float8_e4m3fnuz: (0.25, 1e-4),
    torch.float8_e5m2: (0.5, 1e-4),
    torch.float8_e5m2fnuz: (0.5, 1e-4),
}
_TF32 = (2e-3, 1e-7)
_COMPLEX_PARTS = {
    torch.complex128: torch.float64,
    torch.complex64: torch.float32,
    torch.complex32: torch.float16,
}
# float32 matmul settings (torch's precision, mkldnn's fp32_precision) that reduce it
_REDUCED = {"medium": "bfloat16", "high": "tf32", "bf16": "bfloat16", "tf32": "tf32"}
_NON_FINITE = (
    "NaN where eager is not NaN",
    "not NaN where eager is NaN",
    "infinities differ from eager's",
)


@dataclass(frozen=True, slots=True)
class Comparison:
    """The verdict of :func:`compare`: ``max_abs`` is the largest absolute difference over
    the finite compared elements (0.0 if none); ``max_rel`` the largest normalised error over
    the leaves (``inf`` for a NaN/Inf or structure breach); ``reason`` says why when not
    ``ok``, naming the path; ``leaves`` counts the tensors compared."""

    ok: bool
    max_abs: float
    max_rel: float
    reason: str | None
    leaves: int = 0
    where: Mapping[str, Any] | None = None  # where the first breaching tensor differs


def default_tolerances(dtype: torch.dtype, *, tf32: bool = False) -> tuple[float, float]:
    """The default ``(rtol, atol)`` for tensors of ``dtype``: looser for float32 math done in
    TF32 (``tf32=True``: CUDA matmuls or convolutions with TF32 allowed), a complex dtype's
    components' figures, and ``(0.0, 0.0)`` (exact) for integer and bool dtypes."""
    dtype = _COMPLEX_PARTS.get(dtype, dtype)
    if tf32 and dtype == torch.float32:
        return _TF32
    if dtype in _DEFAULTS:
        return _DEFAULTS[dtype]
    if not dtype.is_floating_point:
        return (0.0, 0.0)
    # An exotic float (e.g. float8_e8m0fnu): a few units in the last place.
    eps = torch.finfo(dtype).eps
    return (max(2.0 * eps, 1e-4), 1e-7)


Masks = Callable[[], Mapping[str, torch.Tensor]]


def compare(
    actual: object,
    expected: object,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    masks: Masks | None = None,
) -> Comparison:
    """Compare ``actual`` (the compiled output) with ``expected`` (eager's), nested to any
    depth; ``docs/tolerances.md`` says what counts as a breach.

    ``rtol`` / ``atol`` of ``None`` mean the per-dtype defaults (:func:`default_tolerances`;
    float32 takes the TF32 or bf16 figures where its matmuls run so, a Python float the
    float32 figures). Never raises on odd outputs: what cannot be compared faithfully is a
    breach with a reason. All per-tensor figures are read back with one sync per device.
    A tensor that breaches on its values is located (:func:`locate`); ``masks``, called
    only then, gives the call's mask-like inputs by name, to say whether the differences
    line up with one.
    """
    walk = _Walk(rtol, atol, masks)
    with torch.no_grad():
        try:
            walk.visit(actual, expected, "out")
        except Exception as exc:  # a user object that fails when read: conservative
            too_deep = isinstance(exc, RecursionError)
            why = f"comparison failed ({type(exc).__name__})"
            walk.breach("out", "structure too deep to compare" if too_deep else why)
            walk.pending = []
        walk.measure()
    return walk.result()


@dataclass(slots=True)
class _Leaf:
    """A pair of tensors whose values remain to be compared."""

    order: int
    path: str
    actual: torch.Tensor
    expected: torch.Tensor
    exact: bool  # integer or bool: compare exactly
    label: str  # the dtype as shown in messages (e.g. "bfloat16", "float32 (tf32)")
    rtol: float
    atol: float


class _Walk:
    """Walks two output structures side by side and collects breaches and figures."""

    def __init__(self, rtol: float | None, atol: float | None, masks: Masks | None) -> None:
        self.rtol, self.atol = rtol, atol
        self.masks = masks
        self.where: dict[str, Any] | None = None
        self.breaches: list[tuple[int, str]] = []
        self.pending: list[_Leaf] = []
        self.order = 0
        self.leaves = 0
        self.max_abs = 0.0
        self.max_rel = 0.0

    def breach(
        self, path: str, why: str, *, order: int | None = None, numeric: bool = False
    ) -> None:
        """Record a breach; all but a figure over tolerance (``numeric``) make max_rel inf."""
        self.breaches.append((self.order if order is None else order, f"{path}: {why}"))
        if not numeric:
            self.max_rel = math.inf

    def cannot(self, path: str, exc: Exception, order: int | None = None) -> None:
        self.breach(path, f"cannot compare this tensor ({type(exc).__name__})", order=order)

    def figures(self, max_abs: float, rel: float) -> None:
        self.max_abs = max(self.max_abs, max_abs)
        self.max_rel = max(self.max_rel, math.inf if math.isnan(rel) else rel)

    def result(self) -> Comparison:
        if not self.breaches:
            return Comparison(True, self.max_abs, self.max_rel, None, self.leaves)
        reason = min(self.breaches, key=lambda item: item[0])[1]  # the first in the walk
        if more := len(self.breaches) - 1:
            reason += f" (and {more} more breach{'es' if more > 1 else ''})"
        where = None
        if self.where is not None:
            where = {k: v for k, v in self.where.items() if k != "order"}
        return Comparison(False, self.max_abs, self.max_rel, reason, self.leaves, where)

    def visit(self, actual: object, expected: object, path: str) -> None:
        self.order += 1
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
            self.tensor(actual, expected, path)
        elif type(actual) is not type(expected):
            self.breach(path, f"type {_tname(actual)} != {_tname(expected)}")
        # from here on, both of one type
        elif isinstance(expected, _PLAIN):
            self.plain(actual, expected, path)
        elif isinstance(expected, Mapping) and isinstance(actual, Mapping):
            self.mapping(actual, expected, path)
        elif isinstance(expected, Sequence) and isinstance(actual, Sequence):
            self.sequence(actual, expected, path)
        elif dataclasses.is_dataclass(expected) and not isinstance(expected, type):
            for f in dataclasses.fields(expected):
                self.visit(getattr(actual, f.name), getattr(expected, f.name), f"{path}.{f.name}")
        else:
            self.other(actual, expected, path)

    def sequence(self, actual: Sequence[Any], expected: Sequence[Any], path: str) -> None:
        """Length first, then items (a named tuple's by their field names)."""
        if len(actual) != len(expected):
            self.breach(path, f"length {len(actual)} != {len(expected)}")
            return
        fields = getattr(type(expected), "_fields", ()) if isinstance(expected, tuple) else ()
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            name = fields[i] if i < len(fields) else None
            self.visit(a, e, f"{path}.{name}" if isinstance(name, str) else f"{path}[{i}]")

    def mapping(
        self,
        actual: Mapping[Any, Any],
        expected: Mapping[Any, Any],
        path: str,
        *,
        attributes: bool = False,
    ) -> None:
        """Keys first, then values; ``attributes`` for an object's ``vars()``."""
        missing = [k for k in expected if k not in actual]
        extra = [k for k in actual if k not in expected]
        what = "attributes" if attributes else "keys"
        parts = [
            f"{how} {what} {_keys(k)}"
            for how, k in (("missing", missing), ("unexpected", extra))
            if k
        ]
        if parts:
            self.breach(path, ", ".join(parts))
            return
        for key, e in expected.items():
            sub = f"{path}.{key}" if attributes else f"{path}[{_key(key)}]"
            self.visit(actual[key], e, sub)

    def plain(self, actual: object, expected: object, path: str) -> None:
        """Python scalars of one type: int/bool/str/bytes exact, float and complex close."""
        if isinstance(expected, numbers.Integral) or not isinstance(expected, numbers.Complex):
            if actual != expected:
                self.breach(path, f"{_tname(expected)} values differ")
            return
        assert isinstance(actual, numbers.Complex)
        a, e = complex(actual), complex(expected)
        a_nan, e_nan = cmath.isnan(a), cmath.isnan(e)
        if a_nan or e_nan:
            if a_nan != e_nan:
                self.breach(path, _NON_FINITE[0] if a_nan else _NON_FINITE[1])
            return
        if math.isinf(abs(a)) or math.isinf(abs(e)):
            if a != e:
                self.breach(path, "infinite value differs from eager's")
            return
        rtol, atol = self.tolerances(torch.float32)
        diff, ref = abs(a - e), abs(e)
        rel = diff / ref if ref > 0 else (0.0 if diff == 0 else math.inf)
        self.figures(diff, rel)
        if diff > atol + rtol * ref:
            allowed = rtol + atol / ref if ref else atol
            why = f"relative error {_fig(rel)} > tolerance {_fig(allowed)} ({_tname(expected)})"
            self.breach(path, why, numeric=True)

    def other(self, actual: object, expected: object, path: str) -> None:
        """Same-type objects of no known container type: ``==`` decides, or, for identity
        equality, their attributes (a Hugging Face ``DynamicCache`` compares by its tensors)."""
        if actual is expected:
            return
        if type(expected).__eq__ is object.__eq__:
            a_vars, e_vars = getattr(actual, "__dict__", None), getattr(expected, "__dict__", None)
            if isinstance(a_vars, dict) and isinstance(e_vars, dict):
                self.mapping(a_vars, e_vars, path, attributes=True)
            else:
                self.breach(path, f"{_tname(expected)} values differ (compared by identity)")
            return
        try:
            equal: object = actual == expected
        except Exception as exc:
            self.breach(path, f"cannot compare {_tname(expected)} ({type(exc).__name__})")
            return
        if not isinstance(equal, bool):
            self.breach(path, f"cannot compare {_tname(expected)} (== is not a bool)")
        elif not equal:
            self.breach(path, f"{_tname(expected)} values differ")

    def tolerances(self, dtype: torch.dtype, *, tf32: bool = False) -> tuple[float, float]:
        rtol, atol = default_tolerances(dtype, tf32=tf32)
        return (rtol if self.rtol is None else self.rtol, atol if self.atol is None else self.atol)

    def tensor(self, actual: torch.Tensor, expected: torch.Tensor, path: str) -> None:
        self.leaves += 1
        mismatch = _tensor_mismatch(actual, expected)
        if mismatch is not None:
            self.breach(path, mismatch)
            return
        if actual is expected or actual.device.type == "meta" or actual.numel() == 0:
            return
        try:
            a, e = _dense(actual), _dense(expected)
        except Exception as exc:
            self.cannot(path, exc)
            return
        self.pending.append(self.leaf(path, a, e))

    def leaf(self, path: str, a: torch.Tensor, e: torch.Tensor) -> _Leaf:
        """Two dense tensors of one dtype and shape to compare: integers and bools exactly,
        complex as real pairs, floats with the tolerances of the precision they run in."""
        dtype = e.dtype  # after dequantizing
        if not (dtype.is_floating_point or dtype.is_complex):
            return _Leaf(self.order, path, a, e, True, _dname(dtype), 0.0, 0.0)
        if a.is_complex():
            a, e = torch.view_as_real(a.resolve_conj()), torch.view_as_real(e.resolve_conj())
        kind = _fp32_kind(a.device) if a.dtype == torch.float32 else None
        runs_in = torch.bfloat16 if kind == "bfloat16" else a.dtype
        rtol, atol = self.tolerances(runs_in, tf32=kind == "tf32")
        label = _dname(dtype) if kind is None else f"{_dname(dtype)} ({kind})"
        return _Leaf(self.order, path, a, e, False, label, rtol, atol)

    def measure(self) -> None:
        """Compute every pending leaf's figures, reading them back once per device."""
        figures: list[torch.Tensor | None] = []
        for leaf in self.pending:
            try:
                figures.append(_exact_figures(leaf) if leaf.exact else _fast_figures(leaf))
            except Exception as exc:
                figures.append(None)
                self.cannot(leaf.path, exc, leaf.order)
        for leaf, got in zip(self.pending, _read_back(figures), strict=True):
            try:
                if got is not None:
                    self.judge(leaf, got)
            except Exception as exc:
                self.cannot(leaf.path, exc, leaf.order)
        self.pending = []

    def judge(self, leaf: _Leaf, got: list[float]) -> None:
        path, order, n = leaf.path, leaf.order, leaf.expected.numel()
        if leaf.exact:
            wrong = int(got[0])
            if wrong:
                counted = f"{wrong} of {n} elements differ ({leaf.label})"
                self.breach(path, counted + self.locate(leaf, counted=True), order=order)
            return
        d_norm, e_norm, a_norm, d_lo, d_hi, e_lo, e_hi = got
        figures = TensorFigures(d_norm, e_norm, a_norm, max(-d_lo, d_hi), max(-e_lo, e_hi), n)
        if not all(math.isfinite(x) for x in got) or (
            (d_norm == 0 and figures.d_max > 0) or (e_norm == 0 and figures.e_max > 0)
        ):  # NaN/Inf somewhere, or squares that overflowed or underflowed
            counts, figures = _slow_figures(leaf)
            located = False
            for count, what in zip(counts, _NON_FINITE, strict=True):
                if count:
                    at = "" if located else self.locate(leaf)
                    located = True
                    self.breach(path, f"{what} ({count} of {n} elements){at}", order=order)
            if any(counts):
                self.figures(figures.d_max, math.inf)
                return
            if figures.n == 0:  # nothing finite: NaNs and infinities all matched
                return
        rel, why = verdict(figures, leaf.rtol, leaf.atol, leaf.label)
        self.figures(figures.d_max, rel)
        if why is not None:
            self.breach(path, why + self.locate(leaf), order=order, numeric=True)

    def locate(self, leaf: _Leaf, *, counted: bool = False) -> str:
        """Where a breaching tensor differs, as text for its reason (the first is kept in
        ``where``); never raises: a tensor that cannot be located is not."""
        try:
            masks = self.masks() if self.masks is not None else {}
            found = locate(
                leaf.actual, leaf.expected, leaf.rtol, leaf.atol, masks, exact=leaf.exact
            )
        except Exception:
            return ""
        if self.where is None or leaf.order < self.where["order"]:
            self.where = {"order": leaf.order, "path": leaf.path, **found}
        return _where_text(found, counted=counted)


@dataclass(frozen=True, slots=True)
class TensorFigures:
    """One tensor's figures over the elements finite on both sides, ``d = actual - expected``;
    the norms may be divided by one ``scale`` (keeping their squares in range)."""

    d_norm: float  # ‖d‖
    e_norm: float  # ‖expected‖
    a_norm: float  # ‖actual‖
    d_max: float  # max|d|
    e_max: float  # max|expected|
    n: int  # elements compared
    scale: float = 1.0

    @property
    def normalised(self) -> float:
        """``‖d‖ / ‖expected‖``: 0 when both are 0, ``inf`` when only ``expected`` is."""
        if self.e_norm > 0:
            return self.d_norm / self.e_norm
        return 0.0 if self.d_norm == 0 else math.inf

    @property
    def scale_error(self) -> float:
        """The least-squares scale error ``s = <d, e> / ‖e‖²`` (``a ≈ (1 + s)·e``; 0 if
        undefined), from the norms: ``(‖a‖² - ‖d‖² - ‖e‖²) / 2‖e‖²`` since ``a = d + e``."""
        e = self.e_norm
        if e <= 0:
            return 0.0
        rel = self.d_norm / e
        return (self.a_norm - e) * (self.a_norm + e) / (2 * e * e) - rel * rel / 2

    def floor(self, atol: float) -> float:
        """``atol·√n`` in the units of the norms."""
        return atol * math.sqrt(self.n) / self.scale

    def scale_allowance(self, rtol: float, atol: float) -> float:
        """The largest ``|scale_error|`` that passes (see :func:`verdict`)."""
        if self.e_norm <= 0:
            return math.inf
        spread = self.e_max / (self.e_norm * self.scale)  # max|e| / ‖e‖, ~1/√n if flat
        noise = SCALE_SIGMAS * self.normalised * spread  # what noise alone can show
        return SCALE_SHARE * rtol + noise + self.floor(atol) / self.e_norm


def verdict(
    f: TensorFigures, rtol: float, atol: float, label: str = ""
) -> tuple[float, str | None]:
    """``(normalised error, why the tensor breaches or None)``; ``label`` (the dtype, say)
    goes in the message. With ``d = actual - expected`` and ``e = expected``, in order
    (``docs/tolerances.md`` explains each term and the measurements behind them):

    1. noise: ``‖d‖ <= rtol·‖e‖ + atol·√n``;
    2. scale: ``|<d, e> / ‖e‖²| <= SCALE_SHARE·rtol + SCALE_SIGMAS·(‖d‖/‖e‖)·(max|e|/‖e‖)
       + atol·√n/‖e‖`` (a drift shows in full; rounding, uncorrelated with ``e``, barely);
    3. peak: ``max|d| <= PEAK_FACTOR·rtol·max|e| + atol`` (a few wrong elements).
    """
    rel = f.normalised
    tag = f" ({label})" if label else ""
    more = f" ({label or 'tensor'}; normalised error {_fig(rel)})"
    if f.d_norm > rtol * f.e_norm + f.floor(atol):
        if f.e_norm > 0:
            allowed = rtol + f.floor(atol) / f.e_norm
            return rel, f"normalised error {_fig(rel)} > tolerance {_fig(allowed)}{tag}"
        rms = f.d_norm * f.scale / math.sqrt(f.n)
        return rel, f"RMS difference {_fig(rms)} > atol {_fig(atol)}{tag}"
    if f.d_norm > 0:
        s, allowed = f.scale_error, f.scale_allowance(rtol, atol)
        if abs(s) > allowed:
            return rel, f"scale error {_fig(s)} > tolerance {_fig(allowed)}{more}"
    if f.d_max > PEAK_FACTOR * rtol * f.e_max + atol:
        if f.e_max == 0:
            return rel, f"largest difference {_fig(f.d_max)} > atol {_fig(atol)}{tag}"
        allowed = PEAK_FACTOR * rtol + atol / f.e_max
        peak = _fig(f.d_max / f.e_max)
        return rel, f"peak error {peak} of the largest magnitude > tolerance {_fig(allowed)}{more}"
    return rel, None


_MAX_ALIGNMENTS = 24  # ways a mask's dims may line up with an output's, tried at most


def locate(
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float,
    atol: float,
    masks: Mapping[str, torch.Tensor] | None = None,
    *,
    exact: bool = False,
) -> dict[str, Any]:
    """Where two dense tensors of one shape differ: ``differ`` (elements whose difference
    exceeds ``atol + rtol·max|expected|``; any difference with ``exact``) of ``elements``,
    the ``worst_index`` and its ``worst_diff`` (``inf`` where only one side is NaN or
    Inf), its ``worst_share`` of the largest magnitude, and, when every differing element
    lies where one of ``masks`` (bool or 0/1 inputs by name) is set, or where it is not,
    ``mask`` (its name), ``mask_value`` (``True``/``False``, 1/0) and ``mask_dims`` (the
    output dim each mask dim lines up with). Figures and indices only, never values."""
    with torch.no_grad():
        if actual.is_complex():
            actual, expected = torch.view_as_real(actual), torch.view_as_real(expected)
        shape = tuple(expected.shape)
        if exact:
            diff = torch.ne(actual, expected).to(torch.float32)
            differ = diff > 0
            e_max = 0.0
        else:
            work = torch.float64 if expected.dtype == torch.float64 else torch.float32
            a, e = actual.to(work), expected.to(work)
            diff = (a - e).abs()
            same = (a == e) | (torch.isnan(a) & torch.isnan(e))  # equal infinities, NaNs
            diff = torch.where(same, 0.0, torch.nan_to_num(diff, nan=math.inf))
            finite = torch.isfinite(e)
            e_max = float(torch.where(finite, e.abs(), 0.0).max()) if e.numel() else 0.0
            differ = diff > atol + rtol * e_max
        count = int(differ.sum())
        worst = int(diff.reshape(-1).argmax())
        worst_diff = float(diff.reshape(-1)[worst])
        found: dict[str, Any] = {
            "differ": count,
            "elements": diff.numel(),
            "worst_index": [int(i) for i in torch.unravel_index(torch.tensor(worst), shape)],
            "worst_diff": worst_diff,
        }
        if not exact and e_max > 0 and math.isfinite(worst_diff):
            found["worst_share"] = worst_diff / e_max
        if count:
            found.update(_mask_alignment(differ, masks or {}))
    return found


def _mask_alignment(differ: torch.Tensor, masks: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The first mask that every differing position lies inside (or outside) of."""
    for name, mask in masks.items():
        if mask.device != differ.device or mask.ndim == 0 or mask.ndim > differ.ndim:
            continue
        set_ = mask != 0 if mask.dtype != torch.bool else mask
        for dims in mask_alignments(tuple(mask.shape), tuple(differ.shape)):
            where = expand_mask(set_, dims, tuple(differ.shape))
            for value, inside in ((True, where), (False, ~where)):
                if not bool((differ & ~inside).any()) and not bool(inside.all()):
                    shown: bool | int = value if mask.dtype == torch.bool else int(value)
                    return {"mask": name, "mask_value": shown, "mask_dims": list(dims)}
    return {}


def mask_alignments(mask: tuple[int, ...], out: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The ways a mask of shape ``mask`` lines up with an output of shape ``out``: for each
    mask dim, the output dim of the same size it stands for; the leading dims first."""
    found = []
    for dims in itertools.permutations(range(len(out)), len(mask)):
        if all(out[d] == n for d, n in zip(dims, mask, strict=True)):
            found.append(dims)
            if len(found) >= _MAX_ALIGNMENTS:
                break
    return found


def expand_mask(mask: torch.Tensor, dims: Sequence[int], out: tuple[int, ...]) -> torch.Tensor:
    """``mask`` broadcast to the shape ``out``, mask dim ``i`` standing for ``dims[i]``."""
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    shape = [1] * len(out)
    for i in order:
        shape[dims[i]] = out[dims[i]]
    return mask.permute(order).reshape(shape).expand(out)


def _where_text(found: Mapping[str, Any], *, counted: bool) -> str:
    """``"; 12 of 96 elements differ, worst at [1, 4, 0] by 0.8 of max|eager|;
    they differ only where src_key_padding_mask is True (...)"``: for a reason
    (a share of the largest magnitude, never a difference in the tensor's own units)."""
    index = ", ".join(str(i) for i in found["worst_index"])
    if counted:  # exact: every difference counts the same
        text = f", the first at [{index}]"
    else:
        text = f"; {found['differ']} of {found['elements']} elements differ, worst at [{index}]"
        share = found.get("worst_share")
        text += f" by {_fig(share)} of max|eager|" if share is not None else ""
    if "mask" in found:
        name, value, dims = found["mask"], found["mask_value"], found["mask_dims"]
        text += f"; they differ only where {name} is {value}"
        declared = f"{name!r}" if value in (True, 1) else f"{name!r}, equals={value!r}"
        if dims != list(range(len(dims))):
            declared += f", dims={tuple(dims)!r}"
        text += f" (don't-care there? Shadow(compare=ignore_where({declared})))"
    return text


def _fast_figures(leaf: _Leaf) -> torch.Tensor:
    """[‖d‖, ‖e‖, ‖a‖, min d, max d, min e, max e] with d = a - e, in the working precision,
    not read back. ``aminmax`` is several times faster on CPU than an infinity norm."""
    a, e = leaf.actual, leaf.expected
    work = torch.float64 if e.dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm
    upcast = e.dtype != work
    if upcast:  # exact upcasts, then one rounding in the subtraction
        a, e = a.to(work), e.to(work)
    a_norm, e_norm = norm(a), norm(e)
    e_lo, e_hi = torch.aminmax(e)
    d = a.sub_(e) if upcast else torch.sub(a, e)  # in place only on our own copy
    d_lo, d_hi = torch.aminmax(d)
    return torch.stack([norm(d), e_norm, a_norm, d_lo, d_hi, e_lo, e_hi])


def _exact_figures(leaf: _Leaf) -> torch.Tensor:
    """[number of elements that differ]."""
    return torch.ne(leaf.actual, leaf.expected).sum().reshape(1)


def _read_back(figures: list[torch.Tensor | None]) -> list[list[float] | None]:
    """Move every leaf's figures to the host: one transfer (one sync) per device."""
    out: list[list[float] | None] = [None] * len(figures)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, fig in enumerate(figures):
        if fig is not None:
            by_device.setdefault(fig.device, []).append((i, fig))
    for device, items in by_device.items():
        wide = torch.float32 if device.type == "mps" else torch.float64
        flat = iter(torch.cat([fig.to(wide) for _, fig in items]).tolist())
        for i, fig in items:
            out[i] = list(itertools.islice(flat, fig.numel()))
    return out


def _slow_figures(leaf: _Leaf) -> tuple[list[int], TensorFigures]:
    """The careful path, for fast figures that were not all finite: the counts of new NaNs,
    lost NaNs and mismatched infinities, and the figures over the elements finite on both
    sides (norms divided by a scale that keeps their squares in range)."""
    work = torch.float64 if leaf.expected.dtype == torch.float64 else torch.float32
    a, e = leaf.actual.to(work), leaf.expected.to(work)
    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    inf_bad = ((torch.isinf(a) | torch.isinf(e)) & ~a_nan & ~e_nan & (a != e)).sum()
    finite = torch.isfinite(a) & torch.isfinite(e)
    a, e = torch.where(finite, a, 0.0), torch.where(finite, e, 0.0)
    d = a - e
    d_max, e_max, a_max = (_abs_max(t) for t in (d, e, a))
    scale = torch.maximum(torch.maximum(d_max, e_max), a_max).clamp_min(torch.finfo(work).tiny)
    counts = [(a_nan & ~e_nan).sum(), (e_nan & ~a_nan).sum(), inf_bad, finite.sum()]
    norms = [torch.linalg.vector_norm(t / scale) for t in (d, e, a)]
    got = torch.stack([c.to(work) for c in counts] + norms + [d_max, e_max, scale]).tolist()
    d_norm, e_norm, a_norm, dm, em, s = got[4:]
    return [int(x) for x in got[:3]], TensorFigures(d_norm, e_norm, a_norm, dm, em, int(got[3]), s)


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    lo, hi = torch.aminmax(t)
    return torch.maximum(lo.neg(), hi)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A strided tensor with the same values (sparse made dense, quantized dequantized)."""
    if t.is_quantized:
        return t.dequantize()
    return t.to_dense() if t.layout != torch.strided else t


def _fp32_kind(device: torch.device) -> str | None:
    """How float32 matmuls run now: ``None`` (full fp32), ``"tf32"`` or ``"bfloat16"``."""
    kind = _REDUCED.get(torch.get_float32_matmul_precision())
    if kind is None and device.type == "cuda":
        cuda_tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
        kind = "tf32" if cuda_tf32 else None
    if kind is None and device.type == "cpu":
        mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
        kind = _REDUCED.get(getattr(mkldnn, "fp32_precision", "none"))
    return kind


def _tensor_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Why two tensors' values cannot be compared: the first of their type, device,
    dtype, layout, nesting and shape that differs; ``None`` when none does."""
    if _ttype(actual) is not _ttype(expected):
        return f"type {_tname(actual)} != {_tname(expected)}"
    if actual.device != expected.device:
        return f"device {actual.device} != {expected.device}"
    if actual.dtype != expected.dtype:
        return f"dtype {_dname(actual.dtype)} != {_dname(expected.dtype)}"
    if actual.layout != expected.layout:
        return f"layout {actual.layout} != {expected.layout}"
    if actual.is_nested or expected.is_nested:
        return "nested tensors are not compared"
    shape, want = tuple(actual.shape), tuple(expected.shape)
    return f"shape {shape} != {want}" if shape != want else None


def _ttype(t: torch.Tensor) -> type:
    """The tensor's type, with parameters and buffers counting as plain tensors."""
    return torch.Tensor if isinstance(t, torch.nn.Parameter) else type(t)


def _tname(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor) and _ttype(value) is torch.Tensor:
        return "Tensor"
    return type(value).__qualname__.rsplit("<locals>.", 1)[-1]


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fig(x: float) -> str:
    return f"{x:.3g}"


def _key(key: object) -> str:
    """A mapping key as shown in paths: repr for simple keys, the type name otherwise."""
    if isinstance(key, str | int | bool | float) or key is None:
        return repr(key)
    return f"<{type(key).__qualname__}>"


def _keys(keys: list[Any]) -> str:
    shown = ", ".join(_key(k) for k in keys[:_MAX_SHOWN_KEYS])
    if len(keys) > _MAX_SHOWN_KEYS:
        shown += f", ... ({len(keys)} in all)"
    return f"[{shown}]"
