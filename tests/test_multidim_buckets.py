"""Buckets over several independent lengths (batch x seq), strategy="auto", frozen policies."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
from torch import nn

from safecompile import Buckets, ConfigError, EventKind, Rollback, Warmup, pow2, safe_compile
from safecompile.base import torchcompat
from safecompile.shapes.buckets import Bucketer, resolve_strategy
from safecompile.testing import RecordingBackend

BATCH = pow2(1, 4)  # 1, 2, 4
SEQ = pow2(4, 16)  # 4, 8, 16
DIMS = {"x": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}}
# 9 padded graphs of one function: past dynamo's global recompile limit of 8 without a
# per-function one (2.9.1, 2.11), where the ninth runs eager
NINE_GRAPHS = pytest.mark.skipif(
    not torchcompat.per_function_limit(9),
    reason="no per-function recompile limit in this torch: 8 graphs compile, the 9th runs eager",
)


def named(**options: Any) -> Buckets:
    """Batch and sequence bucketed independently."""
    options.setdefault("dims", DIMS)
    options.setdefault("sizes", {"batch": BATCH, "seq": SEQ})
    return Buckets(**options)


class Encoder(nn.Module):
    """Token-wise projection and a masked mean: outputs (B, S, 8) and (B, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.proj(x)) * mask.unsqueeze(-1)
        pooled = h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return h, pooled


def batch(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(b, s, 6)
    mask = torch.ones(b, s)
    mask[0, s // 2 :] = 0  # one padded row, so the mask matters
    return x, mask


def traffic(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, BATCH[-1]), rng.randint(1, SEQ[-1])) for _ in range(n)]


def guarded(strategy: str, **options: Any) -> tuple[nn.Module, nn.Module, RecordingBackend]:
    torch.manual_seed(0)
    model = Encoder().eval()
    reference = Encoder().eval()
    reference.load_state_dict(model.state_dict())
    backend = RecordingBackend()
    options.setdefault("shadow", None)
    options.setdefault("buckets", named(strategy=strategy))
    g = safe_compile(model, backend=backend, **options)
    return g, reference, backend


# ---------------------------------------------------------------- through the guard


@pytest.mark.parametrize("strategy", ["pad", "dynamic"])
def test_batch_by_seq_traffic_bounded_graphs_and_eager_results(strategy: str) -> None:
    """30 random (batch, seq) calls: every output equals unpadded eager's, in shape and
    value, and the graphs the backend sees stay within the bound of the buckets: the
    product of the counts (padding), plus torch's own 0/1 specialisations (dynamic)."""
    g, reference, backend = guarded(strategy)
    policy = named(strategy=strategy)
    for b, s in traffic(30):
        x, mask = batch(b, s)
        h, pooled = g(x, mask)
        eh, epooled = reference(x, mask)
        assert h.shape == (b, s, 8)
        assert pooled.shape == (b, 8)
        torch.testing.assert_close(h, eh)
        torch.testing.assert_close(pooled, epooled)
    stats = g.safecompile.stats()
    assert backend.compiles == stats.compiles
    assert backend.compiles <= policy.max_graphs(strategy)
    if strategy == "pad":
        assert policy.max_graphs("pad") == len(BATCH) * len(SEQ) == 9
    else:  # no padded work at all
        assert policy.max_graphs("dynamic") == (len(BATCH) + 1) * (len(SEQ) + 2)
        assert all(e["padded_calls"] == 0 for e in g.safecompile.report()["buckets"].values())
    assert stats.calls == 30


@NINE_GRAPHS
def test_padded_graphs_are_one_per_combination_of_sizes() -> None:
    """Every combination reached at least once with pad: exactly one graph each, no more
    (whichever axes a call pads or fits exactly)."""
    g, reference, backend = guarded("pad")
    for b in (1, 2, 3, 4):
        for s in (3, 4, 7, 8, 9, 16):
            x, mask = batch(b, s)
            torch.testing.assert_close(g(x, mask), reference(x, mask))
    assert backend.compiles == len(BATCH) * len(SEQ)


