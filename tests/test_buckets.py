"""Shape buckets: bucket arithmetic, padding arguments, cutting outputs back."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safecompile import ConfigError
from safecompile.base.policies import Buckets, pow2, steps
from safecompile.shapes import buckets as _buckets
from safecompile.shapes.buckets import Bucketer, PadError, UnpadError

SIZES = (16, 32, 64, 128)


def bucketer(fn: Any, **options: Any) -> Bucketer:
    options.setdefault("sizes", SIZES)
    options.setdefault("strategy", "pad")  # these tests are about padding
    return Bucketer(Buckets(**options), fn)


def run_padded(b: Bucketer, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    """(plan, padded output, eager output) for one call."""
    plan = b.plan(args, kwargs)
    assert plan is not None
    pargs, pkwargs = b.pad(plan, args, kwargs)
    return plan, fn(*pargs, **pkwargs), fn(*args, **kwargs)


def assert_same(expected: Any, actual: Any) -> None:
    """Equal structure, shapes and values (exactly)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# ---------------------------------------------------------------- arithmetic


@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=12, unique=True).map(sorted),
    length=st.integers(0, 5100),
)
def test_bucket_is_smallest_size_that_holds(sizes: list[int], length: int) -> None:
    """bucket() is the smallest size >= length, or None past the largest."""
    b = bucketer(lambda x: x, dims={"x": 0}, sizes=sizes)
    expected = min((s for s in sizes if s >= length), default=None)
    assert expected == b.bucket(length)


@given(length=st.integers(0, 300_000))
def test_bucket_bisect_path_matches(length: int) -> None:
    """Sizes too large for a lookup table are bisected, with the same answers."""
    sizes = (16, 1024, 1 << 17, 1 << 18)
    b = bucketer(lambda x: x, dims={"x": 0}, sizes=sizes)
    assert b._table is None
    assert min((s for s in sizes if s >= length), default=None) == b.bucket(length)


@given(lo=st.integers(1, 4000), span=st.integers(0, 4000))
def test_pow2_covers_range(lo: int, span: int) -> None:
    """pow2 gives increasing powers of two whose first holds lo and whose last holds hi."""
    hi = lo + span
    sizes = pow2(lo, hi)
    assert all(s & (s - 1) == 0 for s in sizes)
    assert list(sizes) == sorted(set(sizes))
    assert sizes[-1] >= hi
    assert sizes[0] // 2 < lo <= sizes[0] or sizes[0] == 1


@given(lo=st.integers(1, 500), span=st.integers(0, 2000), step=st.integers(1, 64))
def test_steps_cover_range(lo: int, span: int, step: int) -> None:
    """steps() goes from lo by step and its last value is the first that holds hi."""
    hi = lo + span
    sizes = steps(lo, hi, step)
    assert sizes[0] == lo
    assert all(b - a == step for a, b in itertools.pairwise(sizes))
    assert sizes[-1] >= hi > sizes[-1] - step or sizes == (lo,)


def test_vllm_like_sizes_are_valid_buckets() -> None:
    """pow2 and steps concatenate into a valid size list."""
    sizes = pow2(1, 4) + steps(8, 256, 8) + steps(272, 512, 16)
    policy = Buckets(dims={"x": 0}, sizes=sizes)
    assert policy.sizes[:5] == (1, 2, 4, 8, 16)
    assert policy.sizes[-1] == 512
    assert len(policy.sizes) == 3 + 32 + 16


@pytest.mark.parametrize(
    "outputs",
    [True, "1", (1, 1), {1: 1}, {"0": "x"}, {"0": (1, 1)}, ()],
)
def test_bad_outputs_spec_is_refused(outputs: Any) -> None:
    """Buckets(outputs=...) accepts None, dims or a path->dims mapping, nothing else."""
    with pytest.raises(ConfigError, match=r"Buckets\(outputs=\.\.\.\)"):
        Buckets(dims={"x": 1}, sizes=SIZES, outputs=outputs)


