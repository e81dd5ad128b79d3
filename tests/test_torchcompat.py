"""torch's private names behind one module: found on this torch, degrading when missing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import structlog
import torch
from structlog.testing import capture_logs

from safecompile import Shadow, State, safe_compile
from safecompile.base import torchcompat
from safecompile.observe.log import (
    LINE_LIMIT,
    forget_said,
    readable_line,
    torch_missing,
)

MISSING_EVENT = "safecompile.torch_feature_missing"


@pytest.fixture(autouse=True)
def _say_again() -> Iterator[None]:
    """Each test sees the once-per-name warning afresh."""
    forget_said()
    yield
    forget_said()


def without(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make ``torchcompat.lookup`` answer as a torch lacking ``names`` would."""
    real = torchcompat.lookup

    def lookup(dotted: str) -> Any:
        return None if dotted in names else real(dotted)

    monkeypatch.setattr(torchcompat, "lookup", lookup)


def missing_events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The missing-name events about ``name`` (an older torch may lack others too)."""
    return [e for e in logs if e["event"] == MISSING_EVENT and e["torch_name"] == name]


def counting_backend() -> tuple[Callable[..., Any], list[int]]:
    """A backend that runs the graph as traced, counting its compiles."""
    compiles: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiles.append(1)
        return gm.forward

    return backend, compiles


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def test_lookup_reads_modules_then_attributes() -> None:
    """A dotted name resolves through its longest importable module; an absent one is None."""
    assert torchcompat.lookup("torch._dynamo.exc.Unsupported") is torch._dynamo.exc.Unsupported
    assert torchcompat.lookup("torch._functorch.config") is not None
    assert torchcompat.lookup("torch._dynamo.no_such_name") is None
    assert torchcompat.lookup("torch._no_such_module.attr") is None


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_every_accessor_finds_its_name_on_the_installed_torch() -> None:
    """On the torch the project pins, nothing is missing (an upgrade that drops one fails here)."""
    assert len(torchcompat.compile_errors()) == 2
    if _torch_version() >= (2, 13):  # checked absent in 2.9.1
        assert not isinstance(torchcompat.eager_backward(), torchcompat.Missing)
    assert not isinstance(torchcompat.inductor_options(), torchcompat.Missing)
    assert not isinstance(torchcompat.remote_cache_classes(), torchcompat.Missing)
    assert not isinstance(
        torchcompat.compiler_wrapper("eager", None, None, None), torchcompat.Missing
    )
    assert "max-autotune" in torchcompat.mode_options()
    assert torchcompat.compile_lock() is not None
    if _torch_version() >= (2, 13):  # checked absent in 2.9.1
        assert torchcompat.per_function_limit(3) == {
            "recompile_limit": 3,
            "isolate_recompiles": True,
        }
    assert torchcompat.compile_callbacks() is not None
    if _torch_version() >= (2, 13):  # checked absent in 2.9.1, 2.11
        assert torchcompat.compiled_function_loader() is torch.compiler.load_compiled_function
    assert torchcompat.lookup("torch.distributed.distributed_c10d._get_default_store")
    assert all(torchcompat.lookup(name) is not None for name in torchcompat._SIDE_EFFECT_NAMES)
    assert torchcompat.is_op_overload(torch.ops.aten.add.Tensor)
    assert not torchcompat.is_op_overload(torch.add)
    assert torchcompat.lookup("torch._dynamo.source.TensorPropertySource") is not None
    assert not torchcompat.is_tensor_property(None)
    tensor = torch.zeros(4, 3)
    assert torchcompat.mark_dynamic(tensor, 0, 2, 8) is None
    assert any(hasattr(tensor, name) for name in torchcompat.DYNAMIC_MARKS)
    module = torch.nn.Linear(2, 2)
    assert torchcompat.compiled_original(torch.compile(module, backend="eager")) is module
    assert torchcompat.compiled_original(torch.compile(_double, backend="eager")) is _double
    assert torchcompat.compiled_original(module) is None
    assert torchcompat.graph_line_map(torch.fx.symbolic_trace(torch.nn.ReLU()))


def test_a_missing_marker_is_falsy_and_says_what_degrades(monkeypatch: pytest.MonkeyPatch) -> None:
    """An accessor whose name is gone answers with a marker instead of raising."""
    without(monkeypatch, "torch._dynamo.reset_code", "torch._dynamo.mark_dynamic")
    missing = torchcompat.reset_code((lambda: 0).__code__)
    assert isinstance(missing, torchcompat.Missing)
    assert not missing
    assert missing.name == "torch._dynamo.reset_code"
    assert "reset()" in missing.effect
    assert isinstance(torchcompat.mark_dynamic(torch.zeros(2), 0, 2, 8), torchcompat.Missing)


def test_compile_errors_keep_the_names_that_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without FailOnRecompileLimitHit still recognises its other compile errors."""
    without(monkeypatch, "torch._dynamo.exc.FailOnRecompileLimitHit")
    assert torchcompat.compile_errors() == (torch._dynamo.exc.TorchDynamoException,)


