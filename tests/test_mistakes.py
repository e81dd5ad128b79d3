"""Mistakes are seen: a doubtful kill-switch value and a shared name raise a Python
warning (once, whole, the consequence first) besides their event; a policy's unknown
option gets a did-you-mean."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from safecompile import (
    ENV_VAR,
    Buckets,
    ConfigError,
    EventKind,
    Rollback,
    Shadow,
    Warmup,
    safe_compile,
)
from safecompile.base import killswitch as ks


def inc(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@pytest.fixture
def fresh_switch() -> Iterator[None]:
    """Each mistake is warned once per process: forget what was warned and the names."""
    saved = set(ks.SWITCH.warned), set(ks.SWITCH.names), dict(ks.SWITCH.owners)
    ks.SWITCH.warned.clear()
    ks.SWITCH.names.clear()
    ks.SWITCH.owners.clear()
    yield
    ks.SWITCH.warned.clear()
    ks.SWITCH.names.clear()
    ks.SWITCH.owners.clear()
    ks.SWITCH.warned.update(saved[0])
    ks.SWITCH.names.update(saved[1])
    ks.SWITCH.owners.update(saved[2])


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (
            lambda: Shadow(canery=8),  # type: ignore[call-arg]
            "Shadow() got unknown option(s) canery (did you mean canary?)",
        ),
        (
            lambda: Rollback(max_recompile=4),  # type: ignore[call-arg]
            "Rollback() got unknown option(s) max_recompile (did you mean max_recompiles?)",
        ),
        (
            lambda: Warmup(inputs=[], backgrond=True),  # type: ignore[call-arg]
            "Warmup() got unknown option(s) backgrond (did you mean background?)",
        ),
        (
            lambda: Buckets(dim={"x": 1}, sizes=[8, 16]),  # type: ignore[call-arg]
            "Buckets() got unknown option(s) dim (did you mean dims?)",
        ),
    ],
)
def test_a_policys_unknown_option_gets_a_did_you_mean(build: Callable[[], Any], says: str) -> None:
    """``Shadow(canery=8)`` is a ``ConfigError`` naming the option, the likely one and the
    allowed ones, as ``safe_compile(backnd=...)`` is, not a bare ``TypeError``."""
    with pytest.raises(ConfigError) as caught:
        build()
    assert str(caught.value).startswith(says)
    assert "; allowed: " in str(caught.value)


@pytest.mark.parametrize(
    ("value", "whole"),
    [
        (
            "garbage",
            "SAFECOMPILE_DISABLE='garbage' disables nothing: it is neither a boolean "
            "(1/true/yes/on/all/* turn everything off, 0/false/no/off nothing) nor a guarded name",
        ),
        (
            "ranker.*;embed.*",
            "SAFECOMPILE_DISABLE='ranker.*;embed.*' disables nothing: it was read as one name; "
            "separate names with commas ('ranker.*,embed.*')",
        ),
    ],
)
def test_a_doubtful_switch_value_raises_one_python_warning(
    value: str, whole: str, monkeypatch: pytest.MonkeyPatch, fresh_switch: None
) -> None:
    """A program that configured no logging still sees it: one ``UserWarning``, the
    whole sentence with the consequence first, said once for the process."""
    monkeypatch.setenv(ENV_VAR, value)
    x = torch.ones(4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        g: Any = safe_compile(inc, backend="eager", shadow=None, name="ranker.score")
        g(x)
        h = safe_compile(inc, backend="eager", shadow=None, name="ranker.other")
        h(x)
    said = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    assert said == [whole]
    events = [e for e in g.safecompile.events() if e.kind is EventKind.SWITCH_WARNING]
    assert [e.message for e in events] == [whole]


def test_two_guards_sharing_a_name_raise_one_warning(fresh_switch: None) -> None:
    """The kill switch and telemetry key on the name: a second live guard of the same
    name is a warning (and an event), once per name."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first: Any = safe_compile(lambda x: x + 1, backend="eager", shadow=None, name="dup.f")
        second = safe_compile(lambda x: x + 2, backend="eager", shadow=None, name="dup.f")
        third = safe_compile(lambda x: x + 3, backend="eager", shadow=None, name="dup.f")
        other = safe_compile(lambda x: x + 4, backend="eager", shadow=None, name="dup.g")
    said = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    assert said == [
        "two guarded callables are named 'dup.f': the kill switch, telemetry and persisted "
        "verdicts cannot tell them apart; give each its own safe_compile(name=...)"
    ]
    guards: list[Any] = [first, second, third, other]
    kinds = [[e.kind for e in g.safecompile.events()] for g in guards]
    assert [k.count(EventKind.NAME_SHARED) for k in kinds] == [0, 1, 0, 0]


def test_a_guard_gone_leaves_its_name_free(fresh_switch: None) -> None:
    """A guard built again after the first one is gone (a reload, a test) shares nothing."""
    import gc

    first = safe_compile(lambda x: x + 1, backend="eager", shadow=None, name="dup.h")
    del first
    gc.collect()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        safe_compile(lambda x: x + 1, backend="eager", shadow=None, name="dup.h")
    assert not [w for w in seen if "named 'dup.h'" in str(w.message)]
