"""The doctor's records (what it was given, measured and concluded) and the words its
reports say a place, a duration and a count of graphs in."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from safecompile.base.policies import Buckets, Rollback

__all__ = [
    "DEFAULT_LIMIT",
    "SCHEMA",
    "Call",
    "Check",
    "DoctorTarget",
    "Example",
    "Failure",
    "Report",
    "Settings",
    "Status",
    "Thresholds",
    "Timing",
    "UsageError",
    "graphs",
    "message_lines",
    "secs",
    "time_unit",
    "where",
]

SCHEMA = "safecompile.doctor/1"
"""The ``schema`` field of the JSON report; bumped when a field changes meaning."""
Status = Literal["pass", "warn", "fail", "skip"]
_LABEL_LIMIT = 120
DEFAULT_LIMIT = Rollback().recompile_limit
_NOISY_SPREAD = 0.25  # timing pairs' interquartile range over their median ratio


class UsageError(Exception):
    """The doctor cannot run on what it was given (exit code 2).

    The message is one line; where the user's own code raised, it names the line.
    ``detail`` is more text for the user (the traceback from their own code), or ``None``.
    """

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


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


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        where = "" if value.device.type == "cpu" else f"@{value.device}"
        return f"{dtype}[{', '.join(map(str, value.shape))}]{where}"
    if isinstance(value, list | tuple) and len(value) <= 8:
        inner = ", ".join(_describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return type(value).__name__


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


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Where a check turns from PASS to WARN or FAIL (see ``docs/doctor.md``)."""

    max_graph_breaks: int = 0  # more: FAIL; 1..max: WARN
    max_recompiles: int = DEFAULT_LIMIT  # the sweep reaching it: FAIL; over half: WARN
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
    max_graph_breaks: int = Thresholds.max_graph_breaks
    max_recompiles: int | None = None
    slower_ratio: float = Thresholds.slower_ratio
    compile_warn_s: float = Thresholds.compile_warn_s
    reset_dynamo: bool = True  # torch.compiler.reset() first, as in a fresh process


@dataclass(frozen=True, kw_only=True)
class Call:
    """The first call of one input shape through the guarded callable."""

    label: str
    role: Literal["example", "sweep"]
    path: Literal["compiled", "eager", "failed", "skipped"]  # what served it
    seconds: float | None = None  # wall time of the first call: compile and one run
    graphs: int = 0  # graphs compiled for it
    backend_s: float = 0.0  # of ``seconds``, time in the backend compiler
    graph_s: tuple[float, ...] = ()  # backend compile time of each of those graphs
    # inductor's caches during the call: "cold" (every graph compiled afresh), "warm"
    # (the caches served every one), "mixed"; None: no cache was asked (another backend)
    cache: Literal["cold", "warm", "mixed"] | None = None
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
    ratio_low: float | None = None  # the middle half of the pairs' ratios: first quartile
    ratio_high: float | None = None  # and third

    @property
    def noisy(self) -> bool:
        """The machine was too busy for the ratio to mean much (``spread`` over 0.25)."""
        return self.spread is not None and self.spread > _NOISY_SPREAD

    def middle_half(self) -> tuple[float, float] | None:
        """The first and third quartiles of the pairs' ratios (from ``ratio`` and
        ``spread`` when a report did not record them); ``None`` if unknown."""
        if self.ratio_low is not None and self.ratio_high is not None:
            return self.ratio_low, self.ratio_high
        if self.ratio is None or self.spread is None:
            return None
        half = self.ratio * self.spread / 2
        return self.ratio - half, self.ratio + half


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
    created: str | None = None  # when the doctor ran: ISO 8601, UTC, to the second
    examples: tuple[Call, ...]
    sweep: tuple[Call, ...] = ()
    sweep_plan: str | None = None  # what the sweep varied, or why there was none
    sweep_stopped: str | None = None
    compiles: int = 0  # shapes (or buckets) that compiled, as safe_compile counts them
    graphs: int = 0
    graph_breaks: tuple[Mapping[str, Any], ...] = ()
    random_op: str | None = None
    # graphs safe_compile cannot shadow-check, and why ("graph 2: ..."): its state
    # reads "unchecked" while they serve
    unchecked: tuple[str, ...] = ()
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
        verdict = "ready" if self.ready else "not_ready"
        head = {"schema": SCHEMA, "verdict": verdict, "exit_code": self.exit_code}
        return cast(dict[str, Any], _jsonable({**head, **dataclasses.asdict(self)}))


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


def where(file: object, line: object, function: object) -> str:
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


def message_lines(message: str | None, limit: int) -> list[str]:
    lines = [line.strip() for line in (message or "").splitlines()]
    return [line for line in lines if line][:limit]


def graphs(n: int) -> str:
    return f"{n} graph{'' if n == 1 else 's'}"


def secs(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    scale, unit = time_unit(seconds)
    return f"{seconds * scale:.{1 if unit == 'us' else 2}f} {unit}"


def time_unit(largest: float) -> tuple[float, str]:
    """A scale and unit name for times up to ``largest`` seconds."""
    if largest >= 1.0:
        return 1.0, "s"
    if largest >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"
