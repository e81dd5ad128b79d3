"""docs/design.md names every module of the package and what it owns; module state is
listed, and fork-safe."""

from __future__ import annotations

import importlib
import os
import re
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_is_in_the_design_table() -> None:
    package = ROOT / "safecompile"
    modules = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "__init__.py" or p.parent == package
    }
    text = (ROOT / "docs" / "design.md").read_text()
    table = text.split("## Who owns what", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", table, flags=re.MULTILINE))
    assert listed == modules


# Every module-level mutable global (tests/module_state.py finds them), with why it is
# process-wide. A subpackage keeps its process state in one object (persist/_state.py;
# remote.py's holds its own types); caches memoise facts that cannot change in a process.
PROCESS_STATE = {
    "base/killswitch.py:SWITCH": "the kill switch: disable(), enable() and the watched rule",
    "base/torchcompat.py:_FOUND": "cache: torch's modules, classes and functions by name",
    "checks/speed.py:_cuda": "cache: torch.cuda.is_available()",
    "fleet/ranks.py:_CHANNELS": "agreements by name: every rank counts them alike",
    "fleet/switch.py:WATCHER": "the one poller of SAFECOMPILE_DISABLE_SOURCE",
    "observe/log.py:_SAID": "what internal errors and missing torch names were said once",
    "observe/progress.py:_OPEN": "the spinners open now: a compile on any thread tells them",
    "observe/source.py:_internal_dirs": "cache: torch's and our directories",
    "observe/source.py:_our_dir": "cache: safecompile's directory",
    "observe/source.py:_stdlib_dirs": "cache: the standard library's directories",
    "observe/telemetry.py:_PROCESS": "configure()'s providers, instruments, call-count sources",
    "persist/_state.py:STATE": "reads in flight, keys made, warnings given, key files read",
    "persist/cache.py:_triton_version": "cache: the installed triton",
    "persist/kernels.py:machine": "cache: the hash of the machine kernels are built for",
    "persist/remote.py:_PROCESS": "Redis links, activations, torch's patched transport",
    "persist/remote.py:_bounded_connection": "cache: one connection class per redis-py class",
    "persist/sources.py:_defs": "cache: a module's source parsed once for its functions",
    "runner.py:_PROCESS": "what install() put in torch.compile's place; names given",
    "runner.py:_guarded_module_class": "cache: the OptimizedModule subclass made once",
    # guard/
    "guard/_deferred.py:_WORKER": "the deferred-compile worker thread (renewed in a fork)",
    "guard/_isa_checks.py:ISA_CHECKS": "cache: CPU instruction-set answers",
    "guard/_logs.py:META_LOG": "dynamo's meta log held while a graph compiles",
    "guard/_workers.py:CHECKS": "the async shadow checks' thread (renewed in a fork)",
    "guard/_workers.py:EXITING": "set once when the interpreter exits",
    "guard/_workers.py:_LOCK": "EXITING and the workers the exit waits for (renewed in a fork)",
    "guard/_workers.py:_WORKERS": "the workers the exit waits for (emptied in a fork)",
    "guard/_graph_backend.py:_TRACE": "per thread: the graph being traced",
    "guard/_effects.py:_closure_names": "cache: dynamo's closure helpers",
    "guard/facts.py:_seeded": "cache: whether an ATen op draws random numbers",
}


def test_module_state_is_listed() -> None:
    """A new module-level mutable global (a dict, a lock, a cache, a stateful object...) is
    either moved onto the object that uses it or listed above with its reason."""
    from module_state import scan

    found = {item.key: item.kind for item in scan()}
    assert sorted(set(found) - set(PROCESS_STATE)) == [], "unlisted: move it or list it"
    assert sorted(set(PROCESS_STATE) - set(found)) == [], "listed but gone: drop it"


def test_process_state_gets_fresh_locks_in_a_forked_child() -> None:
    """Every lock the listed state objects hold (outside guard/) is free in a forked child
    even when another thread of the parent held it at the fork."""
    locks = _process_locks()
    assert len(locks) >= 8
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait()
        for lock in locks:
            lock.release()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait()
    try:
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                fresh = _process_locks()
                code = 0 if all(lock.acquire(timeout=1) for lock in fresh) else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join()
    assert os.waitstatus_to_exitcode(status) == 0


def _process_locks() -> list[Any]:
    """The locks of every state object outside guard/, read afresh (a fork renews them)."""
    from module_state import scan

    return [
        lock
        for item in scan()
        if item.kind == "object" and item.subpackage != "guard"
        for lock in _locks_of(getattr(importlib.import_module(item.module), item.name))
    ]


def _locks_of(value: object, depth: int = 0) -> list[Any]:
    """The locks in ``value``'s attributes, and in those of safecompile objects it holds."""
    kinds = (type(threading.Lock()), type(threading.RLock()))
    found: list[Any] = []
    for attr in getattr(value, "__dict__", {}).values():
        if isinstance(attr, kinds):
            found.append(attr)
        elif depth < 1 and type(attr).__module__.startswith("safecompile"):
            found.extend(_locks_of(attr, depth + 1))
    return found
