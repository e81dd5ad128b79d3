"""The doctor: is a callable ready for ``safe_compile`` in production?

``python -m safecompile doctor MODULE:FACTORY`` imports ``MODULE``, calls ``FACTORY()`` for
the callable and its example inputs (:class:`DoctorTarget` lists the forms accepted), runs
it through ``safe_compile`` as production would, next to eager, and answers the questions to
settle before switching compilation on:

- compile: does every example compile, and how long does a cold first call take?
- graph breaks: where (file, line, function) and why does dynamo split the graph?
- recompiles: how many compiles does a sweep of batch and sequence sizes cost, against
  the recompile limit?
- speed: the compiled path's median per-call time against eager's, measured interleaved;
- drift: how far are compiled outputs from eager's?

Measuring (:func:`diagnose`), judging (:func:`judge`) and rendering (:func:`render_text`,
:func:`render_html`, :meth:`Report.to_dict`) are separate: judging and rendering are pure
functions of a :class:`Report`. ``docs/doctor.md`` describes the checks, their thresholds
and the exit codes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import linecache
import math
import os
import platform
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from safecompile._version import __version__
from safecompile.base.errors import ConfigError
from safecompile.base.model import Event, EventKind, State
from safecompile.base.policies import Buckets, Rollback
from safecompile.checks.compare import compare
from safecompile.guard.backend import backend_name, build_compiler, validate_compile_options
from safecompile.guard.decorator import safe_compile
from safecompile.guard.graphs import random_op
from safecompile.observe.progress import spinner
from safecompile.observe.source import dedupe_graph_breaks, graph_breaks_of, location_of_function

from .html import render_html

__all__ = [
    "SCHEMA",
    "Call",
    "Check",
    "DoctorTarget",
    "Example",
    "Failure",
    "Report",
    "Settings",
    "Thresholds",
    "Timing",
    "UsageError",
    "diagnose",
    "is_debug_backend",
    "judge",
    "load_target",
    "parse_inputs",
    "render_html",
    "render_text",
    "to_target",
]

SCHEMA = "safecompile.doctor/1"
"""The ``schema`` field of the JSON report; bumped when a field changes meaning."""

Status = Literal["pass", "warn", "fail", "skip"]
CallPath = Literal["compiled", "eager", "failed", "skipped"]

_SAMPLE_S = 2e-3  # a timing sample runs the call enough times to last about this long
_MAX_INNER = 1000
_MAX_TIMED = 4  # examples timed (the first ones)
_LABEL_LIMIT = 120
_DEFAULT_LIMIT = Rollback().recompile_limit
_NOISY_SPREAD = 0.25  # timing pairs' interquartile range over their median ratio


class UsageError(Exception):
    """The doctor cannot run on what it was given (exit code 2).

    The message is one line; where the user's own code raised, it names the line.
    ``detail`` is more text for the user (the traceback from their own code), or ``None``.
    """

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


# ---------------------------------------------------------------------------- the target


@dataclass(frozen=True, slots=True)
class Example:
    """One example call: positional and keyword arguments."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        """Shapes and dtypes, never values: ``float32[8, 16], mask=bool[8, 16]``."""
        parts = [_describe(a) for a in self.args]
        parts += [f"{k}={_describe(v)}" for k, v in self.kwargs.items()]
        text = ", ".join(parts) or "(no arguments)"
        return text if len(text) <= _LABEL_LIMIT else text[: _LABEL_LIMIT - 1] + "\u2026"


@dataclass(frozen=True, kw_only=True)
class DoctorTarget:
    """What a doctor ``FACTORY()`` returns: the callable, example inputs and options.

    ``fn`` is a function or an ``nn.Module`` (its ``forward`` is checked; module hooks do
    not run), plain or already guarded by ``safe_compile`` (its backend, mode, dynamic and
    fullgraph are then the defaults). ``inputs`` is the example calls: a **list** of calls,
    each a tuple of positional arguments, a dict of keyword arguments or a single tensor;
    or **one** call, given as a tuple of positional arguments, a dict or a tensor. Give one
    example per shape you serve: each is compiled cold, timed against eager and checked for
    drift.

    ``backend``, ``mode``, ``options``, ``dynamic``, ``fullgraph``, ``buckets`` and ``name``
    are ``safe_compile``'s (``backend=None``: ``"inductor"``); ``max_recompiles`` is
    ``Rollback(max_recompiles=...)``'s; ``rtol``/``atol`` are the drift tolerances
    (``None``: per-dtype defaults). ``sweep=None`` lets the doctor vary the leading and
    sequence dims of the first example; ``()`` skips the sweep; a list of calls (like
    ``inputs``) sweeps those. Command-line flags override these fields.
    """

    fn: Callable[..., Any]
    inputs: Any
    name: str | None = None
    backend: str | Callable[..., Any] | None = None
    mode: str | None = None
    options: Mapping[str, Any] | None = None
    dynamic: bool | None = None
    fullgraph: bool = False
    buckets: Buckets | None = None
    max_recompiles: int | None = None
    rtol: float | None = None
    atol: float | None = None
    sweep: Any = None


def to_target(value: object, factory: str = "FACTORY") -> DoctorTarget:
    """``FACTORY()``'s return value as a :class:`DoctorTarget` (:class:`UsageError` if not one).

    Accepted: a ``DoctorTarget``, or a pair ``(fn, inputs)``.
    """
    if isinstance(value, DoctorTarget):
        target = value
    elif isinstance(value, tuple) and len(value) == 2 and callable(value[0]):
        target = DoctorTarget(fn=value[0], inputs=value[1])
    else:
        hint = " (a callable without inputs: return (fn, inputs))" if callable(value) else ""
        raise UsageError(
            f"{factory}() returned {_kind(value)}{hint}; expected "
            "DoctorTarget(fn=..., inputs=[...]) or a pair (fn, inputs), where inputs is a "
            "list of calls (each a tuple of arguments, a dict of keyword arguments or a "
            "tensor) or one call's tuple of arguments"
        )
    if not callable(target.fn):
        raise UsageError(
            f"{factory}(): fn must be a function or an nn.Module, got {_kind(target.fn)}"
        )
    parse_inputs(target.inputs, f"{factory}(): inputs")  # refuse bad inputs now
    if target.sweep is not None and not (
        isinstance(target.sweep, Sequence) and len(target.sweep) == 0
    ):
        parse_inputs(target.sweep, f"{factory}(): sweep")
    return target


def parse_inputs(value: object, what: str = "inputs") -> tuple[Example, ...]:
    """The example calls in ``value`` (see :class:`DoctorTarget`); :class:`UsageError` if none."""
    if isinstance(value, torch.Tensor | tuple | Mapping):
        return (_one(value, what),)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        if not value:
            raise UsageError(f"{what} is empty: give at least one example call")
        return tuple(_one(item, f"{what}[{i}]") for i, item in enumerate(value))
    raise UsageError(
        f"{what} must be a list of calls (each a tuple of arguments, a dict of keyword "
        f"arguments or a tensor) or one call's tuple of arguments, got {_kind(value)}"
    )


def _one(value: object, what: str) -> Example:
    if isinstance(value, torch.Tensor):
        return Example((value,))
    if isinstance(value, tuple):
        return Example(value)
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            raise UsageError(f"{what}: keyword argument names must be identifiers, got {bad[0]!r}")
        return Example((), dict(value))
    raise UsageError(
        f"{what} must be a tuple of positional arguments, a dict of keyword arguments or a "
        f"tensor, got {_kind(value)} (wrap one argument as (arg,))"
    )


def load_target(spec: str) -> DoctorTarget:
    """Import ``MODULE`` and call ``FACTORY()`` for ``spec = "MODULE:FACTORY"``.

    ``MODULE`` is a dotted module name (the current directory is importable, as with
    ``python -m``) or a path to a ``.py`` file; ``FACTORY`` may be dotted
    (``Class.method``). Every failure is a :class:`UsageError`.
    """
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr or os.sep in attr:
        raise UsageError(
            f"expected MODULE:FACTORY (e.g. mypkg.models:doctor_target or "
            f"path/to/file.py:doctor_target), got {spec!r}"
        )
    module = _import(module_part)
    factory: Any = module
    for part in attr.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            raise UsageError(
                f"{module_part} has no attribute {attr!r} (looked for the factory in "
                f"{getattr(module, '__file__', module_part)})"
            ) from None
    if not callable(factory):
        raise UsageError(f"{spec} is {_kind(factory)}, not a callable factory")
    try:
        value = factory()
    except (Exception, SystemExit) as exc:
        raise UsageError(f"{attr}() raised {_error_at(exc)}", detail=_user_traceback(exc)) from exc
    return to_target(value, attr)


def _import(name: str) -> types.ModuleType:
    if name.endswith(".py") or "/" in name or os.sep in name:
        return _import_file(name)
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)  # what `python -m` does; a console script does not
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise UsageError(
                f"cannot import {name!r}: no module named {exc.name!r} here (run from the folder "
                "that holds it, or give a file: path/to/file.py:FACTORY)"
            ) from None
        raise UsageError(
            f"cannot import {name!r}: {_error_at(exc)}", detail=_user_traceback(exc)
        ) from exc
    except (Exception, SystemExit) as exc:
        raise UsageError(
            f"cannot import {name!r}: {_error_at(exc)}", detail=_user_traceback(exc)
        ) from exc


def _import_file(name: str) -> types.ModuleType:
    path = os.path.abspath(name)
    if not os.path.isfile(path):
        raise UsageError(f"no such file: {name}")
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and os.path.abspath(file) == path:
            return module  # already imported under its own name: the same objects
    stem = os.path.splitext(os.path.basename(path))[0]
    modname = (
        stem if stem.isidentifier() and stem not in sys.modules else f"_doctor_{abs(hash(path))}"
    )
    spec = importlib.util.spec_from_file_location(modname, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {name}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its sibling modules import, as when run as a script
    sys.modules[modname] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[modname]
        raise UsageError(
            f"cannot import {name}: {_error_at(exc)}", detail=_user_traceback(exc)
        ) from exc
    return module


# ---------------------------------------------------------------------------- settings


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Where a check turns from PASS to WARN or FAIL (see ``docs/doctor.md``)."""

    max_graph_breaks: int = 0  # more: FAIL; 1..max: WARN
    max_recompiles: int = _DEFAULT_LIMIT  # the sweep reaching it: FAIL; over half: WARN
    slower_ratio: float = 1.10  # compiled/eager median time above it: FAIL; above 1: WARN
    compile_warn_s: float = 60.0  # cold first calls adding up to more: WARN


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How the doctor runs (the command-line flags). ``None``: the target's, else the default."""

    backend: str | None = None
    mode: str | None = None
    dynamic: Literal["true", "false", "auto"] | None = None
    grad: bool = False  # False: run under torch.no_grad()
    quick: bool = False  # skip the shape sweep and the timing
    repeat: int = 20  # timing samples per example and path
    max_graph_breaks: int = 0
    max_recompiles: int | None = None
    slower_ratio: float = 1.10
    compile_warn_s: float = 60.0
    reset_dynamo: bool = True  # torch._dynamo.reset() first, as in a fresh process