def test_outputs_are_cut_per_axis_learned() -> None:
    """Learned: h is cut on dims 0 (batch) and 1 (seq), pooled on dim 0 (batch) only."""
    g, reference, _ = guarded("pad")
    x, mask = batch(3, 10)
    torch.testing.assert_close(g(x, mask), reference(x, mask))
    report = g.safecompile.report()["buckets"]
    (entry,) = [e for label, e in report.items() if label.startswith("batch=4,seq=16 ")]
    assert entry["status"] == "ready"
    assert entry["cut"] == "output.0 dims [0:batch, 1:seq]; output.1 dims [0:batch]"


def test_outputs_are_cut_per_axis_declared() -> None:
    """Declared per axis: cut without learning; a wrong axis rejects the bucket, and
    eager's result is returned."""
    right = {"0": {0: "batch", 1: "seq"}, "1": {0: "batch"}}
    g, reference, _ = guarded("pad", buckets=named(strategy="pad", outputs=right))
    x, mask = batch(3, 10)
    torch.testing.assert_close(g(x, mask), reference(x, mask))
    cut = next(iter(g.safecompile.report()["buckets"].values()))["cut"]
    assert cut == "output.0 dims [0:batch, 1:seq]; output.1 dims [0:batch]"

    wrong = {"0": {0: "batch", 1: "seq"}, "1": {0: "seq"}}  # pooled's dim 0 is batch (4), not 16
    bad, reference, _ = guarded("pad", buckets=named(strategy="pad", outputs=wrong))
    torch.testing.assert_close(bad(x, mask), reference(x, mask))
    rejected = [e for e in bad.safecompile.events() if e.kind == EventKind.BUCKET_REJECTED]
    assert len(rejected) == 1
    assert "not the bucket size seq=16" in (rejected[0].message or "")


@pytest.mark.parametrize("strategy", [pytest.param("pad", marks=NINE_GRAPHS), "dynamic"])
def test_warmup_compiles_the_product_and_traffic_compiles_nothing(strategy: str) -> None:
    """One example; warmup compiles every combination of sizes (and, for dynamic ranges,
    torch's length-1 specialisations), so random traffic compiles nothing more."""
    torch.manual_seed(0)
    backend = RecordingBackend()
    model = Encoder().eval()
    reference = Encoder().eval()
    reference.load_state_dict(model.state_dict())
    g = safe_compile(
        model,
        backend=backend,
        shadow=None,
        buckets=named(strategy=strategy),
        warmup=Warmup(inputs=[batch(3, 10)]),
    )
    warmed = backend.compiles
    if strategy == "pad":
        assert warmed == len(BATCH) * len(SEQ)
    else:  # ranges: batch 1, 2, 3..4 x seq 2..4, 5..8, 9..16, and seq 1
        assert 0 < warmed <= len(BATCH) * (len(SEQ) + 1)  # torch may fold some together
    assert g.safecompile.stats().calls == 0
    for b, s in traffic(40, seed=1):
        x, mask = batch(b, s)
        torch.testing.assert_close(g(x, mask), reference(x, mask))
    assert backend.compiles == warmed
    if strategy == "pad":  # every padded key was verified by warmup: no eager on traffic
        assert all(e["status"] == "ready" for e in g.safecompile.report()["buckets"].values())


def test_labels_in_plans_reports_and_events() -> None:
    """Labels name each axis: "batch=4,seq=16" in the report, compile events and
    bucketing summary; the resolved strategy is in the report."""
    g, _, _ = guarded("pad")
    g(*batch(3, 10))
    report = g.safecompile.report()
    assert any(
        label.startswith("batch=4,seq=16 (batch 3, seq 10) [") for label in report["buckets"]
    )
    compiled = [e for e in g.safecompile.events() if e.kind == EventKind.COMPILED]
    assert compiled
    assert all((e.bucket or "").startswith("batch=4,seq=16") for e in compiled)
    assert report["bucketing"] == {
        "strategy": "pad",
        "requested": "pad",
        "axes": {"batch": list(BATCH), "seq": list(SEQ)},
        "buckets": 9,
    }
    b = Bucketer(named(strategy="pad"), Encoder())
    plan = b.plan(batch(3, 10), {})
    assert plan is not None
    assert (plan.label, plan.lengths, plan.sizes) == ("batch=4,seq=16", (3, 10), (4, 16))
    too_long = b.plan(batch(5, 10), {})
    assert too_long is not None
    assert (too_long.status, too_long.label) == ("oversize", "oversize(batch=5,seq=10)")


