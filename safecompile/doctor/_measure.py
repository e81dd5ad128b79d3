"""Measuring: run the target through ``safe_compile`` next to eager, and fill a report.

:func:`diagnose` compiles each example cold, sweeps shapes against the recompile limit,
times compiled against eager in interleaved pairs and compares outputs; the verdict is
:func:`~safecompile.doctor._judge.judge`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import linecache
import math
import os
import platform
import statistics
import time
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from safecompile._version import __version__
from safecompile.base import torchcompat
from safecompile.base.errors import ConfigError
from safecompile.base.model import Event, EventKind, Reason, State
from safecompile.base.policies import Rollback
from safecompile.base.torchcompat import pytree
from safecompile.checks.compare import compare
from safecompile.checks.timing import LatencyWindow
from safecompile.compose import safe_compile
from safecompile.guard.backend import backend_name, build_compiler, validate_compile_options
from safecompile.guard.graphs import Recorder
from safecompile.observe.progress import spinner
from safecompile.observe.source import dedupe_graph_breaks, location_of_function

from ._judge import judge
from ._sweep import sweep_calls, tensors
from ._target import error_at, parse_inputs, parse_sweep, user_traceback
from .report import (
    DEFAULT_LIMIT,
    Call,
    DoctorTarget,
    Example,
    Failure,
    Report,
    Settings,
    Thresholds,
    Timing,
    UsageError,
)

__all__ = ["diagnose", "versions"]

_SAMPLE_S = 2e-3  # a timing sample runs the call enough times to last about this long
_MAX_INNER = 1000
_MAX_TIMED = 4  # examples timed (the first ones)
#: Longest silence between the doctor's progress lines while it times (seconds); compiles
#: say so on their own (:func:`~safecompile.observe.progress.spinner`).
PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """The target and settings, resolved."""

    target: DoctorTarget  # buckets, rtol and atol are read from it as given
    call: Callable[..., Any]  # what is guarded: a function, or a module's bound forward
    kind: str
    name: str
    backend: str | Callable[..., Any]
    mode: str | None
    options: Mapping[str, Any] | None
    dynamic: bool | None
    fullgraph: bool
    examples: tuple[Example, ...]
    sweep: tuple[Example, ...] | None  # None: guess; (): none
    thresholds: Thresholds
    device: torch.device  # of the first tensor argument, else of the module's parameters


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
        torch.compiler.reset()
    recorder = Recorder(
        build_compiler(plan.backend, mode=plan.mode, options=plan.options, dynamic=plan.dynamic),
        backend_name(plan.backend),
    )
    try:
        with warnings.catch_warnings():  # a target guarded already shares our guard's name
            warnings.filterwarnings("ignore", message="two guarded callables are named")
            guarded: Any = safe_compile(
                plan.call,
                backend=recorder,
                dynamic=plan.dynamic,
                fullgraph=plan.fullgraph,
                buckets=plan.target.buckets,
                shadow=None,
                rollback=Rollback(max_recompiles=plan.thresholds.max_recompiles, slower_ratio=None),
                name=plan.name,
            )
    except (ConfigError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    session = _Session(guarded, plan, recorder, say)
    if guarded.safecompile.state is State.DISABLED:
        raise UsageError(
            f"the kill switch turns {plan.name!r} off (SAFECOMPILE_DISABLE="
            f"{os.environ.get('SAFECOMPILE_DISABLE', '')!r}): unset it to run the doctor"
        )

    # told progress (the CLI): a compile past ~2 s also shows "compiling ... 12 s" on a TTY
    shown = spinner() if progress is not None else contextlib.nullcontext()
    with torch.set_grad_enabled(settings.grad), shown:
        calls = session.examples()
        sweep, sweep_plan, stopped = session.sweep(settings)
        timing = session.timing(settings)

    graphs = recorder.graphs
    breaks = dedupe_graph_breaks(b for g in graphs for b in g.breaks)
    stats = guarded.safecompile.stats()
    report = Report(
        target=spec or plan.name,
        name=plan.name,
        kind=plan.kind,
        settings=_report_settings(plan, settings),
        thresholds=plan.thresholds,
        versions=versions(plan.device),
        quick=settings.quick,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        examples=tuple(calls),
        sweep=tuple(sweep),
        sweep_plan=sweep_plan,
        sweep_stopped=stopped,
        compiles=stats.compiles,
        graphs=len(graphs),
        graph_breaks=tuple(
            {**b, "source": source_line(b.get("file"), b.get("line"))} for b in breaks
        ),
        random_op=next((g.random_op for g in graphs if g.random_op is not None), None),
        unchecked=tuple(
            f"graph {n}: {g.unchecked}" for n, g in enumerate(graphs, 1) if g.unchecked
        ),
        timing=tuple(timing),
        failure=session.failure,
    )
    return dataclasses.replace(report, checks=judge(report))


def _report_settings(plan: _Plan, settings: Settings) -> dict[str, Any]:
    """The settings the doctor ran with, as the report shows them."""
    return {
        "backend": backend_name(plan.backend),
        "mode": plan.mode,
        "options": dict(plan.options) if plan.options else None,
        "dynamic": {None: "auto", True: "true", False: "false"}[plan.dynamic],
        "fullgraph": plan.fullgraph,
        "buckets": repr(plan.target.buckets) if plan.target.buckets is not None else None,
        "grad": settings.grad,
        "repeat": settings.repeat,
        "rtol": plan.target.rtol,
        "atol": plan.target.atol,
        "examples": len(plan.examples),
    }


def _plan(target: DoctorTarget, settings: Settings) -> _Plan:
    """Each option from the command line, else the target, else a guarded target's own."""
    controller = getattr(target.fn, "safecompile", None)
    kind, call, name = _guarded_call(target.fn, controller)
    made = _made_with(controller)
    name = target.name or made.get("name") or name
    backend: str | Callable[..., Any]
    if settings.backend is not None:  # the target's options are for the target's backend
        backend, mode, options = settings.backend, settings.mode, None
    else:
        backend = target.backend or made.get("backend") or "inductor"
        mode = settings.mode or target.mode or made.get("mode")
        options = None if settings.mode is not None else target.options  # --mode replaces them
    if settings.dynamic is not None:
        dynamic = {"true": True, "false": False, "auto": None}[settings.dynamic]
    else:
        dynamic = target.dynamic if target.dynamic is not None else made.get("dynamic")
    fullgraph = target.fullgraph or bool(made.get("fullgraph"))
    try:
        validate_compile_options(
            backend=backend, mode=mode, options=options, dynamic=dynamic, fullgraph=fullgraph
        )
    except ConfigError as exc:
        raise UsageError(f"invalid compile option: {exc}") from exc

    limit = settings.max_recompiles or target.max_recompiles or DEFAULT_LIMIT
    sweep = parse_sweep(target.sweep)  # parsed before the inputs: same error first
    examples = parse_inputs(target.inputs, "inputs")
    return _Plan(
        target=target,
        call=call,
        kind=kind,
        name=name,
        backend=backend,
        mode=mode,
        options=options,
        dynamic=dynamic,
        fullgraph=fullgraph,
        examples=examples,
        sweep=sweep,
        thresholds=Thresholds(
            max_graph_breaks=settings.max_graph_breaks,
            max_recompiles=limit,
            slower_ratio=settings.slower_ratio,
            compile_warn_s=settings.compile_warn_s,
        ),
        device=_device_of(examples, call),
    )


