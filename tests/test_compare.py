"""compare(): structures, NaN/Inf rules, exact dtypes, calibrated tolerances, privacy."""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from safecompile.checks.compare import (
    Comparison,
    TensorFigures,
    compare,
    default_tolerances,
    verdict,
)

SECRET = 12345.678  # a distinctive value that must never appear in a reason


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def breach(result: Comparison, *fragments: str) -> None:
    """Assert a breach whose reason contains every fragment."""
    assert not result.ok, result
    assert result.reason is not None
    for fragment in fragments:
        assert fragment in result.reason, result.reason


# ------------------------------------------------------------------------ basic verdicts


def test_identical_tensors_pass() -> None:
    """A tensor against an equal copy: ok, zero figures, one leaf."""
    x = randn(4, 8)
    assert compare(x, x.clone()) == Comparison(True, 0.0, 0.0, None, 1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(512,), (8, 512), (4, 64, 256)])
def test_one_percent_shift_trips(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """out * 1.01 trips in every float dtype, on small and large tensors."""
    x = randn(*shape, dtype=dtype)
    result = compare(x * 1.01, x)
    assert not result.ok, result
    assert result.max_rel == pytest.approx(0.01, rel=0.1)
    assert result.max_abs > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_one_percent_shift_down_trips(dtype: torch.dtype) -> None:
    """A shift towards zero (out * 0.99) trips as well."""
    x = randn(16, 256, dtype=dtype)
    assert not compare(x * 0.99, x).ok


@pytest.mark.parametrize(
    ("dtype", "noise"),
    [
        (torch.float64, 1e-12),
        (torch.float32, 1e-6),
        (torch.float16, 5e-4),
        (torch.bfloat16, 4e-3),
    ],
)
def test_rounding_noise_passes(dtype: torch.dtype, noise: float) -> None:
    """Independent relative noise of about one unit roundoff per element passes."""
    ref = randn(16, 256, dtype=torch.float64, seed=1)
    wobble = 1 + noise * randn(16, 256, dtype=torch.float64, seed=2)
    result = compare((ref * wobble).to(dtype), ref.to(dtype))
    assert result.ok, result.reason
    assert result.max_rel < default_tolerances(dtype)[0]


def test_near_zero_elements_do_not_matter() -> None:
    """Huge elementwise relative errors near zero pass: the error is small against the norm.

    This is the bf16 transformer case: max elementwise relative difference in the
    thousands, yet compiled closer to an fp64 reference than eager.
    """
    ref = randn(64, 64, dtype=torch.float32, seed=3)
    ref[ref.abs() < 0.5] *= 1e-4  # many elements very close to zero
    got = ref + 1e-3 * randn(64, 64, seed=4) * ref.abs().max()  # absolute rounding noise
    elementwise = ((got - ref).abs() / ref.abs()).max()
    assert elementwise > 100
    assert compare(got.bfloat16(), ref.bfloat16()).ok


def test_a_few_wrong_elements_trip_the_peak_check() -> None:
    """One element far off trips even where the norm averages it away."""
    ref = randn(256, 256, dtype=torch.bfloat16, seed=5)
    got = ref.clone()
    got[17, 3] = ref[17, 3] + 3.0  # small against ‖ref‖ = 256, large against max|ref|
    result = compare(got, ref)
    breach(result, "out: peak error", "bfloat16", "normalised error")
    assert result.max_rel < default_tolerances(torch.bfloat16)[0]  # the norm alone passes


def test_scale_check_ignores_noise_on_tiny_tensors() -> None:
    """On a tensor of two elements, one bf16 step of difference is noise, not a drift."""
    ref = torch.tensor([3.125, -1.25], dtype=torch.bfloat16)
    got = torch.tensor([3.15625, -1.25], dtype=torch.bfloat16)  # one step up
    assert compare(got, ref).ok


def test_max_abs_and_max_rel_figures() -> None:
    """max_abs is the largest absolute difference; max_rel the normalised error."""
    ref = torch.tensor([1.0, -2.0, 2.0, 0.0], dtype=torch.float64)
    got = ref * 1.5
    result = compare(got, ref)
    assert result.max_abs == pytest.approx(1.0)
    assert result.max_rel == pytest.approx(0.5)
    breach(result, "out: normalised error 0.5 > tolerance", "(float64)")


def test_max_figures_are_over_all_leaves() -> None:
    """Figures are the maxima over leaves; the reason names the first breaching path."""
    a, b = randn(64), randn(64, seed=1)
    result = compare((a, b * 1.1), (a, b))
    assert result.max_rel == pytest.approx(0.1)
    breach(result, "out[1]:")
    assert result.leaves == 2


def test_user_tolerances_override_defaults() -> None:
    """rtol/atol given loosen or tighten the defaults."""
    x = randn(16, 256)
    assert compare(x * 1.01, x, rtol=0.05).ok
    assert not compare(x * (1 + 1e-7), x, rtol=0.0, atol=0.0).ok
    assert compare(x, x.clone(), rtol=0.0, atol=0.0).ok


def test_atol_floor_for_all_zero_reference() -> None:
    """Where eager is all zeros, the RMS difference is held to atol."""
    zeros = torch.zeros(100)
    assert compare(zeros + 1e-9, zeros).ok
    breach(compare(zeros + 1e-3, zeros), "RMS difference", "> atol")


# ---------------------------------------------------------------------------- NaN / Inf


def test_single_nan_trips() -> None:
    """One NaN where eager is finite: a breach with the count, max_rel inf."""
    x = randn(8, 128)
    got = x.clone()
    got[3, 7] = math.nan
    result = compare(got, x)
    breach(result, "out: NaN where eager is not NaN (1 of 1024 elements)")
    assert result.max_rel == math.inf


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_single_nan_trips_in_every_dtype(dtype: torch.dtype) -> None:
    """The NaN rule holds in low precision too."""
    x = randn(1000, dtype=dtype)
    got = x.clone()
    got[-1] = math.nan
    breach(compare(got, x), "NaN where eager is not NaN")


def test_nan_in_the_same_places_passes() -> None:
    """NaN where eager has NaN is agreement; the finite rest is still compared."""
    x = randn(64)
    x[::7] = math.nan
    assert compare(x.clone(), x).ok
    breach(compare(x * 1.5, x), "normalised error")


def test_nan_in_other_places_trips() -> None:
    """Eager's NaN turning finite is a breach too."""
    x = randn(64)
    y = x.clone()
    x[5] = math.nan
    y[6] = math.nan
    result = compare(y, x)
    breach(result, "NaN where eager is not NaN (1 of 64", "(and 1 more breach)")


def test_all_nan_both_sides_passes() -> None:
    """Nothing finite to compare, and the NaNs agree."""
    x = torch.full((5,), math.nan)
    assert compare(x.clone(), x).ok


def test_equal_infinities_pass() -> None:
    """+Inf against +Inf (and -Inf against -Inf) is agreement."""
    x = torch.tensor([math.inf, 1.0, -math.inf, 2.0])
    assert compare(x.clone(), x).ok


@pytest.mark.parametrize(
    ("got", "want"),
    [
        ([math.inf, 1.0], [5.0, 1.0]),  # Inf where eager is finite
        ([5.0, 1.0], [math.inf, 1.0]),  # finite where eager is Inf
        ([-math.inf, 1.0], [math.inf, 1.0]),  # the other infinity
    ],
)
def test_mismatched_infinities_trip(got: list[float], want: list[float]) -> None:
    """Any difference involving an infinity is a breach."""
    breach(compare(torch.tensor(got), torch.tensor(want)), "infinities differ")


def test_overflowing_squares_are_still_compared() -> None:
    """Values near float32's range (squares overflow) are compared by scaled norms."""
    x = randn(1000) * 1e30
    assert compare(x * (1 + 1e-7), x).ok
    breach(compare(x * 1.01, x), "normalised error 0.01")


def test_underflowing_squares_are_still_compared() -> None:
    """Tiny values (squares underflow to zero) are compared by scaled norms."""
    x = randn(1000) * 1e-25
    assert compare(x.clone(), x, atol=0.0).ok
    breach(compare(x * 1.01, x, atol=0.0), "normalised error 0.01")


# ------------------------------------------------------------------ exact and odd dtypes


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.uint8, torch.bool])
def test_integer_and_bool_tensors_compare_exactly(dtype: torch.dtype) -> None:
    """Any difference in an integer or bool tensor is a breach, with a count."""
    x = torch.tensor([1, 0, 1, 1]).to(dtype)
    assert compare(x.clone(), x).ok
    y = x.clone()
    y[1] = 1
    breach(compare(y, x), f"out: 1 of 4 elements differ ({str(dtype).split('.')[1]})")


