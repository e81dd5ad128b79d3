"""Zero code: every ``torch.compile`` of a program answered by :func:`safe_compile`.

``safecompile run [OPTIONS] -- COMMAND...`` puts a ``sitecustomize`` directory first on
``PYTHONPATH`` and runs the command, like ``opentelemetry-instrument``: the program and
every Python process it starts (``torchrun`` workers, ``multiprocessing`` spawn children,
a ``subprocess`` Python) install the runner as soon as they import ``torch``.
:func:`install` / :func:`uninstall` do the same in one process from code.

Under the runner ``torch.compile`` keeps its signature and calling forms; each callable
it is given is guarded by ``safe_compile`` with torch.compile's own options plus the
runner's (``SAFECOMPILE_RUN_OPTIONS``), named after the compiled function. The contract
for what it returns (docs/zero-code.md):

- a function or a bound method (``nn.Module.compile()`` compiles ``self._call_impl``):
  the guarded callable, as ``safe_compile`` returns it;
- an ``nn.Module``: a subclass of torch's ``OptimizedModule``, as ``torch.compile``
  returns: ``_orig_mod`` is the module (left unguarded), ``state_dict()`` keys carry
  torch's ``_orig_mod.`` prefix, attributes read through, and ``forward`` goes through the
  guard; ``.safecompile`` is its controller.

``disable=True``, ``shapes_spec=``, ``options={"use_aoti": ...}`` and torch's own calls
(its higher-order ops run eagerly through ``torch.compile``) go to torch's own
``torch.compile`` unchanged, as does a call ``safe_compile`` refuses (torch raises its own
error or compiles it, unguarded, and an event ``safecompile.run.unguarded`` says why).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib
import inspect
import json
import logging
import os
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from safecompile.base import torchcompat
from safecompile.base.errors import ConfigError
from safecompile.base.forks import in_forked_child
from safecompile.base.killswitch import ENV_VAR as DISABLE_VAR
from safecompile.base.options import Options
from safecompile.base.policies import Rollback, Shadow
from safecompile.compose import safe_compile
from safecompile.observe.log import log_event

__all__ = [
    "ENV_OPTIONS",
    "SITE_DIR",
    "Settings",
    "install",
    "install_from_environment",
    "installed",
    "main",
    "settings_from",
    "uninstall",
]

#: The runner's options: one JSON object (see :func:`settings_from`).
ENV_OPTIONS = "SAFECOMPILE_RUN_OPTIONS"
#: The directory ``safecompile run`` puts first on ``PYTHONPATH`` (its ``sitecustomize``).
SITE_DIR = Path(__file__).resolve().parent / "_autorun"

EXIT_USAGE = 2
EXIT_NOT_FOUND = 127
_OTEL_EXPORTERS = ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER")
_DEFAULT = Options()


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The runner's options: ``safe_compile``'s, for every call it answers."""

    shadow: Shadow | None = _DEFAULT.shadow
    rollback: Rollback = _DEFAULT.rollback
    rollout: float = _DEFAULT.rollout

    def __post_init__(self) -> None:  # the decorator's own checks and messages
        Options(shadow=self.shadow, rollback=self.rollback, rollout=self.rollout)


_POLICIES: dict[str, type] = {"shadow": Shadow, "rollback": Rollback}
_KEYS = tuple(f.name for f in dataclasses.fields(Settings))