def test_outputs_spec_is_normalised() -> None:
    """An int becomes a tuple; a mapping becomes a dict of tuples."""
    assert Buckets(dims={"x": 1}, sizes=SIZES, outputs=1).outputs == (1,)
    assert Buckets(
        dims={"x": 1}, sizes=SIZES, outputs={"0": 1, "attn": (2, 3), "pooled": ()}
    ).outputs == {"0": (1,), "attn": (2, 3), "pooled": ()}


# ---------------------------------------------------------------- resolving arguments


def test_unknown_argument_is_a_config_error() -> None:
    """A dims name that fn does not take is refused, naming it."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(ConfigError, match=r"'mask'.*not a parameter"):
        bucketer(fn, dims={"x": 1, "mask": 1})


def test_variadic_argument_is_a_config_error() -> None:
    """*args cannot be bucketed by name."""

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        return xs[0]

    with pytest.raises(ConfigError, match="variadic"):
        bucketer(fn, dims={"xs": 1})


def test_var_keyword_accepts_names_as_keywords() -> None:
    """fn(**kwargs) takes any name, by keyword only."""

    def fn(**kw: torch.Tensor) -> torch.Tensor:
        return kw["x"]

    b = bucketer(fn, dims={"x": 1})
    plan = b.plan((), {"x": torch.zeros(2, 10)})
    assert plan is not None
    assert (plan.length, plan.size) == (10, 16)


def test_methods_and_modules_resolve_positions() -> None:
    """self counts for a class-body function, not for a bound method or a module."""

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            return x

    m = M()
    x, mask = torch.zeros(2, 10), torch.ones(2, 10)
    unbound = bucketer(M.forward, dims={"mask": 1})
    bound = bucketer(m.forward, dims={"mask": 1})
    module = bucketer(m, dims={"mask": 1})
    plan = unbound.plan((m, x, mask), {})
    assert plan is not None
    assert plan.length == 10
    for b in (bound, module):
        plan = b.plan((x, mask), {})
        assert plan is not None
        assert plan.length == 10


def test_positional_only_is_not_looked_up_by_keyword() -> None:
    """A positional-only parameter is found by position only."""

    def fn(x: torch.Tensor, /, **kw: Any) -> torch.Tensor:
        return x

    b = bucketer(fn, dims={"x": 1})
    assert b.plan((), {"x": torch.zeros(2, 3)}) is None
    assert b.plan((torch.zeros(2, 3),), {}) is not None


# ---------------------------------------------------------------- planning


def two(x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    out = x * scale
    if mask is not None:
        out = out * mask.unsqueeze(-1)
    return out


def test_plan_none_without_bucketed_tensor() -> None:
    """No bucketed tensor in the call: no plan."""
    b = bucketer(two, dims={"mask": 1})
    assert b.plan((torch.zeros(2, 10, 4),), {}) is None
    assert b.plan((torch.zeros(2, 10, 4), None), {}) is None


def test_plan_key_is_one_per_bucket_and_shape() -> None:
    """Padded lengths in one bucket share a key; another batch or bucket is another key,
    and so is the length that fits the bucket exactly (nothing to verify or cut there)."""
    b = bucketer(two, dims={"x": 1, "mask": 1})

    def key(batch: int, length: int) -> Any:
        plan = b.plan((torch.zeros(batch, length, 4), torch.ones(batch, length)), {})
        assert plan is not None
        return plan.key

    assert key(2, 17) == key(2, 30)
    assert key(2, 17) != key(2, 32)
    assert key(2, 17) != key(3, 17)
    assert key(2, 17) != key(2, 33)
    assert key(2, 17) != key(2, 16)
    dynamic = bucketer(two, dims={"x": 1, "mask": 1}, strategy="dynamic")
    plans = [dynamic.plan((torch.zeros(2, n, 4), torch.ones(2, n)), {}) for n in (17, 32)]
    assert plans[0] is not None
    assert plans[1] is not None
    assert plans[0].key == plans[1].key  # one dynamic range, nothing padded


def test_plan_fields() -> None:
    """status, length, size, padded, label and describe tell what happens."""
    b = bucketer(two, dims={"x": 1, "mask": 1})
    plan = b.plan((torch.zeros(2, 20, 4),), {"mask": torch.ones(2, 20)})
    assert plan is not None
    assert (
        plan.status,
        plan.length,
        plan.size,
        plan.padded,
        plan.label,
    ) == ("bucketed", 20, 32, True, "32")
    assert "mask=2x32:float32" in plan.describe()
    assert "x=2x32x4:float32" in plan.describe()


def test_plan_key_ignores_how_arguments_are_passed() -> None:
    """Positional or keyword, one signature is one key."""
    b = bucketer(two, dims={"x": 1, "mask": 1})
    x, mask = torch.zeros(2, 20, 4), torch.ones(2, 20)
    by_position = b.plan((x, mask), {})
    by_keyword = b.plan((), {"mask": mask, "x": x})
    assert by_position is not None
    assert by_keyword is not None
    assert by_position.key == by_keyword.key


def test_plan_is_memoised_per_signature() -> None:
    """The same shapes give the same plan object (the hot path is a dict lookup)."""
    b = bucketer(two, dims={"x": 1})
    first = b.plan((torch.zeros(2, 20, 4),), {})
    assert first is b.plan((torch.ones(2, 20, 4),), {})
    assert first is not b.plan((torch.ones(2, 21, 4),), {})
    assert first is not b.plan((torch.ones(2, 20, 4, dtype=torch.float64),), {})


def test_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memo never grows past its limit."""
    monkeypatch.setattr(_buckets, "_MEMO_LIMIT", 8)
    b = bucketer(two, dims={"x": 1})
    for n in range(1, 100):
        b.plan((torch.zeros(1, n, 1),), {})
    assert len(b._memo) <= 8