def test_complex_tensors_compare_as_real_pairs() -> None:
    """Complex tensors: equal (even as a conjugate view) passes, a 1% shift trips."""
    z = torch.complex(randn(256), randn(256, seed=1))
    assert compare(z.conj().conj(), z).ok
    assert compare(z.conj(), z.conj().clone()).ok
    breach(compare(z * 1.01, z), "(complex64)")


def test_float8_tensors_compare() -> None:
    """float8 values are upcast; an equal copy passes, a gross error trips."""
    x = randn(64).to(torch.float8_e4m3fn)
    assert compare(x.clone(), x).ok
    assert not compare((x.float() * 2).to(torch.float8_e4m3fn), x).ok


def test_sparse_tensors_compare_dense() -> None:
    """Sparse against sparse compares values; against dense it is a layout breach."""
    dense = torch.zeros(4, 4)
    dense[1, 2] = 3.0
    sparse = dense.to_sparse()
    assert compare(sparse, dense.to_sparse()).ok
    assert not compare(sparse * 1.01, sparse).ok
    breach(compare(sparse, dense), "out: layout torch.sparse_coo != torch.strided")


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_tensors_compare_dequantized() -> None:
    """Quantized tensors are dequantized before the comparison."""
    q = torch.quantize_per_tensor(randn(32), scale=0.1, zero_point=0, dtype=torch.qint8)
    assert compare(q, torch.quantize_per_tensor(q.dequantize(), 0.1, 0, torch.qint8)).ok


