"""The doctor: is a callable ready for ``safe_compile`` in production?

``python -m safecompile doctor MODULE:FACTORY``; :mod:`.report` measures and judges,
:mod:`.html` renders the page.
"""

from __future__ import annotations

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
    diagnose,
    is_debug_backend,
    judge,
    load_target,
    parse_inputs,
    render_html,
    render_text,
    to_target,
)

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
