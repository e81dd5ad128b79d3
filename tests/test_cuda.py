"""On a CUDA GPU: inductor, CUDA graphs, async checks, bf16 and a decoder generating.

Skipped without a GPU (the ``cuda`` marker, tests/conftest.py); ``bench/gpu.sh`` runs
them. Each compiles with real inductor (also marked ``inductor``), on tiny models, so
the whole file takes a few minutes on one GPU. Outputs are cloned as soon as they are
returned: under CUDA graphs the next replay rewrites them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zoo

from safecompile import Buckets, EventKind, Shadow, State, pow2, safe_compile
from safecompile.testing import DriftingBackend, drain_shadow_checks

pytestmark = [pytest.mark.cuda, pytest.mark.inductor]

DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.cuda.synchronize()


class Net(torch.nn.Module):
    """Two linear layers over the last dim: any (batch, seq) shape, no cross-position mixing."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def net(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return Net().to(DEVICE, dtype).eval()


def skipped(guarded: Any) -> list[str | None]:
    return [e.message for e in guarded.safecompile.events() if e.kind is EventKind.SHADOW_SKIPPED]


def assert_checked_clean(guarded: Any) -> None:
    stats = guarded.safecompile.stats()
    assert stats.shadow_checks > 0
    assert stats.shadow_breaches == 0, stats.last_rollback
    assert stats.shadow_skipped == 0, skipped(guarded)
    assert stats.rollbacks == 0, stats.last_rollback


def test_inductor_default_on_cuda_is_checked_and_equals_eager() -> None:
    model = net()
    reference = copy.deepcopy(model)
    guarded = safe_compile(model, backend="inductor", shadow=Shadow(canary=4, every=1))
    with torch.no_grad():
        for batch in (8, 8, 8, 8, 16):
            x = torch.randn(batch, 32, 64, device=DEVICE)
            torch.testing.assert_close(guarded(x).clone(), reference(x), rtol=1e-4, atol=1e-4)
    assert_checked_clean(guarded)
    assert guarded.safecompile.state in (State.COMPILED, State.CANARY)


def test_reduce_overhead_with_padded_buckets_keeps_eagers_results() -> None:
    """CUDA graphs need static shapes: ``strategy="auto"`` pads the sequence to pow2
    sizes; each bucket is verified against unpadded eager; results stay eager's."""
    model = net()
    reference = copy.deepcopy(model)
    guarded = safe_compile(
        model,
        backend="inductor",
        mode="reduce-overhead",
        buckets=Buckets(dims={"x": 1}, sizes=pow2(16, 128)),
        shadow=Shadow(canary=2, every=4),
    )
    with torch.no_grad():
        for seq in (10, 16, 33, 100, 20, 64, 10, 100, 50, 7):
            x = torch.randn(4, seq, 64, device=DEVICE)
            got = guarded(x).clone()
            torch.testing.assert_close(got, reference(x), rtol=1e-4, atol=1e-4)
    report = guarded.safecompile.report()
    assert report["bucketing"]["strategy"] == "pad", report["bucketing"]
    assert_checked_clean(guarded)


def test_async_checks_under_cuda_graphs_compare_each_calls_own_output() -> None:
    """Async checks run after later replays rewrote the pool: each compares the copy
    of its own call's output, so no false breach."""
    model = net()
    guarded = safe_compile(
        model,
        backend="inductor",
        mode="reduce-overhead",
        dynamic=False,
        shadow=Shadow(canary=8, every=1, mode="async"),
    )
    with torch.no_grad():
        for i in range(12):
            guarded(torch.full((8, 16, 64), 0.01 * i, device=DEVICE))
    drain_shadow_checks()
    assert_checked_clean(guarded)


def test_bf16_under_inductor_passes_default_tolerances_and_drift_is_caught() -> None:
    """bf16 rounding differs between fused kernels and eager: within the per-dtype
    defaults, no false trip; a 2% drift is still caught."""
    guarded = safe_compile(
        net(torch.bfloat16), backend="inductor", shadow=Shadow(canary=8, every=1)
    )
    with torch.no_grad():
        for _ in range(8):
            guarded(torch.randn(8, 32, 64, device=DEVICE, dtype=torch.bfloat16))
    assert_checked_clean(guarded)
    drifting = safe_compile(
        net(torch.bfloat16),
        backend=DriftingBackend(scale=1.02),
        shadow=Shadow(canary=8, every=1),
    )
    with torch.no_grad():
        drifting(torch.randn(8, 32, 64, device=DEVICE, dtype=torch.bfloat16))
    assert drifting.safecompile.state is State.ROLLED_BACK


def test_training_under_cuda_graphs_gives_eagers_gradients() -> None:
    """reduce-overhead while training, a warmup first (its outputs are dropped, so the
    guard marks a new step): every step's gradients are eager's."""
    model = net().train()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16, 64, device=DEVICE)
    guarded = safe_compile(
        model, backend="inductor", mode="reduce-overhead", shadow=Shadow(canary=2, every=0)
    )
    guarded.safecompile.warmup(x)
    for _ in range(4):
        for m in (guarded, reference):
            m.zero_grad(set_to_none=True)
            m(x).pow(2).mean().backward()
        for (name, expected), got in zip(
            reference.named_parameters(), model.parameters(), strict=True
        ):
            torch.testing.assert_close(got.grad, expected.grad, rtol=1e-4, atol=1e-4, msg=name)
    assert guarded.safecompile.stats().rollbacks == 0


def _generate(module: torch.nn.Module, **options: Any) -> torch.Tensor:
    _, kwargs = zoo.text_inputs(2, 6, mask=False)
    ids = kwargs["input_ids"].to(DEVICE)
    with torch.no_grad():
        out: torch.Tensor = module.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=zoo.VOCAB - 1,
            **options,
        )
    return out


@pytest.mark.parametrize(("mode", "cache"), [(None, "dynamic"), ("reduce-overhead", "static")])
def test_a_small_decoder_generates_eagers_tokens_with_every_graph_checked(
    mode: str | None, cache: str
) -> None:
    """GPT-2 (tiny, random weights) generating on the GPU: a DynamicCache under inductor,
    a StaticCache under CUDA graphs; tokens are eager's and no graph goes unchecked."""
    model = zoo.gpt2(dropout=0.0).module.to(DEVICE)
    reference = copy.deepcopy(model)
    guarded = safe_compile(model, backend="inductor", mode=mode, shadow=Shadow(canary=8, every=64))
    options = {} if cache == "dynamic" else {"cache_implementation": "static"}
    torch.testing.assert_close(_generate(guarded, **options), _generate(reference, **options))
    stats = guarded.safecompile.stats()
    assert stats.shadow_checks > 0
    assert stats.shadow_skipped == 0, skipped(guarded)
    assert stats.rollbacks == 0, stats.last_rollback
    assert guarded.safecompile.state is not State.UNCHECKED