def _guarded_call(fn: Callable[..., Any], controller: Any) -> tuple[str, Callable[..., Any], str]:
    """Kind, callable and qualified name of what the doctor guards: a module's own forward
    (hooks do not run), the function inside a guarded one."""
    if isinstance(fn, torch.nn.Module):
        cls = type(fn)
        forward = types.MethodType(cls.forward, fn)
        return "module", forward, f"{cls.__module__}.{cls.__qualname__}.forward"
    call = fn if controller is None else fn.__wrapped__  # type: ignore[attr-defined]
    name = getattr(call, "__qualname__", None) or type(call).__qualname__
    return "function", call, f"{getattr(call, '__module__', None) or '__main__'}.{name}"


def _made_with(controller: Any) -> dict[str, Any]:
    """A guarded target's name, dynamic and fullgraph, and its backend and mode when the
    backend is a known name (``{}`` for a plain target)."""
    if controller is None:
        return {}
    info = controller.report()
    made = {key: info.get(key) for key in ("name", "dynamic", "fullgraph")}
    if info.get("backend") in torch.compiler.list_backends(exclude_tags=()):
        made |= {"backend": info["backend"], "mode": info.get("mode")}
    return made


class _Session:
    """One guarded callable next to eager: the examples, the sweep, the timing, and the
    failure that makes the rest moot."""

    def __init__(
        self, guarded: Any, plan: _Plan, recorder: Recorder, say: Callable[[str], None]
    ) -> None:
        self.say = say
        self.guarded = guarded
        self.controller = guarded.safecompile
        self.plan = plan
        self.recorder = recorder
        self.failure: Failure | None = None
        self.limit_hit = False
        self._sync = _synchronizer(plan.device)

    def examples(self) -> list[Call]:
        """Each example's first call, up to the first that fails to compile."""
        calls: list[Call] = []
        for i, example in enumerate(self.plan.examples):
            label = example.label()
            self.say(f"compiling example {i + 1}/{len(self.plan.examples)}: {label}")
            calls.append(self.first_call(example, label, "example"))
            if self.failure is not None:
                break
        return calls

    def sweep(self, settings: Settings) -> tuple[list[Call], str, str | None]:
        """The sweep's first calls, what it varied (or why not), why it stopped early (or None)."""
        if settings.quick:
            return [], "skipped (--quick)", None
        if self.failure is not None:
            return [], "skipped: a compile failed", None
        sweep: list[Call] = []
        stopped: str | None = None
        shapes, sweep_plan = sweep_calls(self.plan.sweep, self.plan.examples)
        for i, (label, example) in enumerate(shapes):
            self.say(f"sweep {i + 1}/{len(shapes)}: {label}")
            call = self.first_call(example, label, "sweep")
            sweep.append(call)
            if call.path == "failed":
                stopped = "stopped: a compile failed"
                break
            if call.path == "eager" and self.limit_hit:
                left = len(shapes) - i - 1
                more = f"{left} more shape(s) would run eager"
                stopped = f"stopped at the recompile limit ({more})" if left else None
                break
        return sweep, sweep_plan, stopped

    def timing(self, settings: Settings) -> list[Timing]:
        """Compiled against eager timings of the first examples (none when quick or failed)."""
        timing: list[Timing] = []
        if not settings.quick and self.failure is None:
            for i, example in enumerate(self.plan.examples[:_MAX_TIMED]):
                label = example.label()
                self.say(f"timing example {i + 1}: {label} ({settings.repeat} samples)")
                timing.append(self.time(example, label, settings.repeat))
        return timing

    def first_call(self, example: Example, label: str, role: Literal["example", "sweep"]) -> Call:
        """Call a new shape through the guarded callable, then eager, and compare."""
        graphs_before = len(self.recorder.graphs)
        events_before = self.controller.events()
        before = self.controller.stats()
        args, kwargs = _cloned(example)
        caches = torchcompat.compile_cache_counts()
        started = time.perf_counter()
        try:
            out = self.guarded(*args, **kwargs)
            self._sync()
        except Exception as exc:
            # safe_compile raises only what eager raises too: the inputs' own error
            if role == "example":
                raise UsageError(
                    f"the example {label} raises in eager too ({error_at(exc)}): "
                    "fix the factory's inputs",
                    detail=user_traceback(exc),
                ) from exc
            return Call(
                label=label,
                role=role,
                path="skipped",
                note=f"eager raises {type(exc).__name__}: the sweep does not fit these inputs",
            )
        seconds = time.perf_counter() - started
        new_graphs = self.recorder.graphs[graphs_before:]
        call = Call(
            label=label,
            role=role,
            path="compiled",
            seconds=seconds,
            graphs=len(new_graphs),
            backend_s=math.fsum(g.compile_s for g in new_graphs),
            graph_s=tuple(g.compile_s for g in new_graphs),
            cache=_cache_state(caches, torchcompat.compile_cache_counts()),
        )
        failed = _failure_event(_since(events_before, self.controller.events()))
        after = self.controller.stats()
        if failed is not None and failed.reason is Reason.DRIFT:
            # a graph's first run differed from its eager run (docs/design.md, "A graph's
            # first run"): the guard answered with eager's result and rolled back
            drift = failed.message or "outputs differ"
            return dataclasses.replace(
                call,
                max_abs=failed.max_abs_diff or 0.0,
                max_rel=failed.max_rel_diff or 0.0,
                drift=drift,
            )
        if failed is not None:
            self.failure = self._failure(failed, label)
            note = f"{failed.error_type}: safe_compile answered with eager's result"
            return dataclasses.replace(call, path="failed", note=note)
        if after.compiled_calls == before.compiled_calls:
            limit = after.recompile_limit_calls > before.recompile_limit_calls
            self.limit_hit = self.limit_hit or limit
            note = "past the recompile limit: runs eager" if limit else "ran eager"
            return dataclasses.replace(call, path="eager", note=note)
        args, kwargs = _cloned(example)
        expected = self.plan.call(*args, **kwargs)
        result = compare(out, expected, rtol=self.plan.target.rtol, atol=self.plan.target.atol)
        return dataclasses.replace(
            call, max_abs=result.max_abs, max_rel=result.max_rel, drift=result.reason
        )

    def time(self, example: Example, label: str, repeat: int) -> Timing:
        """Median per-call time of each path, in interleaved samples."""
        compiled = functools.partial(self.guarded, *example.args, **example.kwargs)
        eager = functools.partial(self.plan.call, *example.args, **example.kwargs)
        before = self.controller.stats().compiled_calls
        compiled()
        eager()
        one = max(self._clock(eager, 1), self._clock(compiled, 1))
        inner = max(1, min(_MAX_INNER, int(_SAMPLE_S / max(one, 1e-9))))
        c_times, e_times = LatencyWindow(repeat), LatencyWindow(repeat)
        paths = ((compiled, c_times), (eager, e_times))
        said = time.perf_counter()
        for i in range(repeat):
            if time.perf_counter() - said >= PROGRESS_EVERY_S:  # a slow call is never silent
                said = time.perf_counter()
                self.say(f"timing {label}: {i} of {repeat} samples")
            for fn, times in paths[::-1] if i % 2 else paths:  # each path goes first in turn
                times.record(self._clock(fn, inner))
        served = self.controller.stats().compiled_calls - before
        calls = repeat * inner + 2
        # Each pair was timed back to back: the median of the pairs' ratios holds up when
        # the machine's load changes during the run; their spread says how much it did.
        pairs = zip(c_times.samples(), e_times.samples(), strict=True)
        ratios = [c / e for c, e in pairs if e > 0] if served else []
        ratio = statistics.median(ratios) if ratios else None
        spread = q1 = q3 = None
        if ratio and len(ratios) >= 4:
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            spread = (q3 - q1) / ratio
        compiled_p = c_times.percentiles() if served else {}
        eager_p = e_times.percentiles()
        note = None if served == calls else f"{calls - served} of {calls} calls ran eager"
        return Timing(
            label=label,
            eager_s=eager_p["p50"],
            compiled_s=compiled_p.get("p50"),
            ratio=ratio,
            samples=repeat,
            calls_per_sample=inner,
            spread=spread,
            note=note if served else "the compiled path did not serve this shape (it ran eager)",
            eager_p99_s=eager_p["p99"],
            compiled_p99_s=compiled_p.get("p99"),
            ratio_low=q1,
            ratio_high=q3,
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
            source=source_line(event.file, event.line),
            at_definition=at_definition,
        )


