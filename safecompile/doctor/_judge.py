"""Judging: the readiness checks, pure functions of a :class:`~.report.Report`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

from .report import Call, Check, Report, Status, Timing, graphs, message_lines, secs, where

__all__ = ["is_debug_backend", "judge"]


def _check(
    name: str, status: Status, summary: str, advice: str = "none", lines: Sequence[str] = ()
) -> Check:
    return Check(
        name=name,
        title=name.replace("_", " "),
        status=status,
        summary=summary,
        advice=advice,
        lines=tuple(lines),
    )


def judge(report: Report) -> tuple[Check, ...]:
    """The checks, from a report's measurements and thresholds (pure)."""
    checks = (_check_compile, _check_graph_breaks, _check_recompiles, _check_speed, _check_drift)
    return tuple(check(report) for check in checks)


def _check_compile(r: Report) -> Check:
    verdict = partial(_check, "compile")
    failure = r.failure
    if failure is not None:
        place = where(failure.file, failure.line, failure.function)
        if failure.at_definition:
            place += " (the function's definition: torch named no closer line)"
        lines = [f"on {failure.label}", f"at {place}"]
        if failure.source:
            lines.append(f"  {failure.line} | {failure.source}")
        lines += [f"  {m}" for m in message_lines(failure.message, 3)]
        if failure.reason == "runtime_error":
            return verdict(
                "fail",
                f"the compiled code raised {failure.error_type} where eager does not",
                "a compiler bug: safe_compile would roll back to eager; keep eager for "
                "this callable and report it upstream with the line shown",
                lines,
            )
        return verdict(
            "fail",
            f"compiling failed: {failure.error_type}",
            "safe_compile would serve eager (no gain): fix the line shown, or rerun with "
            "--backend aot_eager / eager to see which layer fails",
            lines,
        )
    compiled = [c for c in r.examples if c.path == "compiled"]
    total = math.fsum(c.seconds or 0.0 for c in r.examples)
    lines = [
        f"{c.label}: {graphs(c.graphs)}, first call {secs(c.seconds)}"
        + (f" (backend {secs(c.backend_s)})" if c.graphs else "")
        + (f" - {c.note}" if c.note else "")
        for c in r.examples
    ]
    made = sum(c.graphs for c in r.examples)
    if made == 0:
        return verdict(
            "warn",
            "nothing was captured: dynamo compiled no graph, so every call pays "
            "its overhead for nothing",
            "drop safe_compile here, or find out why with TORCH_LOGS=graph_breaks",
            lines,
        )
    n = len(r.examples)
    done = f"{n} example{'s' if n > 1 else ''}" if len(compiled) == n else f"{len(compiled)} of {n}"
    summary = f"{done} compiled into {graphs(made)}; {_first_calls(r.examples)} took {secs(total)}"
    if total > r.thresholds.compile_warn_s:
        return verdict(
            "warn",
            summary + f" (over {secs(r.thresholds.compile_warn_s)})",
            "compile before serving: warmup=Warmup(inputs=[...], background=True), "
            "and keep SAFECOMPILE_CACHE_DIR on a persistent volume",
            lines,
        )
    return verdict(
        "pass", summary, "compile these shapes before traffic: warmup=Warmup(inputs=[...])", lines
    )


def _first_calls(calls: Sequence[Call]) -> str:
    """What the first calls were: "cold" only where inductor was measured compiling
    afresh (its cache missed), never where its caches served them."""
    caches = {c.cache for c in calls if c.graphs}
    if caches == {"cold"}:
        return "cold first calls"
    if caches == {"warm"}:
        return "first calls (warm: inductor's caches served every graph)"
    if "cold" in caches or "mixed" in caches:
        return "first calls (partly cold: some graphs came from inductor's caches)"
    return "first calls"


