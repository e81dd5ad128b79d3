"""safecompile.testing.assert_compiles: breaks counted like the guard counts them, and the
function's own keywords passed through."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from safecompile import safe_compile
from safecompile.testing import CompileCheck, RecordingBackend, assert_compiles


def breaks_first(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()  # BREAK-FIRST: nothing compiled before it
    return x * 2 + 1


def breaks_between(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    torch._dynamo.graph_break()  # BREAK-BETWEEN
    return y + 1


def clean(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 3


def marked_line(tag: str) -> int:
    with open(__file__, encoding="utf-8") as source:
        return next(i for i, line in enumerate(source, 1) if f"# {tag}" in line)


def test_a_break_before_anything_compiled_is_a_break() -> None:
    """The break on the first line fails max_graph_breaks=0, like the guard counts it."""
    x = torch.randn(4)
    with pytest.raises(AssertionError, match=r"1 graph break\(s\), at most 0") as info:
        assert_compiles(breaks_first, x)
    assert f"test_assert_compiles.py:{marked_line('BREAK-FIRST')}" in str(info.value)
    report = assert_compiles(breaks_first, x, max_graph_breaks=1)
    assert [b["line"] for b in report.graph_breaks] == [marked_line("BREAK-FIRST")]
    guarded = safe_compile(breaks_first, backend="aot_eager", shadow=None)
    guarded(x)
    assert guarded.safecompile.stats().graph_breaks == len(report.graph_breaks) == 1


def test_a_break_between_graphs_counts_once() -> None:
    """Seen from the graph it ends and from the one resuming after it: one break."""
    report = assert_compiles(breaks_between, torch.randn(4), max_graph_breaks=1)
    assert report.graphs == 2
    assert [b["line"] for b in report.graph_breaks] == [marked_line("BREAK-BETWEEN")]
    with pytest.raises(AssertionError, match=r"1 graph break\(s\), at most 0"):
        assert_compiles(breaks_between, torch.randn(4))


def test_no_break_passes_and_compares_outputs() -> None:
    report = assert_compiles(clean, torch.randn(3, 5))
    assert (report.graphs, report.graph_breaks) == (1, [])
    assert report.max_abs_diff < 1e-5


def configurable(
    x: torch.Tensor, *, backend: str = "none", check_outputs: bool = False
) -> torch.Tensor:
    return x + (1 if backend == "fast" else 2) + (10 if check_outputs else 0)


def test_the_functions_own_keywords_pass_through() -> None:
    """``backend=`` and ``check_outputs=`` are the function's, not assert_compiles'."""
    seen: list[tuple[str, bool]] = []

    def spy(x: torch.Tensor, *, backend: str, check_outputs: bool) -> torch.Tensor:
        seen.append((backend, check_outputs))
        return configurable(x, backend=backend, check_outputs=check_outputs)

    x = torch.zeros(2)
    assert_compiles(spy, x, backend="fast", check_outputs=True)
    # compiled once and run eagerly once to compare, both with the caller's keywords
    assert seen == [("fast", True), ("fast", True)]


def test_compile_check_takes_the_options() -> None:
    """CompileCheck(backend=..., check_outputs=...) is assert_compiles with settings."""
    backend = RecordingBackend()
    report = CompileCheck(backend=backend, check_outputs=False)(clean, torch.randn(2))
    assert backend.compiles == report.graphs == 1
    assert report.max_abs_diff == 0.0

    def wrong(gm: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        def run(*args: object) -> object:
            return [t * 2 for t in gm.forward(*args)]

        return run

    with pytest.raises(AssertionError, match="differs from eager"):
        CompileCheck(backend=wrong)(clean, torch.randn(2))
    CompileCheck(backend=wrong, check_outputs=False)(clean, torch.randn(2))


class Breaking(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        torch._dynamo.graph_break()  # BREAK-IN-MODULE
        return y + 1


def test_a_guarded_module_is_checked_through_its_own_forward() -> None:
    """A module guarded in place: its own forward is compiled afresh (not the guard), so
    its break is found at its line and its calls through the guard are not counted."""
    module: Any = safe_compile(Breaking(), backend="eager", shadow=None)
    with pytest.raises(AssertionError, match=r"1 graph break\(s\), at most 0") as info:
        assert_compiles(module, torch.randn(3))
    assert f"test_assert_compiles.py:{marked_line('BREAK-IN-MODULE')}" in str(info.value)
    assert module.safecompile.stats().calls == 0