def test_oversize_on_any_axis() -> None:
    """Past the largest size of either axis: eager by default, its own graph with
    oversize="compile"."""
    for oversize, compiles in (("eager", 0), ("compile", 1)):
        torch.manual_seed(0)
        backend = RecordingBackend()
        model = Encoder().eval()
        g = safe_compile(
            model, backend=backend, shadow=None, buckets=named(strategy="pad", oversize=oversize)
        )
        for b, s in ((5, 5), (2, 20)):
            x, mask = batch(b, s)
            assert g(x, mask)[0].shape == (b, s, 8)
        assert backend.compiles == compiles * 2


def test_axis_lengths_that_disagree_are_unbucketable() -> None:
    """x and mask must agree on each axis; otherwise the call runs unpadded, with a reason
    naming the axis."""
    b = Bucketer(named(strategy="pad"), Encoder())
    plan = b.plan((torch.zeros(3, 10, 6), torch.ones(3, 11)), {})
    assert plan is not None
    assert plan.status == "unbucketable"
    assert plan.reason == "bucketed dims of axis 'seq' have different lengths: x[1]=10, mask[1]=11"


def test_equal_sizes_and_lengths_are_ambiguous_until_they_differ() -> None:
    """Two padded axes with one size and one length cannot tell their dims apart: the cut
    serves that call only; the guard verifies again until a call tells them apart."""

    def square(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).contiguous() * 2

    policy = Buckets(dims={"x": {0: "a", 1: "b"}}, sizes={"a": (8,), "b": (8,)}, strategy="pad")
    b = Bucketer(policy, square)
    x = torch.randn(5, 5)
    plan = b.plan((x,), {})
    assert plan is not None
    (px,), _ = b.pad(plan, (x,), {})
    assert b.learn_cuts(plan, square(px), square(x)).ambiguous
    y = torch.randn(5, 6)
    plan2 = b.plan((y,), {})
    assert plan2 is not None
    (py,), _ = b.pad(plan2, (y,), {})
    spec = b.learn_cuts(plan2, square(py), square(y))
    assert not spec.ambiguous
    assert spec.cut_axes == {"": ((0, "b"), (1, "a"))}

    g = safe_compile(square, backend="eager", shadow=None, buckets=policy)
    for shape in ((5, 5), (5, 6), (6, 5)):
        t = torch.randn(*shape)
        torch.testing.assert_close(g(t), square(t))
    entries = g.safecompile.report()["buckets"]
    assert [e["status"] for e in entries.values()] == ["ready"]


def test_dynamic_marks_each_axis_and_leaves_the_callers_tensors_unmarked() -> None:
    """strategy="dynamic": one range's graph serves other lengths of the same ranges;
    the caller's tensors carry no dynamo marks afterwards."""
    g, reference, backend = guarded("dynamic")
    x, mask = batch(3, 10)
    g(x, mask)
    assert not hasattr(x, "_dynamo_dynamic_indices")
    first = backend.compiles
    for b, s in ((4, 9), (3, 16), (4, 12)):  # batch 3..4, seq 9..16: the same ranges
        x, mask = batch(b, s)
        torch.testing.assert_close(g(x, mask), reference(x, mask))
    assert backend.compiles == first


