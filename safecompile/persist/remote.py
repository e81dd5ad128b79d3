"""Compile once per fleet: ``SAFECOMPILE_REMOTE_CACHE=redis://host:port[/db]`` (read at each
decoration) turns on torch's remote caches (``TORCH_FLAGS``; a flag the user set is kept)
over :class:`RedisLink` (one short timeout and one event when Redis is down, not torch's
retries per lookup; values sealed with the operator's key), and a verdict tier. Without
redis-py, a key or a URL that parses, one warning says so and everything stays local.

Each command has a deadline for the whole of it (connecting included) and a byte budget
for its replies, whatever the server sends: the socket redis-py reads is a
:class:`_DeadlineSocket`, whose every read waits at most the time left and counts the bytes
against the budget (a value claimed larger than its limit is refused unread).
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
    "ReplyTooLargeError",
    "activate",
    "link_for",
    "links",
    "parse_url",
    "redacted",
    "reset",
]

REMOTE_ENV_VAR = "SAFECOMPILE_REMOTE_CACHE"
CONNECT_TIMEOUT_S = 0.25  # a Redis that is not there answers (or not) within this
SOCKET_TIMEOUT_S = 0.5  # a Redis that goes silent: per read, within the command's deadline
COMMAND_TIMEOUT_S = 1.0  # a command whole, connecting included: a verdict, the kill switch
BULK_TIMEOUT_S = 10.0  # a command moving a precompiled function or one of torch's values
VALUE_MAX_BYTES = 1 << 20  # a verdict, a key's scopes, a kill-switch value
BLOB_MAX_BYTES = 1 << 30  # a precompiled function (the limit of a file in precompiled/)
TORCH_MAX_BYTES = 64 << 20  # one of torch's remote-cache values (most are KiB)
_REPLY_SLACK = 4096  # RESP framing (and the connection's handshake) on top of a value
RETRY_AFTER_S = 30.0  # after a failure, local only for this long, then try again
VERDICT_TTL_S = 30 * 24 * 3600  # seconds: verdicts of an old stack (torch, code) age out
VERDICT_PREFIX = "safecompile:v1:verdicts:"
BLOB_PREFIX = "safecompile:v1:blobs:"
_SCHEMES = ("redis", "rediss", "unix")

TORCH_FLAGS = torchcompat.REMOTE_CACHE_FLAGS  # (environment variable, config module, attribute)

T = TypeVar("T")


class RemoteUnavailableError(Exception):
    """The shared Redis cannot be used now (not installed, down, timed out, backing off)."""


class ReplyTooLargeError(Exception):
    """A reply outgrew its command's byte budget: refused before it was read whole."""


class _Budget(threading.local):
    """The running command's deadline (``time.monotonic()``) and bytes it may still
    receive, per thread (redis-py's synchronous client reads on the calling thread)."""

    deadline: float | None = None
    left: int | None = None