def test_nested_tensors_are_a_breach() -> None:
    """Nested tensors are not compared: a conservative breach with a clear reason."""
    nt = torch.nested.nested_tensor([randn(2), randn(3)], layout=torch.jagged)
    breach(compare(nt, nt.clone()), "nested tensors are not compared")


def test_empty_and_zero_dim_tensors() -> None:
    """Empty tensors compare by shape; 0-dim tensors by value."""
    assert compare(torch.empty(0, 3), torch.empty(0, 3)).ok
    breach(compare(torch.empty(0, 3), torch.empty(0, 4)), "shape (0, 3) != (0, 4)")
    assert compare(torch.tensor(2.0), torch.tensor(2.0)).ok
    assert not compare(torch.tensor(2.0), torch.tensor(2.5)).ok


def test_views_grad_and_meta_tensors() -> None:
    """Non-contiguous, expanded and grad-requiring tensors compare; meta by metadata only."""
    x = randn(8, 16)
    assert compare(x.t(), x.t().contiguous()).ok
    assert compare(torch.ones(1).expand(100), torch.ones(100)).ok
    w = randn(8).requires_grad_()
    assert compare(w * 2, (w * 2).detach()).ok
    assert compare(torch.empty(3, device="meta"), torch.empty(3, device="meta")).ok


def test_parameters_count_as_tensors() -> None:
    """An nn.Parameter against a plain tensor with equal values passes."""
    x = randn(4)
    assert compare(nn.Parameter(x.clone()), x).ok


# ------------------------------------------------------------------ metadata mismatches


def test_shape_mismatch() -> None:
    """A different shape is a breach naming both shapes."""
    breach(compare(randn(2, 3), randn(2, 4)), "out: shape (2, 3) != (2, 4)")


def test_dtype_mismatch() -> None:
    """A different dtype is a breach, even with equal values."""
    x = randn(4)
    breach(compare(x.double(), x), "out: dtype float64 != float32")


def test_device_mismatch() -> None:
    """A different device is a breach."""
    breach(compare(torch.empty(2, device="meta"), randn(2)), "out: device meta != cpu")


def test_tensor_against_non_tensor() -> None:
    """A tensor where eager returned something else (and vice versa) is a type breach."""
    breach(compare(randn(2), [1.0, 2.0]), "out: type Tensor != list")
    breach(compare(None, randn(2)), "out: type None != Tensor")


# ----------------------------------------------------------------------------- structures