# ---------------------------------------------------------------------------- the report


@dataclass(frozen=True, kw_only=True)
class Call:
    """The first call of one input shape through the guarded callable."""

    label: str
    role: Literal["example", "sweep"]
    path: CallPath  # what served it: compiled, eager (recompile limit), failed, skipped
    seconds: float | None = None  # wall time of the first call: compile and one run
    graphs: int = 0  # graphs compiled for it
    backend_s: float = 0.0  # of ``seconds``, time in the backend compiler
    graph_s: tuple[float, ...] = ()  # backend compile time of each of those graphs
    note: str | None = None
    max_abs: float | None = None  # against eager (compiled calls only)
    max_rel: float | None = None
    drift: str | None = None  # why the comparison failed, or None


@dataclass(frozen=True, kw_only=True)
class Timing:
    """Median per-call times of one example, compiled (guarded) and eager, interleaved."""

    label: str
    eager_s: float
    compiled_s: float | None
    ratio: float | None  # median of the pairs' compiled / eager: below 1 is faster
    samples: int
    calls_per_sample: int
    spread: float | None = None  # interquartile range of the pairs' ratios / their median
    note: str | None = None
    eager_p99_s: float | None = None  # 99th percentile of eager's samples
    compiled_p99_s: float | None = None

    @property
    def noisy(self) -> bool:
        """The machine was too busy for the ratio to mean much (``spread`` over 0.25)."""
        return self.spread is not None and self.spread > _NOISY_SPREAD


@dataclass(frozen=True, kw_only=True)
class Failure:
    """Why the compiled path failed, and where in the user's source."""

    reason: str  # "compile_error" or "runtime_error"
    label: str  # the input it failed on
    error_type: str | None
    message: str | None
    file: str | None
    line: int | None
    function: str | None
    source: str | None  # the text of that line
    at_definition: bool  # the line is the function's definition: torch named no closer one


@dataclass(frozen=True, kw_only=True)
class Check:
    """One answer of the readiness report."""

    name: str  # compile, graph_breaks, recompiles, speed, drift
    title: str
    status: Status
    summary: str
    advice: str  # what to do, one line
    lines: tuple[str, ...] = ()  # details for the text report


