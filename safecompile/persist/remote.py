"""Compile once per fleet: ``SAFECOMPILE_REMOTE_CACHE=redis://host:port[/db]`` (read at each
decoration) turns on torch's remote caches (``TORCH_FLAGS``; a flag the user set is kept)
over :class:`RedisLink` (one short timeout and one event when Redis is down, not torch's
retries per lookup; values sealed with the operator's key), and a verdict tier. Without
redis-py, a key or a URL that parses, one warning says so and everything stays local.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from safecompile.base import torchcompat
from safecompile.base.forks import in_forked_child
from safecompile.base.options import Clock
from safecompile.observe.log import Once, log_event, torch_missing

from .signing import KEY_ENV_VAR, KEY_FILE_ENV_VAR, Signer, signer, warn_ignored

__all__ = [
    "REMOTE_ENV_VAR",
    "RedisLink",
    "RemoteUnavailableError",
    "RemoteVerdicts",
    "activate",
    "link_for",
    "links",
    "parse_url",
    "redacted",
    "reset",
]

REMOTE_ENV_VAR = "SAFECOMPILE_REMOTE_CACHE"
CONNECT_TIMEOUT_S = 0.25  # a Redis that is not there answers (or not) within this
SOCKET_TIMEOUT_S = 0.5  # a Redis that hangs mid-command: per read, not per command
RETRY_AFTER_S = 30.0  # after a failure, local only for this long, then try again
VERDICT_TTL_S = 30 * 24 * 3600  # seconds: verdicts of an old stack (torch, code) age out
VERDICT_PREFIX = "safecompile:v1:verdicts:"
BLOB_PREFIX = "safecompile:v1:blobs:"
_SCHEMES = ("redis", "rediss", "unix")

TORCH_FLAGS = torchcompat.REMOTE_CACHE_FLAGS  # (environment variable, config module, attribute)

T = TypeVar("T")


class RemoteUnavailableError(Exception):
    """The shared Redis cannot be used now (not installed, down, timed out, backing off)."""


def parse_url(value: str) -> str:
    """``value`` stripped, once it is a Redis URL without a ``#key``; else ``ValueError``."""
    text = value.strip()
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in _SCHEMES:
        raise ValueError(
            f"{redacted(text)!r}: expected redis://host:port[/db], rediss://... or unix:///path"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"{redacted(text)!r}: no host")
    try:
        parts.port  # noqa: B018 (validates the port)
    except ValueError as exc:
        raise ValueError(f"{redacted(text)!r}: {exc}") from None
    if parts.fragment:
        raise ValueError(f"{redacted(text)!r}: a #key has no meaning here")
    return text