class Pair(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extra: list[torch.Tensor]
    note: str = "x"


class ModelOutput(OrderedDict[str, Any]):
    """A stand-in for Hugging Face's ModelOutput: an OrderedDict and a dataclass at once."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value


@dataclasses.dataclass
class CausalLMOutput(ModelOutput):
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


def test_tuples_and_lists() -> None:
    """Tuples and lists compare elementwise; paths index into them."""
    a, b = randn(3), randn(3, seed=1)
    assert compare((a, [b, a]), (a.clone(), [b.clone(), a.clone()])).ok
    breach(compare((a, [b, a * 2]), (a, [b, a])), "out[1][1]: normalised error")
    breach(compare([a, b], [a]), "out: length 2 != 1")
    breach(compare((a, b), [a, b]), "out: type tuple != list")


def test_namedtuples_use_field_names() -> None:
    """Namedtuple paths use field names."""
    a, b = randn(3), randn(1)
    assert compare(Pair(a, b), Pair(a.clone(), b.clone())).ok
    breach(compare(Pair(a, b * 2), Pair(a, b)), "out.loss:")
    breach(compare(Pair(a, b), (a, b)), "out: type Pair != tuple")


def test_dicts_compare_keys_then_values() -> None:
    """Dicts: key sets must match (order does not matter); paths name the keys."""
    a, b = randn(2, 3), randn(2, 4)
    assert compare({"x": a, "y": b}, {"y": b.clone(), "x": a.clone()}).ok
    breach(
        compare([a, {"logits": a}], [a, {"logits": b}]), "out[1]['logits']: shape (2, 3) != (2, 4)"
    )
    breach(compare({"x": a}, {"x": a, "y": b}), "out: missing keys ['y']")
    breach(compare({"x": a, "z": a}, {"x": a}), "unexpected keys ['z']")
    breach(compare(OrderedDict(x=a), {"x": a}), "out: type OrderedDict != dict")


def test_many_missing_keys_are_summarised() -> None:
    """A long list of keys is cut short."""
    want = {f"k{i}": i for i in range(20)}
    breach(compare({}, want), "missing keys ['k0', 'k1', 'k2', 'k3', 'k4', ... (20 in all)]")


def test_non_string_keys_are_shown_by_type() -> None:
    """Keys that are not simple values appear as their type name, never their value."""
    key = torch.tensor([SECRET])
    result = compare({1: randn(2), (SECRET,): 1}, {1: randn(2), (SECRET,): 2})
    assert "12345" not in str(result.reason)
    breach(result, "out[<tuple>]: int values differ")
    assert compare({key: 1}, {key: 1}).ok


def test_dataclasses_compare_fields() -> None:
    """Dataclasses compare field by field; paths use the field names."""
    a = randn(3)
    assert compare(Output(a, [a]), Output(a.clone(), [a.clone()])).ok
    breach(compare(Output(a, [a * 2]), Output(a, [a])), "out.extra[0]:")
    breach(compare(Output(a, [], "y"), Output(a, [], "x")), "out.note: str values differ")


def test_model_output_compares_as_a_mapping() -> None:
    """A ModelOutput (OrderedDict + dataclass) compares by its keys, before its fields."""
    logits, hidden = randn(2, 5), (randn(2, 4),)
    want = CausalLMOutput(logits=logits, hidden_states=hidden)
    assert compare(CausalLMOutput(logits=logits.clone(), hidden_states=hidden), want).ok
    breach(
        compare(CausalLMOutput(logits=logits * 2, hidden_states=hidden), want),
        "out['logits']: normalised error",
    )
    breach(compare(CausalLMOutput(logits=logits), want), "out: missing keys ['hidden_states']")


def test_none_and_scalars() -> None:
    """None, ints, bools and strings compare exactly; floats closely; types must match."""
    assert compare(None, None).ok
    assert compare([1, True, "a", b"b", 2.0], [1, True, "a", b"b", 2.0 * (1 + 1e-9)]).ok
    breach(compare(1, 2), "out: int values differ")
    breach(compare(True, 1), "out: type bool != int")
    breach(compare(1.0, 1), "out: type float != int")
    breach(compare(2.0, 2.1), "out: relative error")
    assert compare(math.nan, math.nan).ok
    assert compare(math.inf, math.inf).ok
    breach(compare(math.nan, 1.0), "out: NaN where eager is not NaN")
    breach(compare(1.0, math.nan), "out: not NaN where eager is NaN")
    breach(compare(math.inf, 1.0), "infinite value differs")
    assert compare(1 + 2j, 1 + 2j).ok


def test_other_objects_compare_by_equality() -> None:
    """Unknown objects of the same type compare with ==; what cannot compare is a breach."""
    assert compare(torch.float32, torch.float32).ok
    assert compare(torch.Size([2, 3]), torch.Size([2, 3])).ok
    breach(compare(torch.Size([2, 3]), torch.Size([2, 4])), "out[1]: int values differ")
    breach(compare(torch.float32, torch.float16), "out: dtype values differ")

    class Slotted:
        __slots__ = ("value",)

    breach(compare(Slotted(), Slotted()), "out: Slotted values differ (compared by identity)")

    class Weird:
        def __eq__(self, other: object) -> bool:
            raise TypeError(str(SECRET))

        __hash__ = object.__hash__

    result = compare(Weird(), Weird())
    breach(result, "cannot compare", "TypeError")
    assert "12345" not in str(result.reason)


class Cache:
    """An object without __eq__, like a Hugging Face DynamicCache in a model's output."""

    def __init__(self, keys: list[torch.Tensor], step: int) -> None:
        self.keys = keys
        self.step = step


def test_objects_without_eq_compare_by_attributes() -> None:
    """Objects with identity equality compare attribute by attribute."""
    k = randn(2, 8)
    assert compare({"cache": Cache([k], 3)}, {"cache": Cache([k.clone()], 3)}).ok
    breach(compare(Cache([k * 2], 3), Cache([k], 3)), "out.keys[0]: normalised error")
    breach(compare(Cache([k], 4), Cache([k], 3)), "out.step: int values differ")
    extra = Cache([k], 3)
    extra.more = 1  # type: ignore[attr-defined]
    breach(compare(extra, Cache([k], 3)), "out: unexpected attributes ['more']")


def test_objects_that_fail_when_read_do_not_raise() -> None:
    """A dataclass whose field cannot be read is a breach, not an exception."""

    @dataclasses.dataclass
    class Lazy:
        value: int = dataclasses.field(init=False)

    breach(compare(Lazy(), Lazy()), "out: comparison failed (AttributeError)")


def test_cyclic_structures_do_not_raise() -> None:
    """A self-referencing output is a breach, not an exception."""
    a: list[Any] = []
    a.append(a)
    b: list[Any] = []
    b.append(b)
    breach(compare(a, b), "too deep")


def test_several_breaches_are_counted() -> None:
    """The reason names the first breach in path order and counts the rest."""
    x = randn(4)
    result = compare([x * 2, x.double(), x], [x, x, x[:2]])
    breach(result, "out[0]: normalised error", "(and 2 more breaches)")


# -------------------------------------------------------------------------------- privacy


def secret_cases() -> Iterator[tuple[str, object, object]]:
    """Breaches of every kind over tensors and objects holding SECRET."""
    base = randn(64, 64)
    base[0, 0] = SECRET
    nan = base.clone()
    nan[1, 1] = math.nan
    inf = base.clone()
    inf[0, 0] = math.inf
    peak = base.clone()
    peak[5, 5] += SECRET / 2
    ints = torch.tensor([12345, 678])
    yield "shift", base * 1.01, base
    yield "big", base * 3, base
    yield "nan", nan, base
    yield "inf", inf, base
    yield "peak", peak, base
    yield "shape", base[:10], base
    yield "dtype", base.double(), base
    yield "bf16", base.bfloat16() * 1.05, base.bfloat16()
    yield "ints", ints + 1, ints
    yield "float", SECRET, SECRET * 1.5
    yield "str", f"{SECRET}", f"{SECRET}!"
    yield "dict", {"k": base * 2}, {"k": base}
    yield "complex", torch.complex(base, base) * 2, torch.complex(base, base)


@pytest.mark.parametrize(("case", "actual", "expected"), list(secret_cases()))
def test_reasons_never_contain_values(case: str, actual: object, expected: object) -> None:
    """No reason shows a value from the user's tensors or objects, only figures of difference."""
    result = compare(actual, expected)
    assert not result.ok, case
    reason = str(result.reason)
    for leak in ("12345", "1.23e+04", "1.23e4", "6.17e+03"):
        assert leak not in reason, (case, reason)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.floats(allow_nan=True, allow_infinity=True, width=32),
        min_size=0,
        max_size=50,
    ),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_any_tensor_equals_itself(values: list[float], dtype: torch.dtype) -> None:
    """Whatever the values (NaN, Inf, huge, subnormal), a tensor matches its own copy."""
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    result = compare(x.clone(), x)
    assert result.ok, result.reason
    assert result.max_abs == 0.0


