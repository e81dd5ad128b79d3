"""What a cache directory (or the Redis tier) holds, for ``safecompile cache``: its
entries by artifact key.

An entry is everything stored under one key: signed verdicts (``verdicts/KEY/``), the
precompiled functions they index (``precompiled/KEY/``) and torch's artifact blob
(``artifacts/KEY.bin``). :func:`scan` reads each file's bytes and checks its HMAC under the
operator's key; nothing is unpickled (a blob's MAC covers its bytes; a verdict is JSON).
Torch's own caches (``torch/``) are torch's and are only measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import platform
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from .bounded import read_file
from .cache import _PURPOSE as VERDICT_PURPOSE
from .cache import MAX_VERDICT_BYTES, _doc_name, code_fingerprint
from .remote import (
    BLOB_MAX_BYTES,
    BLOB_PREFIX,
    BULK_TIMEOUT_S,
    VALUE_MAX_BYTES,
    VERDICT_PREFIX,
    RemoteVerdicts,
)
from .restart import _ARTIFACTS_PURPOSE, BUCKET_REJECTED, BUCKET_VERIFIED
from .signing import Signer
from .sources import stale_reasons

__all__ = [
    "PRECOMPILED_PURPOSE",
    "PRECOMPILED_SCOPE",
    "Entry",
    "StoredFile",
    "foreign",
    "is_current",
    "remove",
    "remove_remote",
    "scan",
    "scan_remote",
    "torch_cache_bytes",
]

# Listing Redis: the keys' names, and one key's verdicts (a handful of scopes), bounded.
_NAMES_MAX_BYTES = 16 * VALUE_MAX_BYTES
_HASH_MAX_BYTES = 8 * VALUE_MAX_BYTES
# Written by safecompile.guard._precompile (a layer above): the index verdict's scope, the
# MAC's purpose of a precompiled function, and the kind of the pointer verdict it keeps
# under a key that outlives an edit (tests/test_deploy_cli.py checks they agree).
PRECOMPILED_SCOPE = "torch.compile.aot_compile"
PRECOMPILED_PURPOSE = "precompiled"
PRECOMPILED_POINTER = "precompiled_key"
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
    # its precompiled functions' index rows, each with its record of the code it came from
    index: tuple[dict[str, Any], ...] = ()

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
    return _listed(_entry(root, key, signing) for key in sorted(keys))


def scan_remote(tier: RemoteVerdicts, signing: Signer | None) -> list[Entry]:
    """Every entry in the Redis behind ``tier`` (its verdict hashes and precompiled blobs),
    judged as :func:`scan` judges files; :class:`~.remote.RemoteUnavailableError` when
    Redis cannot be read."""

    def text(value: bytes | str) -> str:
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else value

    def names(r: Any) -> tuple[list[str], list[str]]:
        hashes = sorted(text(n) for n in r.scan_iter(match=f"{VERDICT_PREFIX}*", count=500))
        blob_names = sorted(text(n) for n in r.scan_iter(match=f"{BLOB_PREFIX}*", count=500))
        return hashes, blob_names

    # one bounded command at a time: the names, then each key's verdicts, then each blob
    link = tier.link
    hashes, blob_names = link.run(names, timeout=BULK_TIMEOUT_S, max_bytes=_NAMES_MAX_BYTES)
    keys = {n.removeprefix(VERDICT_PREFIX) for n in hashes}
    keys |= {n.removeprefix(BLOB_PREFIX).partition(":")[0] for n in blob_names}
    entries = []
    for key in sorted(keys):
        fields: dict[Any, Any] = link.run(
            functools.partial(_hgetall, f"{VERDICT_PREFIX}{key}"),
            timeout=BULK_TIMEOUT_S,
            max_bytes=_HASH_MAX_BYTES,
        )
        verdicts = [
            _Raw(f"{VERDICT_PREFIX}{key}[{text(f)!r}]", text(f), bytes(v), len(v))
            for f, v in sorted(fields.items())
        ]
        blobs = []
        for name in (n for n in blob_names if n.startswith(f"{BLOB_PREFIX}{key}:")):
            data: object = link.run(
                functools.partial(_get, name), timeout=BULK_TIMEOUT_S, max_bytes=BLOB_MAX_BYTES
            )
            file = name.removeprefix(f"{BLOB_PREFIX}{key}:")
            size = len(data) if isinstance(data, bytes) else 0
            blob = _Raw(name, file, data if isinstance(data, bytes) else None, size)
            blobs.append(
                dataclasses.replace(blob, purpose=PRECOMPILED_PURPOSE, mac_name=f"{key}/{file}")
            )
        entries.append(_assemble(key, verdicts, blobs, signing, str))
    return _listed(entries)


def _hgetall(name: str, r: Any) -> dict[Any, Any]:
    return dict(r.hgetall(name) or {})


def _get(name: str, r: Any) -> object:
    return r.get(name)


def _listed(entries: Iterable[Entry]) -> list[Entry]:
    """The entries an operator deals with: not the pointers a restart keeps from a
    function to the key it saved last (they hold no artifact; a dangling one is a miss)."""
    return [e for e in entries if set(e.kinds) != {PRECOMPILED_POINTER}]


def remove_remote(tier: RemoteVerdicts, entry: Entry) -> int:
    """Delete ``entry``'s verdicts and blobs from Redis; the number of Redis keys deleted."""
    return tier.delete(entry.key)