def test_memo_tells_none_from_other_non_tensors() -> None:
    """mask=None (absent) and a mask that is not a tensor are not confused."""
    b = bucketer(two, dims={"x": 1, "mask": 1})
    x = torch.zeros(2, 20, 4)
    absent = b.plan((x, None), {})
    wrong = b.plan((x, [1, 2]), {})
    assert absent is not None
    assert wrong is not None
    assert absent.status == "bucketed"
    assert wrong.status == "unbucketable"
    assert wrong.reason == "mask is a list, not a tensor"


def test_mismatched_lengths_are_unbucketable() -> None:
    """x and mask must share one length; otherwise the call runs unpadded."""
    b = bucketer(two, dims={"x": 1, "mask": 1})
    args = (torch.zeros(2, 20, 4), torch.ones(2, 21))
    plan = b.plan(args, {})
    assert plan is not None
    assert (
        plan.status,
        plan.length,
        plan.size,
        plan.padded,
    ) == ("unbucketable", 21, 21, False)
    assert "x[1]=20, mask[1]=21" in (plan.reason or "")
    assert args == b.pad(plan, args, {})[0]


def test_dim_out_of_range_is_unbucketable() -> None:
    """A bucketed dim the tensor does not have: unpadded, with a reason."""
    b = bucketer(two, dims={"x": 2})
    plan = b.plan((torch.zeros(5, 3),), {})
    assert plan is not None
    assert plan.status == "unbucketable"
    assert plan.reason == "x has 2 dims; bucketed dim 2 is out of range"


@pytest.mark.parametrize(
    ("dtype", "value"),
    [(torch.bool, float("-inf")), (torch.bool, 2), (torch.int64, 0.5), (torch.int8, 300)],
)
def test_pad_value_must_fit_dtype(dtype: torch.dtype, value: float) -> None:
    """A pad value the dtype cannot hold exactly makes the call unbucketable."""
    b = bucketer(two, dims={"x": 1, "mask": 1}, pad_value={"mask": value})
    plan = b.plan((torch.zeros(2, 20, 4), torch.ones(2, 20, dtype=dtype)), {})
    assert plan is not None
    assert plan.status == "unbucketable"
    assert "pad value" in (plan.reason or "")


def test_oversize_runs_unpadded() -> None:
    """Longer than the largest size: status oversize, nothing padded."""
    b = bucketer(two, dims={"x": 1})
    args = (torch.zeros(1, 200, 4),)
    plan = b.plan(args, {})
    assert plan is not None
    assert (
        plan.status,
        plan.length,
        plan.size,
        plan.padded,
        plan.label,
    ) == ("oversize", 200, 200, False, "oversize(200)")
    assert args == b.pad(plan, args, {})[0]