def _did_you_mean(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _policy(key: str, value: object) -> Any:
    """``{"canary": 2}`` as ``Shadow(canary=2)``; ``null`` stays ``None``."""
    cls = _POLICIES[key]
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(
            f"{ENV_OPTIONS}: {key!r} must be an object of {cls.__name__}'s fields or null, "
            f"got {value!r}"
        )
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    for field in value:
        if field not in fields:
            raise ConfigError(
                f"{ENV_OPTIONS}: {cls.__name__} has no field {field!r}"
                f"{_did_you_mean(field, fields)}; allowed: {', '.join(fields)}"
            )
    return cls(**value)


def settings_from(text: str | None) -> Settings:
    """The runner's options from ``SAFECOMPILE_RUN_OPTIONS``'s text: a JSON object with any
    of ``shadow`` (``Shadow``'s fields as an object, or ``null`` for no checks),
    ``rollback`` (``Rollback``'s fields) and ``rollout`` (a fraction). Unset or empty:
    the decorator's defaults. Raises :class:`ConfigError` naming what is wrong."""
    if text is None or not text.strip():
        return Settings()
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{ENV_OPTIONS} is not JSON ({exc}): {text!r}") from None
    if not isinstance(given, dict):
        raise ConfigError(f"{ENV_OPTIONS} must be a JSON object, got {text!r}")
    for key in given:
        if key not in _KEYS:
            raise ConfigError(
                f"{ENV_OPTIONS}: unknown option {key!r}{_did_you_mean(key, _KEYS)}; "
                f"allowed: {', '.join(_KEYS)}"
            )
    if "rollback" in given and given["rollback"] is None:
        raise ConfigError(f"{ENV_OPTIONS}: 'rollback' cannot be null; leave it out")
    try:
        values = {k: _policy(k, v) if k in _POLICIES else v for k, v in given.items()}
        return Settings(**values)
    except ConfigError as exc:
        text = str(exc)
        raise ConfigError(
            text if text.startswith(ENV_OPTIONS) else f"{ENV_OPTIONS}: {text}"
        ) from None


# ------------------------------------------------------------------ install


@dataclass(slots=True)
class _Installed:
    original: Callable[..., Any]
    replacement: Callable[..., Any]
    settings: Settings


class _Process:
    """What the runner keeps for the whole process (``torch.compile`` is process-wide):
    what :func:`install` replaced and with what, under one lock, and the names given to
    compiled targets. A forked child gets fresh locks (a thread holding one is gone)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.installed: _Installed | None = None
        self.names = _Names()

    def after_fork_in_child(self) -> None:
        self.lock = threading.RLock()
        self.names.after_fork_in_child()


_KEEP = object()  # install()'s "from the environment" default


def installed() -> bool:
    """Whether ``torch.compile`` is answered by safecompile in this process now."""
    with _PROCESS.lock:
        state = _PROCESS.installed
        return state is not None and torch.compile is state.replacement


def install(
    *,
    shadow: Shadow | object | None = _KEEP,
    rollback: Rollback | object = _KEEP,
    rollout: float | object = _KEEP,
) -> None:
    """Answer every later ``torch.compile`` of this process with ``safe_compile``.

    Options left out come from ``SAFECOMPILE_RUN_OPTIONS``; bad ones raise
    :class:`ConfigError`. Idempotent and thread-safe: installing again only updates the
    options for the calls that follow. Callables compiled before stay as they were, and
    code that bound ``torch.compile`` to another name earlier keeps torch's. Child
    processes are covered by ``safecompile run``, not by this.
    """
    given = {"shadow": shadow, "rollback": rollback, "rollout": rollout}
    settings = settings_from(os.environ.get(ENV_OPTIONS))
    overrides: dict[str, Any] = {k: v for k, v in given.items() if v is not _KEEP}
    if overrides:
        settings = dataclasses.replace(settings, **overrides)
    _install(settings)


def _install(settings: Settings) -> None:
    with _PROCESS.lock:
        state = _PROCESS.installed
        if state is not None and torch.compile is state.replacement:
            state.settings = settings
            return
        original = torchcompat.torch_compile()
        state = _PROCESS.installed = _Installed(original, _replacement(original), settings)
        torch.compile = state.replacement


def uninstall() -> None:
    """Give ``torch.compile`` back to torch. Idempotent and thread-safe; callables already
    guarded stay guarded. When something replaced ``torch.compile`` again after
    :func:`install`, that replacement is left in place (it still calls ours)."""
    with _PROCESS.lock:
        state = _PROCESS.installed
        if state is None:
            return
        if torch.compile is state.replacement:
            torch.compile = state.original
        _PROCESS.installed = None


def _settings() -> Settings | None:
    state = _PROCESS.installed
    return state.settings if state is not None else None


def _replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` with ``original``'s signature, answered by ``safe_compile``."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        if _torch_internal(sys._getframe(1).f_globals.get("__name__")):
            return original(*args, **kwargs)
        return _answer(original, signature, args, kwargs)

    compile.__signature__ = signature  # type: ignore[attr-defined]
    compile.__safecompile_original__ = original  # type: ignore[attr-defined]
    return compile


# torch modules whose torch.compile is the user's: the rest of torch compiles its own
# machinery with it (higher-order ops run eagerly, flex attention, block masks)
_TORCH_FOR_USERS = frozenset({"torch.nn.modules.module", "torch.compiler"})


def _torch_internal(caller: object) -> bool:
    """Whether ``torch.compile`` was called by torch itself, for its own use."""
    if not isinstance(caller, str) or caller in _TORCH_FOR_USERS:
        return False
    return caller == "torch" or caller.startswith("torch.")


def _answer(
    original: Callable[..., Any],
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)  # torch's own error
    bound.apply_defaults()
    given = dict(bound.arguments)
    first = next(iter(signature.parameters))
    model = given.pop(first)
    if model is None:  # the decorator form, @torch.compile(...)
        options = {k: v for k, v in kwargs.items() if k != first}

        def decorate(fn: Any) -> Any:
            if fn is None:
                return original(**options)(fn)  # torch's "Model can't be None"
            return _answer(original, signature, (fn,), options)

        return decorate
    settings = _settings()
    if (
        given.get("disable")
        or settings is None
        or torch.compiler.is_exporting()
        or torch.compiler.is_compiling()  # a compile inside a traced function
    ):
        return original(*args, **kwargs)
    reason = _torch_only(given)
    if reason is None:
        try:
            return _guard(model, given, settings)
        except (ConfigError, TypeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
    log_event(
        "safecompile.run.unguarded",
        level=logging.WARNING,
        function=_describe(model)[0],
        reason=reason,
    )
    return original(*args, **kwargs)


def _torch_only(given: Mapping[str, Any]) -> str | None:
    """Why torch's own ``torch.compile`` must answer this call, or ``None``."""
    if given.get("shapes_spec") is not None:
        return "shapes_spec= is torch.compile's own"
    options = given.get("options")
    if isinstance(options, Mapping) and options.get("use_aoti"):
        return "options={'use_aoti': ...} is torch.compile's own"
    return None


def _default_backend() -> str:
    found = torchcompat.lookup("torch._dynamo.backends.registry.get_default_backend")
    return str(found()) if callable(found) else "inductor"


def _guard(model: Any, given: Mapping[str, Any], settings: Settings) -> Any:
    rollback = settings.rollback
    limit = given.get("recompile_limit")
    if limit is not None:
        rollback = dataclasses.replace(rollback, max_recompiles=limit)
    options = given.get("options")
    keywords: dict[str, Any] = {
        "backend": given.get("backend") or _default_backend(),
        "mode": given.get("mode"),
        "options": dict(options) if options is not None else None,
        "dynamic": given.get("dynamic"),
        "fullgraph": bool(given.get("fullgraph", False)),
        "shadow": settings.shadow,
        "rollback": rollback,
        "rollout": settings.rollout,
    }
    label = given.get("name")
    if isinstance(model, torch.nn.Module):
        return _wrap_module(model, keywords, label, dict(given))
    if getattr(model, "safecompile", None) is not None:
        return model  # already guarded: once is enough
    return safe_compile(model, name=label or _PROCESS.names.claim(model), **keywords)


# ------------------------------------------------------------------ names


def _module_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}.forward"