def _check_graph_breaks(r: Report) -> Check:
    verdict = partial(_check, "graph_breaks")
    allowed = r.thresholds.max_graph_breaks
    breaks = r.graph_breaks
    if r.failure is not None and r.graphs == 0:
        return verdict(
            "skip", "unknown: the compile failed before any graph was captured", "see compile"
        )
    lines: list[str] = []
    for b in breaks:
        lines.append(where(b.get("file"), b.get("line"), b.get("function")))
        if b.get("source"):
            lines.append(f"  {b.get('line')} | {b.get('source')}")
        said = message_lines(str(b.get("reason") or ""), 8)
        hint = [m for m in said if m.startswith("Hint:")]
        lines += [f"  reason: {m}" for m in said[:1]] + [f"  {h}" for h in hint[:1]]
    n = len(breaks)
    if n == 0:
        return verdict(
            "pass",
            f"no graph breaks in {graphs(r.graphs)}",
            "keep it so in CI: safecompile.testing.assert_compiles(fn, *args)",
        )
    summary = f"{n} graph break{'s' if n > 1 else ''}, {allowed} allowed"
    if n <= allowed:
        return verdict(
            "warn",
            summary,
            "each break is a trip back to Python and a smaller graph: remove the ones "
            "shown when you can",
            lines,
        )
    return verdict(
        "fail",
        summary,
        "remove each break at the line shown (TORCH_LOGS=graph_breaks explains it), "
        "or accept them with --max-graph-breaks N",
        lines,
    )


def _check_recompiles(r: Report) -> Check:
    verdict = partial(_check, "recompiles")
    limit = r.thresholds.max_recompiles
    if r.quick or r.failure is not None or not r.sweep:
        why = r.sweep_plan or "no sweep"
        if r.failure is not None and not r.quick:
            why = "skipped: a compile failed"
        return verdict("skip", why, "none")
    lines = [f"swept {r.sweep_plan}"]
    reused = 0
    for c in r.sweep:
        if c.graphs == 0 and c.path == "compiled":
            reused += 1  # served by a graph compiled before
            continue
        what = graphs(c.graphs) + (f" in {secs(c.seconds)}" if c.graphs else "")
        lines.append(f"{c.label}: {what}" + (f" - {c.note}" if c.note else ""))
    if reused:
        lines.append(f"{reused} other shape(s) reused a graph compiled before")
    if r.sweep_stopped:
        lines.append(r.sweep_stopped)
    ran = [c for c in r.sweep if c.path != "skipped"]
    if not ran:
        return verdict(
            "warn",
            "the sweep's shapes all raise in eager: it guessed the dims wrong",
            "give the shapes to sweep: DoctorTarget(sweep=[...])",
            lines,
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
        return verdict(
            "fail",
            f"{r.compiles} compiles reached max_recompiles={limit} at {hit.label}: "
            "new shapes past it run eager",
            advice,
            lines,
        )
    summary = (
        f"{len(ran)} swept shape(s): {r.compiles} compile(s) in all ({graphs(r.graphs)}), "
        f"limit {limit}"
    )
    if r.compiles > limit // 2:
        return verdict(
            "warn",
            summary + ": over half the limit",
            "real traffic has more shapes than the sweep: bound them with "
            "buckets=Buckets(...) or dynamic=True",
            lines,
        )
    return verdict(
        "pass",
        summary,
        "nothing; if traffic has other shapes, sweep them: DoctorTarget(sweep=[...])",
        lines,
    )


def _check_speed(r: Report) -> Check:
    verdict = partial(_check, "speed")
    if r.quick or r.failure is not None or not r.timing:
        why = "skipped (--quick)" if r.quick else "skipped: a compile failed"
        return verdict("skip", why, "none")
    lines = [
        f"{t.label}: compiled {secs(t.compiled_s)}, eager {secs(t.eager_s)}"
        + (f" -> {t.ratio:.2f}x" if t.ratio is not None else "")
        + (f" (noisy: {_noise(t)})" if t.noisy else "")
        + (f" - {t.note}" if t.note else "")
        for t in r.timing
    ]
    timed = [t for t in r.timing if t.ratio is not None]
    if not timed:
        return verdict("skip", "the compiled path served no timed example", "see recompiles", lines)
    backend = str(r.settings.get("backend"))
    return verdict(*_speed_verdict(timed, r.thresholds.slower_ratio, backend), lines)


def _speed_verdict(timed: list[Timing], limit: float, backend: str) -> tuple[Status, str, str]:
    """Status, summary and advice of the speed check (``timed``: at least one example)."""
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
    undecided = [t for t in timed if _undecided(t, limit)]
    if undecided:
        return _inconclusive(max(undecided, key=lambda t: t.spread or 0.0))
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
        "the speed verdict (on by default, Rollback(slower_ratio=1.05)) falls back if "
        "traffic shapes behave worse",
    )