class _Process:
    """What this module keeps for the whole process: the links :func:`link_for` made (every
    link, for a forked child), the activation of each URL, what it changed in torch (to
    undo), the outages said, the compiles whose remote reads failed; per thread, the running
    command's budget and the values handed to torch. A forked child gets fresh locks and
    clients (the parent's sockets are not reused)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # links, active, undo, suspended
        self.links: dict[tuple[str, str], RedisLink] = {}
        self.every_link: weakref.WeakSet[RedisLink] = weakref.WeakSet()
        self.active: dict[str, RemoteVerdicts] = {}
        self.unavailable = Once()  # (url, reason) pairs said
        self.undo: list[Callable[[], None]] = []  # what use_torch_remote_caches changed
        self.suspended: list[str] = []  # compiles that failed on what torch read: reads off
        self.budget = _Budget()
        self.reads = threading.local()  # values handed to torch from Redis, and a mark

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()
        for link in list(self.every_link):
            link._after_fork()


_PROCESS = _Process()
in_forked_child(_PROCESS.after_fork_in_child)


def _time_left() -> float | None:
    """Seconds left to the running command (``None``: no command runs); a timeout once none."""
    deadline = _PROCESS.budget.deadline
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the command's deadline passed")
    return left


class _DeadlineSocket:
    """A connected socket (plain, TLS or Unix) whose reads and writes wait at most the
    running command's time left, and whose reads count against its byte budget."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._timeout: float | None = sock.gettimeout()  # what redis-py asked for

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def settimeout(self, value: float | None) -> None:
        self._timeout = value
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _arm(self) -> None:
        left = _time_left()
        wanted = self._timeout
        if left is not None and wanted != 0:  # 0: redis-py polls without blocking
            wanted = left if wanted is None else min(wanted, left)
        self._sock.settimeout(wanted)

    def _spend(self, count: int) -> None:
        budget = _PROCESS.budget
        left = budget.left
        if left is None:
            return
        budget.left = left - count
        if left < count:
            raise ReplyTooLargeError("a reply larger than its limit: refused unread")

    def recv(self, size: int, flags: int = 0) -> bytes:
        self._arm()
        data: bytes = self._sock.recv(size, flags)
        self._spend(len(data))
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self._arm()
        count: int = self._sock.recv_into(buffer, nbytes, flags)
        self._spend(count)
        return count

    def sendall(self, data: Any, flags: int = 0) -> None:
        self._arm()  # sendall's timeout bounds the whole send
        self._sock.sendall(data, flags)


@functools.cache
def _bounded_connection(base: type) -> type:
    """redis-py's connection class ``base``, connecting within the command's time left and
    reading through a :class:`_DeadlineSocket` (``_connect``: checked redis-py 5 to 8)."""

    class BoundedConnection(base):  # type: ignore[misc]
        def _connect(self) -> Any:
            saved = getattr(self, "socket_connect_timeout", None)
            left = _time_left()
            if left is not None:  # connect and a TLS handshake each wait at most this
                self.socket_connect_timeout = left if saved is None else min(saved, left)
            try:
                sock = super()._connect()
            finally:
                self.socket_connect_timeout = saved
            return _DeadlineSocket(sock)

    BoundedConnection.__name__ = BoundedConnection.__qualname__ = f"Bounded{base.__name__}"
    return BoundedConnection


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
        _PROCESS.every_link.add(self)

    def run(
        self,
        command: Callable[[Any], T],
        *,
        timeout: float = COMMAND_TIMEOUT_S,
        max_bytes: int | None = VALUE_MAX_BYTES,
    ) -> T:
        """``command(client)`` within ``timeout`` seconds, its replies within ``max_bytes``
        (and framing); :class:`RemoteUnavailableError` instead of any failure. A reply too
        large is one ``safecompile.cache_file_ignored`` warning (none if ``quiet``), not an
        outage."""
        until = self._down_until
        if until is not None and self._clock() < until:
            raise RemoteUnavailableError(f"{self.purpose}: backing off after a failure")
        started = time.perf_counter()
        budget = _PROCESS.budget
        outer = budget.deadline, budget.left
        budget.deadline = time.monotonic() + timeout
        budget.left = None if max_bytes is None else max_bytes + _REPLY_SLACK
        try:
            client = self._client
            if client is None:  # cheap (it connects at its first command): a race builds two
                client = self._client = self._build()
            result = command(client)
        except ReplyTooLargeError:  # redis-py dropped the connection, the rest unread
            reason = f"a reply larger than {max_bytes} bytes: refused unread"
            if not self.quiet:
                warn_ignored(f"{redacted(self.url)} ({self.purpose})", reason)
            raise RemoteUnavailableError(reason) from None
        except Exception as exc:  # redis-py missing, a bad URL option, down, timed out
            self._failed(f"{type(exc).__name__}: {exc}")
            raise RemoteUnavailableError(str(exc)) from None
        finally:
            budget.deadline, budget.left = outer
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

    def run_or(
        self,
        command: Callable[[Any], T],
        failed: T,
        *,
        timeout: float = COMMAND_TIMEOUT_S,
        max_bytes: int | None = VALUE_MAX_BYTES,
    ) -> T:
        """``command(client)`` (see :meth:`run`), or ``failed`` when Redis cannot be used now."""
        try:
            return self.run(command, timeout=timeout, max_bytes=max_bytes)
        except RemoteUnavailableError:
            return failed

    def _after_fork(self) -> None:  # no lock held by a thread that did not fork, no sockets
        self._lock = threading.Lock()
        self._client = None

    def _build(self) -> Any:
        redis = _import_redis()
        if redis is None:
            raise ImportError("redis-py is not installed (pip install 'safecompile[redis]')")
        connection = redis.connection
        scheme = urllib.parse.urlsplit(self.url).scheme
        base = {"rediss": connection.SSLConnection, "unix": connection.UnixDomainSocketConnection}
        options: dict[str, Any] = {
            "socket_timeout": SOCKET_TIMEOUT_S,
            "retry": redis.retry.Retry(redis.backoff.NoBackoff(), 0),
            "health_check_interval": 0,
            "connection_class": _bounded_connection(base.get(scheme, connection.Connection)),
        }
        if scheme != "unix":
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
        """The document for ``(key, scope)``, or ``None`` (one larger than
        ``VALUE_MAX_BYTES`` too, unread)."""
        value = self.link.run_or(lambda r: r.hget(self.name(key), scope), None)
        return _within(value, VALUE_MAX_BYTES, self.where(key, scope))

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
        stored = self.link.run_or(
            lambda r: r.set(blob, data, ex=VERDICT_TTL_S), False, timeout=BULK_TIMEOUT_S
        )
        return bool(stored)

    def get_blob(self, key: str, name: str, limit: int = BLOB_MAX_BYTES) -> bytes | None:
        """A blob :meth:`put_blob` stored, or ``None`` (one over ``limit`` bytes, unread)."""
        blob = f"{BLOB_PREFIX}{key}:{name}"
        value = self.link.run_or(
            lambda r: r.get(blob), None, timeout=BULK_TIMEOUT_S, max_bytes=limit
        )
        return _within(value, limit, f"{redacted(self.link.url)} {blob}")

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

        return self.link.run_or(command, 0, timeout=BULK_TIMEOUT_S, max_bytes=None)


