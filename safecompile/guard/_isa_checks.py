"""Inductor's vector-ISA checks kept across restarts, for the machine that passed them.

Each check builds a C++ program and loads it in a new Python; one that passed is kept,
signed, under a key for this torch build, this Python and this CPU (``_isa_key``), so a
restart on the same machine answers it without running it. A warm restart (``_precompile``)
reads them before inductor's first check and saves the new ones after a warmup.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable

import torch

from safecompile.base import torchcompat
from safecompile.observe.log import torch_missing
from safecompile.persist.cache import Verdict, VerdictStore, environment

__all__ = ["ISA_CHECKS", "ISA_SCOPE", "IsaChecks"]

ISA_SCOPE = "torch._inductor.cpu_vec_isa"  # the vector-ISA checks passed on this machine


class IsaChecks:
    """Inductor's vector-ISA checks (each builds a C++ program and loads it in a new Python:
    ten a process, ~3 s here) answered from those passed in an earlier process of the same
    torch, Python and CPU, kept signed. torch still reads the CPU's flags itself before it
    asks a check, and a check not passed before runs: no saved answer claims an instruction."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._routed = False
        self._passed: set[str] = set()  # torch's keys of the checks passed
        self._unsaved = False

    def route(self, store: VerdictStore) -> None:
        """Once per process, before inductor's first check: read what passed before."""
        with self._lock:
            if self._routed:
                return
            self._routed = True
        verdict = store.get(_isa_key(), ISA_SCOPE)
        passed = verdict.details.get("passed", []) if verdict is not None else []
        with self._lock:
            self._passed.update(k for k in passed if isinstance(k, str))
        missing = torchcompat.route_vec_isa_checks(self.answer)
        if isinstance(missing, torchcompat.Missing):
            torch_missing(missing)

    def answer(self, key: str, check: Callable[[], bool]) -> bool:
        if key in self._passed:
            return True
        if not check():
            return False  # not kept: a failure may be passing (a probe timed out)
        with self._lock:
            self._passed.add(key)
            self._unsaved = True
        return True

    def save(self, store: VerdictStore) -> None:
        with self._lock:
            if not self._unsaved:
                return
            self._unsaved = False
            passed = sorted(self._passed)
        verdict = Verdict(kind="vec_isa_checks", time=time.time(), details={"passed": passed})
        store.put(_isa_key(), verdict, ISA_SCOPE)


ISA_CHECKS = IsaChecks()


def _isa_key() -> str:
    """What a check's result depends on besides torch's key for it (which holds the
    compiler's version, the flags and the torch version): this torch build, its library
    directory, this Python, the CPU."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    facts = environment("cpu") | {"torch.lib": lib, "python.executable": sys.executable}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]