# ---------------------------------------------------------------- padding


def test_pad_several_arguments_with_per_argument_values() -> None:
    """x with 0 on dim 1, a bool mask with False, a square bias with -inf on dims 1 and 2;
    a non-tensor argument is untouched."""

    def fn(x: Any, mask: Any, bias: Any, scale: float) -> Any:
        return x

    b = bucketer(
        fn,
        dims={"x": 1, "mask": -1, "bias": (1, 2)},
        pad_value={"mask": 0, "bias": float("-inf")},
    )
    x = torch.randn(2, 20, 4)
    mask = torch.ones(2, 20, dtype=torch.bool)
    bias = torch.randn(2, 20, 20)
    plan = b.plan((x, mask), {"bias": bias, "scale": 0.5})
    assert plan is not None
    (px, pmask), kw = b.pad(plan, (x, mask), {"bias": bias, "scale": 0.5})
    pbias = kw["bias"]
    assert kw["scale"] == 0.5
    assert (px.shape, pmask.shape, pbias.shape) == ((2, 32, 4), (2, 32), (2, 32, 32))
    assert torch.bool == pmask.dtype
    assert torch.equal(x, px[:, :20])
    assert bool((px[:, 20:] == 0).all())
    assert bool(pmask[:, :20].all())
    assert not bool(pmask[:, 20:].any())
    assert torch.equal(bias, pbias[:, :20, :20])
    assert bool(torch.isneginf(pbias[:, 20:, :]).all())
    assert bool(torch.isneginf(pbias[:, :, 20:]).all())


def test_pad_length_equal_to_bucket_is_no_copy() -> None:
    """A length that is already a bucket size is passed through as it is."""
    b = bucketer(two, dims={"x": 1})
    x = torch.zeros(2, 32, 4)
    plan = b.plan((x,), {})
    assert plan is not None
    assert not plan.padded
    assert b.pad(plan, (x,), {})[0][0] is x


def test_pad_refuses_arguments_that_do_not_match_the_plan() -> None:
    """pad() with another call's arguments raises PadError."""
    b = bucketer(two, dims={"x": 1})
    plan = b.plan((torch.zeros(2, 20, 4),), {})
    assert plan is not None
    with pytest.raises(PadError, match="expected shape"):
        b.pad(plan, (torch.zeros(2, 21, 4),), {})


def test_gradients_flow_through_pad_and_unpad() -> None:
    """Training works: the gradient reaches the unpadded input."""
    b = bucketer(two, dims={"x": 1})
    x = torch.randn(2, 20, 4, requires_grad=True)
    plan, padded, eager = run_padded(b, two, x, None, 3.0)
    out = b.unpad(plan, padded, b.learn_cuts(plan, padded, eager))
    out.sum().backward()
    assert x.grad is not None
    assert torch.equal(torch.full_like(x, 3.0), x.grad)


# ---------------------------------------------------------------- un-padding


class Pair(NamedTuple):
    hidden: torch.Tensor
    attn: torch.Tensor


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    pooled: torch.Tensor
    extra: list[Any]
    note: str = "ok"


def encoder(x: torch.Tensor, mask: torch.Tensor) -> Any:
    """Hidden states, a square attention map, a pooled vector, and odds and ends."""
    scores = x @ x.transpose(1, 2) + mask[:, None, :].float()
    hidden = torch.softmax(scores.masked_fill(~mask[:, None, :], -1e9), dim=-1) @ x
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return (
        Pair(hidden, scores),
        {"pooled": pooled, "mask": mask, "count": 3, "none": None},
        [Output(hidden=hidden * 2, pooled=pooled, extra=[None, 1.5])],
    )