_CALLS = ("__call__", "_call_impl", "_wrapped_call_impl", "forward")


def _describe(target: Any) -> tuple[str, object]:
    """The readable name of ``target`` and what makes it the same target again."""
    inner = target
    while isinstance(inner, functools.partial):
        inner = inner.func
    if isinstance(inner, torch.nn.Module):
        return _module_name(type(inner)), type(inner)
    if isinstance(inner, types.MethodType):
        owner, func = inner.__self__, inner.__func__
        cls = owner if isinstance(owner, type) else type(owner)
        if isinstance(owner, torch.nn.Module) and func.__name__ in _CALLS:
            return _module_name(cls), cls
        return f"{cls.__module__}.{cls.__qualname__}.{func.__name__}", func
    code = getattr(inner, "__code__", None)
    if not hasattr(inner, "__qualname__"):  # a callable object
        inner = type(inner)
    name = f"{getattr(inner, '__module__', None) or '__main__'}.{inner.__qualname__}"
    if isinstance(code, types.CodeType) and inner.__name__ == "<lambda>":
        name = f"{name}:{code.co_firstlineno}"  # each lambda by its line
    return name, code if code is not None else inner


class _Names:
    """Each compiled target's name: readable, and the same in every run of a program."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, list[object]] = {}

    def claim(self, target: Any) -> str:
        """``module.qualname`` of what is compiled (a module's class plus ``.forward``;
        a lambda plus its line); another target under a name taken gets ``#2``, ``#3``..."""
        name, identity = _describe(target)
        with self._lock:
            seen = self._seen.setdefault(name, [])
            if identity not in seen:
                seen.append(identity)
            index = seen.index(identity)
        return name if index == 0 else f"{name}#{index + 1}"

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork


