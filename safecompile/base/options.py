"""The decorator's options as records every layer may read (no layer above is imported).

:class:`CompileOptions` is what ``torch.compile`` is handed, validated by the decorator
(:mod:`safecompile.guard.decorator`); the persisted verdicts (:mod:`safecompile.persist`)
key on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Clock", "CompileOptions", "CompilerFn"]

Clock = Callable[[], float]
"""Monotonic seconds (``time.perf_counter``; tests inject fake clocks)."""

CompilerFn = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]
"""A ``torch.compile`` backend: ``(gm, example_inputs) -> callable``."""


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """What is handed to ``torch.compile`` (validated by the decorator)."""

    backend: str | Callable[..., Any]
    backend_label: str
    mode: str | None
    options: Mapping[str, Any] | None
    dynamic: bool | None
    fullgraph: bool
    compiler: CompilerFn
