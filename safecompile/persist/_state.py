"""What persist keeps for the whole process, in one place (the remote tier's links and
activations, typed by what ``remote.py`` defines, are in its own ``_PROCESS``).

A forked child gets fresh locks, and forgets the reads in flight: the threads doing them
did not fork along.
"""

from __future__ import annotations

import threading

from safecompile.base.forks import in_forked_child
from safecompile.observe.log import Once

__all__ = ["STATE"]


class _State:
    def __init__(self) -> None:
        # bounded.py: the names whose last bounded call has not returned (their threads
        # are process-wide), under stuck_lock
        self.stuck_lock = threading.Lock()
        self.stuck: set[str] = set()
        # cache.py: the keys CallKey made -> where their code came from (see provenance());
        # the lock that points torch's cache directories (environment variables)
        self.origins: dict[str, dict[str, str]] = {}
        self.torch_dirs_lock = threading.Lock()
        # signing.py: warnings given, ("untrusted", token) and ("ignored", entry, reason);
        # key files already read, path -> key (no lock: two threads may both read one, alike)
        self.said = Once()
        self.key_files: dict[str, bytes | None] = {}

    def after_fork_in_child(self) -> None:
        self.stuck_lock = threading.Lock()
        self.stuck.clear()
        self.torch_dirs_lock = threading.Lock()


STATE = _State()
in_forked_child(STATE.after_fork_in_child)
