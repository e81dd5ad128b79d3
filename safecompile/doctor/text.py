"""The readiness report as text: the verdict first, then one section per check."""

from __future__ import annotations

import textwrap

from .report import Report

__all__ = ["LINE_LIMIT", "counts", "render_text"]

#: Longest line of the text report.
LINE_LIMIT = 200
_COUNTED = {"fail": "failed", "warn": "warning", "pass": "passed", "skip": "skipped"}


def render_text(report: Report) -> str:
    """The readiness report as text: the verdict first, then one section per check."""
    verdict = ("READY" if report.ready else "NOT READY") + " - " + counts(report)
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
        out.append(f"[{check.status.upper()}] {check.title.ljust(width)}  {check.summary}")
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
    return "".join(line + "\n" for entry in out for line in _fitted(entry))


def counts(report: Report) -> str:
    """How the checks came out: ``1 failed (recompiles), 1 warning (speed), 3 passed``."""
    said = []
    for status, word in _COUNTED.items():
        titles = [c.title for c in report.checks if c.status == status]
        if titles:
            plural = "s" if status == "warn" and len(titles) > 1 else ""
            named = f" ({', '.join(titles)})" if status in ("fail", "warn") else ""
            said.append(f"{len(titles)} {word}{plural}{named}")
    return ", ".join(said)


def _fitted(line: str) -> list[str]:
    """``line`` (each of its lines) wrapped at :data:`LINE_LIMIT`, the rest indented."""
    if "\n" in line:
        return [part for piece in line.split("\n") for part in _fitted(piece)]
    if len(line) <= LINE_LIMIT:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return textwrap.wrap(line, LINE_LIMIT, subsequent_indent=indent, break_on_hyphens=False) or [
        line[:LINE_LIMIT]
    ]
