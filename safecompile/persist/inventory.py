"""What a cache directory holds, for ``safecompile cache``: its entries by artifact key.

An entry is everything stored under one key: signed verdicts (``verdicts/KEY/``), the
precompiled functions they index (``precompiled/KEY/``) and torch's artifact blob
(``artifacts/KEY.bin``). :func:`scan` reads each file's bytes and checks its HMAC under the
operator's key; nothing is unpickled (a blob's MAC covers its bytes; a verdict is JSON).
Torch's own caches (``torch/``) are torch's and are only measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

from .bounded import read_file
from .cache import _PURPOSE as VERDICT_PURPOSE
from .cache import MAX_VERDICT_BYTES, _doc_name, code_fingerprint
from .restart import _ARTIFACTS_PURPOSE, BUCKET_REJECTED, BUCKET_VERIFIED
from .signing import Signer

__all__ = [
    "PRECOMPILED_PURPOSE",
    "PRECOMPILED_SCOPE",
    "Entry",
    "StoredFile",
    "foreign",
    "is_current",
    "remove",
    "scan",
    "torch_cache_bytes",
]

# Written by safecompile.guard._precompile (a layer above): the index verdict's scope and
# the MAC's purpose of a precompiled function (tests/test_cache_cli.py checks they agree).
PRECOMPILED_SCOPE = "torch.compile.aot_compile"
PRECOMPILED_PURPOSE = "precompiled"
MAX_BLOB_BYTES = 2 << 30
READ_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class StoredFile:
    """One file of an entry: its path under the root, size, and why it is not trusted."""

    path: str
    bytes: int
    problem: str | None = None  # None: its HMAC verifies (or no key to check it with)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Entry:
    """Everything stored under one artifact key."""

    key: str
    function: str | None  # the guarded callable's name, as its verdicts give it
    kinds: tuple[str, ...]  # the verdicts' kinds (precompiled, compile_failed, ...)
    graphs: int  # precompiled functions its index lists
    labels: tuple[str, ...]  # their labels (argument shapes and dtypes)
    buckets: int  # bucket verdicts (verified or rejected)
    made: dict[str, str]  # what the verdicts record of where they were made (signed)
    time: float | None  # the newest verdict's time (seconds since the epoch)
    files: tuple[StoredFile, ...]
    checked: bool  # whether the HMACs were checked (a key was given)

    @property
    def bytes(self) -> int:
        """The size of its files."""
        return sum(f.bytes for f in self.files)

    @property
    def torch(self) -> str | None:
        """The torch version that made it (``None``: not recorded)."""
        return self.made.get("torch")

    @property
    def invalid(self) -> list[StoredFile]:
        """Its files whose signature does not verify (or that are missing or misplaced)."""
        return [f for f in self.files if f.problem is not None]

    def age(self, now: float) -> float | None:
        """Seconds since its newest verdict."""
        return None if self.time is None else max(0.0, now - self.time)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (without what :func:`is_current` says)."""
        return {
            "key": self.key,
            "function": self.function,
            "kinds": list(self.kinds),
            "graphs": self.graphs,
            "labels": list(self.labels),
            "buckets": self.buckets,
            "torch": self.torch,
            "python": self.made.get("python"),
            "made": dict(self.made),
            "time": self.time,
            "bytes": self.bytes,
            "signature": None if not self.checked else not self.invalid,
            "foreign": foreign(self),
            "files": [f.to_dict() for f in self.files],
        }


def scan(root: Path, signing: Signer | None) -> list[Entry]:
    """Every entry under ``root``, by key; each file's HMAC checked when ``signing`` is given
    (without it nothing is verified, and what the verdicts say is shown unverified)."""
    keys: set[str] = set()
    for sub in ("verdicts", "precompiled"):
        with contextlib.suppress(OSError):
            keys.update(p.name for p in (root / sub).iterdir() if p.is_dir())
    with contextlib.suppress(OSError):
        keys.update(p.stem for p in (root / "artifacts").glob("*.bin"))
    return [_entry(root, key, signing) for key in sorted(keys)]