def _within(value: object, limit: int, where: str) -> bytes | None:
    """``value`` when it is bytes of at most ``limit``; else ``None`` (too large: warned)."""
    if not isinstance(value, bytes):
        return None
    if len(value) > limit:
        warn_ignored(where, f"larger than {limit} bytes")
        return None
    return value


# ---------------------------------------------------------------- activation


def link_for(url: str, purpose: str) -> RedisLink:
    """The process's one :class:`RedisLink` for ``(url, purpose)``."""
    with _PROCESS.lock:
        link = _PROCESS.links.get((url, purpose))
        if link is None:
            link = _PROCESS.links[(url, purpose)] = RedisLink(url, purpose=purpose)
        return link


def links() -> list[RedisLink]:
    """Every link :func:`link_for` made (their counters, for benchmarks and reports)."""
    with _PROCESS.lock:
        return list(_PROCESS.links.values())


def activate() -> RemoteVerdicts | None:
    """Read ``SAFECOMPILE_REMOTE_CACHE``; when set, switch torch's remote caches on over it
    (once per URL) and return the verdict tier; ``None``: local only. Never raises."""
    url = os.environ.get(REMOTE_ENV_VAR, "").strip()
    if not url:
        return None
    try:
        found = _PROCESS.active.get(url)  # one atomic read; _first_activation writes under the lock
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
    with _PROCESS.lock:
        _PROCESS.active.setdefault(url, verdicts)
    log_event(
        "safecompile.remote_cache_enabled",
        url=redacted(url),
        torch_caches=torch_caches,
        verdicts=True,
    )
    return verdicts