def _noise(t: Timing) -> str:
    """How noisy a timing was: its spread, and the middle half of its pairs' ratios (the
    medians of each path, timed apart, can disagree with the pairs' ratio when noisy)."""
    middle = t.middle_half()
    said = f"spread {t.spread or 0.0:.0%}"
    return said if middle is None else f"{said}, pairs {middle[0]:.2f}x to {middle[1]:.2f}x"


def _undecided(timing: Timing, limit: float) -> bool:
    """Noisy, and the middle half of its pairs' ratios reaches both sides of 1.0 or of
    the limit: the timing cannot say faster, slower or too slow."""
    middle = timing.middle_half()
    if not timing.noisy or middle is None:
        return False
    low, high = middle
    return low <= 1.0 <= high or low <= limit <= high


def _inconclusive(t: Timing) -> tuple[Status, str, str]:
    low, high = t.middle_half() or (0.0, 0.0)
    return (
        "warn",
        f"inconclusive: compiled took {t.ratio or 0.0:.2f}x eager's time on {t.label}, but "
        f"the timings were noisy: the middle half of the pairs spans {low:.2f}x to "
        f"{high:.2f}x (spread {t.spread or 0.0:.0%}), too wide to say faster or slower",
        "rerun on an idle machine with more samples (--repeat 100), the process pinned to "
        "cores nothing else uses (taskset -c 2,3 python -m safecompile doctor ...)",
    )


def _check_drift(r: Report) -> Check:
    verdict = partial(_check, "drift")
    compared = [c for c in (*r.examples, *r.sweep) if c.path == "compiled"]
    if not compared:
        return verdict("skip", "no compiled output to compare", "see compile")
    max_abs = max(c.max_abs or 0.0 for c in compared)
    max_rel = max(c.max_rel or 0.0 for c in compared)
    figures = f"max abs {max_abs:.3g}, normalised {max_rel:.3g}"
    breached = [c for c in compared if c.drift is not None]
    lines = [f"{c.label}: {c.drift}" for c in breached[:5]]
    if r.random_op is not None:
        return verdict(
            "warn",
            f"not comparable: the graph draws random numbers ({r.random_op}); {figures}",
            "return the model in eval() mode from the factory; safe_compile skips "
            "shadow checks on such graphs",
            lines,
        )
    if r.unchecked and not breached:
        return verdict(
            "warn",
            f"{figures}; safe_compile cannot shadow-check {len(r.unchecked)} "
            "graph(s): its state will read 'unchecked'",
            "keep what the graph updates in the module's buffers and attributes, or "
            "in objects passed as arguments; safe_compile copies those for its checks",
            lines=r.unchecked[:5],
        )
    if breached:
        return verdict(
            "fail",
            f"compiled differs from eager on {len(breached)} of {len(compared)} call(s): {figures}",
            "find the op: rerun with --backend aot_eager (no drift: the backend causes "
            "it); if expected (low precision), set DoctorTarget(rtol=..., atol=...) and "
            "Shadow(rtol=..., atol=...)",
            lines,
        )
    rtol = r.settings.get("rtol")
    tolerance = "per-dtype default tolerances" if rtol is None else f"rtol {rtol}"
    return verdict(
        "pass",
        f"{figures} over {len(compared)} call(s), within {tolerance}",
        "keep shadow checks on in production: Shadow(canary=8) compares new graphs",
    )


def is_debug_backend(name: str) -> bool:
    """Whether ``name`` is a torch backend that runs the graph as captured (no speed-up to
    expect): ``eager``, ``aot_eager`` and their variants."""
    return name == "pre_dispatch_eager" or name.startswith(("eager", "aot_eager"))