@dataclass(frozen=True, kw_only=True)
class Report:
    """Everything the doctor measured, and its verdict (``checks``, see :func:`judge`)."""

    target: str
    name: str
    kind: str  # "function" or "module"
    settings: Mapping[str, Any]
    thresholds: Thresholds
    versions: Mapping[str, str]
    quick: bool
    examples: tuple[Call, ...]
    sweep: tuple[Call, ...] = ()
    sweep_plan: str | None = None  # what the sweep varied, or why there was none
    sweep_stopped: str | None = None
    compiles: int = 0  # shapes (or buckets) that compiled, as safe_compile counts them
    graphs: int = 0
    graph_breaks: tuple[Mapping[str, Any], ...] = ()
    random_op: str | None = None
    timing: tuple[Timing, ...] = ()
    failure: Failure | None = None
    checks: tuple[Check, ...] = ()

    @property
    def ready(self) -> bool:
        """No check failed."""
        return all(c.status != "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        """0 ready, 1 not ready."""
        return 0 if self.ready else 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form: floats that are not finite become ``"inf"``/``"nan"``."""
        body = dataclasses.asdict(self)
        out: dict[str, Any] = {
            "schema": SCHEMA,
            "verdict": "ready" if self.ready else "not_ready",
            "exit_code": self.exit_code,
            **body,
        }
        jsonable: dict[str, Any] = _jsonable(out)  # type: ignore[assignment]
        return jsonable


# ---------------------------------------------------------------------------- measuring


@dataclass(frozen=True, slots=True)
class _Graph:
    breaks: tuple[dict[str, object], ...]
    random_op: str | None
    backend_s: float


class _Recorder:
    """The backend handed to ``safe_compile``: notes each graph, then compiles it."""

    def __init__(self, compiler: Callable[..., Any], label: str) -> None:
        self.graphs: list[_Graph] = []
        self._compiler = compiler
        self.__name__ = label

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        breaks = tuple(graph_breaks_of(gm, include_resumed=True))
        random = random_op(gm)
        started = time.perf_counter()
        try:
            return self._compiler(gm, example_inputs)
        finally:
            self.graphs.append(_Graph(breaks, random, time.perf_counter() - started))


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """The target and settings, resolved."""

    call: Callable[..., Any]  # what is guarded: a function, or a module's bound forward
    kind: str
    name: str
    backend: str | Callable[..., Any]
    mode: str | None
    options: Mapping[str, Any] | None
    dynamic: bool | None
    fullgraph: bool
    buckets: Buckets | None
    examples: tuple[Example, ...]
    sweep: tuple[Example, ...] | None  # None: guess; (): none
    rtol: float | None
    atol: float | None
    thresholds: Thresholds


def diagnose(
    target: DoctorTarget,
    settings: Settings | None = None,
    *,
    spec: str = "",
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Run ``target`` through ``safe_compile`` next to eager and judge it.

    ``spec`` names the target in the report; ``progress`` receives a line per step (the
    CLI prints them on stderr). Raises :class:`UsageError` when the options are invalid or
    an example raises in eager too.
    """
    settings = settings or Settings()
    say = progress or (lambda _line: None)
    plan = _plan(target, settings)
    if settings.reset_dynamo:
        torch._dynamo.reset()
    recorder = _Recorder(
        build_compiler(plan.backend, mode=plan.mode, options=plan.options, dynamic=plan.dynamic),
        backend_name(plan.backend),
    )
    try:
        guarded: Any = safe_compile(
            plan.call,
            backend=recorder,
            dynamic=plan.dynamic,
            fullgraph=plan.fullgraph,
            buckets=plan.buckets,
            shadow=None,
            rollback=Rollback(max_recompiles=plan.thresholds.max_recompiles, slower_ratio=None),
            name=plan.name,
        )
    except (ConfigError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    session = _Session(guarded, plan, recorder)
    if guarded.safecompile.state is State.DISABLED:
        raise UsageError(
            f"the kill switch turns {plan.name!r} off (SAFECOMPILE_DISABLE="
            f"{os.environ.get('SAFECOMPILE_DISABLE', '')!r}): unset it to run the doctor"
        )

    # told progress (the CLI): a compile past ~2 s also shows "compiling ... 12 s" on a TTY
    shown = spinner() if progress is not None else contextlib.nullcontext()
    with torch.set_grad_enabled(settings.grad), shown:
        calls = _run_examples(session, plan, say)
        sweep, sweep_plan, stopped = _run_sweep(session, plan, settings, say)
        timing = _run_timing(session, plan, settings, say)

    graphs = recorder.graphs
    breaks = dedupe_graph_breaks(b for g in graphs for b in g.breaks)
    stats = guarded.safecompile.stats()
    report = Report(
        target=spec or plan.name,
        name=plan.name,
        kind=plan.kind,
        settings=_report_settings(plan, settings),
        thresholds=plan.thresholds,
        versions=versions(_device_of(plan)),
        quick=settings.quick,
        examples=tuple(calls),
        sweep=tuple(sweep),
        sweep_plan=sweep_plan,
        sweep_stopped=stopped,
        compiles=stats.compiles,
        graphs=len(graphs),
        graph_breaks=tuple(_with_source(b) for b in breaks),
        random_op=next((g.random_op for g in graphs if g.random_op is not None), None),
        timing=tuple(timing),
        failure=session.failure,
    )
    return dataclasses.replace(report, checks=judge(report))


def _run_examples(session: _Session, plan: _Plan, say: Callable[[str], None]) -> list[Call]:
    """Each example's first call, up to the first that fails to compile."""
    calls: list[Call] = []
    for i, example in enumerate(plan.examples):
        label = example.label()
        say(f"compiling example {i + 1}/{len(plan.examples)}: {label}")
        calls.append(session.first_call(example, label, "example"))
        if session.failed():
            break
    return calls


def _run_sweep(
    session: _Session, plan: _Plan, settings: Settings, say: Callable[[str], None]
) -> tuple[list[Call], str, str | None]:
    """The sweep's first calls, what it varied (or why there was none), and why it
    stopped early (``None``: it did not)."""
    if settings.quick:
        return [], "skipped (--quick)", None
    if session.failed():
        return [], "skipped: a compile failed", None
    sweep: list[Call] = []
    stopped: str | None = None
    shapes, sweep_plan = _sweep_calls(plan)
    for i, (label, example) in enumerate(shapes):
        say(f"sweep {i + 1}/{len(shapes)}: {label}")
        call = session.first_call(example, label, "sweep")
        sweep.append(call)
        if session.failed():
            stopped = "stopped: a compile failed"
            break
        if call.path == "eager" and session.limit_hit:
            left = len(shapes) - i - 1
            stopped = (
                f"stopped at the recompile limit ({left} more shape(s) would run eager)"
                if left
                else None
            )
            break
    return sweep, sweep_plan, stopped


def _run_timing(
    session: _Session, plan: _Plan, settings: Settings, say: Callable[[str], None]
) -> list[Timing]:
    """Compiled against eager timings of the first examples (none when quick or failed)."""
    timing: list[Timing] = []
    if not settings.quick and session.failure is None:
        for i, example in enumerate(plan.examples[:_MAX_TIMED]):
            label = example.label()
            say(f"timing example {i + 1}: {label} ({settings.repeat} samples)")
            timing.append(session.time(example, label, settings.repeat))
    return timing


def _report_settings(plan: _Plan, settings: Settings) -> dict[str, Any]:
    """The settings the doctor ran with, as the report shows them."""
    return {
        "backend": backend_name(plan.backend),
        "mode": plan.mode,
        "options": dict(plan.options) if plan.options else None,
        "dynamic": {None: "auto", True: "true", False: "false"}[plan.dynamic],
        "fullgraph": plan.fullgraph,
        "buckets": repr(plan.buckets) if plan.buckets is not None else None,
        "grad": settings.grad,
        "repeat": settings.repeat,
        "rtol": plan.rtol,
        "atol": plan.atol,
        "examples": len(plan.examples),
    }


def _plan(target: DoctorTarget, settings: Settings) -> _Plan:
    fn = target.fn
    controller = getattr(fn, "safecompile", None)
    kind, call, name = _guarded_call(fn, controller)
    inherited, name = _inherited(controller, name)
    name = target.name or name

    backend, mode, options = _compiler_choice(target, settings, inherited)
    dynamic = _dynamic_choice(target, settings, inherited)
    fullgraph = target.fullgraph or bool(inherited.get("fullgraph"))
    try:
        validate_compile_options(
            backend=backend, mode=mode, options=options, dynamic=dynamic, fullgraph=fullgraph
        )
    except ConfigError as exc:
        raise UsageError(f"invalid compile option: {exc}") from exc

    limit = settings.max_recompiles or target.max_recompiles or _DEFAULT_LIMIT
    sweep = _sweep_examples(target)  # parsed before the inputs: same error first
    return _Plan(
        call=call,
        kind=kind,
        name=name,
        backend=backend,
        mode=mode,
        options=options,
        dynamic=dynamic,
        fullgraph=fullgraph,
        buckets=target.buckets,
        examples=parse_inputs(target.inputs, "inputs"),
        sweep=sweep,
        rtol=target.rtol,
        atol=target.atol,
        thresholds=Thresholds(
            max_graph_breaks=settings.max_graph_breaks,
            max_recompiles=limit,
            slower_ratio=settings.slower_ratio,
            compile_warn_s=settings.compile_warn_s,
        ),
    )


def _guarded_call(fn: Callable[..., Any], controller: Any) -> tuple[str, Callable[..., Any], str]:
    """What the doctor guards for ``fn`` (``controller``: its ``safecompile``, if guarded):
    its kind, the callable (a module's bound forward, or the function inside a guarded
    one) and its qualified name."""
    if isinstance(fn, torch.nn.Module):
        cls = type(fn)
        forward = types.MethodType(cls.forward, fn)
        return "module", forward, f"{cls.__module__}.{cls.__qualname__}.forward"
    call = fn
    if controller is not None:
        wrapped = getattr(fn, "__wrapped__", None)
        if not callable(wrapped):
            raise UsageError(f"cannot find the function inside guarded {fn!r}")
        call = wrapped
    return "function", call, f"{getattr(call, '__module__', None) or '__main__'}.{_qualname(call)}"


def _inherited(controller: Any, name: str) -> tuple[dict[str, Any], str]:
    """The settings an already guarded target was made with (its backend and mode only
    when the backend is a known name), and its name (``name`` when it has none)."""
    inherited: dict[str, Any] = {}
    if controller is not None and callable(getattr(controller, "report", None)):
        info = controller.report()
        name = str(getattr(controller, "name", name))
        known = set(torch._dynamo.list_backends(exclude_tags=()))
        if info.get("backend") in known:
            inherited["backend"] = info["backend"]
            inherited["mode"] = info.get("mode")
        inherited["dynamic"] = info.get("dynamic")
        inherited["fullgraph"] = bool(info.get("fullgraph"))
    return inherited, name


def _compiler_choice(
    target: DoctorTarget, settings: Settings, inherited: Mapping[str, Any]
) -> tuple[str | Callable[..., Any], str | None, Mapping[str, Any] | None]:
    """Backend, mode and options: the command line's, else the target's, else those of
    the guarded target, else inductor's defaults."""
    if settings.backend is not None:
        # the target's options are for the target's backend
        return settings.backend, settings.mode, None
    backend = target.backend or inherited.get("backend") or "inductor"
    mode = settings.mode or target.mode or inherited.get("mode")
    options = target.options
    if mode is not None and options is not None and settings.mode is not None:
        options = None  # --mode replaces the target's options
    return backend, mode, options


def _dynamic_choice(
    target: DoctorTarget, settings: Settings, inherited: Mapping[str, Any]
) -> bool | None:
    """``dynamic``: the command line's, else the target's, else the guarded target's."""
    if settings.dynamic is not None:
        return {"true": True, "false": False, "auto": None}[settings.dynamic]
    dynamic: bool | None = (
        target.dynamic if target.dynamic is not None else inherited.get("dynamic")
    )
    return dynamic


def _sweep_examples(target: DoctorTarget) -> tuple[Example, ...] | None:
    """The target's sweep: ``None`` to guess one, ``()`` for none, else its calls."""
    if target.sweep is None:
        return None
    empty = isinstance(target.sweep, Sequence) and len(target.sweep) == 0
    return () if empty else parse_inputs(target.sweep, "sweep")


class _Session:
    """One guarded callable, its eager twin, and what has gone wrong so far."""

    def __init__(self, guarded: Any, plan: _Plan, recorder: _Recorder) -> None:
        self.guarded = guarded
        self.controller = guarded.safecompile
        self.eager = plan.call
        self.plan = plan
        self.recorder = recorder
        self.failure: Failure | None = None
        self.limit_hit = False
        self._sync = _synchronizer(plan)

    def failed(self) -> bool:
        """Whether the compiled path has failed (the rest of the checks are moot)."""
        return self.failure is not None

    def first_call(self, example: Example, label: str, role: Literal["example", "sweep"]) -> Call:
        """Call a new shape through the guarded callable, then eager, and compare."""
        graphs_before = len(self.recorder.graphs)
        events_before = self.controller.events()
        before = self.controller.stats()
        args, kwargs = _cloned(example)
        started = time.perf_counter()
        try:
            out = self.guarded(*args, **kwargs)
            self._sync()
        except Exception as exc:
            # safe_compile raises only what eager raises too: the inputs' own error
            if role == "example":
                raise UsageError(
                    f"the example {label} raises in eager too ({_error_at(exc)}): "
                    "fix the factory's inputs",
                    detail=_user_traceback(exc),
                ) from exc
            return Call(
                label=label,
                role=role,
                path="skipped",
                note=f"eager raises {type(exc).__name__}: the sweep does not fit these inputs",
            )
        seconds = time.perf_counter() - started
        new_graphs = self.recorder.graphs[graphs_before:]
        graphs = len(new_graphs)
        backend_s = math.fsum(g.backend_s for g in new_graphs)
        graph_s = tuple(g.backend_s for g in new_graphs)
        events = _since(events_before, self.controller.events())
        after = self.controller.stats()
        failed = _failure_event(events)
        if failed is not None:
            self.failure = self._failure(failed, label)
            return Call(
                label=label,
                role=role,
                path="failed",
                seconds=seconds,
                graphs=graphs,
                backend_s=backend_s,
                graph_s=graph_s,
                note=f"{failed.error_type}: safe_compile answered with eager's result",
            )
        if after.compiled_calls == before.compiled_calls:
            limit = after.recompile_limit_calls > before.recompile_limit_calls or any(
                e.kind is EventKind.RECOMPILE_LIMIT for e in events
            )
            self.limit_hit = self.limit_hit or limit
            return Call(
                label=label,
                role=role,
                path="eager",
                seconds=seconds,
                graphs=graphs,
                backend_s=backend_s,
                graph_s=graph_s,
                note="past the recompile limit: runs eager" if limit else "ran eager",
            )
        args, kwargs = _cloned(example)
        expected = self.eager(*args, **kwargs)
        result = compare(out, expected, rtol=self.plan.rtol, atol=self.plan.atol)
        return Call(
            label=label,
            role=role,
            path="compiled",
            seconds=seconds,
            graphs=graphs,
            backend_s=backend_s,
            graph_s=graph_s,
            max_abs=result.max_abs,
            max_rel=result.max_rel,
            drift=result.reason,
        )

    def time(self, example: Example, label: str, repeat: int) -> Timing:
        """Median per-call time of each path, in interleaved samples."""
        args, kwargs = example.args, dict(example.kwargs)

        def compiled() -> Any:
            return self.guarded(*args, **kwargs)

        def eager() -> Any:
            return self.eager(*args, **kwargs)

        before = self.controller.stats().compiled_calls
        compiled()
        eager()
        one = max(self._clock(eager, 1), self._clock(compiled, 1))
        inner = max(1, min(_MAX_INNER, int(_SAMPLE_S / max(one, 1e-9))))
        c_times: list[float] = []
        e_times: list[float] = []
        for i in range(repeat):
            if i % 2:
                e_times.append(self._clock(eager, inner))
                c_times.append(self._clock(compiled, inner))
            else:
                c_times.append(self._clock(compiled, inner))
                e_times.append(self._clock(eager, inner))
        served = self.controller.stats().compiled_calls - before
        calls = repeat * inner + 2
        eager_s = statistics.median(e_times)
        if served == 0:
            return Timing(
                label=label,
                eager_s=eager_s,
                compiled_s=None,
                ratio=None,
                samples=repeat,
                calls_per_sample=inner,
                note="the compiled path did not serve this shape (it ran eager)",
                eager_p99_s=_p99(e_times),
            )
        # Each pair was timed back to back: the median of the pairs' ratios holds up when
        # the machine's load changes during the run; their spread says how much it did.
        ratios = [c / e for c, e in zip(c_times, e_times, strict=True) if e > 0]
        ratio = statistics.median(ratios) if ratios else None
        spread = None
        if ratio and len(ratios) >= 4:
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            spread = (q3 - q1) / ratio
        return Timing(
            label=label,
            eager_s=eager_s,
            compiled_s=statistics.median(c_times),
            ratio=ratio,
            samples=repeat,
            calls_per_sample=inner,
            spread=spread,
            note=None if served == calls else f"{calls - served} of {calls} calls ran eager",
            eager_p99_s=_p99(e_times),
            compiled_p99_s=_p99(c_times),
        )

    def _clock(self, fn: Callable[[], Any], n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            fn()
        self._sync()
        return (time.perf_counter() - started) / n

    def _failure(self, event: Event, label: str) -> Failure:
        defined = location_of_function(self.plan.call)
        at_definition = (
            defined is not None and event.file == defined.file and event.line == defined.line
        )
        return Failure(
            reason=event.reason.value if event.reason is not None else "compile_error",
            label=label,
            error_type=event.error_type,
            message=event.message,
            file=event.file,
            line=event.line,
            function=event.function,
            source=_source_line(event.file, event.line),
            at_definition=at_definition,
        )


def _failure_event(events: Sequence[Event]) -> Event | None:
    for kind in (EventKind.COMPILE_FAILED, EventKind.ROLLBACK):
        for event in events:
            if event.kind is kind:
                return event
    return None


def _since(before: Sequence[Event], after: Sequence[Event]) -> tuple[Event, ...]:
    """The events in ``after`` newer than the newest of ``before`` (compared by identity)."""
    if not before:
        return tuple(after)
    last = before[-1]
    for i in range(len(after) - 1, -1, -1):
        if after[i] is last:
            return tuple(after[i + 1 :])
    return tuple(after)


def _cloned(example: Example) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh copies of the tensors, so a call that mutates its inputs cannot skew the next."""
    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.clone(), (example.args, dict(example.kwargs))
    )
    return tuple(args), dict(kwargs)


def _tensors(example: Example) -> list[torch.Tensor]:
    leaves, _ = pytree.tree_flatten((example.args, dict(example.kwargs)))
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _device_of(plan: _Plan) -> torch.device:
    for example in plan.examples:
        for t in _tensors(example):
            return t.device
    owner = getattr(plan.call, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        for p in owner.parameters():
            return p.device
    return torch.device("cpu")


def _synchronizer(plan: _Plan) -> Callable[[], None]:
    device = _device_of(plan)
    if device.type == "cpu":
        return lambda: None
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    if not callable(sync):
        return lambda: None
    return lambda: sync(device)


# ---------------------------------------------------------------------------- the sweep


def _sweep_calls(plan: _Plan) -> tuple[list[tuple[str, Example]], str]:
    """The sweep's calls, and a line saying what they vary."""
    if plan.sweep is not None:
        if not plan.sweep:
            return [], "none (the target's sweep=())"
        return [(e.label(), e) for e in plan.sweep], f"the target's {len(plan.sweep)} call(s)"
    example = plan.examples[0]
    tensors = [t for t in _tensors(example) if t.ndim >= 1 and t.shape[0] > 0]
    if not tensors:
        return [], "none: the first example has no tensor with a dim to vary"
    batch = tensors[0].shape[0]
    plans = [(0, batch, _batch_sizes(batch), "leading (batch) dim")]
    seq_src = next(
        (
            t
            for t in tensors
            if (t.ndim >= 3 or (t.ndim == 2 and not t.is_floating_point())) and t.shape[1] > 0
        ),
        None,
    )
    if seq_src is not None:
        seq = seq_src.shape[1]
        plans.append((1, seq, _seq_sizes(seq), "dim 1 (sequence)"))
    calls: list[tuple[str, Example]] = []
    said: list[str] = []
    seen = {e.label() for e in plan.examples}  # compiled already
    for dim, length, sizes, words in plans:
        said.append(f"{words} {length} -> {', '.join(map(str, sizes))}")
        for size in sizes:
            resized = _resize(example, dim, length, size)
            label = resized.label()
            if label not in seen:
                seen.add(label)
                calls.append((label, resized))
    return calls, "; ".join(said)


def _batch_sizes(n: int) -> list[int]:
    return sorted({1, 2, 3, 5, n + 1, 2 * n} - {n})


def _seq_sizes(n: int) -> list[int]:
    return sorted({max(1, n // 4), max(1, n // 2), n - 1, n + 1, n + n // 2, 2 * n} - {n, 0})


def _resize(example: Example, dim: int, length: int, size: int) -> Example:
    """``example`` with dim ``dim`` of every tensor whose dim is ``length`` made ``size``
    long, by repeating or cutting its own values (so token ids and masks stay valid)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.ndim <= dim or t.shape[dim] != length:
            return t
        index = torch.arange(size, device=t.device) % length
        return t.index_select(dim, index)

    args, kwargs = pytree.tree_map_only(torch.Tensor, one, (example.args, dict(example.kwargs)))
    return Example(tuple(args), dict(kwargs))


# ---------------------------------------------------------------------------- judging


def judge(report: Report) -> tuple[Check, ...]:
    """The checks, from a report's measurements and thresholds (pure)."""
    return (
        _check_compile(report),
        _check_graph_breaks(report),
        _check_recompiles(report),
        _check_speed(report),
        _check_drift(report),
    )


def _check_compile(r: Report) -> Check:
    title = "compile"
    failure = r.failure
    if failure is not None:
        where = _where(failure.file, failure.line, failure.function)
        if failure.at_definition:
            where += " (the function's definition: torch named no closer line)"
        lines = [f"on {failure.label}", f"at {where}"]
        if failure.source:
            lines.append(f"  {failure.line} | {failure.source}")
        lines += [f"  {m}" for m in _message_lines(failure.message, 3)]
        if failure.reason == "runtime_error":
            return Check(
                name="compile",
                title=title,
                status="fail",
                summary=f"the compiled code raised {failure.error_type} where eager does not",
                advice="a compiler bug: safe_compile would roll back to eager; keep eager for "
                "this callable and report it upstream with the line shown",
                lines=tuple(lines),
            )
        return Check(
            name="compile",
            title=title,
            status="fail",
            summary=f"compiling failed: {failure.error_type}",
            advice="safe_compile would serve eager (no gain): fix the line shown, or rerun with "
            "--backend aot_eager / eager to see which layer fails",
            lines=tuple(lines),
        )
    compiled = [c for c in r.examples if c.path == "compiled"]
    seconds = [c.seconds or 0.0 for c in r.examples]
    total = math.fsum(seconds)
    lines = [
        f"{c.label}: {_graphs(c.graphs)}, first call {_secs(c.seconds)}"
        + (f" (backend {_secs(c.backend_s)})" if c.graphs else "")
        + (f" - {c.note}" if c.note else "")
        for c in r.examples
    ]
    graphs = sum(c.graphs for c in r.examples)
    if graphs == 0:
        return Check(
            name="compile",
            title=title,
            status="warn",
            summary="nothing was captured: dynamo compiled no graph, so every call pays "
            "its overhead for nothing",
            advice="drop safe_compile here, or find out why with TORCH_LOGS=graph_breaks",
            lines=tuple(lines),
        )
    n = len(r.examples)
    done = f"{n} example{'s' if n > 1 else ''}" if len(compiled) == n else f"{len(compiled)} of {n}"
    summary = f"{done} compiled into {_graphs(graphs)}; cold first calls took {_secs(total)}"
    if total > r.thresholds.compile_warn_s:
        return Check(
            name="compile",
            title=title,
            status="warn",
            summary=summary + f" (over {_secs(r.thresholds.compile_warn_s)})",
            advice="compile before serving: warmup=Warmup(inputs=[...], background=True), "
            "and keep SAFECOMPILE_CACHE_DIR on a persistent volume",
            lines=tuple(lines),
        )
    return Check(
        name="compile",
        title=title,
        status="pass",
        summary=summary,
        advice="compile these shapes before traffic: warmup=Warmup(inputs=[...])",
        lines=tuple(lines),
    )


def _check_graph_breaks(r: Report) -> Check:
    title = "graph breaks"
    allowed = r.thresholds.max_graph_breaks
    breaks = r.graph_breaks
    if r.failure is not None and r.graphs == 0:
        return Check(
            name="graph_breaks",
            title=title,
            status="skip",
            summary="unknown: the compile failed before any graph was captured",
            advice="see compile",
        )
    lines: list[str] = []
    for b in breaks:
        lines.append(f"{_where(b.get('file'), b.get('line'), b.get('function'))}")
        if b.get("source"):
            lines.append(f"  {b.get('line')} | {b.get('source')}")
        reason = _message_lines(str(b.get("reason") or ""), 1)
        hint = [m for m in _message_lines(str(b.get("reason") or ""), 8) if m.startswith("Hint:")]
        lines += [f"  reason: {m}" for m in reason] + [f"  {h}" for h in hint[:1]]
    n = len(breaks)
    if n == 0:
        return Check(
            name="graph_breaks",
            title=title,
            status="pass",
            summary=f"no graph breaks in {_graphs(r.graphs)}",
            advice="keep it so in CI: safecompile.testing.assert_compiles(fn, *args)",
        )
    summary = f"{n} graph break{'s' if n > 1 else ''}, {allowed} allowed"
    if n <= allowed:
        return Check(
            name="graph_breaks",
            title=title,
            status="warn",
            summary=summary,
            advice="each break is a trip back to Python and a smaller graph: remove the ones "
            "shown when you can",
            lines=tuple(lines),
        )
    return Check(
        name="graph_breaks",
        title=title,
        status="fail",
        summary=summary,
        advice="remove each break at the line shown (TORCH_LOGS=graph_breaks explains it), "
        "or accept them with --max-graph-breaks N",
        lines=tuple(lines),
    )


def _check_recompiles(r: Report) -> Check:
    title = "recompiles"
    limit = r.thresholds.max_recompiles
    if r.quick or r.failure is not None or not r.sweep:
        why = r.sweep_plan or "no sweep"
        if r.failure is not None and not r.quick:
            why = "skipped: a compile failed"
        return Check(name="recompiles", title=title, status="skip", summary=why, advice="none")
    lines = [f"swept {r.sweep_plan}"]
    reused = 0
    for c in r.sweep:
        if c.graphs == 0 and c.path == "compiled":
            reused += 1  # served by a graph compiled before
            continue
        what = _graphs(c.graphs) + (f" in {_secs(c.seconds)}" if c.graphs else "")
        lines.append(f"{c.label}: {what}" + (f" - {c.note}" if c.note else ""))
    if reused:
        lines.append(f"{reused} other shape(s) reused a graph compiled before")
    if r.sweep_stopped:
        lines.append(r.sweep_stopped)
    ran = [c for c in r.sweep if c.path != "skipped"]
    if not ran:
        return Check(
            name="recompiles",
            title=title,
            status="warn",
            summary="the sweep's shapes all raise in eager: it guessed the dims wrong",
            advice="give the shapes to sweep: DoctorTarget(sweep=[...])",
            lines=tuple(lines),
        )
    hit = next((c for c in r.sweep if c.path == "eager"), None)
    dynamic = r.settings.get("dynamic")
    if hit is not None:
        if dynamic == "false":
            advice = (
                "with dynamic=False every new shape compiles: pad to a few sizes "
                "(buckets=Buckets(dims={...}, sizes=pow2(lo, hi))) or let dims go dynamic "
                "(dynamic=None)"
            )
        else:
            advice = (
                "pad the varying dims to a few sizes: buckets=Buckets(dims={...}, "
                "sizes=pow2(lo, hi)), or mark them dynamic (dynamic=True); raise "
                "Rollback(max_recompiles=...) only for a few known shapes"
            )
        return Check(
            name="recompiles",
            title=title,
            status="fail",
            summary=f"{r.compiles} compiles reached max_recompiles={limit} at {hit.label}: "
            "new shapes past it run eager",
            advice=advice,
            lines=tuple(lines),
        )
    summary = (
        f"{len(ran)} swept shape(s): {r.compiles} compile(s) in all ({_graphs(r.graphs)}), "
        f"limit {limit}"
    )
    if r.compiles > limit // 2:
        return Check(
            name="recompiles",
            title=title,
            status="warn",
            summary=summary + ": over half the limit",
            advice="real traffic has more shapes than the sweep: bound them with "
            "buckets=Buckets(...) or dynamic=True",
            lines=tuple(lines),
        )
    return Check(
        name="recompiles",
        title=title,
        status="pass",
        summary=summary,
        advice="nothing; if traffic has other shapes, sweep them: DoctorTarget(sweep=[...])",
        lines=tuple(lines),
    )


def _check_speed(r: Report) -> Check:
    title = "speed"
    if r.quick or r.failure is not None or not r.timing:
        why = "skipped (--quick)" if r.quick else "skipped: a compile failed"
        return Check(name="speed", title=title, status="skip", summary=why, advice="none")
    lines = [
        f"{t.label}: compiled {_secs(t.compiled_s)}, eager {_secs(t.eager_s)}"
        + (f" -> {t.ratio:.2f}x" if t.ratio is not None else "")
        + (f" (noisy: spread {t.spread:.0%})" if t.noisy else "")
        + (f" - {t.note}" if t.note else "")
        for t in r.timing
    ]
    timed = [t for t in r.timing if t.ratio is not None]
    if not timed:
        return Check(
            name="speed",
            title=title,
            status="skip",
            summary="the compiled path served no timed example",
            advice="see recompiles",
            lines=tuple(lines),
        )
    status, summary, advice = _speed_verdict(
        timed, r.thresholds.slower_ratio, str(r.settings.get("backend"))
    )
    return Check(
        name="speed",
        title=title,
        status=status,
        summary=summary,
        advice=advice,
        lines=tuple(lines),
    )


def _speed_verdict(timed: list[Timing], limit: float, backend: str) -> tuple[Status, str, str]:
    """Status, summary and advice of the speed check, from the timed examples (at least
    one), the slower-ratio limit and the backend's name."""
    worst = max(timed, key=lambda t: t.ratio or 0.0)
    ratio = worst.ratio or 0.0
    samples = f"median of {worst.samples} interleaved samples"
    if is_debug_backend(backend) and ratio > 1.0:
        return (
            "warn",
            f"compiled takes {ratio:.2f}x eager's time on {worst.label} ({samples}); "
            f"backend {backend} does not optimise, so this is overhead only",
            "judge speed with the backend you will serve with (default inductor)",
        )
    if ratio > limit and any(t.noisy for t in timed):
        return (
            "warn",
            f"could not judge: compiled took {ratio:.2f}x eager's time on "
            f"{worst.label}, but the timings were noisy (the machine was busy)",
            "rerun on an idle machine, or with more --repeat",
        )
    if ratio > limit:
        return (
            "fail",
            f"compiled takes {ratio:.2f}x eager's time on {worst.label} "
            f"(limit {limit:.2f}x, {samples})",
            "keep eager here, or give it more work per call (bigger batches) or another "
            "mode; Rollback(slower_ratio=...) falls back automatically in production",
        )
    if ratio > 1.0:
        return (
            "warn",
            f"no speed-up: compiled takes {ratio:.2f}x eager's time on {worst.label} ({samples})",
            "compiling buys nothing here yet: try mode='max-autotune' or bigger batches "
            "before switching it on",
        )
    best = min(t.ratio or 0.0 for t in timed)
    spread = f"{ratio:.2f}x" if len(timed) == 1 else f"{best:.2f}x to {ratio:.2f}x"
    return (
        "pass",
        f"compiled takes {spread} eager's time ({samples})",
        "set Rollback(slower_ratio=1.1) to fall back if traffic shapes behave worse",
    )


def _check_drift(r: Report) -> Check:
    title = "drift"
    compared = [c for c in (*r.examples, *r.sweep) if c.path == "compiled"]
    if not compared:
        return Check(
            name="drift",
            title=title,
            status="skip",
            summary="no compiled output to compare",
            advice="see compile",
        )
    max_abs = max(c.max_abs or 0.0 for c in compared)
    max_rel = max(c.max_rel or 0.0 for c in compared)
    figures = f"max abs {max_abs:.3g}, normalised {max_rel:.3g}"
    breached = [c for c in compared if c.drift is not None]
    lines = [f"{c.label}: {c.drift}" for c in breached[:5]]
    if r.random_op is not None:
        return Check(
            name="drift",
            title=title,
            status="warn",
            summary=f"not comparable: the graph draws random numbers ({r.random_op}); {figures}",
            advice="return the model in eval() mode from the factory; safe_compile skips "
            "shadow checks on such graphs",
            lines=tuple(lines),
        )
    if breached:
        return Check(
            name="drift",
            title=title,
            status="fail",
            summary=f"compiled differs from eager on {len(breached)} of {len(compared)} "
            f"call(s): {figures}",
            advice="find the op: rerun with --backend aot_eager (no drift: the backend causes "
            "it); if expected (low precision), set DoctorTarget(rtol=..., atol=...) and "
            "Shadow(rtol=..., atol=...)",
            lines=tuple(lines),
        )
    tolerance = (
        "per-dtype default tolerances"
        if r.settings.get("rtol") is None
        else f"rtol {r.settings.get('rtol')}"
    )
    return Check(
        name="drift",
        title=title,
        status="pass",
        summary=f"{figures} over {len(compared)} call(s), within {tolerance}",
        advice="keep shadow checks on in production: Shadow(canary=8) compares new graphs",
    )


def is_debug_backend(name: str) -> bool:
    """Whether ``name`` is a torch backend that runs the graph as captured (no speed-up to
    expect): ``eager``, ``aot_eager`` and their variants."""
    return name == "pre_dispatch_eager" or name.startswith(("eager", "aot_eager"))


# ---------------------------------------------------------------------------- rendering

_TAGS = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "SKIP"}


def render_text(report: Report) -> str:
    """The readiness report as text: the verdict first, then one section per check."""
    failed = [c.title for c in report.checks if c.status == "fail"]
    warned = [c.title for c in report.checks if c.status == "warn"]
    passed = sum(c.status == "pass" for c in report.checks)
    skipped = sum(c.status == "skip" for c in report.checks)
    counts = []
    if failed:
        counts.append(f"{len(failed)} failed ({', '.join(failed)})")
    if warned:
        counts.append(
            f"{len(warned)} warning{'s' if len(warned) > 1 else ''} ({', '.join(warned)})"
        )
    if passed:
        counts.append(f"{passed} passed")
    if skipped:
        counts.append(f"{skipped} skipped")
    verdict = ("READY" if report.ready else "NOT READY") + " - " + ", ".join(counts)
    s = report.settings
    options = (
        f"backend={s.get('backend')} mode={s.get('mode') or 'default'} "
        f"dynamic={s.get('dynamic')} fullgraph={s.get('fullgraph')} "
        f"grad={'on' if s.get('grad') else 'off'} "
        f"max_recompiles={report.thresholds.max_recompiles}"
    )
    if s.get("buckets"):
        options += f" buckets={s.get('buckets')}"
    out = [
        f"safecompile doctor: {verdict}",
        f"  target   {report.target} ({report.kind} {report.name})",
        f"  options  {options}",
        "",
    ]
    width = max(len(c.title) for c in report.checks) if report.checks else 0
    for check in report.checks:
        out.append(f"[{_TAGS[check.status]}] {check.title.ljust(width)}  {check.summary}")
        out += [f"       {line}" for line in check.lines]
        if check.status != "skip":
            out.append(f"       what to do: {check.advice}")
        out.append("")
    v = report.versions
    out.append(
        "versions: "
        + ", ".join(f"{k} {v[k]}" for k in ("safecompile", "torch", "python") if k in v)
        + f"; device {v.get('device', '?')}"
    )
    return "\n".join(out) + "\n"


def versions(device: torch.device | None = None) -> dict[str, str]:
    """safecompile, torch, Python, platform and device, as text."""
    device = device or torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        where = f"{device} ({name}, CUDA {torch.version.cuda})"
    elif device.type == "cpu":
        where = f"cpu ({platform.machine() or '?'}, {torch.get_num_threads()} threads)"
    else:
        where = str(device)
    return {
        "safecompile": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "device": where,
    }


# ---------------------------------------------------------------------------- helpers


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        where = "" if value.device.type == "cpu" else f"@{value.device}"
        return f"{dtype}[{', '.join(map(str, value.shape))}]{where}"
    if isinstance(value, list | tuple) and len(value) <= 8:
        inner = ", ".join(_describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return type(value).__name__


def _kind(value: object) -> str:
    if value is None:
        return "None"
    name = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _qualname(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)


_NOT_USERS = (
    "<frozen ",
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # safecompile
    os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep,  # the import machinery
)
_MESSAGE_LIMIT = 300


def _is_ours(filename: str) -> bool:
    """A frame of safecompile's own or of the import machinery: not the user's code."""
    return filename.startswith(_NOT_USERS)


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` from its first frame that is the user's code (``None`` if none is)."""
    while tb is not None and _is_ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` from the user's first frame on (safecompile's are left out)."""
    tb = _user_frames(exc.__traceback__)
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _error_at(exc: BaseException) -> str:
    """``Type: message (at file:line in function)`` on one line: the user's deepest frame."""
    if isinstance(exc, SystemExit):
        text = f"SystemExit({exc.code!r}) (sys.exit() while the doctor loaded it)"
    else:
        message = " ".join(str(exc).split())
        if len(message) > _MESSAGE_LIMIT:
            message = message[: _MESSAGE_LIMIT - 1] + "\u2026"
        text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    where: str | None = None
    if isinstance(exc, SyntaxError) and exc.filename:
        where = _where(exc.filename, exc.lineno, None)
    else:
        last = None
        tb = _user_frames(exc.__traceback__)
        while tb is not None:
            if not _is_ours(tb.tb_frame.f_code.co_filename):
                last = tb
            tb = tb.tb_next
        if last is not None:
            code = last.tb_frame.f_code
            where = _where(code.co_filename, last.tb_lineno, code.co_name)
    return f"{text} (at {where})" if where else text


def _source_line(file: str | None, line: int | None) -> str | None:
    if not file or not line:
        return None
    text = linecache.getline(file, line).strip()
    return text or None


def _with_source(entry: Mapping[str, object]) -> dict[str, object]:
    file, line = entry.get("file"), entry.get("line")
    source = _source_line(
        file if isinstance(file, str) else None, line if isinstance(line, int) else None
    )
    return {**entry, "source": source}


def _where(file: object, line: object, function: object) -> str:
    if not isinstance(file, str):
        return "(unknown location)"
    place = _shown_path(file) + (f":{line}" if isinstance(line, int) else "")
    return place + (f" in {function}" if function else "")


def _shown_path(file: str) -> str:
    try:
        rel = os.path.relpath(file)
    except ValueError:  # another drive
        return file
    return file if rel.startswith("..") else rel


def _message_lines(message: str | None, limit: int) -> list[str]:
    lines = [line.strip() for line in (message or "").splitlines()]
    return [line for line in lines if line][:limit]


def _p99(samples: Sequence[float]) -> float:
    """The 99th percentile of timing samples (linear between ranks; the largest when few)."""
    if len(samples) < 2:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


def _graphs(n: int) -> str:
    return f"{n} graph{'' if n == 1 else 's'}"


def _secs(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _jsonable(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)
