"""structlog, the way a library should use it: silent unless the application set logging up.

Decided per event, never at import: when the application has configured structlog
(``structlog.is_configured()``, also true inside ``structlog.testing.capture_logs()``) the
event goes to ``structlog.get_logger("safecompile")`` and through the application's
processors. Otherwise it goes to the stdlib logger ``"safecompile"`` (which has a
``NullHandler``, so nothing reaches stdout or stderr unless the application adds a handler),
with the event's fields as the record's ``extra`` attributes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import structlog
from opentelemetry import trace

__all__ = ["LOGGER_NAME", "current_trace_ids", "log_event", "report_internal_error"]

LOGGER_NAME = "safecompile"

_stdlib_logger = logging.getLogger(LOGGER_NAME)
if not any(isinstance(h, logging.NullHandler) for h in _stdlib_logger.handlers):
    _stdlib_logger.addHandler(logging.NullHandler())

# Attributes of logging.LogRecord (and the two names makeRecord refuses): an ``extra`` key
# among them makes ``Logger.makeRecord`` raise, so such fields are renamed.
_RESERVED = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "event", "exc_info", "stack_info", "stacklevel"}
)

_lock = threading.Lock()
_stdlib_bound: Any = None
_reported: set[tuple[str, str]] = set()


def _stdlib_structlog() -> Any:
    global _stdlib_bound
    if _stdlib_bound is None:
        with _lock:
            if _stdlib_bound is None:
                _stdlib_bound = structlog.wrap_logger(
                    _stdlib_logger,
                    processors=[
                        structlog.stdlib.filter_by_level,
                        structlog.stdlib.render_to_log_kwargs,
                    ],
                    wrapper_class=structlog.stdlib.BoundLogger,
                    cache_logger_on_first_use=True,
                )
    return _stdlib_bound


def current_trace_ids(span: trace.Span | None = None) -> dict[str, str]:
    """``trace_id`` / ``span_id`` (hex) of ``span``, else of the current span; ``{}`` if none."""
    context = (span if span is not None else trace.get_current_span()).get_span_context()
    if not context.is_valid:
        return {}
    return {
        "trace_id": trace.format_trace_id(context.trace_id),
        "span_id": trace.format_span_id(context.span_id),
    }


def _safe_key(key: str) -> str:
    return f"safecompile_{key}" if key in _RESERVED else key


def log_event(
    event: str, *, level: int = logging.INFO, span: trace.Span | None = None, **fields: Any
) -> None:
    """Log one structured event; never raises.

    ``trace_id`` / ``span_id`` are added from ``span`` (or the current span) when valid.
    Fields whose names clash with ``logging.LogRecord`` attributes get a ``safecompile_``
    prefix, so the same keys arrive through structlog and through stdlib ``extra``.
    """
    try:
        payload = {_safe_key(k): v for k, v in fields.items()}
        payload.update(current_trace_ids(span))
        logger: Any
        if structlog.is_configured():
            logger = structlog.get_logger(LOGGER_NAME)
        else:
            logger = _stdlib_structlog()
        if level >= logging.ERROR:
            logger.error(event, **payload)
        elif level >= logging.WARNING:
            logger.warning(event, **payload)
        elif level >= logging.INFO:
            logger.info(event, **payload)
        else:
            logger.debug(event, **payload)
    except Exception as exc:  # logging must never break a call
        report_internal_error("log", exc)


def report_internal_error(where: str, exc: BaseException) -> None:
    """Report a failure inside safecompile's own telemetry, once per place and type.

    Goes to the stdlib logger only (no structlog: it may be what failed); never raises.
    """
    key = (where, type(exc).__qualname__)
    try:
        with _lock:
            if key in _reported:
                return
            _reported.add(key)
        _stdlib_logger.warning(
            "safecompile telemetry failed in %s (reported once; calls are unaffected)",
            where,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
    except Exception:  # nothing left to report to
        pass