_PROCESS = _Process()
in_forked_child(_PROCESS.after_fork_in_child)


# ------------------------------------------------------------------ modules


def _wrap_module(
    module: torch.nn.Module, keywords: dict[str, Any], label: str | None, given: dict[str, Any]
) -> torch.nn.Module:
    cls = _guarded_module_class()
    if cls is None:  # a torch without OptimizedModule: guard in place
        return safe_compile(module, name=label or _PROCESS.names.claim(module), **keywords)
    if getattr(module, "safecompile", None) is not None:
        forward: Callable[..., Any] = module.__call__  # guarded in place already
    else:
        name = label or _PROCESS.names.claim(module)
        forward = safe_compile(module.__call__, name=name, **keywords)
    return cls(module, forward, given)  # type: ignore[no-any-return]


def _compile_again(module: torch.nn.Module, given: dict[str, Any]) -> Any:
    """A pickled or deep-copied compiled module: ``torch.compile`` of its module again."""
    return torch.compile(module, **given)


@functools.cache
def _guarded_module_class() -> type | None:
    base = torchcompat.lookup("torch._dynamo.eval_frame.OptimizedModule")
    if not isinstance(base, type):
        return None

    class GuardedModule(base):  # type: ignore[misc, valid-type]
        """``torch.compile(module)`` under the runner: torch's ``OptimizedModule`` whose
        ``forward`` is the guarded ``_orig_mod.__call__`` (checked: 2.13.0)."""

        # class attributes, so OptimizedModule.__setattr__ keeps them on the wrapper
        safecompile: Any = None
        _safecompile_forward: Any = None
        _safecompile_given: Any = None

        def __init__(
            self, mod: torch.nn.Module, forward: Callable[..., Any], given: dict[str, Any]
        ) -> None:
            object.__setattr__(self, "_safecompile_forward", forward)
            object.__setattr__(self, "_safecompile_given", given)
            super().__init__(mod, None)
            self.safecompile = getattr(forward, "safecompile", None)

        def _initialize(self) -> None:
            self.forward = self._safecompile_forward
            if hasattr(self._orig_mod, "_initialize_hook"):  # a lazy module, as torch does
                self._forward = self.forward
                self.forward = self._call_lazy_check

        def __reduce__(self) -> tuple[Any, ...]:
            return (_compile_again, (self._orig_mod, self._safecompile_given))

    GuardedModule.__qualname__ = "GuardedModule"
    return GuardedModule


# ------------------------------------------------------------------ the runner


