"""SAFECOMPILE_DISABLE and disable()/enable(): honoured at the next call, no restart."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

import safecompile
from safecompile import ENV_VAR, EventKind, State, safe_compile
from safecompile.base import killswitch as ks
from safecompile.base.killswitch import parse
from safecompile.testing import RecordingBackend


def inc(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off", "OFF", " False "])
def test_off_words_enable(value: str) -> None:
    """Unset, empty and the off words leave every callable enabled."""
    rule = parse(value)
    assert not rule.matches("anything")


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", "all", "*", "TRUE", " on "])
def test_all_words_disable_everything(value: str) -> None:
    """The on words disable every guarded callable."""
    assert parse(value).matches("ranker.score")


def test_names_and_globs() -> None:
    """Anything else is a comma-separated list of names or fnmatch globs."""
    rule = parse("ranker.*, embed.forward")
    assert rule.matches("ranker.score")
    assert rule.matches("embed.forward")
    assert not rule.matches("embed.backward")
    assert not rule.matches("other.ranker.score")


def test_env_flip_at_runtime_takes_effect_next_call(
    monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """Setting the variable in os.environ disables at the next call; unsetting re-enables."""
    backend = RecordingBackend()
    g = safe_compile(inc, backend=backend, shadow=None, name="ranker.inc")
    g(x)
    assert g.safecompile.state == State.COMPILED
    monkeypatch.setenv(ENV_VAR, "ranker.*")
    torch.testing.assert_close(g(x), x + 1)
    assert g.safecompile.state == State.DISABLED
    assert g.safecompile.stats().eager_calls == 1
    assert backend.runs == 1
    monkeypatch.setenv(ENV_VAR, "other.*")
    g(x)
    assert g.safecompile.state == State.COMPILED
    assert backend.runs == 2
    kinds = [e.kind for e in g.safecompile.events()]
    assert kinds.count(EventKind.DISABLED) == 1
    assert kinds.count(EventKind.ENABLED) == 1


def test_disabled_never_calls_torch_compile(
    monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """While disabled, nothing is compiled, not even on the first call."""
    monkeypatch.setenv(ENV_VAR, "1")
    backend = RecordingBackend()
    g = safe_compile(inc, backend=backend, shadow=None)
    for _ in range(3):
        g(x)
    assert backend.compiles == 0
    assert g.safecompile.state == State.DISABLED
    g.safecompile.warmup(x)
    assert backend.compiles == 0


def test_disabled_at_decoration_never_calls_torch_compile_itself(
    monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """Decorated while disabled: ``torch.compile`` itself is not called (not even lazily,
    at decoration) until the switch is lifted; then once, on the first call."""
    calls: list[object] = []
    real_compile = torch.compile

    def counting_compile(*args: object, **kwargs: object) -> object:
        calls.append(args[0] if args else None)
        return real_compile(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "compile", counting_compile)
    monkeypatch.setenv(ENV_VAR, "1")
    g = safe_compile(inc, backend="eager", shadow=None)
    module = safe_compile(torch.nn.Linear(8, 2), backend="eager", shadow=None)
    for _ in range(3):
        torch.testing.assert_close(g(x), inc(x))
        module(x)
    g.safecompile.warmup(x)
    g.safecompile.reset()
    assert calls == []
    assert g.safecompile.state == State.DISABLED
    monkeypatch.delenv(ENV_VAR)
    torch.testing.assert_close(g(x), inc(x))
    torch.testing.assert_close(g(x), inc(x))
    assert calls == [inc]
    assert g.safecompile.stats().compiled_calls == 2


def test_disable_enable_from_code(x: torch.Tensor) -> None:
    """safecompile.disable()/enable() do the same from code, by name or for all."""
    a = safe_compile(inc, backend="eager", shadow=None, name="ranker.a")
    b = safe_compile(inc, backend="eager", shadow=None, name="embed.b")
    safecompile.disable("ranker.*")
    a(x)
    b(x)
    assert a.safecompile.state == State.DISABLED
    assert b.safecompile.state == State.COMPILED
    safecompile.disable()
    b(x)
    assert b.safecompile.state == State.DISABLED
    safecompile.enable()
    a(x)
    b(x)
    assert a.safecompile.state == State.COMPILED
    assert b.safecompile.state == State.COMPILED


def test_disable_turns_the_hot_path_eager_at_the_next_call(x: torch.Tensor) -> None:
    """disable() makes every callable's token stale: its next call re-reads the switch
    (no ``state`` read in between does it for the hot path)."""
    backend = RecordingBackend()
    g = safe_compile(inc, backend=backend, shadow=None, name="ranker.inc")
    g(x)
    safecompile.disable("ranker.*")
    torch.testing.assert_close(g(x), x + 1)
    safecompile.enable()
    g(x)
    stats = g.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls, backend.runs) == (2, 1, 2)


def test_a_disable_while_the_switch_is_re_read_is_not_lost(
    monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """disable() from another thread after a callable read the rules, before it stored the
    environment value it read: the next call re-reads the switch all the same."""
    g = safe_compile(inc, backend="eager", shadow=None, name="ranker.inc")
    g(x)
    source_of = ks.source_of

    def racing(name: str, value: Any) -> str | None:
        found = source_of(name, value)  # the rules as they were: enabled
        monkeypatch.setattr(ks, "source_of", source_of)
        safecompile.disable()  # lands now, before the re-read stores its token
        return found

    monkeypatch.setattr(ks, "source_of", racing)
    monkeypatch.setenv(ENV_VAR, "other.*")  # a new value: the next call re-reads
    g(x)  # read before the disable(): compiled
    g(x)
    stats = g.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls) == (2, 1)


def test_enable_does_not_override_environment(
    monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """enable() undoes disable(); the environment variable still applies."""
    monkeypatch.setenv(ENV_VAR, "all")
    g = safe_compile(inc, backend="eager", shadow=None)
    safecompile.enable()
    g(x)
    assert g.safecompile.state == State.DISABLED


def test_disable_rejects_non_strings() -> None:
    """disable() takes names or globs as strings."""
    with pytest.raises(TypeError):
        safecompile.disable([3])  # type: ignore[list-item]


# ---------------------------------------------------------------- which switch, and doubts


@pytest.fixture
def fresh_doubts() -> Iterator[None]:
    """Doubts are warned once per process: forget those warned and the names built."""
    saved = set(ks.SWITCH.warned), set(ks.SWITCH.names)
    ks.SWITCH.warned.clear()
    ks.SWITCH.names.clear()
    yield
    ks.SWITCH.warned.clear()
    ks.SWITCH.names.clear()
    ks.SWITCH.warned.update(saved[0])
    ks.SWITCH.names.update(saved[1])


def _disabled_message(g: Any) -> str:
    [event] = [e for e in g.safecompile.events() if e.kind is EventKind.DISABLED]
    return str(event.message)


def test_the_disabled_event_names_the_environment_value(
    monkeypatch: pytest.MonkeyPatch, x: torch.Tensor
) -> None:
    """The event says which switch turned the callable off: the variable and its value."""
    monkeypatch.setenv(ENV_VAR, "ranker.*")
    g = safe_compile(inc, backend="eager", shadow=None, name="ranker.inc")
    g(x)
    assert "SAFECOMPILE_DISABLE='ranker.*' turned this callable off" in _disabled_message(g)


def test_the_disabled_event_names_disable_from_code(x: torch.Tensor) -> None:
    """disable() is named as such, not as the environment."""
    g = safe_compile(inc, backend="eager", shadow=None, name="ranker.inc")
    safecompile.disable("ranker.*")
    g(x)
    message = _disabled_message(g)
    assert "disable() turned this callable off" in message
    assert ENV_VAR not in message


def test_the_disabled_event_names_the_watched_source(x: torch.Tensor) -> None:
    """The fleet's watched source is named with its label."""
    g = safe_compile(inc, backend="eager", shadow=None, name="ranker.inc")
    ks.set_watched(parse("ranker.*"), "file:///etc/safecompile/disable")
    try:
        g(x)
        message = _disabled_message(g)
    finally:
        ks.set_watched(ks.NOTHING, "unset")
    assert "the watched source file:///etc/safecompile/disable turned this callable off" in message


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("maybe", "neither a boolean"),
        ("2", "neither a boolean"),
        ("y", "neither a boolean"),
        ("disable", "neither a boolean"),
        ("ranker.*;embed.*", "separate names with commas ('ranker.*,embed.*')"),
        ("ranker.* embed.*", "separate names with commas"),
        ("Ranker.*", "case-sensitive; it would match 'ranker.score'"),
    ],
)
def test_a_doubtful_value_gets_one_warning_naming_it(
    value: str, says: str, monkeypatch: pytest.MonkeyPatch, fresh_doubts: None, x: torch.Tensor
) -> None:
    """An operator's typo disables nothing, but it is not silent: one warning event
    (logged at WARNING) naming the value and how it was read, once per process."""
    monkeypatch.setenv(ENV_VAR, value)
    with capture_logs() as logs:
        g = safe_compile(inc, backend="eager", shadow=None, name="ranker.score")
        g(x)
        h = safe_compile(inc, backend="eager", shadow=None, name="ranker.other")
        h(x)
    warnings = [e for e in g.safecompile.events() if e.kind is EventKind.SWITCH_WARNING]
    assert len(warnings) == 1
    assert f"SAFECOMPILE_DISABLE={value!r}" in str(warnings[0].message)
    assert says in str(warnings[0].message)
    assert not [e for e in h.safecompile.events() if e.kind is EventKind.SWITCH_WARNING]
    logged = [e for e in logs if e["event"] == "safecompile.switch_warning"]
    assert len(logged) == 1
    assert logged[0]["log_level"] == "warning"
    assert g.safecompile.state == State.COMPILED


