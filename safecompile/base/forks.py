"""A forked child starts without the parent's other threads: a lock one of them held at the
fork stays held there for good, and a thread it ran is gone."""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["in_forked_child"]


def in_forked_child(reset: Callable[[], None]) -> Callable[[], None]:
    """Decorator: run ``reset`` in every child this process forks from now on."""
    if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
        os.register_at_fork(after_in_child=reset)
    return reset
