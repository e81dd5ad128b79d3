"""A real ``redis-server`` on 127.0.0.1 for the fleet tests and the remote-cache bench.

``RedisServer.start()`` runs ``redis-server --port N --save '' --appendonly no`` on a free
port (nothing written to disk), waits until it answers ``PING`` and returns a handle;
``stop()`` terminates it (``kill`` if it does not exit). :func:`require_redis_server`
says where the binary is, or skips the calling test when there is none, unless
``SAFECOMPILE_REQUIRE_REDIS=1`` (CI sets it), where a missing server is a failure.
:class:`FakeRedis` is no redis-server: a thread on 127.0.0.1 that answers badly on
purpose (a trickle, a huge value), for the bounds on what a server sends.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

REQUIRE_ENV_VAR = "SAFECOMPILE_REQUIRE_REDIS"
_START_TIMEOUT_S = 10.0


def redis_server_binary() -> str | None:
    """``redis-server``'s path (``PATH``, then ``/usr/bin``), or ``None``."""
    found = shutil.which("redis-server")
    if found is None and os.access("/usr/bin/redis-server", os.X_OK):
        found = "/usr/bin/redis-server"
    return found


def require_redis_server() -> str:
    """The binary; a test without one is skipped, or fails under ``SAFECOMPILE_REQUIRE_REDIS=1``."""
    binary = redis_server_binary()
    if binary is not None:
        return binary
    message = "redis-server is not installed (apt-get install redis-server)"
    if os.environ.get(REQUIRE_ENV_VAR, "").strip() == "1":
        pytest.fail(f"{message}, and {REQUIRE_ENV_VAR}=1 requires it")
    pytest.skip(message)


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def ping(port: int, timeout: float = 0.5) -> bool:
    """Whether a Redis answers ``PING`` on 127.0.0.1:``port`` (plain RESP, no client)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    """One ``redis-server`` process on 127.0.0.1."""

    port: int
    process: subprocess.Popen[bytes] = field(repr=False)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, binary: str | None = None, *, port: int | None = None) -> RedisServer:
        """Start a server on ``port`` (default: a free one) and wait for its ``PING``."""
        binary = binary or redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server")
        for _attempt in range(3):  # a port taken between free_port() and bind: try another
            port = port or free_port()
            process = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            deadline = time.monotonic() + _START_TIMEOUT_S
            while time.monotonic() < deadline and process.poll() is None:
                if ping(port):
                    return cls(port=port, process=process)
                time.sleep(0.02)
            terminate(process)
        raise RuntimeError("redis-server did not answer PING")

    def stop(self) -> None:
        """Terminate the server (idempotent)."""
        terminate(self.process)


def terminate(process: subprocess.Popen[Any], timeout: float = 5) -> None:
    """Stop a server process: terminate, then kill if it lingers past ``timeout``."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)


class FakeRedis:
    """A misbehaving Redis on 127.0.0.1 (plain RESP, a thread per connection), for bounds.

    ``trickle``: every command's reply (a valid 40-byte bulk string) is sent one byte every
    ``trickle`` seconds, as an overloaded proxy does. ``claim``: ``GET``/``HGET`` answer a
    bulk string claiming ``claim`` bytes and then send zeros as fast as the client takes
    them (other commands: ``+OK``). ``sent`` counts the bytes that left; ``stop()`` (or
    the end of a ``with`` block) closes everything.
    """

    REPLY = b"$32\r\n" + b"x" * 32 + b"\r\n"

    def __init__(self, *, trickle: float | None = None, claim: int | None = None) -> None:
        self.trickle = trickle
        self.claim = claim
        self.sent = 0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> FakeRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop answering and close the listener (connections end at their next send)."""
        self._stop.set()
        self._thread.join(5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as stream:
            try:
                while not self._stop.is_set():
                    command = _read_command(stream)
                    if command is None:
                        return
                    self._answer(conn, command)
            except OSError:  # the client gave up and closed: what a bound looks like
                return

    def _answer(self, conn: socket.socket, command: list[bytes]) -> None:
        if command[0].upper() == b"HELLO" and self.trickle is None:  # RESP3 asked: proto
            self._send(conn, b"%1\r\n$5\r\nproto\r\n:" + command[1] + b"\r\n")
        elif self.trickle is not None:
            for byte in self.REPLY:
                if self._stop.wait(self.trickle):
                    return
                conn.sendall(bytes([byte]))
                self.sent += 1
        elif self.claim is not None and command[0].upper() in (b"GET", b"HGET"):
            self._send(conn, f"${self.claim}\r\n".encode())
            chunk = bytes(1 << 20)
            left = self.claim
            while left > 0 and not self._stop.is_set():
                self._send(conn, chunk[: min(left, len(chunk))])
                left -= len(chunk)
            self._send(conn, b"\r\n")
        else:
            self._send(conn, b"+OK\r\n")

    def _send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)


def _read_command(stream: Any) -> list[bytes] | None:
    """One RESP command (an array of bulk strings) from ``stream``; ``None`` at its end."""
    header = stream.readline()
    if not header.startswith(b"*"):
        return None
    args: list[bytes] = []
    for _ in range(int(header[1:])):
        size = int(stream.readline()[1:])
        args.append(stream.read(size + 2)[:size])
    return args
