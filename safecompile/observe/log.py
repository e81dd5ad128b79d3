"""structlog, the way a library should use it: silent unless the application set logging up.

Decided per event, never at import: when the application has configured structlog
(``structlog.is_configured()``, true inside ``capture_logs()`` too) the event goes through
its processors; otherwise to the stdlib logger ``"safecompile"`` (a ``NullHandler``: silent
unless the application adds a handler), with the fields as the record's ``extra`` and one
line a person reads (:func:`readable_line`) as its message.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Mapping
from typing import Any

import structlog
import torch
from opentelemetry import trace

from safecompile.base.torchcompat import Missing

from .source import truncate

__all__ = [
    "LINE_LIMIT",
    "LOGGER_NAME",
    "Once",
    "forget_said",
    "log_event",
    "readable_line",
    "report_internal_error",
    "torch_missing",
]

LOGGER_NAME = "safecompile"
#: Longest stdlib log message (:func:`readable_line`).
LINE_LIMIT = 200

_stdlib_logger = logging.getLogger(LOGGER_NAME)
if not any(isinstance(h, logging.NullHandler) for h in _stdlib_logger.handlers):
    _stdlib_logger.addHandler(logging.NullHandler())

# Attributes of logging.LogRecord (and the two names makeRecord refuses): an ``extra`` key
# among them makes ``Logger.makeRecord`` raise, so such fields are renamed.
_RESERVED = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "event", "exc_info", "stack_info", "stacklevel"}
)


class Once:
    """Keys seen before: the first :meth:`first` of a key is true, every later one false.

    Thread-safe without a lock (none to leave held across a fork): ``dict.setdefault``
    is one atomic step for the str and tuple keys used.
    """

    def __init__(self) -> None:
        self._seen: dict[Hashable, object] = {}

    def first(self, key: Hashable) -> bool:
        """Whether ``key`` is new (it is remembered from now on)."""
        mine = object()
        return self._seen.setdefault(key, mine) is mine

    def warn(self, key: Hashable, event: str, /, **fields: Any) -> None:
        """Log ``event`` at WARNING the first time ``key`` is seen; never raises."""
        if self.first(key):
            log_event(event, level=logging.WARNING, **fields)

    def forget(self) -> None:
        """Let every key be new again (for resets and tests)."""
        self._seen.clear()


#: What was said once per process: ``("internal", place, exception type)`` by
#: :func:`report_internal_error`, ``("torch missing", name)`` by :func:`torch_missing`,
#: and the keys :func:`warn_once` was given.
_SAID = Once()


def forget_said() -> None:
    """Let everything said once per process be said again (for tests)."""
    _SAID.forget()


def warn_once(key: Hashable, event: str, /, **fields: Any) -> None:
    """Log ``event`` at WARNING the first time this process sees ``key``; never raises."""
    _SAID.warn(key, event, **fields)


def _trace_ids(span: trace.Span | None) -> dict[str, str]:
    """``trace_id`` / ``span_id`` (hex) of ``span``, else of the current span; ``{}`` if none."""
    context = (span if span is not None else trace.get_current_span()).get_span_context()
    if not context.is_valid:
        return {}
    return {
        "trace_id": trace.format_trace_id(context.trace_id),
        "span_id": trace.format_span_id(context.span_id),
    }


# structlog's method for a level (any wrapper class has these, not every one a log(level)).
_METHODS = ((logging.ERROR, "error"), (logging.WARNING, "warning"), (logging.INFO, "info"))


def _safe_key(key: str) -> str:
    return f"safecompile_{key}" if key in _RESERVED else key


def log_event(
    event: str, *, level: int = logging.INFO, span: trace.Span | None = None, **fields: Any
) -> None:
    """Log one structured event with ``span``'s (or the current span's) ids; never raises.
    Fields named like ``LogRecord`` attributes get a ``safecompile_`` prefix, so the same
    keys arrive through structlog and through stdlib ``extra``."""
    try:
        payload = {_safe_key(k): v for k, v in fields.items()}
        payload.update(_trace_ids(span))
        if not structlog.is_configured():
            if _stdlib_logger.isEnabledFor(level):
                payload[_safe_key("event")] = event
                _stdlib_logger.log(level, readable_line(event, fields), extra=payload)
            return
        method = next((name for floor, name in _METHODS if level >= floor), "debug")
        getattr(structlog.get_logger(LOGGER_NAME), method)(event, **payload)
    except Exception as exc:  # logging must never break a call
        report_internal_error("log", exc)


# Reasons a kind of event says by itself.
_IMPLIED_REASONS = {"compile_failed": ("compile_error",), "recompile_limit": ("recompile_limit",)}


def _figure(value: object) -> str | None:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else None


def readable_line(event: str, fields: Mapping[str, Any], limit: int = LINE_LIMIT) -> str:
    """One line a person reads: ``kind function [figures]: description (at file:line)``,
    at most ``limit`` characters; torch's raw text (``error_message``) stays a field."""
    kind = event.removeprefix(f"{LOGGER_NAME}.")
    figures = []
    reason = fields.get("reason")
    if isinstance(reason, str) and reason not in _IMPLIED_REASONS.get(kind, (kind,)):
        figures.append(reason)
    labels = {"duration_s": "{} s", "max_rel_diff": "max_rel={}", "retry_in_s": "retry in {} s"}
    for key, label in labels.items():
        text = _figure(fields.get(key))
        if text is not None:
            figures.append(label.format(text))
    function = fields.get("function")
    head = f"{kind} {function}" if function else kind  # process-wide events name none
    if figures:
        head += f" [{', '.join(figures)}]"
    description = str(fields.get("description") or fields.get("error_type") or "")
    file, line = fields.get("code_file"), fields.get("code_line")
    if isinstance(file, str) and file:
        place = os.path.basename(file) + (f":{line}" if isinstance(line, int) else "")
        if place not in description:
            description = f"{description} (at {place})" if description else f"at {place}"
    text = " ".join((f"{head}: {description}" if description else head).split())
    return truncate(text, limit)


def report_internal_error(where: str, exc: BaseException) -> None:
    """Report a failure inside safecompile's own telemetry, once per place and type, to
    the stdlib logger only (structlog may be what failed); never raises."""
    try:
        if not _SAID.first(("internal", where, type(exc).__qualname__)):
            return
        _stdlib_logger.warning(
            "safecompile telemetry failed in %s (reported once; calls are unaffected)",
            where,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
    except Exception:  # nothing left to report to
        pass


def torch_missing(missing: Missing) -> None:
    """Say once per name that the installed torch lacks a private name safecompile uses,
    and what goes without it (see :mod:`safecompile.base.torchcompat`)."""
    _SAID.warn(
        ("torch missing", missing.name),
        "safecompile.torch_feature_missing",
        torch_name=missing.name,
        effect=missing.effect,
        torch=torch.__version__,
        description=f"no {missing.name} in this torch: {missing.effect}",
    )
