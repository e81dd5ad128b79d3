"""The doctor: is a callable ready for ``safe_compile`` in production?

``python -m safecompile doctor MODULE:FACTORY``. By concern: :mod:`._target` loads the
target, :mod:`._measure` runs it next to eager, :mod:`._judge` turns the measurements into
checks, :mod:`.text` and :mod:`.html` render them (:meth:`Report.to_dict` is the JSON);
:mod:`.report` holds the records and the words they share.
"""

from __future__ import annotations

from ._judge import is_debug_backend, judge
from ._measure import diagnose
from ._target import call_factory, load_target, parse_inputs, to_target
from .html import render_html
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
    "call_factory",
    "diagnose",
    "is_debug_backend",
    "judge",
    "load_target",
    "parse_inputs",
    "render_html",
    "render_text",
    "to_target",
]