@settings(max_examples=40, deadline=None)
@given(
    st.integers(min_value=512, max_value=8192),
    st.integers(min_value=0, max_value=2**31 - 1),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    st.floats(min_value=1e-3, max_value=1e3),
)
def test_rounding_passes_and_one_percent_trips(
    n: int, seed: int, dtype: torch.dtype, magnitude: float
) -> None:
    """For any size >= 512 and scale: unit-roundoff noise passes; a 1% shift trips."""
    exact = randn(n, dtype=torch.float64, seed=seed) * magnitude
    rounded = exact.to(dtype)
    unit = torch.finfo(dtype).eps / 2
    noise = randn(n, dtype=torch.float64, seed=seed + 1)
    wobbled = (exact * (1 + unit * noise)).to(dtype)
    result = compare(wobbled, rounded)
    assert result.ok, result.reason
    assert not compare((exact * 1.01).to(dtype), rounded).ok


# ------------------------------------------------------------------- defaults and verdict


def test_default_tolerances_order_by_precision() -> None:
    """Lower precision, looser tolerance; integers exact; complex like its parts."""
    rtol = {d: default_tolerances(d)[0] for d in (torch.float64, torch.float32, torch.bfloat16)}
    assert rtol[torch.float64] < rtol[torch.float32] < default_tolerances(torch.float16)[0]
    assert default_tolerances(torch.float16)[0] < rtol[torch.bfloat16]
    assert default_tolerances(torch.bfloat16)[0] < default_tolerances(torch.float8_e4m3fn)[0]
    assert default_tolerances(torch.int32) == (0.0, 0.0)
    assert default_tolerances(torch.bool) == (0.0, 0.0)
    assert default_tolerances(torch.complex64) == default_tolerances(torch.float32)
    assert default_tolerances(torch.float32, tf32=True)[0] > rtol[torch.float32]
    assert default_tolerances(torch.bfloat16, tf32=True) == default_tolerances(torch.bfloat16)
    # A 1% shift must stay detectable in every dtype of 16 bits or more.
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        r, _ = default_tolerances(dtype)
        assert r * 0.25 < 0.01