@dataclasses.dataclass(frozen=True)
class _Raw:
    """One stored item as read: where it is (for humans), the name its store gives it (a
    file name, a hash field), its bytes (``None``: not there), and what its MAC covers."""

    where: str
    name: str
    data: bytes | None
    size: int
    problem: str | None = None  # why it could not be read
    purpose: str = VERDICT_PURPOSE
    mac_name: str = ""


def _entry(root: Path, key: str, signing: Signer | None) -> Entry:
    verdicts = [
        _read(root, path, MAX_VERDICT_BYTES) for path in _files(root / "verdicts" / key, "*.json")
    ]
    blobs = [
        dataclasses.replace(
            _read(root, path, MAX_BLOB_BYTES),
            purpose=PRECOMPILED_PURPOSE,
            mac_name=f"{key}/{path.name}",
        )
        for path in _files(root / "precompiled" / key, "*.bin")
    ]
    blob = root / "artifacts" / f"{key}.bin"
    if blob.is_file():
        artifacts = _read(root, blob, MAX_BLOB_BYTES)
        blobs.append(dataclasses.replace(artifacts, purpose=_ARTIFACTS_PURPOSE, mac_name=key))
    entry = _assemble(key, verdicts, blobs, signing, _file_name)
    if entry.time is None:  # no verdict says when: the files' modification times
        times = []
        for f in entry.files:
            with contextlib.suppress(OSError):
                times.append((root / f.path).stat().st_mtime)
        entry = dataclasses.replace(entry, time=max(times, default=None))
    return entry


def _file_name(scope: str) -> str:
    """The file name :class:`~.cache.VerdictStore` gives a verdict of ``scope``."""
    return f"{hashlib.sha256(scope.encode()).hexdigest()[:24]}.json"


def _read(root: Path, path: Path, limit: int) -> _Raw:
    where = str(path.relative_to(root))
    try:
        data = read_file(path, limit=limit, timeout=READ_TIMEOUT_S)
        size = path.stat().st_size
    except OSError as exc:
        return _Raw(where, path.name, None, 0, f"unreadable: {type(exc).__name__}: {exc}")
    return _Raw(where, path.name, data, size, None if data is not None else "missing")


