"""File reads that cannot hang the caller (maybe ``safe_compile()`` itself) on a hung NFS
mount or a FIFO nobody writes to: a worker thread, a timeout, a size limit, regular files.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ._state import STATE

__all__ = ["READ_TIMEOUT_S", "ReadTimeoutError", "bounded", "read_fd", "read_file"]

T = TypeVar("T")

READ_TIMEOUT_S = 1.0  # a local file answers in microseconds; a hung mount never does


class ReadTimeoutError(OSError):
    """The read did not finish within its timeout (or an earlier one has not yet)."""


def read_file(path: Path, *, limit: int, timeout: float = READ_TIMEOUT_S) -> bytes | None:
    """Up to ``limit + 1`` bytes (more than ``limit``: too large) of the regular file
    ``path``, ``None`` if missing; :class:`OSError` otherwise (a timeout included)."""
    name = str(path)
    return bounded(lambda: _read(name, limit), name, timeout, doing="reading")


def bounded(work: Callable[[], T], name: str, timeout: float, *, doing: str = "using") -> T:
    """``work()``'s value or exception, waited for ``timeout`` seconds (then, and while it is
    still stuck for the same ``name``, :class:`ReadTimeoutError`)."""
    with STATE.stuck_lock:
        if name in STATE.stuck:
            raise ReadTimeoutError(f"an earlier attempt at {doing} {name} has not returned")
        STATE.stuck.add(name)
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:
            box["error"] = exc
        finally:
            with STATE.stuck_lock:
                STATE.stuck.discard(name)
            done.set()

    threading.Thread(target=run, name="safecompile-read", daemon=True).start()
    if not done.wait(timeout):
        raise ReadTimeoutError(f"{doing} {name} took over {timeout:g} s")
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def _read(name: str, limit: int) -> bytes | None:
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        return None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), name)
        if not stat.S_ISREG(mode):
            raise OSError(f"{name} is not a regular file")
        return read_fd(fd, limit)
    finally:
        os.close(fd)


def read_fd(fd: int, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes from ``fd`` (more than ``limit``: too large)."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = os.read(fd, limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