@pytest.mark.parametrize("value", ["1", "off", "ranker.*", "solo,ranker.score", "solo"])
def test_a_sound_value_gets_no_warning(
    value: str, monkeypatch: pytest.MonkeyPatch, fresh_doubts: None, x: torch.Tensor
) -> None:
    """Booleans, patterns that match and a bare word that is a guarded name are not
    doubted."""
    monkeypatch.setenv(ENV_VAR, value)
    safe_compile(inc, backend="eager", shadow=None, name="solo")
    g = safe_compile(inc, backend="eager", shadow=None, name="ranker.score")
    g(x)
    assert not [e for e in g.safecompile.events() if e.kind is EventKind.SWITCH_WARNING]


def test_a_value_set_while_running_is_doubted_at_the_next_call(
    monkeypatch: pytest.MonkeyPatch, fresh_doubts: None, x: torch.Tensor
) -> None:
    """The value is checked when it changes, not only when a guard is built."""
    g = safe_compile(inc, backend="eager", shadow=None, name="ranker.score")
    g(x)
    monkeypatch.setenv(ENV_VAR, "maybe")
    g(x)
    kinds = [e.kind for e in g.safecompile.events()]
    assert kinds.count(EventKind.SWITCH_WARNING) == 1


def test_a_pattern_matching_no_guarded_name_is_warned_once_guards_are_built(
    monkeypatch: pytest.MonkeyPatch, fresh_doubts: None, x: torch.Tensor
) -> None:
    """``rankr.*`` (a typo) matches nothing: warned at the first compiled call, once the
    application's guards are built; ``embed.*`` is not, since a guard built after the
    first one matches it."""
    monkeypatch.setenv(ENV_VAR, "rankr.*,embed.*")
    ranker = safe_compile(inc, backend="eager", shadow=None, name="ranker.score")
    assert not [e for e in ranker.safecompile.events() if e.kind is EventKind.SWITCH_WARNING]
    embed = safe_compile(inc, backend="eager", shadow=None, name="embed.forward")
    ranker(x)
    embed(x)
    warnings = [e for e in ranker.safecompile.events() if e.kind is EventKind.SWITCH_WARNING]
    assert [str(w.message) for w in warnings] == [
        "SAFECOMPILE_DISABLE='rankr.*,embed.*': 'rankr.*' disables nothing here: it matches"
        " none of the 2 guarded names in this process ('embed.forward', 'ranker.score')"
    ]
    assert embed.safecompile.state == State.DISABLED
    assert not [e for e in embed.safecompile.events() if e.kind is EventKind.SWITCH_WARNING]