def test_learn_and_unpad_several_outputs() -> None:
    """Tuples, namedtuples, dicts, lists, dataclasses and non-tensors come back as
    eager's, cut where padding changed the length."""
    b = bucketer(encoder, dims={"x": 1, "mask": 1}, pad_value={"mask": 0})
    x = torch.randn(3, 20, 8)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[0, 15:] = False
    plan, padded, eager = run_padded(b, encoder, x, mask)
    spec = b.learn_cuts(plan, padded, eager)
    assert spec.cuts == {
        "0.hidden": (1,),
        "0.attn": (1, 2),
        "1.mask": (1,),
        "2.0.hidden": (1,),
    }
    out = b.unpad(plan, padded, spec)
    torch.testing.assert_close(out[:2], eager[:2])
    assert type(out[0]) is Pair
    (got,), (want,) = out[2], eager[2]
    assert type(got) is Output
    torch.testing.assert_close(got.hidden, want.hidden)
    torch.testing.assert_close(got.pooled, want.pooled)
    assert (got.extra, got.note) == ([None, 1.5], "ok")


def test_square_attention_map_is_cut_on_both_dims() -> None:
    """(B, L, L) becomes (B, S, S) padded; both dims are cut back."""

    def attn(x: torch.Tensor) -> torch.Tensor:
        return x @ x.transpose(1, 2)

    b = bucketer(attn, dims={"x": 1})
    plan, padded, eager = run_padded(b, attn, torch.randn(2, 20, 8))
    spec = b.learn_cuts(plan, padded, eager)
    assert spec.cuts == {"": (1, 2)}
    assert_same(eager, b.unpad(plan, padded, spec))


def test_hidden_dim_equal_to_bucket_is_not_cut() -> None:
    """A hidden size of 32 with a bucket of 32: only the sequence dim is cut."""

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.mean(1)

    b = bucketer(fn, dims={"x": 1})
    x = torch.randn(2, 20, 32)
    plan, padded, eager = run_padded(b, fn, x)
    assert plan.size == 32
    spec = b.learn_cuts(plan, padded, eager)
    assert spec.cuts == {"0": (1,)}
    out = b.unpad(plan, padded, spec)
    assert out[0].shape == (2, 20, 32)
    assert out[1].shape == (2, 32)


def test_reduction_over_padded_dim_is_detectable() -> None:
    """A sum over the padded dim with pad value 1 keeps its shape, so nothing is cut
    and the un-padded result differs from eager: the shadow check catches it."""

    def total(x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1)

    b = bucketer(total, dims={"x": 1}, pad_value=1)
    x = torch.randn(2, 20, 4)
    plan, padded, eager = run_padded(b, total, x)
    spec = b.learn_cuts(plan, padded, eager)
    assert spec.cuts == {}
    assert spec.describe() == "nothing cut"
    out = b.unpad(plan, padded, spec)
    assert eager.shape == out.shape
    assert torch.allclose(out - eager, torch.full_like(eager, 12.0))
    assert not torch.allclose(out, eager)


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda x: x[:, 1:], "dim 1: padded run gave 31, unpadded 19"),
        (lambda x: x.flatten(1), "dim 1: padded run gave 128, unpadded 80"),
        (lambda x: (x, x) if x.shape[1] == 32 else [x, x], "padded run gave a tuple"),
        (lambda x: x.shape[1], "depends on the padded length"),
        (lambda x: {"a": x} if x.shape[1] == 32 else {"b": x}, "keys"),
        (lambda x: object(), "cannot see inside"),
    ],
)
def test_changes_that_cutting_cannot_undo_are_refused(fn: Any, match: str) -> None:
    """A shape that is not 'length unpadded, size padded', or another structure."""
    b = bucketer(fn, dims={"x": 1})
    plan, padded, eager = run_padded(b, fn, torch.randn(2, 20, 4))
    with pytest.raises(UnpadError, match=match):
        b.learn_cuts(plan, padded, eager)


def test_nothing_to_learn_when_length_is_bucket() -> None:
    """Length == size: learn_cuts says so, and unpad passes the output through."""
    b = bucketer(two, dims={"x": 1})
    x = torch.randn(2, 32, 4)
    plan, padded, eager = run_padded(b, two, x)
    with pytest.raises(ValueError, match="nothing to learn"):
        b.learn_cuts(plan, padded, eager)
    assert padded is b.unpad(plan, padded, None)