def test_reduced_fp32_matmul_loosens_float32() -> None:
    """With bf16/TF32 matmuls allowed for float32, the looser figures apply."""
    x = randn(16, 256)
    noisy = x * (1 + 2e-4 * randn(16, 256, seed=9))
    before = torch.get_float32_matmul_precision()
    try:
        assert not compare(noisy, x).ok
        torch.set_float32_matmul_precision("high")
        result = compare(noisy, x)
        assert result.ok, result.reason
        torch.set_float32_matmul_precision("medium")
        assert compare(noisy, x).ok
        breach(compare(x * 1.5, x), "(float32 (bfloat16))")
    finally:
        torch.set_float32_matmul_precision(before)


def test_verdict_directly() -> None:
    """verdict() applies the noise, scale and peak checks to precomputed figures."""
    # noise orthogonal to the reference: ‖a‖² = ‖e‖² + ‖d‖²
    a_norm = math.sqrt(1 + 0.01**2)
    flat = TensorFigures(d_norm=0.01, e_norm=1.0, a_norm=a_norm, d_max=0.001, e_max=0.1, n=100)
    assert verdict(flat, 0.016, 0.0) == (pytest.approx(0.01), None)
    # the same noise, all along the reference: a scale error of 1%
    shifted = dataclasses.replace(flat, a_norm=1.01, d_max=0.001)
    rel, why = verdict(shifted, 0.016, 0.0, "bfloat16")
    assert rel == pytest.approx(0.01)
    assert why is not None
    assert why.startswith("scale error 0.01 > tolerance")
    assert "(bfloat16; normalised error 0.01)" in why
    assert flat.scale_error == pytest.approx(0.0, abs=1e-12)
    assert shifted.scale_error == pytest.approx(0.01)


# ------------------------------------------------------------- real models, real backends


def mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, 2 * width),
        nn.GELU(),
        nn.Linear(2 * width, 2 * width),
        nn.GELU(),
        nn.Linear(2 * width, width),
    )