def _entry(root: Path, key: str, signing: Signer | None) -> Entry:
    files: list[StoredFile] = []
    docs: list[dict[str, Any]] = []
    claimed: list[str] = []  # names that verdicts failing their check give, for humans
    for path in _files(root / "verdicts" / key, "*.json"):
        doc, problem = _verdict(path, key, signing)
        files.append(_stored(root, path, problem))
        if doc is not None and problem is None:
            docs.append(doc)
        elif doc is not None and isinstance(doc.get("verdict"), dict):
            name = doc["verdict"].get("name")
            claimed += [f"{name} (unverified)"] if isinstance(name, str) else []
    verdicts = [d["verdict"] for d in docs if isinstance(d.get("verdict"), dict)]
    index: list[dict[str, Any]] = []  # the precompiled functions' index
    for doc in docs:
        if doc.get("scope") == PRECOMPILED_SCOPE and isinstance(doc.get("verdict"), dict):
            graphs = doc["verdict"].get("details", {}).get("graphs", [])
            index += [g for g in graphs if isinstance(g, dict)] if isinstance(graphs, list) else []
    listed = {str(g.get("file")) for g in index}
    for path in _files(root / "precompiled" / key, "*.bin"):
        name = f"{key}/{path.name}"
        files.append(_stored(root, path, _seal_problem(path, PRECOMPILED_PURPOSE, name, signing)))
    for file in sorted(listed - {p.name for p in _files(root / "precompiled" / key, "*.bin")}):
        path = root / "precompiled" / key / file
        files.append(StoredFile(str(path.relative_to(root)), 0, "listed by its index but missing"))
    blob = root / "artifacts" / f"{key}.bin"
    if blob.is_file():
        files.append(_stored(root, blob, _seal_problem(blob, _ARTIFACTS_PURPOSE, key, signing)))
    made: dict[str, str] = {}
    for doc in docs:  # the newest verdict's record wins
        record = doc.get("made")
        if isinstance(record, dict):
            made = {str(k): str(v) for k, v in record.items()}
    times = [float(v["time"]) for v in verdicts if isinstance(v.get("time"), int | float)]
    if not times:  # no verdict to say when: the files' modification times
        for f in files:
            with contextlib.suppress(OSError):
                times.append((root / f.path).stat().st_mtime)
    names = [v["name"] for v in verdicts if isinstance(v.get("name"), str)]
    kinds = sorted({str(v.get("kind")) for v in verdicts})
    buckets = sum(v.get("kind") in (BUCKET_VERIFIED, BUCKET_REJECTED) for v in verdicts)
    return Entry(
        key=key,
        function=next(iter(names + claimed), None),
        kinds=tuple(kinds),
        graphs=len(index),
        labels=tuple(str(g.get("label", "?")) for g in index),
        buckets=buckets,
        made=made,
        time=max(times) if times else None,
        files=tuple(files),
        checked=signing is not None,
    )


def _files(folder: Path, pattern: str) -> list[Path]:
    try:
        return sorted(p for p in folder.glob(pattern) if p.is_file())
    except OSError:
        return []


def _stored(root: Path, path: Path, problem: str | None) -> StoredFile:
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    return StoredFile(str(path.relative_to(root)), size, problem)


