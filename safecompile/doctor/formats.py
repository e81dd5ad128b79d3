"""What the doctor's reports share in words: one formatter for each figure and place.

The text report, the JSON report's readers and the HTML page say a location, a number
of graphs, a duration and a check's status the same way, from here.
"""

from __future__ import annotations

import os

__all__ = ["TAGS", "graphs", "message_lines", "secs", "where"]

TAGS = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "SKIP"}


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
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"
