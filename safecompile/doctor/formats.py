"""What the doctor's reports share in words: one formatter for each figure and place.

The text report, the JSON report's readers and the HTML page say a location, a number
of graphs, a duration and a check's status the same way, from here.
"""

from __future__ import annotations

import linecache
import os

import torch

__all__ = [
    "TAGS",
    "describe",
    "graphs",
    "kind",
    "message_lines",
    "qualname",
    "secs",
    "shown_path",
    "source_line",
    "where",
]

TAGS = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "SKIP"}


def describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        where = "" if value.device.type == "cpu" else f"@{value.device}"
        return f"{dtype}[{', '.join(map(str, value.shape))}]{where}"
    if isinstance(value, list | tuple) and len(value) <= 8:
        inner = ", ".join(describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return type(value).__name__


def kind(value: object) -> str:
    if value is None:
        return "None"
    name = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def qualname(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)


def source_line(file: str | None, line: int | None) -> str | None:
    if not file or not line:
        return None
    text = linecache.getline(file, line).strip()
    return text or None


def where(file: object, line: object, function: object) -> str:
    if not isinstance(file, str):
        return "(unknown location)"
    place = shown_path(file) + (f":{line}" if isinstance(line, int) else "")
    return place + (f" in {function}" if function else "")


def shown_path(file: str) -> str:
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