def test_no_eager_backward_lowering_compiles_anyway_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.9 lacks force_non_lazy_backward_lowering: graphs still compile and serve,
    with one warning event for any number of compiles."""
    without(monkeypatch, "torch._functorch.config")
    backend, compiles = counting_backend()
    f = safe_compile(lambda x: x * 2 + 1, backend=backend, shadow=None)
    with structlog.testing.capture_logs() as logs:
        for n in (3, 5, 7):
            x = torch.ones(n)
            torch.testing.assert_close(f(x), x * 2 + 1)
    assert len(compiles) >= 2
    assert f.safecompile.state == State.COMPILED
    assert f.safecompile.stats().compiled_calls == 3
    events = missing_events(logs, "torch._functorch.config.force_non_lazy_backward_lowering")
    assert len(events) == 1
    assert events[0]["log_level"] == "warning"
    assert events[0]["torch"] == torch.__version__


def test_no_side_effect_reader_serves_compiled_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without dynamo's side-effect types nothing tells whether a call updates a Python
    object, so its graph serves compiled but is not shadow-checked (a rerun could apply an
    update twice), and says why."""
    without(monkeypatch, "torch._dynamo.source.LocalSource")
    backend, _ = counting_backend()
    f = safe_compile(lambda x: x.sin(), backend=backend, shadow=Shadow(canary=2, every=1))
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            x = torch.randn(4)
            torch.testing.assert_close(f(x), x.sin())
    stats = f.safecompile.stats()
    assert f.safecompile.state == State.UNCHECKED
    assert (stats.compiled_calls, stats.shadow_checks) == (3, 0)
    assert len(missing_events(logs, "torch._dynamo.source.LocalSource")) == 1


def test_no_source_reader_leaves_the_call_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.9's sources cannot be read back against a running frame: a call updating
    a list it was given is answered and counted, but not checked against eager."""
    monkeypatch.setattr(
        torchcompat,
        "source_value",
        lambda *args: torchcompat.Missing("torch._guards.Source.get_value", "not checked"),
    )
    backend, _ = counting_backend()

    def append_to(x: torch.Tensor, seen: list[torch.Tensor]) -> torch.Tensor:
        seen.append(x)
        return x + 1

    f = safe_compile(append_to, backend=backend, shadow=Shadow(canary=2, every=1))
    seen: list[torch.Tensor] = []
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):
            torch.testing.assert_close(f(torch.ones(2), seen), torch.full((2,), 2.0))
    assert len(seen) == 2  # updated once per call, never twice
    assert f.safecompile.stats().shadow_checks == 0
    assert len(missing_events(logs, "torch._guards.Source.get_value")) == 1


def test_reset_without_reset_code_still_resets(monkeypatch: pytest.MonkeyPatch) -> None:
    """reset() goes back to pending even where torch cannot drop one function's graphs."""
    without(monkeypatch, "torch._dynamo.reset_code")
    backend, _ = counting_backend()

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    f = safe_compile(double, backend=backend, shadow=None)
    f(torch.ones(2))
    with structlog.testing.capture_logs() as logs:
        f.safecompile.reset()
        f.safecompile.reset()
    assert f.safecompile.state == State.PENDING
    assert len(missing_events(logs, "torch._dynamo.reset_code")) == 1
    torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 2.0))