def encoder_layer(width: int) -> nn.Module:
    return nn.TransformerEncoderLayer(width, width // 32, 4 * width, 0.0, batch_first=True)


class PreNormBlock(nn.Module):
    """A GPT-style block: inductor fuses its norms and pointwise ops, changing rounding."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.heads = d // 32
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp256": (lambda: mlp(256), (16, 256)),
    "encoder64": (lambda: encoder_layer(64), (4, 32, 64)),
    "encoder256": (lambda: encoder_layer(256), (2, 64, 256)),
    "prenorm128": (lambda: PreNormBlock(128), (2, 64, 128)),
}


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Each model test starts with a fresh recompile budget (no silent eager fallback)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def check_model(name: str, dtype: torch.dtype, backend: str, seeds: int, grad: bool) -> None:
    """No false trip over seeds; the 1% shift and a single NaN in the same output trip."""
    build, shape = MODELS[name]
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = build().eval().to(dtype)
        compiled = torch.compile(model, backend=backend)
        x = randn(*shape, dtype=dtype, seed=100 + seed)
        with torch.set_grad_enabled(grad):
            eager, got = model(x), compiled(x)
        result = compare(got, eager)
        assert result.ok, f"seed {seed}: {result.reason}"
        assert not compare(got * 1.01, eager).ok, f"seed {seed}: 1% shift missed"
        poisoned = got.detach().clone()
        poisoned.view(-1)[seed * 7] = math.nan
        assert not compare(poisoned, eager).ok


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("name", "grad"),
    [("mlp256", False), ("encoder64", True), ("encoder256", True), ("prenorm128", False)],
)
def test_models_under_aot_eager_never_trip(name: str, grad: bool, dtype: torch.dtype) -> None:
    """fp32/bf16 MLP and transformer blocks under aot_eager: no false trip over 3 seeds.

    nn.TransformerEncoderLayer runs with grad enabled, so eager and compiled both take
    its decomposed path (with no_grad, eager's fused fast path makes them identical).
    """
    check_model(name, dtype, "aot_eager", seeds=3, grad=grad)


@pytest.mark.parametrize("name", ["mlp256", "encoder256", "prenorm128"])
def test_a_more_accurate_compiler_does_not_trip_bf16(name: str) -> None:
    """The worst honest case: compiled keeps fp32 intermediates that eager rounds to bf16.

    Emulated by running the same bf16 weights in fp32 and rounding once at the end; the
    difference is then all of eager's own rounding error.
    """
    for seed in range(3):
        torch.manual_seed(seed)
        build, shape = MODELS[name]
        model = build().eval().bfloat16()
        accurate = copy.deepcopy(model).float()
        x = randn(*shape, dtype=torch.bfloat16, seed=200 + seed)
        with torch.set_grad_enabled(name.startswith("encoder")):
            eager = model(x)
            got = accurate(x.float()).bfloat16()
        result = compare(got, eager)
        assert result.ok, f"seed {seed}: {result.reason}"
        assert result.max_rel > 1e-3  # a real difference, not identical outputs
        assert not compare(got * 1.01, eager).ok


@pytest.mark.inductor
@pytest.mark.usefixtures("fresh_dynamo")
def test_bf16_block_under_inductor_never_trips() -> None:
    """A bf16 transformer block under real inductor (which fuses and rounds differently)."""
    build, shape = MODELS["prenorm128"]
    figures = []
    for seed in range(3):
        torch.manual_seed(seed)
        model = build().eval().bfloat16()
        compiled = torch.compile(model, backend="inductor")
        x = randn(*shape, dtype=torch.bfloat16, seed=300 + seed)
        with torch.no_grad():
            eager, got = model(x), compiled(x)
        result = compare(got, eager)
        assert result.ok, f"seed {seed}: {result.reason}"
        figures.append(result.max_rel)
        assert not compare(got * 1.01, eager).ok
        poisoned = got.clone()
        poisoned.view(-1)[seed] = math.nan
        assert not compare(poisoned, eager).ok
    assert max(figures) > 0  # inductor really computed differently


def test_other_sequences() -> None:
    """Other sequences (a range, a deque) compare by type, length and items."""
    assert compare(range(3), range(3)).ok
    d = collections.deque([randn(2)])
    assert compare(d, collections.deque([d[0].clone()])).ok
    breach(compare(d, collections.deque([randn(2, seed=1)])), "out[0]: normalised error")
