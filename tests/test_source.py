"""Every failure kind maps to the exact line of the user's source that a marker names."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo

import safecompile.observe.source as source_module
from safecompile.observe.source import (
    SourceLocation,
    dedupe_graph_breaks,
    error_type_name,
    graph_breaks_of,
    is_generated_file,
    is_user_file,
    location_of_error,
    location_of_function,
    redact_tensors,
    safe_message,
    truncate,
)

HERE = os.path.abspath(__file__)


def marked(marker: str) -> int:
    """The line of this file that carries ``# <- marker`` (read, never hard-coded)."""
    lines = Path(HERE).read_text().splitlines()
    found = [n for n, text in enumerate(lines, 1) if text.rstrip().endswith(f"# <- {marker}")]
    assert len(found) == 1, f"marker {marker!r} found {len(found)} times"
    return found[0]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def recording_backend() -> tuple[list[torch.fx.GraphModule], Callable[..., Any]]:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    return graphs, backend


# ---------------------------------------------------------------- user functions under test


def with_break(x: torch.Tensor) -> torch.Tensor:
    y = x + 1
    torch._dynamo.graph_break()  # <- break here
    return y * 2


def breaks_first(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()  # <- first-line break
    y = x + 1
    torch._dynamo.graph_break()  # <- second break
    return y * 2


def helper_that_breaks(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()  # <- nested break
    return x - 1


def calls_helper(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    return helper_that_breaks(y)


def not_fullgraph(x: torch.Tensor) -> torch.Tensor:
    y = x.cos()
    print("side effect")  # <- fullgraph failure
    return y


def shape_bug(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    return y @ torch.ones(5, 5)  # <- shape bug


def backend_victim(x: torch.Tensor) -> torch.Tensor:  # <- backend victim def
    return x.sin() + 1


def lowering_victim(x: torch.Tensor) -> torch.Tensor:
    y = x + 1
    z = torch.cos(y)  # <- node the backend fails on
    return z * 2


def runtime_victim(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    y = x * 2
    z = y[index]  # <- runtime failure
    return z + 1


def kernel_victim(x: torch.Tensor) -> torch.Tensor:  # <- kernel victim def
    return x.cos() + 1


def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


@decorate
@decorate
def decorated(x: torch.Tensor) -> torch.Tensor:  # <- decorated def
    return x


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # <- module forward
        out: torch.Tensor = self.linear(x)
        return out

    def method(self, x: torch.Tensor) -> torch.Tensor:  # <- method def
        return x


class CallableThing:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # <- dunder call
        return x


# ---------------------------------------------------------------- graph breaks


def test_graph_break_maps_to_the_break_line() -> None:
    """A graph break handed to a recording backend names its own line."""
    graphs, backend = recording_backend()
    torch.compile(with_break, backend=backend)(torch.randn(3))
    breaks = [b for gm in graphs for b in graph_breaks_of(gm)]
    assert len(breaks) == 1
    (entry,) = breaks
    assert entry["file"] == HERE
    assert entry["line"] == marked("break here")
    assert entry["function"] == "with_break"
    assert "graph_break" in str(entry["reason"])


def test_graph_break_in_an_inlined_helper() -> None:
    """A break inside a helper the compiled function calls names the helper's line."""
    graphs, backend = recording_backend()
    torch.compile(calls_helper, backend=backend)(torch.randn(3))
    breaks = [b for gm in graphs for b in graph_breaks_of(gm)]
    assert [(b["file"], b["line"], b["function"]) for b in breaks] == [
        (HERE, marked("nested break"), "helper_that_breaks")
    ]


def test_break_with_nothing_before_it_is_found_through_the_resume_function() -> None:
    """A break on a function's first line (no graph before it) is found with include_resumed."""
    graphs, backend = recording_backend()
    torch.compile(breaks_first, backend=backend)(torch.randn(3))
    plain = [b for gm in graphs for b in graph_breaks_of(gm)]
    assert [b["line"] for b in plain] == [marked("second break")]

    every = dedupe_graph_breaks(
        b for gm in graphs for b in graph_breaks_of(gm, include_resumed=True)
    )
    assert sorted((b["file"], b["line"], b["function"]) for b in every) == [
        (HERE, marked("first-line break"), "breaks_first"),
        (HERE, marked("second break"), "breaks_first"),
    ]
    known = next(b for b in every if b["line"] == marked("second break"))
    assert "graph_break" in str(known["reason"])


def test_graph_without_a_break_reports_none() -> None:
    """A graph that ran to its return reports no break."""
    graphs, backend = recording_backend()
    torch.compile(backend_victim, backend=backend)(torch.randn(3))
    assert graphs
    assert [b for gm in graphs for b in graph_breaks_of(gm, include_resumed=True)] == []


# ---------------------------------------------------------------- compile-time errors


def test_fullgraph_failure_maps_to_the_unsupported_line() -> None:
    """``fullgraph=True`` raises Unsupported; its real_stack gives the exact line."""
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(not_fullgraph, backend="eager", fullgraph=True)(torch.randn(3))
    where, generated = location_of_error(info.value, not_fullgraph)
    assert where == SourceLocation(HERE, marked("fullgraph failure"), "not_fullgraph")
    assert generated is None
    assert error_type_name(info.value) == "torch._dynamo.exc.Unsupported"


def test_shape_bug_while_tracing_maps_to_its_line() -> None:
    """A user's shape bug met while tracing (TorchRuntimeError) maps to its line."""
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError) as info:
        torch.compile(shape_bug, backend="eager")(torch.randn(3, 4))
    where, generated = location_of_error(info.value, shape_bug)
    assert where == SourceLocation(HERE, marked("shape bug"), "shape_bug")
    assert generated is None


def test_backend_failure_maps_to_the_function_def_line() -> None:
    """A backend that raises without a node gives no user frame: the function's def line."""

    def failing_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        raise ValueError("backend exploded")

    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(backend_victim, backend=failing_backend)(torch.randn(3))
    where, generated = location_of_error(info.value, backend_victim)
    # Not the backend's own frame (it is in this file too), not dynamo's placeholders.
    assert where == SourceLocation(HERE, marked("backend victim def"), "backend_victim")
    assert generated is None
    assert error_type_name(info.value) == "torch._dynamo.exc.BackendCompilerFailed"


def test_backend_failure_on_a_node_maps_to_the_node_line() -> None:
    """A backend failing while it runs an FX node names that node's source line."""

    class Lowering(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if n.target is torch.cos:
                raise NotImplementedError("no lowering for cos")
            return super().run_node(n)

    def lowering_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        Lowering(gm).run(*example_inputs)
        return gm.forward

    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(lowering_victim, backend=lowering_backend)(torch.randn(3))
    where, _ = location_of_error(info.value, lowering_victim)
    assert where == SourceLocation(HERE, marked("node the backend fails on"), "lowering_victim")


def test_backend_failure_on_a_node_without_torch_message() -> None:
    """With fx's extra traceback off, the node is still found from the backend's frames."""

    class Quiet(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if n.target is torch.cos:
                raise NotImplementedError("no lowering for cos")
            return super().run_node(n)

    def quiet_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        interpreter = Quiet(gm)
        interpreter.extra_traceback = False
        interpreter.run(*example_inputs)
        return gm.forward

    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(lowering_victim, backend=quiet_backend)(torch.randn(3))
    assert "Original traceback" not in str(info.value.inner_exception)
    where, _ = location_of_error(info.value, lowering_victim)
    assert where == SourceLocation(HERE, marked("node the backend fails on"), "lowering_victim")


# ---------------------------------------------------------------- run-time errors


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_runtime_failure_in_compiled_code_maps_to_the_op_line(backend: str) -> None:
    """An op failing at run time inside the compiled graph names the op's own line."""
    compiled = torch.compile(runtime_victim, backend=backend)
    with pytest.raises(IndexError) as info:
        compiled(torch.randn(3), torch.tensor([7]))
    where, generated = location_of_error(info.value, runtime_victim)
    assert where == SourceLocation(HERE, marked("runtime failure"), "runtime_victim")
    assert generated is not None
    assert generated.startswith("<eval_with_key>")


def test_runtime_failure_in_a_generated_kernel_keeps_both_files(tmp_path: Path) -> None:
    """A kernel file with no node map: the user's function, and the generated file apart."""
    kernel_file = str(tmp_path / "torchinductor_user" / "ab" / "cabc123.py")
    namespace: dict[str, Any] = {}
    code = "def call(*args):\n    raise RuntimeError('kernel failed')\n"
    exec(compile(code, kernel_file, "exec"), namespace)

    def kernel_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return namespace["call"]

    with pytest.raises(RuntimeError, match="kernel failed") as info:
        torch.compile(kernel_victim, backend=kernel_backend)(torch.randn(3))
    where, generated = location_of_error(info.value, kernel_victim)
    assert where == SourceLocation(HERE, marked("kernel victim def"), "kernel_victim")
    assert generated == kernel_file


def test_error_with_no_traceback_falls_back_to_the_function() -> None:
    """An exception never raised (no traceback) maps to the function's definition."""
    where, generated = location_of_error(RuntimeError("x"), backend_victim)
    assert where == SourceLocation(HERE, marked("backend victim def"), "backend_victim")
    assert generated is None


def test_cause_chain_is_followed() -> None:
    """A wrapper raised ``from`` a compiled-code failure still maps to the failing op."""
    compiled = torch.compile(runtime_victim, backend="eager")
    try:
        try:
            compiled(torch.randn(3), torch.tensor([9]))
        except IndexError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        where, generated = location_of_error(outer, runtime_victim)
    assert where is not None
    assert where.line == marked("runtime failure")
    assert generated is not None


# ---------------------------------------------------------------- functions


def test_location_of_function_unwraps() -> None:
    """Wrappers, methods, modules and callable objects map to their own def line."""
    model = Model()
    assert location_of_function(decorated) == SourceLocation(
        HERE, marked("decorated def"), "decorated"
    )
    assert location_of_function(model) == SourceLocation(
        HERE, marked("module forward"), "Model.forward"
    )
    assert location_of_function(model.method) == SourceLocation(
        HERE, marked("method def"), "Model.method"
    )
    assert location_of_function(CallableThing()) == SourceLocation(
        HERE, marked("dunder call"), "CallableThing.__call__"
    )
    assert location_of_function(functools.partial(backend_victim)) == SourceLocation(
        HERE, marked("backend victim def"), "backend_victim"
    )
    compiled = torch.compile(backend_victim, backend="eager")
    assert location_of_function(compiled) == location_of_function(backend_victim)
    compiled_module = torch.compile(model, backend="eager")
    assert location_of_function(compiled_module) == location_of_function(model)
    assert location_of_function(len) is None
    assert location_of_function(torch.nn.functional.relu) is None  # torch's, not the user's


# ---------------------------------------------------------------- files and messages


def test_is_user_file() -> None:
    """Only the user's files count: not torch, safecompile, stdlib or generated code."""
    assert is_user_file(HERE)
    assert not is_user_file(torch.__file__)
    assert not is_user_file(torch._dynamo.exc.__file__)
    assert not is_user_file(source_module.__file__)
    assert not is_user_file(os.__file__)
    assert not is_user_file("<eval_with_key>.12")
    assert not is_user_file("<eval_with_key>.3 from /x/proxy_tensor.py:1 in wrapped")
    assert not is_user_file("<string>")
    assert not is_user_file("<frozen importlib._bootstrap>")
    assert not is_user_file("/tmp/torchinductor_me/ab/cabcdef.py")
    assert not is_user_file("")
    assert is_user_file("<stdin>")
    site = next(p for p in sys.path if p.endswith("site-packages"))
    assert is_user_file(os.path.join(site, "transformers", "modeling_bert.py"))
    assert is_generated_file("/tmp/torchinductor_me/ab/cabcdef.py")
    assert not is_generated_file(HERE)


def test_generated_file_under_the_inductor_cache_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Output under ``TORCHINDUCTOR_CACHE_DIR`` is generated code, whatever its name."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert not is_user_file(str(tmp_path / "cache" / "xy" / "cxy.py"))
    assert is_user_file(str(tmp_path / "model.py"))


def test_error_type_name() -> None:
    """Builtins by their bare name, everything else qualified by module."""
    assert error_type_name(RuntimeError()) == "RuntimeError"
    assert error_type_name(torch._dynamo.exc.TorchRuntimeError("x")) == (
        "torch._dynamo.exc.TorchRuntimeError"
    )


def test_truncate_and_redact() -> None:
    """Messages are bounded and never carry a tensor's values."""
    assert truncate("abc", 5) == "abc"
    cut = truncate("x" * 1000)
    assert len(cut) == 512
    assert cut.endswith("\u2026")
    text = f"bad input {torch.tensor([[8675309.25, 1.5], [2.5, 3.5]])} here (ok)"
    assert "8675309" not in redact_tensors(text)
    assert redact_tensors(text) == "bad input tensor(...) here (ok)"
    assert redact_tensors("size (3, 4) vs (5, 5)") == "size (3, 4) vs (5, 5)"
    assert "8675309" not in safe_message(ValueError(f"got {torch.tensor(8675309.25)!r}"))
    boilerplate = (
        "backend='x' raised:\nValueError: no\n\nSet TORCHDYNAMO_VERBOSE=1 for the internal "
        'stack trace (please do this). For even more developer context, set TORCH_LOGS="+dynamo"\n'
    )
    assert safe_message(boilerplate) == "backend='x' raised:\nValueError: no"


def test_exception_chain_follows_causes_torch_wrappers_and_stops() -> None:
    """One walk for every reader: ``__cause__`` before ``__context__``, torch's wrapped
    error first when asked, each exception once (a cycle ends it), at most ``limit``."""

    class Wrapper(Exception):
        def __init__(self, inner: BaseException) -> None:
            super().__init__("wrapped")
            self.inner_exception = inner

    root = ValueError("root")
    handled = KeyError("handled")
    cause = RuntimeError("cause")
    cause.__cause__, cause.__context__ = root, handled
    wrapped = TypeError("inner")
    top = Wrapper(wrapped)
    top.__cause__ = cause

    chain = source_module.exception_chain
    assert list(chain(cause)) == [cause, root]
    assert list(chain(handled)) == [handled]
    assert list(chain(top)) == [top, cause, root]
    assert list(chain(top, inner=True)) == [top, wrapped]
    loop_a, loop_b = ValueError("a"), ValueError("b")
    loop_a.__context__, loop_b.__context__ = loop_b, loop_a
    assert list(chain(loop_a)) == [loop_a, loop_b]
    assert list(chain(top, limit=2)) == [top, cause]


def test_location_fields_are_an_events_source_or_nothing() -> None:
    """The one way an event gets its file, line and function: all three, or none."""
    where = source_module.SourceLocation("/app/model.py", 12, "forward")
    assert source_module.location_fields(where) == {
        "file": "/app/model.py",
        "line": 12,
        "function": "forward",
    }
    assert source_module.location_fields(None) == {}
