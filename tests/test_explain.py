"""torch's failures in plain words: real exceptions from real compiles (backend="eager")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo

from safecompile.base import torchcompat
from safecompile.observe.explain import TEXT_LIMIT, explain, source_line
from safecompile.observe.source import SourceLocation, location_of_error
from safecompile.testing import FailingBackend

HERE = str(Path(__file__).resolve())


def marked(tag: str) -> int:
    lines = Path(HERE).read_text(encoding="utf-8").splitlines()
    (line,) = [n for n, text in enumerate(lines, 1) if text.rstrip().endswith(f"# <- {tag}")]
    return line


def branch_on_sum(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:  # <- sum branch
        return x + 1
    return x - 1


def branch_on_item(x: torch.Tensor) -> torch.Tensor:
    if x.max().item() > 0:  # <- item branch
        return x.softmax(-1)
    return x


def prints(x: torch.Tensor) -> torch.Tensor:
    print("scoring")  # <- print
    return x + 1


def user_break(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()  # <- user break
    return x + 1


@torch.library.custom_op("safecompile_tests::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def calls_custom_op(x: torch.Tensor) -> torch.Tensor:
    return no_fake(x) + 1  # <- custom op


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def failure(fn: Callable[..., Any], *args: Any, **options: Any) -> BaseException:
    options.setdefault("backend", "eager")
    options.setdefault("fullgraph", True)
    with pytest.raises(Exception) as info:  # noqa: PT011 - any of torch's failures
        torch.compile(fn, **options)(*args)
    return info.value


def explained(fn: Callable[..., Any], **options: Any) -> tuple[Any, SourceLocation | None]:
    error = failure(fn, torch.randn(4), **options)
    location, _ = location_of_error(error, fn)
    return explain(error, location), location


def test_a_branch_on_a_tensors_value() -> None:
    """``if x.sum() > 0:``: plain words naming the line and its code, then what to do."""
    got, location = explained(branch_on_sum)
    assert location is not None
    assert location.line == marked("sum branch")
    assert got.kind == "data_dependent_branch"
    assert got.text.startswith(
        f"a branch on a tensor's value at test_explain.py:{marked('sum branch')} "
        "(`if x.sum() > 0:`)"
    )
    assert "torch.cond" in got.text
    assert got.summary == "a branch on a tensor's value"


def test_a_branch_on_item_the_issues_wording() -> None:
    """torch's "Could not guard on data-dependent expression zuf0 > 0.0" is the same kind."""
    error = failure(branch_on_item, torch.randn(4))
    assert "Could not guard on data-dependent expression" in str(error)
    location, _ = location_of_error(error, branch_on_item)
    got = explain(error, location)
    assert got.kind == "data_dependent_branch"
    assert f"test_explain.py:{marked('item branch')}" in got.text
    assert "zuf0" not in got.text


@pytest.mark.parametrize(
    ("fn", "tag", "what"),
    [(prints, "print", "`print`"), (user_break, "user break", "torch._dynamo.graph_break()")],
)
def test_a_graph_break_under_fullgraph(fn: Callable[..., Any], tag: str, what: str) -> None:
    got, _ = explained(fn)
    assert got.kind == "graph_break"
    assert f"at test_explain.py:{marked(tag)}" in got.text
    assert what in got.text
    assert "fullgraph=True allows none" in got.text


def test_a_custom_op_without_a_fake_implementation() -> None:
    got, location = explained(calls_custom_op)
    assert got.kind == "custom_op"
    assert "safecompile_tests::no_fake" in got.text
    assert "register_fake" in got.text
    assert location is not None
    assert location.line == marked("custom op")


def test_the_recompile_limit() -> None:
    keywords = torchcompat.per_function_limit(1)
    if isinstance(keywords, torchcompat.Missing):  # 2.9.1, 2.11: dynamo's global limit
        keywords, limit = {}, {"recompile_limit": 1}
    else:
        limit = {}
    with torch._dynamo.config.patch(limit):
        compiled = torch.compile(double, backend="eager", dynamic=False, **keywords)
        compiled(torch.randn(2))
        with (
            torch._dynamo.config.patch(fail_on_recompile_limit_hit=True),
            pytest.raises(Exception) as info,  # noqa: PT011
        ):
            compiled(torch.randn(3))
    got = explain(info.value)
    assert got.kind == "recompile_limit"
    assert "Buckets" in got.text


def test_a_backend_failure_keeps_the_inner_errors_first_line() -> None:
    error = failure(double, torch.randn(2), backend=FailingBackend(), fullgraph=False)
    got = explain(error, SourceLocation("/srv/app/model.py", None, "double"))
    assert got.kind == "backend_error"
    assert got.summary == "InjectedCompileError: injected compile failure"
    assert got.text == (
        "backend 'FailingBackend' failed to compile at model.py: "
        "InjectedCompileError: injected compile failure"
    )


def test_anything_else_keeps_its_own_first_line_bounded() -> None:
    got = explain(ValueError("first line\nsecond line " + "x" * 500))
    assert (got.kind, got.summary, got.text) == (
        "error",
        "ValueError: first line",
        "ValueError: first line",
    )
    long = explain(RuntimeError("y" * 1000), SourceLocation(HERE, 1, None))
    assert len(long.text) <= TEXT_LIMIT
    assert len(long.summary) <= 100


def test_source_line_of_unknown_places() -> None:
    assert source_line(None) is None
    assert source_line(SourceLocation("/nonexistent.py", 3, None)) is None
    assert source_line(SourceLocation(HERE, None, None)) is None