def redacted(url: str) -> str:
    """``url`` without its password, for logs and reports."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
        port = parts.port
    except ValueError:  # not even a URL: keep the scheme only
        return url.partition("://")[0] + "://***"
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{port}" if port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _import_redis() -> Any | None:
    try:
        return importlib.import_module("redis")
    except ImportError:
        return None


_every_link: weakref.WeakSet[RedisLink] = weakref.WeakSet()  # reset in a forked child


class RedisLink:
    """A lazy redis-py client (short timeouts, no retries) behind a breaker: ``retry_after``
    seconds off the network after a failure; one warning per outage (none if ``quiet``)."""

    def __init__(
        self,
        url: str,
        *,
        purpose: str = "remote cache",
        clock: Clock = time.monotonic,
        retry_after: float = RETRY_AFTER_S,
        quiet: bool = False,
    ) -> None:
        self.url = parse_url(url)
        self.purpose = purpose
        self.quiet = quiet  # the caller logs outages itself
        self._clock = clock
        self._retry_after = retry_after
        self._lock = threading.Lock()
        self._client: Any = None
        self._down_until: float | None = None
        self._down = False
        self.failures = 0  # for tests and reports, as are commands sent and their time
        self.commands = 0
        self.seconds = 0.0
        _every_link.add(self)

    def run(self, command: Callable[[Any], T]) -> T:
        """``command(client)``; :class:`RemoteUnavailableError` instead of any failure."""
        until = self._down_until
        if until is not None and self._clock() < until:
            raise RemoteUnavailableError(f"{self.purpose}: backing off after a failure")
        started = time.perf_counter()
        try:
            client = self._client
            if client is None:  # cheap (it connects at its first command): a race builds two
                client = self._client = self._build()
            result = command(client)
        except Exception as exc:  # redis-py missing, a bad URL option, down, timed out
            self._failed(f"{type(exc).__name__}: {exc}")
            raise RemoteUnavailableError(str(exc)) from None
        finally:
            self.commands += 1
            self.seconds += time.perf_counter() - started
        if self._down:
            with self._lock:
                was_down, self._down = self._down, False
            if was_down and not self.quiet:
                log_event(
                    "safecompile.remote_cache_restored", url=redacted(self.url), use=self.purpose
                )
        return result

    def run_or(self, command: Callable[[Any], T], failed: T) -> T:
        """``command(client)``, or ``failed`` when Redis cannot be used now."""
        try:
            return self.run(command)
        except RemoteUnavailableError:
            return failed

    def _after_fork(self) -> None:  # no lock held by a thread that did not fork, no sockets
        self._lock = threading.Lock()
        self._client = None

    def _build(self) -> Any:
        redis = _import_redis()
        if redis is None:
            raise ImportError("redis-py is not installed (pip install 'safecompile[redis]')")
        options: dict[str, Any] = {
            "socket_timeout": SOCKET_TIMEOUT_S,
            "retry": redis.retry.Retry(redis.backoff.NoBackoff(), 0),
            "health_check_interval": 0,
        }
        if not self.url.startswith("unix://"):
            options["socket_connect_timeout"] = CONNECT_TIMEOUT_S
        # options in the URL's query (?socket_timeout=2) win over ours
        return redis.Redis.from_url(self.url, **options)

    def _failed(self, reason: str) -> None:
        with self._lock:
            self.failures += 1
            self._down_until = self._clock() + self._retry_after
            first, self._down = not self._down, True
        if first and not self.quiet:
            log_event(
                "safecompile.remote_cache_unavailable",
                level=logging.WARNING,
                url=redacted(self.url),
                use=self.purpose,
                reason=reason[:300],
                local_only_s=self._retry_after,
            )


class RemoteVerdicts:
    """The local store's documents in Redis, a hash per key, a field per scope; each put
    refreshes the TTL (an old stack's verdicts age out). Redis down: "nothing"."""

    def __init__(self, link: RedisLink) -> None:
        self.link = link

    @staticmethod
    def name(key: str) -> str:
        """The Redis key of an artifact key's verdicts."""
        return f"{VERDICT_PREFIX}{key}"

    def where(self, key: str, scope: str = "") -> str:
        """Where ``(key, scope)`` lives, for log events (no password)."""
        return f"{redacted(self.link.url)} {self.name(key)}[{scope!r}]"

    def get(self, key: str, scope: str = "") -> bytes | None:
        """The document for ``(key, scope)``, or ``None``."""
        value = self.link.run_or(lambda r: r.hget(self.name(key), scope), None)
        return value if isinstance(value, bytes) else None

    def put(self, key: str, scope: str, document: bytes) -> bool:
        """Store ``document`` for ``(key, scope)``; ``False`` if Redis could not be used."""

        def command(r: Any) -> bool:
            pipe = r.pipeline(transaction=True)
            pipe.hset(self.name(key), scope, document)
            pipe.expire(self.name(key), VERDICT_TTL_S)
            pipe.execute()
            return True

        return self.link.run_or(command, False)

    def scopes(self, key: str) -> list[str]:
        """The scopes stored under ``key``."""
        found: list[Any] = self.link.run_or(lambda r: r.hkeys(self.name(key)), [])
        return [f.decode("utf-8", "replace") if isinstance(f, bytes) else str(f) for f in found]

    def put_blob(self, key: str, name: str, data: bytes) -> bool:
        """Store a (sealed) binary artifact next to ``key``'s verdicts; same TTL."""
        blob = f"{BLOB_PREFIX}{key}:{name}"
        return bool(self.link.run_or(lambda r: r.set(blob, data, ex=VERDICT_TTL_S), False))

    def get_blob(self, key: str, name: str) -> bytes | None:
        """A blob :meth:`put_blob` stored, or ``None``."""
        value = self.link.run_or(lambda r: r.get(f"{BLOB_PREFIX}{key}:{name}"), None)
        return value if isinstance(value, bytes) else None

    def delete(self, key: str | None = None, scope: str | None = None) -> int:
        """Delete one document, all of ``key``'s (blobs too), or everything (``key=None``);
        the number of Redis keys or fields removed."""

        def command(r: Any) -> int:
            if key is not None and scope is not None:
                return int(r.hdel(self.name(key), scope))
            pattern = f"{BLOB_PREFIX}{key}:*" if key is not None else f"{BLOB_PREFIX}*"
            names = list(r.scan_iter(match=pattern, count=500))
            if key is None:
                names += list(r.scan_iter(match=f"{VERDICT_PREFIX}*", count=500))
            else:
                names.append(self.name(key))
            return int(r.delete(*names)) if names else 0

        return self.link.run_or(command, 0)


# ---------------------------------------------------------------- activation

_lock = threading.Lock()
_links: dict[tuple[str, str], RedisLink] = {}
_active: dict[str, RemoteVerdicts] = {}
_unavailable = Once()  # (url, reason) pairs said


def link_for(url: str, purpose: str) -> RedisLink:
    """The process's one :class:`RedisLink` for ``(url, purpose)``."""
    with _lock:
        link = _links.get((url, purpose))
        if link is None:
            link = _links[(url, purpose)] = RedisLink(url, purpose=purpose)
        return link


def links() -> list[RedisLink]:
    """Every link :func:`link_for` made (their counters, for benchmarks and reports)."""
    with _lock:
        return list(_links.values())


def activate() -> RemoteVerdicts | None:
    """Read ``SAFECOMPILE_REMOTE_CACHE``; when set, switch torch's remote caches on over it
    (once per URL) and return the verdict tier; ``None``: local only. Never raises."""
    url = os.environ.get(REMOTE_ENV_VAR, "").strip()
    if not url:
        return None
    try:
        found = _active.get(url)  # one atomic read; _first_activation writes under the lock
        return found if found is not None else _first_activation(url)
    except Exception as exc:  # a cache must never fail a decoration
        _warn_once(url, f"{type(exc).__name__}: {exc}")
        return None


def _first_activation(url: str) -> RemoteVerdicts | None:
    try:
        parse_url(url)
    except ValueError as exc:
        _warn_once(url, f"{REMOTE_ENV_VAR} is not a Redis URL: {exc}")
        return None
    if _import_redis() is None:
        _warn_once(url, "redis-py is not installed (pip install 'safecompile[redis]')")
        return None
    key = signer()
    if key is None:
        _warn_once(
            url,
            f"no {KEY_ENV_VAR} (or {KEY_FILE_ENV_VAR}): torch's remote caches (torch unpickles "
            "what they hold) and the shared verdicts stay off; see docs/security.md",
        )
        return None
    verdicts = RemoteVerdicts(link_for(url, "verdicts"))
    torch_caches = use_torch_remote_caches(link_for(url, "torch caches"), key)
    with _lock:
        _active.setdefault(url, verdicts)
    log_event(
        "safecompile.remote_cache_enabled",
        url=redacted(url),
        torch_caches=torch_caches,
        verdicts=True,
    )
    return verdicts


def _warn_once(url: str, reason: str) -> None:
    _unavailable.warn(
        (url, reason),
        "safecompile.remote_cache_unavailable",
        url=redacted(url),
        use="all",
        reason=reason,
        local_only_s=None,
    )


_undo: list[Callable[[], None]] = []  # what use_torch_remote_caches changed, for reset()


def reset() -> None:
    """Forget every link and activation; torch's flags and transport as they were (tests)."""
    with _lock:
        _links.clear()
        _active.clear()
        _suspended.clear()
        undo, _undo[:] = list(_undo), []
    _unavailable.forget()
    for step in reversed(undo):
        step()


@in_forked_child
def _fresh_locks() -> None:
    global _lock
    _lock = threading.Lock()
    for link in list(_every_link):
        link._after_fork()


def use_torch_remote_caches(link: RedisLink, key: Signer) -> list[str]:
    """Make ``link`` the transport of torch's ``RedisRemoteCache`` (every remote cache derives
    from it), values sealed with ``key``, and switch each flag the user left unset on for
    every thread (assignments are thread-local); the flags now on."""
    classes = torchcompat.remote_cache_classes()  # ~0.1 s, only when used
    if isinstance(classes, torchcompat.Missing):
        torch_missing(classes)
        return []
    cls, backend_base = classes
    before = cls.__dict__.get("backend_override_cls")
    _undo.append(lambda: setattr(cls, "backend_override_cls", before))
    cls.backend_override_cls = _torch_backend(link, key, backend_base)
    on: list[str] = []
    for env_name, module_name, attr in TORCH_FLAGS:
        if _set_torch_flag(env_name, module_name, attr):
            on.append(attr)
    return on


def _set_torch_flag(env_name: str, module_name: str, attr: str) -> bool:
    value = os.environ.get(env_name)
    if (value or "").strip() not in ("", "1"):
        return False  # the user said no
    os.environ[env_name] = "1"
    _undo.append(functools.partial(_restore_env, env_name, value))
    if module_name not in sys.modules:
        return True  # the config module reads the variable when it is imported
    entry = torchcompat.config_entry(module_name, attr)
    if entry is None:
        return False
    if entry.default is None:  # nobody decided; an assignment (thread-local) still wins
        entry.default = True
        _undo.append(functools.partial(setattr, entry, "default", None))
    return entry.default is True


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


TORCH_PURPOSE = "torch"  # the MAC's purpose for torch's remote-cache values

_reads = threading.local()  # per thread: values handed to torch from Redis, and a mark
_suspended: list[str] = []  # compiles that failed on what torch read from Redis: reads off


def mark_compile() -> None:
    """A compile starts on this thread: :func:`cache_fault` counts reads from here."""
    _reads.mark = getattr(_reads, "count", 0)


def cache_fault(error: BaseException) -> bool:
    """Whether a compile that failed on this thread read torch's remote caches: then the
    fault is theirs, and reads stay off in this process (writes on, to replace it)."""
    if getattr(_reads, "count", 0) <= getattr(_reads, "mark", 0):
        return False
    _reads.mark = getattr(_reads, "count", 0)
    with _lock:
        first = not _suspended
        _suspended.append(f"{type(error).__name__}: {error}"[:300])
    if first:
        log_event(
            "safecompile.remote_cache_error",
            level=logging.WARNING,
            reason=_suspended[0],
            action="a compile that read torch's remote caches failed: retried without them "
            "(reads off in this process, writes on); not a verdict on the function",
        )
    return True


def cache_errors() -> int:
    """Compiles that failed on what torch read from Redis, in this process."""
    return len(_suspended)


def _torch_backend(link: RedisLink, signing: Signer, base: Any) -> Callable[[], Any]:
    """torch's ``RemoteCacheBackend[bytes]`` (``base``) over ``link``, values sealed."""

    class SafecompileRedisBackend(base[bytes]):  # type: ignore[misc]
        """torch's remote-cache transport over safecompile's :class:`RedisLink`."""

        def _get(self, key: str) -> bytes | None:
            if _suspended:
                return None  # after a cache error: compile without what Redis holds
            value = link.run_or(lambda r: r.get(key), None)
            if not isinstance(value, bytes):
                return None
            try:
                data = signing.unseal(TORCH_PURPOSE, key, value)
            except ValueError as exc:  # never handed to torch, which would unpickle it
                warn_ignored(f"{redacted(link.url)} {key}", str(exc))
                return None
            _reads.count = getattr(_reads, "count", 0) + 1  # handed to torch: see cache_fault
            return data

        def _put(self, key: str, data: bytes) -> None:
            sealed = signing.seal(TORCH_PURPOSE, key, data)
            link.run_or(lambda r: r.set(key, sealed), None)

    return SafecompileRedisBackend