def _failure_event(events: Sequence[Event]) -> Event | None:
    kinds = (EventKind.COMPILE_FAILED, EventKind.ROLLBACK)
    return next((e for kind in kinds for e in events if e.kind is kind), None)


def _since(before: Sequence[Event], after: Sequence[Event]) -> tuple[Event, ...]:
    """The events in ``after`` not in ``before`` (by identity: two events can be equal)."""
    seen = {id(e) for e in before}
    return tuple(e for e in after if id(e) not in seen)


def _cloned(example: Example) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh copies of the tensors, so a call that mutates its inputs cannot skew the next."""
    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.clone(), (example.args, dict(example.kwargs))
    )
    return tuple(args), dict(kwargs)


def _device_of(examples: Sequence[Example], call: Callable[..., Any]) -> torch.device:
    for example in examples:
        for t in tensors(example):
            return t.device
    owner = getattr(call, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        for p in owner.parameters():
            return p.device
    return torch.device("cpu")


def _synchronizer(device: torch.device) -> Callable[[], None]:
    sync = getattr(getattr(torch, device.type, None), "synchronize", None)
    if device.type == "cpu" or not callable(sync):
        return lambda: None
    return lambda: sync(device)


def source_line(file: object, line: object) -> str | None:
    if not isinstance(file, str) or not isinstance(line, int) or not file or not line:
        return None
    text = linecache.getline(file, line).strip()
    return text or None


def _cache_state(
    before: Mapping[str, int], after: Mapping[str, int]
) -> Literal["cold", "warm", "mixed"] | None:
    """Whether inductor compiled a call's graphs afresh (``cold``), its caches served them
    all (``warm``), or some of each; ``None`` when no cache was asked (another backend)."""
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    cold = moved.get("fx_miss", 0) > 0
    warm = moved.get("fx_hit", 0) > 0 or moved.get("aot_hit", 0) > 0
    if cold:
        return "mixed" if warm else "cold"
    return "warm" if warm else None


def versions(device: torch.device) -> dict[str, str]:
    """safecompile, torch, Python, platform and device, as text."""
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
