"""Warmup ahead of traffic (blocking and background) and persisted verdicts across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from safecompile import Buckets, EventKind, Reason, State, Warmup, pow2, safe_compile
from safecompile.testing import BlockingBackend, FailingBackend, RecordingBackend


def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_blocking_warmup_compiles_every_bucket_before_traffic() -> None:
    """With buckets, warmup compiles each size; live traffic then compiles nothing."""
    backend = RecordingBackend()
    sizes = pow2(4, 32)
    g = safe_compile(
        scale,
        backend=backend,
        buckets=Buckets(dims={"x": 1}, sizes=sizes, strategy="pad"),
        warmup=Warmup(inputs=[(torch.randn(2, 10),)]),
    )
    assert backend.compiles == len(sizes)
    assert g.safecompile.stats().calls == 0  # warmup is not traffic
    assert g.safecompile.state in (State.CANARY, State.COMPILED)
    for length in range(1, 33):
        x = torch.randn(2, length)
        torch.testing.assert_close(g(x), scale(x))
    assert backend.compiles == len(sizes)
    assert g.safecompile.stats().eager_calls == 0


def test_warmup_method_compiles_now() -> None:
    """controller.warmup(*args) compiles that shape, blocking, without counting a call."""
    backend = RecordingBackend()
    g = safe_compile(scale, backend=backend, shadow=None)
    g.safecompile.warmup(torch.randn(3))
    assert backend.compiles == 1
    assert g.safecompile.state == State.COMPILED
    assert g.safecompile.stats().calls == 0


def test_background_warmup_never_blocks_the_first_call() -> None:
    """While the worker compiles, calls are served eager at once; then compiled takes over."""
    backend = BlockingBackend()
    x = torch.randn(4)
    g = safe_compile(
        scale, backend=backend, shadow=None, warmup=Warmup(inputs=[(x,)], background=True)
    )
    assert backend.started.wait(30)
    assert g.safecompile.state == State.WARMING
    torch.testing.assert_close(g(x), scale(x))  # served while the compile is stuck
    assert g.safecompile.stats().eager_calls == 1
    assert not g.safecompile.wait_warm(0)
    backend.release()
    assert g.safecompile.wait_warm(30)
    g(x)
    assert g.safecompile.stats().compiled_calls == 1
    assert backend.compiles == 1


def test_background_warmup_error_is_recorded() -> None:
    """Example inputs that fail in eager too are reported as an event; eager keeps serving."""
    g = safe_compile(
        scale,
        backend="eager",
        warmup=Warmup(inputs=lambda: [("not a tensor",)], background=True),
    )
    assert g.safecompile.wait_warm(30)
    kinds = [e.kind for e in g.safecompile.events()]
    assert EventKind.WARMUP_FAILED in kinds
    torch.testing.assert_close(g(torch.ones(2)), scale(torch.ones(2)))


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """SAFECOMPILE_CACHE_DIR in a temp folder; torch's cache env var restored after."""
    monkeypatch.setenv("SAFECOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path


def flaky_model(x: torch.Tensor) -> torch.Tensor:
    return x.cos() * 3


def test_known_compile_failure_is_not_retried_after_restart(cache_dir: Path) -> None:
    """A compile failure is persisted; a restarted process trips without compiling again."""
    first = FailingBackend()
    g1 = safe_compile(flaky_model, backend=first, name="m.flaky")
    g1(torch.randn(3))
    assert first.compiles == 1
    assert list((cache_dir / "verdicts").rglob("*.json"))

    second = FailingBackend()  # a "restart": a fresh guard of the same code
    g2 = safe_compile(flaky_model, backend=second, name="m.flaky")
    torch.testing.assert_close(g2(torch.ones(3)), flaky_model(torch.ones(3)))
    assert second.compiles == 0
    assert g2.safecompile.state == State.ROLLED_BACK
    last = g2.safecompile.stats().last_rollback
    assert last is not None
    assert last.reason == Reason.COMPILE_ERROR
    assert "known compile failure" in (last.message or "")

    g2.safecompile.reset()  # forgets the verdict: compiles (and fails) again
    g2(torch.ones(3))
    assert second.compiles == 1


def other_model(x: torch.Tensor) -> torch.Tensor:
    return x.cos() * 4


def test_changed_code_is_compiled_again(cache_dir: Path) -> None:
    """A verdict is keyed by the code: different code compiles afresh."""
    g1 = safe_compile(flaky_model, backend=FailingBackend())
    g1(torch.randn(3))
    backend = FailingBackend()  # the same backend: only the code differs
    g2 = safe_compile(other_model, backend=backend)
    g2(torch.randn(3))
    assert backend.compiles == 1  # tried, not blocked by flaky_model's verdict
    last = g2.safecompile.stats().last_rollback
    assert last is not None
    assert "known compile failure" not in (last.message or "")


def test_corrupt_verdict_file_is_ignored(cache_dir: Path) -> None:
    """A corrupt verdict is ignored (never trusted, never fatal)."""
    g1 = safe_compile(flaky_model, backend=FailingBackend())
    g1(torch.randn(3))
    for path in (cache_dir / "verdicts").rglob("*.json"):
        path.write_text("{ not json")
    backend = RecordingBackend()
    g2 = safe_compile(flaky_model, backend=backend)
    torch.testing.assert_close(g2(torch.ones(3)), flaky_model(torch.ones(3)))
    assert backend.compiles == 1