def _warn_once(url: str, reason: str) -> None:
    _PROCESS.unavailable.warn(
        (url, reason),
        "safecompile.remote_cache_unavailable",
        url=redacted(url),
        use="all",
        reason=reason,
        local_only_s=None,
    )


def reset() -> None:
    """Forget every link and activation; torch's flags and transport as they were (tests)."""
    with _PROCESS.lock:
        _PROCESS.links.clear()
        _PROCESS.active.clear()
        _PROCESS.suspended.clear()
        undo, _PROCESS.undo[:] = list(_PROCESS.undo), []
    _PROCESS.unavailable.forget()
    for step in reversed(undo):
        step()


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
    _PROCESS.undo.append(lambda: setattr(cls, "backend_override_cls", before))
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
    _PROCESS.undo.append(functools.partial(_restore_env, env_name, value))
    if module_name not in sys.modules:
        return True  # the config module reads the variable when it is imported
    entry = torchcompat.config_entry(module_name, attr)
    if entry is None:
        return False
    if entry.default is None:  # nobody decided; an assignment (thread-local) still wins
        entry.default = True
        _PROCESS.undo.append(functools.partial(setattr, entry, "default", None))
    return entry.default is True


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


TORCH_PURPOSE = "torch"  # the MAC's purpose for torch's remote-cache values


def mark_compile() -> None:
    """A compile starts on this thread: :func:`cache_fault` counts reads from here."""
    reads = _PROCESS.reads
    reads.mark = getattr(reads, "count", 0)


def cache_fault(error: BaseException) -> bool:
    """Whether a compile that failed on this thread read torch's remote caches: then the
    fault is theirs, and reads stay off in this process (writes on, to replace it)."""
    reads = _PROCESS.reads
    if getattr(reads, "count", 0) <= getattr(reads, "mark", 0):
        return False
    reads.mark = getattr(reads, "count", 0)
    suspended = _PROCESS.suspended
    with _PROCESS.lock:
        first = not suspended
        suspended.append(f"{type(error).__name__}: {error}"[:300])
    if first:
        log_event(
            "safecompile.remote_cache_error",
            level=logging.WARNING,
            reason=suspended[0],
            action="a compile that read torch's remote caches failed: retried without them "
            "(reads off in this process, writes on); not a verdict on the function",
        )
    return True


def cache_errors() -> int:
    """Compiles that failed on what torch read from Redis, in this process."""
    return len(_PROCESS.suspended)


def _torch_backend(link: RedisLink, signing: Signer, base: Any) -> Callable[[], Any]:
    """torch's ``RemoteCacheBackend[bytes]`` (``base``) over ``link``, values sealed."""

    class SafecompileRedisBackend(base[bytes]):  # type: ignore[misc]
        """torch's remote-cache transport over safecompile's :class:`RedisLink`."""

        def _get(self, key: str) -> bytes | None:
            if _PROCESS.suspended:
                return None  # after a cache error: compile without what Redis holds
            value = _within(
                link.run_or(
                    lambda r: r.get(key), None, timeout=BULK_TIMEOUT_S, max_bytes=TORCH_MAX_BYTES
                ),
                TORCH_MAX_BYTES,
                f"{redacted(link.url)} {key}",
            )
            if value is None:
                return None
            try:
                data = signing.unseal(TORCH_PURPOSE, key, value)
            except ValueError as exc:  # never handed to torch, which would unpickle it
                warn_ignored(f"{redacted(link.url)} {key}", str(exc))
                return None
            reads = _PROCESS.reads
            reads.count = getattr(reads, "count", 0) + 1  # handed to torch: see cache_fault
            return data

        def _put(self, key: str, data: bytes) -> None:
            sealed = signing.seal(TORCH_PURPOSE, key, data)
            link.run_or(lambda r: r.set(key, sealed), None, timeout=BULK_TIMEOUT_S)

    return SafecompileRedisBackend