def test_no_per_function_limit_compiles_under_the_global_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch.compile without recompile_limit=/isolate_recompiles= is called without them."""
    seen: list[dict[str, Any]] = []
    real_compile = torch.compile

    def old_compile(fn: Any = None, **kwargs: Any) -> Any:
        seen.append(kwargs)
        kwargs.pop("recompile_limit", None)
        kwargs.pop("isolate_recompiles", None)
        return real_compile(fn, **kwargs)

    def limit_keywords(limit: int) -> Any:
        return torchcompat.Missing("torch.compile(recompile_limit=)", "shared limit")

    monkeypatch.setattr(torchcompat, "per_function_limit", limit_keywords)
    monkeypatch.setattr(torch, "compile", old_compile)
    backend, _ = counting_backend()
    with structlog.testing.capture_logs() as logs:
        f = safe_compile(lambda x: x - 1, backend=backend, shadow=None)
        torch.testing.assert_close(f(torch.ones(2)), torch.zeros(2))
    assert f.safecompile.stats().compiled_calls == 1
    assert seen
    assert all("recompile_limit" not in kw and "isolate_recompiles" not in kw for kw in seen)
    assert len(missing_events(logs, "torch.compile(recompile_limit=)")) == 1


def test_precompiling_needs_aot_compile_and_a_loader_of_its_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off (2.9.1's default; 2.11 had no aot_compile), or a loader without f_globals= and
    external_data= (2.9.1's): Missing, saying a warm restart traces again."""
    # config.patch, not monkeypatch: monkeypatch's undo deletes a config module's setting
    # (not in the module's __dict__), which hides it from every later test
    with torch._dynamo.config.patch(enable_aot_compile=False):
        off = torchcompat.compiled_function_loader()
    assert isinstance(off, torchcompat.Missing)
    assert off.name == "torch.compile(...).aot_compile"
    assert "warm restart traces again" in off.effect
    real = torchcompat.lookup

    def lookup(dotted: str) -> Any:
        return (lambda file: None) if dotted.endswith("load_compiled_function") else real(dotted)

    monkeypatch.setattr(torchcompat, "lookup", lookup)
    with torch._dynamo.config.patch(enable_aot_compile=True):
        old = torchcompat.compiled_function_loader()
    assert isinstance(old, torchcompat.Missing)
    assert old.name.startswith("torch.compiler.load_compiled_function(")


def test_no_compile_wrapper_falls_back_to_the_backend_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without torch's compile wrappers the named backend is used as it is: it compiles
    and serves."""
    without(monkeypatch, "torch._TorchCompileWrapper")
    with structlog.testing.capture_logs() as logs:
        g = safe_compile(lambda x: x * 2, backend="aot_eager", name="tc.wrapperless", shadow=None)
        torch.testing.assert_close(g(torch.ones(3)), torch.full((3,), 2.0))
    assert g.safecompile.stats().compiled_calls == 1
    assert g.safecompile.report()["backend"] == "aot_eager"
    assert len(missing_events(logs, "torch._TorchCompileWrapper")) == 1


def test_no_inductor_option_list_skips_the_early_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unknown inductor options cannot be refused early without torch's list: no
    ConfigError; torch's own compiler wrapper refuses them, as under torch.compile."""
    without(monkeypatch, "torch._inductor.list_options")
    with (
        structlog.testing.capture_logs() as logs,
        pytest.raises(RuntimeError, match="no_such"),
    ):
        safe_compile(lambda x: x, backend="inductor", options={"no_such": 1}, name="tc.options")
    assert len(missing_events(logs, "torch._inductor.list_options")) == 1