# ---------------------------------------------------------------- strategy="auto"


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, "dynamic"),
        ({"mode": "reduce-overhead"}, "pad"),
        ({"mode": "max-autotune"}, "pad"),
        ({"mode": "max-autotune-no-cudagraphs"}, "dynamic"),
        ({"mode": "default"}, "dynamic"),
        ({"options": {"triton.cudagraphs": True}}, "pad"),
        ({"backend": "cudagraphs"}, "pad"),
        ({"backend": "aot_eager"}, "dynamic"),
        ({"dynamic": False}, "pad"),
        ({"dynamic": True}, "dynamic"),
    ],
)
def test_auto_resolves_by_what_the_backend_needs(options: dict[str, Any], expected: str) -> None:
    """auto is pad where CUDA graphs need static shapes (or dynamic=False), else dynamic."""
    assert resolve_strategy(named(), **options) == expected
    assert resolve_strategy(named(strategy="pad"), **options) == "pad"
    assert resolve_strategy(named(strategy="dynamic"), **options) == "dynamic"


def test_auto_is_the_default_and_its_resolution_is_in_the_report() -> None:
    """Buckets() defaults to auto; safe_compile resolves it from its own options (no CUDA
    needed to decide) and report() says what it chose."""
    assert named().strategy == "auto"
    plain = safe_compile(Encoder(), backend="eager", buckets=named())
    assert plain.safecompile.report()["bucketing"]["strategy"] == "dynamic"
    assert plain.safecompile.report()["bucketing"]["requested"] == "auto"
    graphs = safe_compile(Encoder(), backend="inductor", mode="reduce-overhead", buckets=named())
    report = graphs.safecompile.report()
    assert report["bucketing"]["strategy"] == "pad"
    assert report["dynamic"] is False  # static padded shapes, as CUDA graphs need


def test_an_explicit_recompile_limit_below_the_product_is_refused() -> None:
    big = named(sizes={"batch": pow2(1, 64), "seq": pow2(16, 512)}, strategy="pad")
    assert big.bucket_count == 7 * 6
    with pytest.raises(ConfigError, match=r"below the number of bucket sizes \(42"):
        safe_compile(Encoder(), backend="eager", buckets=big, rollback=Rollback(max_recompiles=16))


def test_recompile_limit_grows_to_the_product() -> None:
    """Without an explicit Rollback, max_recompiles grows to hold every combination: all
    3 x 3 padded graphs compile, past the default limit of 8, none runs eager (torch's
    global limit raised for a torch without a per-function one)."""
    g = safe_compile(Encoder(), backend="eager", shadow=None, buckets=named(strategy="pad"))
    with torch._dynamo.config.patch(recompile_limit=64):
        g.safecompile.warmup(*batch(1, 4))
    stats = g.safecompile.stats()
    assert (stats.graphs, stats.recompile_limit_calls) == (len(BATCH) * len(SEQ), 0)
    assert EventKind.RECOMPILE_LIMIT not in [e.kind for e in g.safecompile.events()]


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"dims": {"x": {0: "batch"}, "mask": 1}}, r"mixes plain dims \('mask'\) with named axes"),
        ({"dims": {"x": {0: 1}}}, r"mapping of dim to axis name"),
        ({"dims": {"x": {"0": "batch"}}}, r"mapping of dim to axis name"),
        ({"dims": {"x": {}}}, r"mapping of dim to axis name"),
        ({"sizes": {"batch": BATCH}}, r"has no sizes for axis 'seq'"),
        ({"sizes": {"batch": BATCH, "seq": SEQ, "heads": (2,)}}, r"names axis 'heads'"),
        ({"sizes": SEQ}, r"must map each axis \('batch', 'seq'\) to its sizes"),
        ({"sizes": {"batch": BATCH, "seq": (8, 4)}}, r"for axis 'seq' must be .*increasing"),
        ({"dims": {"x": 1}, "sizes": {"seq": SEQ}}, r"dims names no axes"),
        ({"outputs": 1}, r"must say which axis each cut dim belongs to"),
        ({"outputs": {"0": {1: "heads"}}}, r"for '0' must map each output dim .* 'batch', 'seq'"),
        ({"outputs": {0: "time"}}, r"one of the axes 'batch', 'seq'"),
        ({"strategy": "static"}, r"strategy=\.\.\.\) must be one of 'auto', 'pad', 'dynamic'"),
    ],
)
def test_bad_forms_are_refused_with_a_clear_message(options: dict[str, Any], match: str) -> None:
    """Each misuse of the named form is a ConfigError naming what is wrong."""
    with pytest.raises(ConfigError, match=match):
        named(**options)


