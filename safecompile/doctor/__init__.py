"""The doctor: is a callable ready for ``safe_compile`` in production?

``python -m safecompile doctor MODULE:FACTORY``. By concern: :mod:`.target` loads the
target, :mod:`.measure` runs it next to eager, :mod:`.judge` turns the measurements into
checks, :mod:`.text` and :mod:`.html` render them (:meth:`Report.to_dict` is the JSON);
:mod:`.report` holds the records and the words they share.
"""

from __future__ import annotations

from .html import render_html
from .judge import is_debug_backend, judge
from .measure import diagnose
from .report import (
    SCHEMA,
    Call,
    Check,
    DoctorTarget,
    Example,
    Failure,
    Report,
    Settings,
    Thresholds,
    Timing,
    UsageError,
)
from .target import load_target, parse_inputs, to_target
from .text import render_text

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
