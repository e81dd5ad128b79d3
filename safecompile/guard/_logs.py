"""torch's log lines inside a guarded call: what the guard says better, held or dropped.

Both filters act only while a frame of the call paths (:mod:`._hot`, :mod:`._paths`,
:mod:`._finish`, :mod:`._buckets`) is on the stack; elsewhere torch's logs pass untouched.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import types

from safecompile.base import torchcompat

__all__ = ["META_LOG"]

_HERE = os.path.dirname(__file__)
_PATHS = ("_hot.py", "_paths.py", "_finish.py", "_buckets.py")
_PATH_FILES = frozenset(os.path.join(_HERE, name) for name in _PATHS)


class _Held(threading.local):
    """One thread's held log records (see :class:`_MetaLogHold`)."""

    def __init__(self) -> None:
        self.records: collections.deque[logging.LogRecord] = collections.deque(maxlen=16)
        self.replaying = False


class _MetaLogHold(logging.Filter):
    """Holds torch's ``failed while attempting to run meta`` error log (a traceback per op)
    logged inside a guarded call: :func:`recover` drops it when eager raises too (the
    user's own bug: eager's error says it all) and hands it on otherwise."""

    LOGGER = torchcompat.FAKE_TENSOR_LOGGER

    def __init__(self) -> None:
        super().__init__()
        self.held = _Held()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.held.replaying or not _in_guarded_call():
            return True
        self.held.records.append(record)
        return False

    def drop(self) -> None:
        self.held.records.clear()

    def replay(self) -> None:
        held = self.held
        records = list(held.records)
        held.records.clear()
        held.replaying = True
        try:
            for record in records:
                logging.getLogger(self.LOGGER).handle(record)
        finally:
            held.replaying = False


def _in_guarded_call() -> bool:
    """Whether a frame of the call paths (a guarded call) is on the stack."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in _PATH_FILES:
            return True
        frame = frame.f_back
    return False


META_LOG = _MetaLogHold()


class _TorchLimitQuiet(logging.Filter):
    """Drops dynamo's own recompile-limit warning raised inside a guarded call: our
    ``recompile_limit`` event said it first (our limit is below torch's), and the calls
    past torch's limit are counted as ``recompile_limit`` too. Elsewhere it stays."""

    LOGGER, START = torchcompat.RECOMPILE_LIMIT_LOG

    def filter(self, record: logging.LogRecord) -> bool:
        said_by_us = isinstance(record.msg, str) and record.msg.startswith(self.START)
        return not (said_by_us and _in_guarded_call())


logging.getLogger(_MetaLogHold.LOGGER).addFilter(META_LOG)
logging.getLogger(_TorchLimitQuiet.LOGGER).addFilter(_TorchLimitQuiet())
