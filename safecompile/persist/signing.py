"""Shared storage is code (torch unpickles its caches; we act on verdicts), so each entry
carries an HMAC-SHA256 over its purpose, name and bytes under the operator's key
(``SAFECOMPILE_CACHE_KEY``, its bytes as set; or ``SAFECOMPILE_CACHE_KEY_FILE``: a file only
this user or root can write, checked like ssh checks a key: every folder and symlink on
its path, and the descriptor read); without a key nothing that would be trusted is read
back (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._state import STATE
from .bounded import READ_TIMEOUT_S, bounded, read_fd

__all__ = [
    "KEY_ENV_VAR",
    "KEY_FILE_ENV_VAR",
    "MIN_KEY_CHARS",
    "Signer",
    "signer",
    "warn_ignored",
    "warn_once",
]

KEY_ENV_VAR = "SAFECOMPILE_CACHE_KEY"
KEY_FILE_ENV_VAR = "SAFECOMPILE_CACHE_KEY_FILE"
MIN_KEY_CHARS = 16
MAX_KEY_BYTES = 4096
MAX_LINKS = 40  # symbolic links followed on a key file's path (Linux's own limit)
MAGIC = b"safecompile-hmac-v1\n"  # a sealed blob: MAGIC, 32 bytes of MAC, the data
MAC_FIELD = "hmac"  # a signed JSON document's field holding the MAC (hex)


@dataclasses.dataclass(frozen=True)
class Signer:
    """Signs and verifies entries under one key."""

    secret: bytes = dataclasses.field(repr=False)
    source: str  # where the key came from, for events (never the key)

    def mac(self, purpose: str, name: str, data: bytes) -> bytes:
        """The HMAC-SHA256 of ``data`` for ``purpose`` under ``name``."""
        digest = hmac.new(self.secret, digestmod=hashlib.sha256)
        for part in (purpose.encode(), name.encode("utf-8", "surrogateescape"), data):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
        return digest.digest()

    def seal(self, purpose: str, name: str, data: bytes) -> bytes:
        """``data`` with its MAC in front (see :meth:`unseal`)."""
        return MAGIC + self.mac(purpose, name, data) + data

    def unseal(self, purpose: str, name: str, blob: bytes) -> bytes:
        """The data :meth:`seal` wrapped; ``ValueError`` saying why if it is not sealed
        under this key, for this purpose and name."""
        if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 32:
            raise ValueError("not signed (no safecompile HMAC)")
        mac, data = blob[len(MAGIC) : len(MAGIC) + 32], blob[len(MAGIC) + 32 :]
        if not hmac.compare_digest(mac, self.mac(purpose, name, data)):
            raise ValueError(f"HMAC does not verify under {self.source} (tampered or another key)")
        return data

    def sign_doc(self, purpose: str, name: str, doc: Mapping[str, Any]) -> dict[str, Any]:
        """``doc`` plus its MAC (over its canonical JSON) in the field ``hmac``."""
        body = {k: v for k, v in doc.items() if k != MAC_FIELD}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()
        return {**body, MAC_FIELD: self.mac(purpose, name, text).hex()}

    def verify_doc(self, purpose: str, name: str, doc: Mapping[str, Any]) -> None:
        """``ValueError`` unless ``doc`` carries a valid MAC (see :meth:`sign_doc`)."""
        given = doc.get(MAC_FIELD)
        if not isinstance(given, str):
            raise ValueError("not signed (no safecompile HMAC)")
        if not hmac.compare_digest(given, self.sign_doc(purpose, name, doc)[MAC_FIELD]):
            raise ValueError(f"HMAC does not verify under {self.source} (tampered or another key)")


def signer() -> Signer | None:
    """The operator's key, or ``None`` (an unusable one: one warning); a key file read once."""
    value = os.environ.get(KEY_ENV_VAR, "")
    if value.strip():  # the bytes as set, UTF-8 or not (os.environb's)
        return _checked(os.fsencode(value.strip()), KEY_ENV_VAR)
    path = os.environ.get(KEY_FILE_ENV_VAR, "").strip()
    if not path:
        return None
    read = STATE.key_files
    if path not in read:  # no lock: two threads at once may both read it, alike
        read[path] = _read_key_file(Path(path))
    secret = read.get(path)
    return _checked(secret, f"{KEY_FILE_ENV_VAR}={path}") if secret is not None else None


def _checked(secret: bytes, source: str) -> Signer | None:
    if len(secret) < MIN_KEY_CHARS:
        warn_once(
            f"short:{source}",
            f"{source} is shorter than {MIN_KEY_CHARS} characters: not used as a key",
        )
        return None
    return Signer(secret=secret, source=source)


