"""The fleet kill switch: ``SAFECOMPILE_DISABLE_SOURCE`` names a file (``file:///path`` or an
absolute path) or a Redis key (``redis://host:port/db#key``, default key
``safecompile:disable``) whose text says what ``SAFECOMPILE_DISABLE`` says (one entry a line
allowed; missing: enabled; unreadable: the last value kept, one warning per outage). A
daemon thread polls it and hands changes to ``killswitch.set_watched``, which makes every
callable's switch token stale (the one compare the hot path already does): no added cost
per call.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import urllib.parse
from pathlib import Path

from safecompile.base import killswitch as ks
from safecompile.base.forks import in_forked_child
from safecompile.observe.log import Once, log_event
from safecompile.persist.bounded import READ_TIMEOUT_S, read_file
from safecompile.persist.remote import COMMAND_TIMEOUT_S, RedisLink, redacted

__all__ = ["SOURCE_ENV_VAR", "WATCHER", "Watcher", "open_source", "rule_of", "watch"]

SOURCE_ENV_VAR = "SAFECOMPILE_DISABLE_SOURCE"
POLL_ENV_VAR = "SAFECOMPILE_DISABLE_POLL"
DEFAULT_POLL_S = 2.0
MIN_POLL_S = 0.01
MAX_POLL_S = 3600.0
DEFAULT_KEY = "safecompile:disable"
MAX_BYTES = 64 * 1024


class FileSource:
    """A file's text (missing: ``None``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.label = f"file://{path}"

    def read(self) -> str | None:
        data = read_file(self.path, limit=MAX_BYTES)  # bounded: a FIFO, a hung mount
        return None if data is None else _decoded(data)


class RedisKeySource:
    """A Redis string key's value (missing: ``None``); its link retries at every poll."""

    def __init__(self, url: str, key: str) -> None:
        self.link = RedisLink(url, purpose="kill switch", retry_after=0.0, quiet=True)
        self.key = key
        self.label = f"{redacted(url)}#{key}"

    def read(self) -> str | None:
        # RemoteUnavailableError: Redis down, past the deadline, or a value over MAX_BYTES
        value = self.link.run(lambda r: r.get(self.key), max_bytes=MAX_BYTES)
        if value is None:
            return None
        if not isinstance(value, bytes):
            raise TypeError(f"not a string value: {type(value).__name__}")
        return _decoded(value)


def _decoded(data: bytes) -> str:
    if len(data) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES} bytes")
    return data.decode("utf-8")  # UnicodeDecodeError: not UTF-8


def open_source(spec: str) -> FileSource | RedisKeySource:
    """The source ``spec`` names (see the module doc); ``ValueError`` if it names none."""
    text = spec.strip()
    parts = urllib.parse.urlsplit(text)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{text!r}: a file:// URL names a local file (file:///path)")
        path = urllib.parse.unquote(parts.path)
        if not path:
            raise ValueError(f"{text!r}: no path")
        return FileSource(Path(path))
    if parts.scheme in ("redis", "rediss", "unix"):
        key = urllib.parse.unquote(parts.fragment) or DEFAULT_KEY
        return RedisKeySource(urllib.parse.urlunsplit(parts._replace(fragment="")), key)
    if os.path.isabs(text):
        return FileSource(Path(text))
    raise ValueError(
        f"{redacted(text)!r}: expected file:///path, an absolute path, or redis://host:port/db#key"
    )


def rule_of(text: str | None) -> ks.Rule:
    """What the source's text disables (``None``, absent: nothing)."""
    if text is None:
        return ks.NOTHING
    lines = (line.strip() for line in text.splitlines())
    return ks.parse(",".join(line for line in lines if line and not line.startswith("#")))


def poll_interval(value: str | None) -> float:
    """``SAFECOMPILE_DISABLE_POLL`` in seconds, clamped (unset: 2 s; ``ValueError``: NaN)."""
    if value is None or not value.strip():
        return DEFAULT_POLL_S
    seconds = float(value)
    if math.isnan(seconds):
        raise ValueError(f"{POLL_ENV_VAR}={value!r} is not a number")
    return min(max(seconds, MIN_POLL_S), MAX_POLL_S)


def _describe(rule: ks.Rule) -> str:
    return "all" if rule.everything else ",".join(rule.patterns) or "nothing"


POLL_WAIT_S = 2 * READ_TIMEOUT_S + COMMAND_TIMEOUT_S  # a bound on waiting for another poll