def _assemble(
    key: str,
    verdicts: list[_Raw],
    blobs: list[_Raw],
    signing: Signer | None,
    named: Callable[[str], str],
) -> Entry:
    """An entry from its items as read, each judged: parsed, in its place, its MAC checked."""
    files: list[StoredFile] = []
    docs: list[dict[str, Any]] = []
    claimed: list[str] = []  # names that verdicts failing their check give, for humans
    for raw in verdicts:
        doc, problem = _verdict(raw, key, signing, named)
        files.append(StoredFile(raw.where, raw.size, problem))
        if doc is not None and problem is None:
            docs.append(doc)
        elif doc is not None and isinstance(doc.get("verdict"), dict):
            name = doc["verdict"].get("name")
            claimed += [f"{name} (unverified)"] if isinstance(name, str) else []
    docs.sort(key=_time_of)
    verdict_list = [d["verdict"] for d in docs if isinstance(d.get("verdict"), dict)]
    index: list[dict[str, Any]] = []  # the precompiled functions' index
    for doc in docs:
        if doc.get("scope") == PRECOMPILED_SCOPE and isinstance(doc.get("verdict"), dict):
            graphs = doc["verdict"].get("details", {}).get("graphs", [])
            index += [g for g in graphs if isinstance(g, dict)] if isinstance(graphs, list) else []
    for raw in blobs:
        problem = raw.problem or _seal_problem(raw, signing)
        files.append(StoredFile(raw.where, raw.size, problem))
    present = {raw.name for raw in blobs if raw.purpose == PRECOMPILED_PURPOSE}
    for file in sorted({str(g.get("file")) for g in index} - present):
        files.append(StoredFile(f"precompiled/{key}/{file}", 0, "listed by its index but missing"))
    made: dict[str, str] = {}
    for doc in docs:  # the newest verdict's record wins
        record = doc.get("made")
        if isinstance(record, dict):
            made = {str(k): str(v) for k, v in record.items()}
    times = [t for t in map(_time_of, docs) if t > 0]
    names = [v["name"] for v in verdict_list if isinstance(v.get("name"), str)]
    kinds = sorted({str(v.get("kind")) for v in verdict_list})
    buckets = sum(v.get("kind") in (BUCKET_VERIFIED, BUCKET_REJECTED) for v in verdict_list)
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
        index=tuple(index),
    )


def _time_of(doc: dict[str, Any]) -> float:
    verdict = doc.get("verdict")
    value = verdict.get("time") if isinstance(verdict, dict) else None
    return float(value) if isinstance(value, int | float) else 0.0


def _files(folder: Path, pattern: str) -> list[Path]:
    try:
        return sorted(p for p in folder.glob(pattern) if p.is_file())
    except OSError:
        return []


def _verdict(
    raw: _Raw, key: str, signing: Signer | None, named: Callable[[str], str]
) -> tuple[dict[str, Any] | None, str | None]:
    """A verdict's document (if it parses) and why it is not trusted (``None``: it is)."""
    try:
        if raw.problem is not None:
            raise ValueError(raw.problem)
        if raw.data is None or len(raw.data) > MAX_VERDICT_BYTES:
            raise ValueError("missing, or too large to be a verdict")
        try:
            doc = json.loads(raw.data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ValueError(f"corrupt: {type(exc).__name__}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("scope"), str):
            raise ValueError("foreign: not a safecompile verdict")
        scope = doc["scope"]
        if doc.get("key") != key or raw.name != named(scope):
            raise ValueError("misplaced: its key or scope is not where it is stored")
    except ValueError as exc:
        return None, str(exc)
    try:
        if signing is not None:
            signing.verify_doc(VERDICT_PURPOSE, _doc_name(key, scope), doc)
    except ValueError as exc:
        return doc, str(exc)  # parsed JSON, but nothing it says is trusted
    return doc, None


def _seal_problem(raw: _Raw, signing: Signer | None) -> str | None:
    """Why the sealed blob ``raw`` does not verify; its bytes are never unpickled."""
    if signing is None:
        return None
    if raw.data is None:
        return "missing"
    try:
        signing.unseal(raw.purpose, raw.mac_name, raw.data)
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

    An entry with precompiled functions is checked as a restart checks them before loading
    (:func:`~safecompile.persist.sources.stale_reasons`): every function dynamo traced for
    them, in any module, and the globals their guards read. Other entries are checked by
    what the artifact key holds: the guarded function (found again by the module and
    qualname its verdicts recorded) and the code it reaches, hashed as
    :func:`~safecompile.persist.cache.code_fingerprint` hashes them. The versions are
    :func:`foreign`'s question. Importing runs the module's top-level code: call it with
    the kill switch on (``SAFECOMPILE_DISABLE=1``) so a warmup at import compiles nothing.
    """
    if entry.index:
        reasons = list(dict.fromkeys(r for row in entry.index for r in stale_reasons(row)))
        if reasons:
            return False, "; ".join(reasons)
        return True, "every function and global its precompiled functions came from is unchanged"
    return _fingerprint_current(entry)


def _fingerprint_current(entry: Entry) -> tuple[bool | None, str]:
    """:func:`is_current` for an entry without precompiled functions: by the artifact key's
    code fingerprint of the guarded function."""
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
