"""Built C++ kernels shipped with a precompiled function, so a replica does not build them.

inductor's CPU kernels are libraries it builds from the source a compiled graph carries,
and finds again in its cache directory under a name hashed from that source and the
compiler's command line. A precompiled function is saved with the libraries its graphs
load; a process that loads it writes them where its own inductor looks first, when they
were built for the same machine (:func:`machine`): a kernel whose name this process's
inductor does not compute (another command line) is built as before.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import sys
from pathlib import Path

import torch

from safecompile.base import torchcompat

from .bounded import read_file
from .cache import _write_atomic, environment

__all__ = ["MAX_BYTES", "blob_name", "install", "machine", "read", "relative"]

MAX_BYTES = 256 << 20  # one kernel library
READ_TIMEOUT_S = 30.0
# Where inductor keeps a library it built: ``<2 characters>/<its key>[.main].so``.
_LIBRARY = re.compile(r"[A-Za-z0-9_]{1,16}/[A-Za-z0-9_.]{1,255}\.so")


@functools.cache
def machine() -> str:
    """A hex hash of what a built kernel depends on beyond inductor's name for it (its
    source and the compiler's command line, flags included): the CPU it was built for
    (inductor builds with ``-march=native``): its model and flags; the compiler's version;
    this torch build and its library directory; this Python; the C library."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    facts = environment("cpu") | {
        "torch.lib": lib,
        "python.executable": sys.executable,
        "libc": " ".join(platform.libc_ver()),
        "compiler": torchcompat.kernel_compiler(),
        "cpu": _cpu(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def _cpu() -> str:
    """The first CPU's model and flags (``/proc/cpuinfo``), else what platform says."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    first = text.split("\n\n", 1)[0]
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part", "isa")
    lines = [line for line in first.splitlines() if line.split(":", 1)[0].strip() in wanted]
    return "\n".join(sorted(" ".join(line.split()) for line in lines))


def relative(root: str, path: str) -> str | None:
    """``path`` (a library inductor built) as a name under ``root``, its cache directory;
    ``None`` when it is not one."""
    try:
        rel = Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return None
    return rel if _LIBRARY.fullmatch(rel) else None


def read(path: str) -> bytes | None:
    return read_file(Path(path), limit=MAX_BYTES, timeout=READ_TIMEOUT_S)


def blob_name(data: bytes) -> str:
    """The file a library is saved as beside the precompiled functions (by its content:
    graphs that share a kernel share its file)."""
    return f"kernel-{hashlib.sha256(data).hexdigest()[:32]}.bin"


def install(root: str, rel: str, data: bytes) -> bool:
    """Write a library where inductor looks for it (unless one is there already); whether
    it is there now."""
    if not _LIBRARY.fullmatch(rel):
        return False
    target = Path(root) / rel
    return target.exists() or _write_atomic(target, data)