def test_spec_applies_to_other_lengths_of_its_key() -> None:
    """A cut learned at length 20 serves length 17 and 31 of the same bucket."""

    def fn(x: torch.Tensor) -> Any:
        return {"h": x.cumsum(1), "attn": x @ x.transpose(1, 2)}

    b = bucketer(fn, dims={"x": 1})
    plan, padded, eager = run_padded(b, fn, torch.randn(2, 20, 4))
    spec = b.learn_cuts(plan, padded, eager)
    for n in (17, 31):
        plan2, padded2, eager2 = run_padded(b, fn, torch.randn(2, n, 4))
        assert plan.key == plan2.key
        torch.testing.assert_close(b.unpad(plan2, padded2, spec), eager2)


def test_unpad_refuses_other_key_or_shape_or_structure() -> None:
    """A spec is bound to its key, and an output must look exactly as learned."""
    b = bucketer(two, dims={"x": 1})
    plan, padded, eager = run_padded(b, two, torch.randn(2, 20, 4))
    spec = b.learn_cuts(plan, padded, eager)
    other = b.plan((torch.randn(3, 20, 4),), {})
    assert other is not None
    with pytest.raises(UnpadError, match="made for bucket 32 with other shapes"):
        b.unpad(other, torch.zeros(3, 32, 4), spec)
    with pytest.raises(UnpadError, match=r"has shape \(2, 32, 5\)"):
        b.unpad(plan, torch.zeros(2, 32, 5), spec)
    with pytest.raises(UnpadError, match=r"output is a tuple, expected a tensor"):
        b.unpad(plan, (padded,), spec)
    with pytest.raises(UnpadError, match="not known yet"):
        b.unpad(plan, padded, None)


def test_a_saved_cut_is_used_only_when_it_fits_its_bucket() -> None:
    """A cut saved by an earlier process serves again, but one that is malformed, does
    not fit the bucket, or keeps the padding of an axis it never cuts is refused."""
    b = bucketer(two, dims={"x": 1})
    plan, padded, eager = run_padded(b, two, torch.randn(2, 20, 4))
    saved = b.learn_cuts(plan, padded, eager).saved()
    assert_same(eager, b.unpad(plan, padded, b.restored_cuts(plan, padded, saved)))
    [[path, shape, dims, contiguous]] = saved
    refused = [
        ([[path, shape, [], contiguous]], "keeps padding"),
        ([[path, shape, [[1, 0], [1, 0]], contiguous]], "not a distinct dim"),
        ([[path, shape, [[2, 0]], contiguous]], "does not fit"),
        ([[1, shape, dims, contiguous]], "path is text"),
        ([[path, [2.0, 32, 4], dims, contiguous]], "not a list of sizes"),
    ]
    for bad, match in refused:
        with pytest.raises(UnpadError, match=match):
            b.restored_cuts(plan, padded, bad)


def test_output_square_only_when_padded_is_cut_once() -> None:
    """x @ w with a hidden size of 32 and a bucket of 32 gives (B, 32, 32) padded: only
    dim 1 was the length unpadded, so dim 2 is never cut."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w  # (B, L, 32) with w (4, 32)

    b = bucketer(fn, dims={"x": 1})
    w = torch.randn(4, 32)
    plan, padded, eager = run_padded(b, fn, torch.randn(2, 20, 4), w)
    spec = b.learn_cuts(plan, padded, eager)
    assert spec.cuts == {"": (1,)}
    assert b.unpad(plan, padded, spec).shape == (2, 20, 32)


def test_unpadded_output_keeps_eager_layout() -> None:
    """Cut outputs are contiguous like eager's (so .view() works); a view when the cut
    is contiguous anyway (batch of one), no copy."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    b = bucketer(fn, dims={"x": 1})
    plan, padded, eager = run_padded(b, fn, torch.randn(2, 20, 4))
    out = b.unpad(plan, padded, b.learn_cuts(plan, padded, eager))
    assert out.is_contiguous()
    assert out.view(2, -1).shape == (2, 80)
    plan, padded, eager = run_padded(b, fn, torch.randn(1, 20, 4))
    out = b.unpad(plan, padded, b.learn_cuts(plan, padded, eager))
    assert out.is_contiguous()
    assert padded.data_ptr() == out.data_ptr()