def test_every_missing_event_reads_as_one_whole_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every private name gone, each accessor degrades, and each event's log line is
    whole (at most LINE_LIMIT characters, not cut short)."""
    monkeypatch.setattr(torchcompat, "lookup", lambda dotted: None)
    monkeypatch.setattr(torch, "compile", lambda model=None, *, backend=None: model)
    markers = [
        torchcompat.eager_backward(),
        torchcompat.per_function_limit(8),
        torchcompat.compiler_wrapper("inductor", None, None, None),
        torchcompat.compiler_wrapper("eager", None, None, None),
        torchcompat.inductor_options(),
        torchcompat.reset_code((lambda: 0).__code__),
        torchcompat.mark_dynamic(torch.zeros(2), 0, 2, 8),
        torchcompat.side_effects(),
        torchcompat.close_symbolic_trace_window(),
        torchcompat.remote_cache_classes(),
        torchcompat.default_store(),
        torchcompat.source_value(object(), {}, {}, {}),
    ]
    assert torchcompat.compile_errors() == ()
    assert all(isinstance(m, torchcompat.Missing) for m in markers)
    with structlog.testing.capture_logs() as logs:
        for marker in markers:
            assert isinstance(marker, torchcompat.Missing)
            torch_missing(marker)
    assert len(logs) == len({m.name for m in markers if isinstance(m, torchcompat.Missing)})
    for event in logs:
        line = readable_line(event["event"], event)
        assert len(line) <= LINE_LIMIT, line
        assert not line.endswith("\u2026"), line


def test_lookup_remembers_classes_not_values() -> None:
    """A class found once is not looked up again; a config value is read afresh."""
    name = "torch._dynamo.source.LocalSource"
    assert torchcompat.lookup(name) is torchcompat._FOUND[name]
    flag = "torch._inductor.config.fx_graph_cache"
    before = torchcompat.lookup(flag)
    with torch._inductor.config.patch(fx_graph_cache=not before):
        assert torchcompat.lookup(flag) is (not before)
    assert flag not in torchcompat._FOUND


def test_caching_precompile_is_warned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's caching precompile loads graphs past any backend, so the guard would not
    see them: the first compile under it says so once, naming the callable."""
    # torch's config itself is left alone (switching it on changes every later compile in
    # the process); the guard reads it through torchcompat.lookup, so that answers "on"
    real_lookup = torchcompat.lookup

    def lookup(dotted: str) -> Any:
        return True if dotted == "torch._dynamo.config.caching_precompile" else real_lookup(dotted)

    monkeypatch.setattr(torchcompat, "lookup", lookup)
    forget_said()  # said once per process: maybe by an earlier test
    with capture_logs() as logs:
        for name in ("pc.first", "pc.second"):
            g = safe_compile(lambda x: x * 2, backend="eager", name=name, shadow=None)
            torch.testing.assert_close(g(torch.ones(3)), torch.full((3,), 2.0))
    warned = [log for log in logs if log["event"] == "safecompile.precompile_unguarded"]
    assert [log["function"] for log in warned] == ["pc.first"]
    assert "TORCH_CACHING_PRECOMPILE" in warned[0]["description"]


def test_no_precompile_warning_by_default() -> None:
    """Without caching precompile nothing is said (and torch 2.13 has the flag, off)."""
    assert torchcompat.lookup("torch._dynamo.config.caching_precompile") is False
    with capture_logs() as logs:
        g = safe_compile(lambda x: x + 1, backend="eager", name="pc.off", shadow=None)
        g(torch.ones(2))
    assert not [log for log in logs if log["event"] == "safecompile.precompile_unguarded"]