def _read_key_file(path: Path) -> bytes | None:
    source = f"{KEY_FILE_ENV_VAR}={path}"
    try:  # bounded: a key file on a hung mount must not hang safe_compile()
        data = bounded(lambda: _read_checked(path), str(path), READ_TIMEOUT_S, doing="reading")
    except _UnsafeError as exc:
        warn_once(f"file:{path}", f"{source} is not used: {exc}")
        return None
    except FileNotFoundError:
        warn_once(f"file:{path}", f"{source} is not used: it does not exist")
        return None
    except OSError as exc:
        warn_once(f"file:{path}", f"{source} cannot be read: {type(exc).__name__}: {exc}")
        return None
    if len(data) > MAX_KEY_BYTES:
        warn_once(f"file:{path}", f"{source} is not used: it is too large")
        return None
    return data.strip()


class _UnsafeError(Exception):
    """A check on the key file's path or descriptor failed (the message says which)."""


def _read_checked(path: Path) -> bytes:
    """The key file's first ``MAX_KEY_BYTES + 1`` bytes, read from the descriptor the checks
    were made on, once every folder and symbolic link on its path passed (see
    :func:`_walk`): a regular file owned by this user or root, that group and others
    cannot write and others cannot read."""
    where, seen = _walk(os.path.join(os.getcwd(), path))  # not abspath: ".." after a link
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(where, flags | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != (seen.st_dev, seen.st_ino):
            raise _UnsafeError(f"{where} changed while it was checked")
        if not stat.S_ISREG(info.st_mode):
            raise _UnsafeError(f"{where} is not a regular file")
        problem = owner_problem(Path(where), info, allow_root=True)
        if problem is None and info.st_mode & stat.S_IROTH:
            problem = f"{where} is readable by other users (mode {stat.S_IMODE(info.st_mode):o})"
        if problem is not None:
            raise _UnsafeError(problem)
        return read_fd(fd, MAX_KEY_BYTES)
    finally:
        os.close(fd)


def _walk(path: str) -> tuple[str, os.stat_result]:
    """``path`` resolved one component at a time, as ssh's ``safe_path`` checks a key:
    every folder on the way owned by this user or root and not writable by group or
    others (unless sticky, like ``/tmp``: there only an entry's owner can replace it, and
    each entry is checked in turn), every symbolic link owned by this user or root (its
    target walked the same way). The file's path, no link left in it, and its ``lstat``."""
    pending = _components(path)
    here = os.sep
    _check_folder(here, os.stat(here))
    links = 0
    while pending:
        name = pending.pop()
        if name == "..":
            here = os.path.dirname(here)  # a folder already checked on the way down
            continue
        full = os.path.join(here, name)
        info = os.lstat(full)
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise _UnsafeError(f"{path}: more than {MAX_LINKS} symbolic links")
            if info.st_uid not in (0, os.geteuid()):  # its mode means nothing
                raise _UnsafeError(f"the symbolic link {full} is owned by uid {info.st_uid}")
            target = os.readlink(full)
            if os.path.isabs(target):
                here = os.sep
            pending.extend(_components(target))
        elif stat.S_ISDIR(info.st_mode):
            _check_folder(full, info)
            here = full
        elif pending:
            raise NotADirectoryError(f"{full} is not a directory")
        else:
            return full, info
    raise IsADirectoryError(f"{path} is a directory")


def _components(path: str) -> list[str]:
    """``path``'s names, last first (a stack), without empty names and ``.``."""
    return [name for name in reversed(path.split(os.sep)) if name not in ("", ".")]


def _check_folder(path: str, info: os.stat_result) -> None:
    problem = owner_problem(Path(path), info, allow_root=True)
    if problem is not None and info.st_mode & stat.S_ISVTX and info.st_uid in (0, os.geteuid()):
        problem = None  # sticky (/tmp): others cannot replace the entries checked next
    if problem is not None:
        raise _UnsafeError(f"a folder on its path: {problem}")


def owner_problem(path: Path, info: os.stat_result, *, allow_root: bool = False) -> str | None:
    """Why another user could change what ``path`` holds, or ``None`` when none can."""
    uid = os.geteuid()
    if info.st_uid != uid and not (allow_root and info.st_uid == 0):
        return f"{path} is owned by uid {info.st_uid}, not this process's ({uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def warn_once(token: str, reason: str) -> None:
    """One ``safecompile.cache_untrusted`` warning per ``token`` and process."""
    STATE.said.warn(("untrusted", token), "safecompile.cache_untrusted", reason=reason)


def warn_ignored(path: Path | str, problem: str | BaseException) -> None:
    """One ``safecompile.cache_file_ignored`` warning per entry and reason (a cache that
    fails at every call says so once); never raises."""
    reason = problem if isinstance(problem, str) else f"{type(problem).__name__}: {problem}"
    where = str(path)
    STATE.said.warn(
        ("ignored", where, reason), "safecompile.cache_file_ignored", path=where, reason=reason
    )


def reset() -> None:
    """Forget warnings given and key files read (for tests)."""
    STATE.said.forget()
    STATE.key_files.clear()