def test_model_output_like_dataclass_dict() -> None:
    """A dataclass that is also an OrderedDict (like transformers' ModelOutput) keeps
    its attribute and item views in step."""

    @dataclasses.dataclass
    class ModelOutput(collections.OrderedDict[str, Any]):
        logits: torch.Tensor | None = None
        hidden: torch.Tensor | None = None

        def __post_init__(self) -> None:
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                if value is not None:
                    self[f.name] = value

    def fn(x: torch.Tensor) -> ModelOutput:
        return ModelOutput(logits=x * 3)

    b = bucketer(fn, dims={"x": 1})
    plan, padded, eager = run_padded(b, fn, torch.randn(2, 20, 4))
    out = b.unpad(plan, padded, b.learn_cuts(plan, padded, eager))
    assert type(out) is ModelOutput
    assert out.logits is not None
    assert out.logits.shape == (2, 20, 4)
    assert out["logits"] is out.logits
    assert out.hidden is None


def test_bucketed_batch_dim() -> None:
    """Bucketing dim 0 (batch) pads and cuts the batch."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.relu()

    b = bucketer(fn, dims={"x": 0})
    plan, padded, eager = run_padded(b, fn, torch.randn(5, 3))
    assert padded.shape == (16, 3)
    assert_same(eager, b.unpad(plan, padded, b.learn_cuts(plan, padded, eager)))


# ---------------------------------------------------------------- declared outputs


def test_declared_outputs_cut_without_eager() -> None:
    """With outputs=..., the cut is known from the padded output alone, even when the
    first call's length is the bucket size, and serves shorter calls of the key."""

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x @ x.transpose(1, 2)

    b = bucketer(fn, dims={"x": 1}, outputs={"0": 1, "1": (1, -1)})
    plan, padded, _ = run_padded(b, fn, torch.randn(2, 32, 4))
    assert not plan.padded
    spec = b.declared_cuts(plan, padded)
    assert spec.cuts == {"0": (1,), "1": (1, 2)}
    assert spec.source == "declared"
    plan2, padded2, eager2 = run_padded(b, fn, torch.randn(2, 20, 4))
    torch.testing.assert_close(b.unpad(plan2, padded2, spec), eager2)


def test_declared_outputs_must_match_what_padding_changed() -> None:
    """A declaration that contradicts the learned cut is refused at learning."""

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x @ x.transpose(1, 2)

    b = bucketer(fn, dims={"x": 1}, outputs=1)  # wrong for the square map
    plan, padded, eager = run_padded(b, fn, torch.randn(2, 20, 4))
    with pytest.raises(UnpadError, match=r"cuts output.1 at dims \[1\].*changed dims \[1, 2\]"):
        b.learn_cuts(plan, padded, eager)
    good = bucketer(fn, dims={"x": 1}, outputs={"0": 1, "1": (1, 2)})
    assert good.learn_cuts(plan, padded, eager).cuts == {"0": (1,), "1": (1, 2)}