def test_one_named_axis_may_take_one_sequence_of_sizes() -> None:
    """A single named axis: sizes may be one sequence (it is that axis's)."""
    policy = Buckets(dims={"x": {1: "seq"}}, sizes=SEQ, outputs={"": {1: "seq"}})
    assert policy.sizes == {"seq": SEQ}
    assert policy == Buckets(
        dims={"x": {1: "seq"}}, sizes={"seq": list(SEQ)}, outputs={"": {1: "seq"}}
    )
    plain = Buckets(dims={"x": 1}, sizes=SEQ)
    assert plain.sizes == SEQ
    with pytest.raises(ConfigError, match="names axes"):
        Buckets(dims={"x": 1}, sizes=SEQ, outputs={1: "seq"})


# ---------------------------------------------------------------- frozen for real


def test_policy_is_frozen_hashable_and_detached_from_the_callers_dicts() -> None:
    """Equal policies hash equal; mutating the dicts passed in changes nothing; the
    stored mappings cannot be changed; repr reads like the call."""
    dims = {"x": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}}
    sizes = {"batch": list(BATCH), "seq": list(SEQ)}
    pads = {"mask": 0}
    outputs = {"0": {0: "batch", 1: "seq"}}
    policy = Buckets(dims=dims, sizes=sizes, pad_value=pads, outputs=outputs)
    same = named(pad_value={"mask": 0.0}, outputs={"0": {1: "seq", 0: "batch"}})
    assert policy == same
    assert hash(policy) == hash(same)
    assert len({policy, same}) == 1

    dims["x"][0] = "time"
    dims["y"] = 1  # type: ignore[assignment]
    sizes["seq"].append(64)
    pads["mask"] = 5
    outputs["1"] = {0: "batch"}
    assert policy == same
    assert policy.dims_of("x") == ((0, 0), (1, 1))
    assert policy.pad_for("mask") == 0

    with pytest.raises(TypeError):
        policy.dims["x"] = 2  # type: ignore[index]
    with pytest.raises(TypeError):
        policy.pad_value["mask"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.sizes = (1,)  # type: ignore[misc]
    assert repr(policy).startswith(
        "Buckets(dims={'x': {0: 'batch', 1: 'seq'}, 'mask': {0: 'batch', 1: 'seq'}}, "
        "sizes={'batch': (1, 2, 4), 'seq': (4, 8, 16)}, pad_value={'mask': 0}"
    )

    short = Buckets(dims={"x": 1, "mask": (1,)}, sizes=[16, 32], pad_value={"mask": 0})
    assert hash(short) == hash(
        Buckets(dims={"x": (1,), "mask": 1}, sizes=(16, 32), pad_value={"mask": 0})
    )
    assert short.dims == {"x": (1,), "mask": (1,)}
    assert dataclasses.replace(short, strategy="pad").dims == short.dims
    assert short != dataclasses.replace(short, strategy="pad")


def test_pad_passes_through_a_tensor_already_at_its_buckets_size() -> None:
    """With two axes, a tensor on the axis that needs no padding is not copied; keyword
    arguments are padded in a new dict, the caller's left as it was."""

    def fn(x: torch.Tensor, pos: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x

    b = Bucketer(
        Buckets(
            dims={"x": {0: "batch", 1: "seq"}, "pos": {0: "seq"}, "scale": {0: "batch"}},
            sizes={"batch": (2, 4), "seq": (8, 16)},
        ),
        fn,
    )
    x, pos, scale = torch.ones(4, 5), torch.arange(5), torch.ones(4)
    kwargs = {"scale": scale}
    plan = b.plan((x, pos), kwargs)
    assert plan is not None
    assert plan.sizes == (4, 8)

    (px, ppos), pkw = b.pad(plan, (x, pos), kwargs)

    assert px.shape == (4, 8)
    assert ppos.shape == (8,)
    assert pkw["scale"] is scale  # already 4 on the batch axis: no copy
    assert kwargs == {"scale": scale}
