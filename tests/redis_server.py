"""A real ``redis-server`` on 127.0.0.1 for the fleet tests and the remote-cache bench.

``RedisServer.start()`` runs ``redis-server --port N --save '' --appendonly no`` on a free
port (nothing written to disk), waits until it answers ``PING`` and returns a handle;
``stop()`` terminates it (``kill`` if it does not exit). :func:`require_redis_server`
says where the binary is, or skips the calling test when there is none, unless
``SAFECOMPILE_REQUIRE_REDIS=1`` (CI sets it), where a missing server is a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
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