def _verdict(
    path: Path, key: str, signing: Signer | None
) -> tuple[dict[str, Any] | None, str | None]:
    """A verdict file's document (if it parses) and why it is not trusted (``None``: it is)."""
    try:
        raw = read_file(path, limit=MAX_VERDICT_BYTES, timeout=READ_TIMEOUT_S)
        if raw is None or len(raw) > MAX_VERDICT_BYTES:
            raise ValueError("missing, or too large to be a verdict")
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ValueError(f"corrupt: {type(exc).__name__}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("scope"), str):
            raise ValueError("foreign: not a safecompile verdict")
        scope = doc["scope"]
        expected = f"{hashlib.sha256(scope.encode()).hexdigest()[:24]}.json"
        if doc.get("key") != key or path.name != expected:
            raise ValueError("misplaced: its key or scope is not where it is stored")
    except OSError as exc:
        return None, f"unreadable: {type(exc).__name__}: {exc}"
    except ValueError as exc:
        return None, str(exc)
    try:
        if signing is not None:
            signing.verify_doc(VERDICT_PURPOSE, _doc_name(key, scope), doc)
    except ValueError as exc:
        return doc, str(exc)  # parsed JSON, but nothing it says is trusted
    return doc, None


def _seal_problem(path: Path, purpose: str, name: str, signing: Signer | None) -> str | None:
    """Why the sealed blob at ``path`` does not verify; its bytes are never unpickled."""
    if signing is None:
        return None
    try:
        sealed = read_file(path, limit=MAX_BLOB_BYTES, timeout=READ_TIMEOUT_S)
    except OSError as exc:
        return f"unreadable: {type(exc).__name__}: {exc}"
    if sealed is None:
        return "missing"
    try:
        signing.unseal(purpose, name, sealed)
    except ValueError as exc:
        return str(exc)
    return None


def foreign(entry: Entry) -> str | None:
    """Why ``entry`` was made by another torch or Python than this one (``None``: it was
    not, or it does not say: written before safecompile recorded versions)."""
    here = {"torch": torch.__version__, "python": platform.python_version()}
    for what, version in here.items():
        made = entry.made.get(what)
        if made is not None and made != version:
            return f"made by {what} {made}, this is {version}"
    return None


def is_current(entry: Entry) -> tuple[bool | None, str]:
    """Whether ``entry`` was built from the code importable here, and why (``None``: this
    cannot be told here).

    What it checks is what the artifact key holds today: the guarded function (found again
    by the module and qualname its verdicts recorded, importing the module) and the code it
    reaches, hashed as :func:`~safecompile.persist.cache.code_fingerprint` hashes them. So
    it sees what the key sees, and misses what the key misses (a function reached as
    ``module.f`` is hashed by its module's name). A key that covers every function torch
    inlined should be checked here the same way it is checked at load time: this function is
    the one place ``safecompile cache`` asks. The versions are :func:`foreign`'s question.
    Importing runs the module's top-level code: call it with the kill switch on
    (``SAFECOMPILE_DISABLE=1``) so a warmup at import compiles nothing.
    """
    module, qualname, code = (entry.made.get(k) for k in ("module", "qualname", "code"))
    if module is None or qualname is None or code is None:
        return None, "no importable function recorded (a method, an nn.Module, a closure)"
    try:
        found: Any = importlib.import_module(module)
    except (Exception, SystemExit) as exc:
        return None, f"{module} does not import here ({type(exc).__name__}: {exc})"
    for part in qualname.split("."):
        found = getattr(found, part, None)
        if found is None:
            return False, f"{module}.{qualname} no longer exists"
    if hasattr(found, "safecompile") and hasattr(found, "__wrapped__"):
        found = found.__wrapped__  # the guard's wrapper: the function it guards
    if code_fingerprint(found) != code:
        return False, f"{module}.{qualname} or the code it reaches changed since it was built"
    return True, f"{module}.{qualname} is the code it was built from"


def remove(root: Path, entry: Entry) -> int:
    """Delete ``entry``'s files (its verdicts, precompiled functions and artifact blob);
    the number of files deleted."""
    removed = 0
    for folder in (root / "verdicts" / entry.key, root / "precompiled" / entry.key):
        removed += len(_files(folder, "*"))
        shutil.rmtree(folder, ignore_errors=True)
    blob = root / "artifacts" / f"{entry.key}.bin"
    with contextlib.suppress(FileNotFoundError):
        blob.unlink()
        removed += 1
    return removed


def torch_cache_bytes(root: Path) -> int:
    """The size of torch's own caches under ``root/torch``."""
    total = 0
    for folder, _, names in os.walk(root / "torch"):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total
