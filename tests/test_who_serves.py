"""The state says who serves: most recent calls eager reads ``mostly_eager``, a callable
dynamo made no graph of reads ``nothing_to_compile``, and every eager call is counted
under exactly one why (``Stats.eager_by_reason`` sums to ``eager_calls``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import safecompile
from safecompile import Buckets, Rollback, State, safe_compile
from safecompile.base.model import EAGER_REASONS
from safecompile.testing import FakeClock, RuntimeFailingBackend


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


def same(x: torch.Tensor) -> torch.Tensor:
    return x


class _Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def torch_warnings() -> Iterator[_Caught]:
    """What dynamo's frame converter warns (its recompile-limit warning)."""
    caught = _Caught()
    logger = logging.getLogger("torch._dynamo.convert_frame")
    logger.addHandler(caught)
    try:
        yield caught
    finally:
        logger.removeHandler(caught)


def _by_reason(**counts: int) -> dict[str, int]:
    return {why: counts.get(why, 0) for why in EAGER_REASONS}


def test_past_the_recompile_limit_the_state_says_mostly_eager(
    clock: FakeClock, torch_warnings: _Caught
) -> None:
    """30 shapes past ``max_recompiles=3``: 27 calls ran eager, every one counted as
    ``recompile_limit`` (past torch's own limit too), the state reads ``mostly_eager``,
    and torch's own recompile-limit warning does not follow ours."""
    g: Any = safe_compile(
        affine,
        backend="eager",
        shadow=None,
        dynamic=False,
        rollback=Rollback(max_recompiles=3, slower_ratio=None),
        clock=clock,
    )
    for n in range(1, 31):
        torch.testing.assert_close(g(torch.ones(n)), affine(torch.ones(n)))
    c = g.safecompile
    stats = c.stats()
    assert (stats.compiled_calls, stats.eager_calls) == (3, 27)
    assert stats.recompile_limit_calls == 27
    assert stats.eager_by_reason == _by_reason(recompile_limit=27)
    assert stats.recent_calls == 30
    assert stats.recent_compiled_share == pytest.approx(0.1)
    assert c.state == State.MOSTLY_EAGER
    assert c.report()["state"] == "mostly_eager"
    assert not [line for line in torch_warnings.lines if "recompile_limit" in line]

    # The compiled shapes take the traffic again: once the window has moved on, the
    # state says compiled serves.
    clock.advance(61)
    assert c.state == State.MOSTLY_EAGER  # the window still holds the eager calls
    for _ in range(20):
        g(torch.ones(2))
    clock.advance(61)
    assert c.state == State.COMPILED
    stats = c.stats()
    assert (stats.recent_calls, stats.recent_compiled_share) == (20, 1.0)


def test_torchs_own_warning_stays_for_code_we_do_not_guard(torch_warnings: _Caught) -> None:
    """Only guarded calls are quieted: a plain ``torch.compile`` past its limit still warns."""

    def plain(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    compiled = torch.compile(plain, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        for n in range(1, 5):
            compiled(torch.ones(n))
    assert [line for line in torch_warnings.lines if "recompile_limit" in line]


def test_a_callable_dynamo_makes_no_graph_of_says_nothing_to_compile() -> None:
    """Dynamo ran it and made no graph: eager serves, and the state says so (not
    ``pending``, which reads "never tried")."""
    g: Any = safe_compile(same, backend="eager", shadow=None)
    assert g.safecompile.state == State.PENDING
    for _ in range(3):
        g(torch.ones(3))
    stats = g.safecompile.stats()
    assert g.safecompile.state == State.NOTHING_TO_COMPILE
    assert (stats.compiled_calls, stats.eager_calls) == (0, 3)
    assert stats.eager_by_reason == _by_reason(no_graph=3)


def test_the_kill_switch_and_a_rollback_count_as_their_own_reasons(x: torch.Tensor) -> None:
    """The hot path's eager calls (switch on, rolled back) are told apart, and everything
    sums to ``eager_calls``."""
    g: Any = safe_compile(affine, backend="eager", shadow=None)
    g(x)
    safecompile.disable()
    for _ in range(4):
        g(x)
    safecompile.enable()
    g(x)
    g.safecompile.rollback()
    for _ in range(5):
        g(x)
    stats = g.safecompile.stats()
    assert stats.eager_by_reason == _by_reason(disabled=4, rolled_back=5)
    assert (stats.compiled_calls, stats.eager_calls) == (2, 9)
    g.safecompile.reset()
    assert g.safecompile.stats().eager_by_reason == _by_reason()
    g(x)
    safecompile.disable()
    g(x)
    safecompile.enable()
    assert g.safecompile.stats().eager_by_reason == _by_reason(disabled=1)


def test_slow_path_reasons_each_count_once(x: torch.Tensor) -> None:
    """Rollout, an oversize bucket and a runtime error each count under their own why."""
    half: Any = safe_compile(affine, backend="eager", shadow=None, rollout=0.5, name="w.half")
    for _ in range(8):
        half(x)
    stats = half.safecompile.stats()
    assert stats.eager_by_reason == _by_reason(rollout=4)
    assert stats.eager_calls == 4

    bucketed: Any = safe_compile(
        affine,
        backend="eager",
        shadow=None,
        buckets=Buckets(dims={"x": 0}, sizes=[4, 8]),
        rollback=Rollback(slower_ratio=None),
        name="w.bucketed",
    )
    bucketed(torch.ones(3))
    bucketed(torch.ones(16))  # longer than the largest size: eager
    stats = bucketed.safecompile.stats()
    assert stats.eager_by_reason == _by_reason(bucket=1)
    assert stats.eager_calls == 1

    failing: Any = safe_compile(
        affine, backend=RuntimeFailingBackend(on_run=1), shadow=None, name="w.failing"
    )
    failing(x)
    failing(x)
    stats = failing.safecompile.stats()
    assert stats.eager_by_reason == _by_reason(error=1, rolled_back=1)
    assert failing.safecompile.state == State.ROLLED_BACK
