"""What a restarted process need not learn again, under ``SAFECOMPILE_CACHE_DIR`` and the
artifact key plus the ``Buckets`` policy and tolerances (a padding verdict depends on both):
each bucket's verdict (verified with its output cut, or rejected with why; shadow checks
still run: a verdict holds for code, not values) and torch's portable compile artifacts
(one sealed blob in ``artifacts/``, loaded before the first compile unless torch's own
on-disk cache wrote them). A failure is one ``safecompile.cache_file_ignored`` warning.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from safecompile.base import torchcompat
from safecompile.shapes.buckets import Bucketer, BucketError, CutSpec, Plan
from safecompile.shapes.table import BucketEntry, BucketStatus

from .bounded import read_file
from .cache import CallKey, Verdict, _write_atomic, signed_store
from .signing import warn_ignored

__all__ = ["ARTIFACTS", "BUCKET_REJECTED", "BUCKET_VERIFIED", "Persisted", "bucket_scope"]

BUCKET_VERIFIED = "bucket_verified"
BUCKET_REJECTED = "bucket_rejected"
ARTIFACTS = "compile_artifacts"
_ARTIFACTS_SCOPE = "torch.compiler.save_cache_artifacts"
_ARTIFACTS_PURPOSE = "artifacts"  # the MAC's purpose for the artifact blob
MAX_ARTIFACT_BYTES = 2 << 30
ARTIFACT_READ_TIMEOUT_S = 30.0  # a blob of many graphs on a slow disk, never a hang


def bucket_scope(key: object) -> str:
    """The verdict scope of a bucket: its plan key as text (shapes, dtypes, sizes)."""
    return f"bucket {key!r}"


class Persisted:
    """One guarded callable's bucket verdicts and compile artifacts across restarts."""

    def __init__(self, target: Callable[..., Any], options: Mapping[str, Any]) -> None:
        self._root, self._store = signed_store()  # the root is used only with the store
        self._key = CallKey(target, options)
        self._identity = CallKey(target, options, code=False)
        self._lock = threading.Lock()
        self._artifacts_checked = False

    @property
    def active(self) -> bool:
        """Whether ``SAFECOMPILE_CACHE_DIR`` was set when the callable was guarded."""
        return self._store is not None

    def key(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
        """The artifact key, made at the first call (the device is the first tensor's)."""
        return self._key.get(args, kwargs) if self._store is not None else None

    def identity_key(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
        """A key like :meth:`key` with the callable's name for its code: it outlives an
        edit, so what was saved before one can be found and said to be stale."""
        return self._identity.get(args, kwargs) if self._store is not None else None

    def restore(self, entry: BucketEntry, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """A bucket's first sight in this process: take an earlier process's verdict."""
        entry.looked_up = True
        key = self.key(args, kwargs)
        if self._store is None or key is None:
            return
        verdict = self._store.get(key, bucket_scope(entry.key))
        if verdict is None:
            return
        if verdict.kind == BUCKET_REJECTED:
            entry.why = verdict.message
            entry.status = BucketStatus.REJECTED
            entry.restored = "rejected"
        elif verdict.kind == BUCKET_VERIFIED and isinstance(verdict.details.get("cut"), list):
            entry.saved = verdict.details["cut"]
            entry.restored = "verified"

    def reuse(self, bucketer: Bucketer, plan: Plan, entry: BucketEntry, padded_out: Any) -> bool:
        """A restored, verified bucket's first padded output: rebuild its cut from the
        verdict, no eager run. ``False`` (verify as new) when the output does not match."""
        saved, entry.saved = entry.saved, None
        if saved is None:
            return False
        try:
            cuts = bucketer.restored_cuts(plan, padded_out, saved)
        except (BucketError, ValueError, TypeError, KeyError, IndexError):
            entry.restored = None  # the output changed since: learn and verify again
            return False
        entry.cuts = cuts
        entry.status = BucketStatus.READY
        return True

    def keep_verified(self, entry: BucketEntry, cuts: CutSpec, name: str) -> None:
        """A bucket's padding was verified: persist it with its cut."""
        self._put(entry, BUCKET_VERIFIED, cuts.describe(), name, cut=cuts.saved())

    def keep_rejected(self, entry: BucketEntry, why: str, name: str) -> None:
        """A bucket was rejected (padding changes results, ...): persist why."""
        self._put(entry, BUCKET_REJECTED, why, name)

    def _put(self, entry: BucketEntry, kind: str, message: str, name: str, **details: Any) -> None:
        key = self._key.value
        if self._store is None or key is None or entry.key is None:
            return
        info = {"bucket": entry.label, **details}
        verdict = Verdict(kind=kind, time=time.time(), name=name, message=message, details=info)
        try:
            self._store.put(key, verdict, bucket_scope(entry.key))
        except Exception as exc:  # a verdict is an optimisation: never fail a call
            warn_ignored("bucket verdict", exc)

    def load_artifacts(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Once per process, before the first compile: load torch's portable artifacts
        when the on-disk cache they were written from is not the one in use."""
        with self._lock:
            if self._artifacts_checked:
                return
            self._artifacts_checked = True
        key = self.key(args, kwargs)
        if self._store is None or key is None:
            return
        verdict = self._store.get(key, _ARTIFACTS_SCOPE)
        if verdict is None or verdict.kind != ARTIFACTS:
            return
        written_from = verdict.details.get("torch_cache_dir")
        if written_from == _torch_cache_dir() and written_from and Path(written_from).is_dir():
            return  # torch's own cache holds them already
        path = self._blob(key)
        signing = self._store.signer
        try:
            sealed = read_file(path, limit=MAX_ARTIFACT_BYTES, timeout=ARTIFACT_READ_TIMEOUT_S)
            if sealed is None:
                return
            if len(sealed) > MAX_ARTIFACT_BYTES:
                raise ValueError(f"larger than {MAX_ARTIFACT_BYTES} bytes")
            assert signing is not None  # no key, no store
            blob = signing.unseal(_ARTIFACTS_PURPOSE, key, sealed)  # torch unpickles it
            torch.compiler.load_cache_artifacts(blob)
        except Exception as exc:  # unreadable, unsigned, tampered, or torch's own failure
            warn_ignored(path, f"not loaded: {type(exc).__name__}: {exc}")

    def save_artifacts(self, name: str) -> None:
        """After a warmup: save every artifact this process compiled or loaded so far."""
        key = self._key.value
        if self._store is None or key is None:
            return
        try:
            with torchcompat.compile_lock() or contextlib.nullcontext():  # guards torch's list
                saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                return
            blob, _ = saved
            path = self._blob(key)
            signing = self._store.signer
            assert signing is not None  # no key, no store
            if not _write_atomic(path, signing.seal(_ARTIFACTS_PURPOSE, key, blob)):
                return
            info = {"file": path.name, "bytes": len(blob), "torch_cache_dir": _torch_cache_dir()}
            verdict = Verdict(kind=ARTIFACTS, time=time.time(), name=name, details=info)
            self._store.put(key, verdict, _ARTIFACTS_SCOPE)
        except Exception as exc:
            warn_ignored("compile artifacts", exc)

    def _blob(self, key: str) -> Path:
        assert self._root is not None
        return self._root / "artifacts" / f"{key}.bin"

    def forget_verdicts(self) -> None:
        """Code under this key changed (an edit the key does not see, found by a precompiled
        function's check at load): every verdict saved under it is learnt afresh."""
        key = self._key.value
        if self._store is not None and key is not None:
            self._store.clear(key)

    def forget(self) -> None:
        """``reset()``: drop this key's bucket verdicts and artifacts, learn afresh."""
        key = self._key.value
        self._artifacts_checked = False  # a single store needs no lock
        if self._store is None or key is None:
            return
        self._store.clear(key)  # this key is ours alone (KnownFailures' has no buckets)
        try:
            self._blob(key).unlink(missing_ok=True)
        except OSError as exc:
            warn_ignored("compile artifacts", exc)


def _torch_cache_dir() -> str | None:
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return str(Path(value).absolute()) if value else None