def install_from_environment() -> None:
    """What ``safecompile run``'s ``sitecustomize`` calls once ``torch`` is imported:
    telemetry exporters from ``OTEL_*`` (with the ``otel`` extra), then :func:`install`
    with ``SAFECOMPILE_RUN_OPTIONS``. Bad options leave ``torch.compile`` as torch's and
    say so on stderr (``safecompile run`` refuses them before starting the command)."""
    try:
        settings = settings_from(os.environ.get(ENV_OPTIONS))
    except ConfigError as exc:
        print(f"safecompile run: {exc}; torch.compile is not guarded", file=sys.stderr)
        return
    problem = _configure_telemetry()
    if problem is not None:
        print(f"safecompile run: {problem}", file=sys.stderr)
    _install(settings)


def _exporters(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        var: environ[var]
        for var in _OTEL_EXPORTERS
        if environ.get(var, "").strip().lower() not in ("", "none")
    }


def _configure_telemetry() -> str | None:
    """Global OpenTelemetry providers from the ``OTEL_*`` variables, as the OpenTelemetry
    distro sets them up (the runner only: the library never sets a global provider).
    Returns what went wrong, or ``None``."""
    if not _exporters(os.environ):
        return None
    try:
        configuration = importlib.import_module("opentelemetry.sdk._configuration")
        configuration._OTelSDKConfigurator().configure()
    except ImportError:
        return "OTEL_*_EXPORTER is set but no OpenTelemetry SDK: pip install 'safecompile[otel]'"
    except Exception as exc:  # telemetry never stops the program
        return f"telemetry not set up from OTEL_* ({type(exc).__name__}: {exc})"
    return None


def _environment(options: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if options is not None:
        env[ENV_OPTIONS] = options
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *paths])
    return env


def _config_text(settings: Settings, env: Mapping[str, str]) -> str:
    try:
        importlib.import_module("opentelemetry.sdk")
        sdk = "installed"
    except ImportError:
        sdk = "not installed (pip install 'safecompile[otel]')"
    exporters = _exporters(env)
    telemetry = ", ".join(f"{k}={v}" for k, v in exporters.items()) or "no OTEL_*_EXPORTER set"
    lines = [
        "safecompile run: every torch.compile answered by safe_compile",
        f"  {ENV_OPTIONS}: {env.get(ENV_OPTIONS) or '(not set: the defaults)'}",
        f"  shadow: {settings.shadow!r}",
        f"  rollback: {settings.rollback!r}",
        f"  rollout: {settings.rollout!r}",
        f"  {DISABLE_VAR}: {env.get(DISABLE_VAR) or '(not set)'}",
        f"  telemetry: {telemetry}; OpenTelemetry SDK {sdk}",
        f"  PYTHONPATH: {env['PYTHONPATH']}",
    ]
    return "\n".join(lines)


_USAGE = "safecompile run [--options JSON] [--print-config] -- COMMAND..."
_DESCRIPTION = f"""\
Run COMMAND with every torch.compile in it, and in every Python process it starts,
answered by safe_compile (a sitecustomize first on PYTHONPATH, like opentelemetry-instrument).
Options: {ENV_OPTIONS}, a JSON object with any of "shadow" (Shadow's fields, or null),
"rollback" (Rollback's fields) and "rollout" (a fraction), e.g.
{ENV_OPTIONS}='{{"shadow": {{"canary": 8, "every": 64}}}}'. {DISABLE_VAR} turns callables
off by name; OTEL_* variables set up the exporters (with the otel extra)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safecompile run",
        usage=_USAGE,
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--options", metavar="JSON", help=f"the options, instead of ${ENV_OPTIONS}")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the options the command would run with, and exit",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """``safecompile run``: exits with the command's code (it replaces this process),
    2 on a usage error, 127 when the command is not found."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    flags, command = argv[:cut], argv[cut + 1 :]
    try:
        args = _parser().parse_args(flags)
    except SystemExit as exc:  # --help, or a bad flag (argparse printed why)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    env = _environment(args.options)
    try:
        settings = settings_from(env.get(ENV_OPTIONS))
    except ConfigError as exc:
        print(f"safecompile run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.print_config:
        print(_config_text(settings, env))
        return 0
    if not command:
        print(f"usage: {_USAGE}\nsafecompile run: error: no command to run", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"safecompile run: error: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