def test_declared_dim_must_have_bucket_size() -> None:
    """Declaring a hidden dim as padded is caught at once."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    b = bucketer(fn, dims={"x": 1}, outputs=2)
    plan, padded, _ = run_padded(b, fn, torch.randn(2, 20, 4))
    with pytest.raises(UnpadError, match="has 4 there, not the bucket size 32"):
        b.declared_cuts(plan, padded)


def test_declared_unknown_path_is_refused() -> None:
    """A path the output does not have is named."""

    def fn(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": x}

    b = bucketer(fn, dims={"x": 1}, outputs={"hidden": 1})
    plan, padded, _ = run_padded(b, fn, torch.randn(2, 20, 4))
    with pytest.raises(UnpadError, match=r"names \['hidden'\].*paths are \['h'\]"):
        b.declared_cuts(plan, padded)
    with pytest.raises(ValueError, match="must be learned"):
        bucketer(fn, dims={"x": 1}).declared_cuts(plan, padded)


# ---------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    lengths=st.lists(st.integers(1, 128), min_size=1, max_size=6),
    pad=st.sampled_from([0, 1, -3.5]),
)
def test_pad_then_unpad_equals_eager(batch: int, lengths: list[int], pad: float) -> None:
    """For a function that works position by position, padded-and-cut == eager."""

    def fn(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(x) * mask[..., None], mask.cumsum(1)

    b = bucketer(fn, dims={"x": 1, "mask": 1}, pad_value=pad)
    specs: dict[Any, Any] = {}
    for n in lengths:
        x, mask = torch.randn(batch, n, 3), torch.randint(0, 2, (batch, n)).float()
        plan, padded, eager = run_padded(b, fn, x, mask)
        assert plan.size == min(s for s in SIZES if s >= n)
        if not plan.padded:
            assert_same(eager, b.unpad(plan, padded, None))
            continue
        spec = specs.setdefault(plan.key, b.learn_cuts(plan, padded, eager))
        assert_same(eager, b.unpad(plan, padded, spec))


def test_compiled_graphs_bounded_by_buckets() -> None:
    """Many random lengths through torch.compile(dynamic=False): at most one graph per
    bucket (a counting backend; no inductor)."""
    from torch._dynamo.testing import CompileCounter

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2

    counter = CompileCounter()
    compiled = torch.compile(fn, backend=counter, dynamic=False)
    b = bucketer(fn, dims={"x": 1})
    gen = torch.Generator().manual_seed(0)
    keys = set()
    torch._dynamo.reset()
    try:
        for n in torch.randint(1, 129, (40,), generator=gen).tolist():
            x = torch.randn(2, n, 4)
            plan = b.plan((x,), {})
            assert plan is not None
            keys.add(plan.key)
            (px,), _ = b.pad(plan, (x,), {})
            padded = compiled(px)
            if plan.padded:
                spec = b.learn_cuts(plan, padded, fn(x))
                assert_same(fn(x), b.unpad(plan, padded, spec))
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == len(keys) <= len(SIZES)


# ---------------------------------------------------------------- warmup helpers


def test_warmup_lengths_pad_by_one_where_possible() -> None:
    """size - 1 when it falls in the same bucket, else the size itself."""
    assert bucketer(two, dims={"x": 1}).warmup_lengths() == (15, 31, 63, 127)
    assert bucketer(two, dims={"x": 1}, sizes=(1, 2, 4, 8)).warmup_lengths() == (1, 2, 3, 7)


def test_resize_cuts_and_tiles_bucketed_dims() -> None:
    """An example is cut or tiled to a length; other arguments are untouched."""
    b = bucketer(two, dims={"x": 1, "mask": -1})
    x = torch.arange(10.0).reshape(1, 10, 1)
    mask = torch.ones(1, 10, dtype=torch.bool)
    (rx, rmask, scale), _ = b.resize((x, mask, 2.0), {}, 4)
    assert rx.flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert (rmask.shape, scale) == ((1, 4), 2.0)
    (rx,), kw = b.resize((x,), {"mask": mask}, 25)
    assert rx.flatten().tolist() == [float(i % 10) for i in range(25)]
    assert kw["mask"].shape == (1, 25)
    assert bool(kw["mask"].all())


def test_resize_refuses_an_unbucketable_example() -> None:
    """A bucketed argument that is not a tensor cannot be resized."""
    b = bucketer(two, dims={"x": 1, "mask": 1})
    with pytest.raises(PadError, match="mask is a list"):
        b.resize((torch.zeros(1, 3, 1), [1]), {}, 8)


def test_warmup_reaches_every_bucket_and_checks_padding() -> None:
    """One example, resized to each warmup length: every bucket is planned padded, its
    cut learned and (for a harmless function) equal to eager; a harmful one is caught."""

    def fn(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x.cumsum(1) * mask[..., None]

    def harmful(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x.softmax(1)  # no masking: padded positions take probability mass

    example = (torch.randn(2, 20, 3), torch.ones(2, 20))
    for f, faithful in ((fn, True), (harmful, False)):
        b = bucketer(f, dims={"x": 1, "mask": 1})
        sizes = []
        for n in b.warmup_lengths():
            args, kwargs = b.resize(example, {}, n)
            plan, padded, eager = run_padded(b, f, *args, **kwargs)
            assert plan.padded
            sizes.append(plan.size)
            out = b.unpad(plan, padded, b.learn_cuts(plan, padded, eager))
            assert torch.allclose(out, eager) is faithful
        assert tuple(sizes) == SIZES