class Watcher:
    """Polls the source ``SAFECOMPILE_DISABLE_SOURCE`` names; one daemon thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._spec: str | None = None
        self._source: FileSource | RedisKeySource | None = None
        self._failing: str | None = None  # the outage being reported, if any
        self._invalid = Once()  # reasons said

    def poll(self) -> ks.Rule:
        """Read the source once and apply what it says; the rule in force. Never raises.
        Polls run one at a time; one that finds another still reading after
        ``POLL_WAIT_S`` (a hung source outlives each read's timeout) keeps the rule in force."""
        if not self._poll_lock.acquire(timeout=POLL_WAIT_S):
            return ks.SWITCH.watched
        try:
            self._poll()
        except Exception as exc:  # unreadable, too large, not UTF-8, Redis down: keep the last
            source = self._source.label if self._source else redacted(self._spec or "")
            self._failed(source, f"{type(exc).__name__}: {exc}")
        finally:
            self._poll_lock.release()
        return ks.SWITCH.watched

    def _poll(self) -> None:
        spec = os.environ.get(SOURCE_ENV_VAR, "").strip() or None
        if spec != self._spec:
            self._spec, self._source, self._failing = spec, None, None
            if spec is not None:
                try:
                    self._source = open_source(spec)
                except ValueError as exc:
                    self._warn_once(f"{SOURCE_ENV_VAR} names no source: {exc}")
        if spec is None:
            self._apply(ks.NOTHING, "unset")
            return
        if self._source is None:
            return  # an invalid spec: keep what was in force
        text = self._source.read()
        if self._failing is not None:
            self._failing = None
            log_event("safecompile.disable_source_restored", source=self._source.label)
        self._apply(rule_of(text), self._source.label)

    def _apply(self, rule: ks.Rule, label: str) -> None:
        if ks.set_watched(rule, label):
            log_event("safecompile.disable_source_changed", source=label, disabled=_describe(rule))

    def _failed(self, label: str, reason: str) -> None:
        if self._failing is None:
            self._failing = reason
            _say_failed(label, reason)

    def _warn_once(self, reason: str) -> None:
        self._invalid.warn(reason, "safecompile.disable_source_invalid", reason=reason)

    def interval(self) -> float:
        """The poll interval now (a bad value: the default, one warning)."""
        try:
            return poll_interval(os.environ.get(POLL_ENV_VAR))
        except ValueError:
            self._warn_once(f"{POLL_ENV_VAR} is not a number of seconds; polling every 2 s")
            return DEFAULT_POLL_S

    @property
    def running(self) -> bool:
        """Whether the polling thread runs."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> None:
        """Read the source now (bounded like every read), then poll on a daemon thread.
        The read holds no lock ``stop()`` waits for."""
        if self.running:
            return
        self.poll()
        with self._lock:
            if not self.running:
                self._spawn(first=False)

    def _spawn(self, *, first: bool) -> None:
        self._stop = stop = threading.Event()
        name = "safecompile-disable-source"
        thread = threading.Thread(target=self._run, args=(stop, first), name=name, daemon=True)
        thread.start()
        self._thread = thread

    def after_fork_in_child(self) -> None:
        """In a pre-fork server's worker: fresh locks, and the parent's polling thread again."""
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()
        polling, self._thread = self._thread is not None, None
        self._stop = threading.Event()  # its lock too may have been held
        if polling:
            try:
                self._spawn(first=True)
            except Exception as exc:  # no threads in this child: env var and disable() work
                self._failed(redacted(self._spec or ""), f"cannot restart the watcher: {exc}")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop polling (the rule in force stays; :meth:`reset` clears it)."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def reset(self) -> None:
        """Stop, forget the source, and clear what it disabled (for tests)."""
        self.stop()
        held = self._poll_lock.acquire(timeout=POLL_WAIT_S)
        self._spec, self._source, self._failing = None, None, None
        self._invalid.forget()
        if held:
            self._poll_lock.release()
        ks.set_watched(ks.NOTHING)

    def _run(self, stop: threading.Event, first: bool) -> None:
        if first:
            self.poll()
        while not stop.wait(self.interval()):
            self.poll()


WATCHER = Watcher()
in_forked_child(WATCHER.after_fork_in_child)


def watch() -> None:
    """Watch ``SAFECOMPILE_DISABLE_SOURCE`` if set, read now so the first call obeys it."""
    if not os.environ.get(SOURCE_ENV_VAR, "").strip():
        return
    try:
        WATCHER.start()
    except Exception as exc:  # e.g. no threads left: the env var and disable() still work
        source = redacted(os.environ.get(SOURCE_ENV_VAR, ""))
        _say_failed(source, f"cannot start the watcher: {type(exc).__name__}: {exc}")


def _say_failed(source: str, reason: str) -> None:
    log_event(
        "safecompile.disable_source_error",
        level=logging.WARNING,
        source=source,
        reason=reason[:300],
        keeping=_describe(ks.SWITCH.watched),
    )
