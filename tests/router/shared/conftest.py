"""``redis_server``: a real ``redis-server`` on a free loopback port, started and stopped by PID; a test
may kill it (SIGKILL) and start it again on the same port."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import LOOPBACK, free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"

needs_redis = pytest.mark.skipif(not os.path.exists(REDIS_SERVER), reason="needs redis-server (.ci/run installs it)")


class RedisServer:
    """One ``redis-server`` process (no persistence) on ``127.0.0.1:port``."""

    def __init__(self, port: int, log_dir: Path) -> None:
        self.port = port
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        log = open(self.log_dir / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
             "--dir", str(self.log_dir), "--enable-debug-command", "local"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.answers():
            assert self.proc.poll() is None, f"redis-server exited: see {self.log_dir}"
            assert time.monotonic() < deadline, "redis-server did not answer PING"
            time.sleep(0.02)

    def answers(self) -> bool:
        try:
            with socket.create_connection((LOOPBACK, self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash: no goodbye to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def command(self, *words: str) -> bytes:
        """One inline command on a new connection; its raw reply's first line (e.g. ``DEBUG SLEEP 1``:
        returns after the sleep; pass ``wait=False`` semantics by using ``send`` instead)."""
        with socket.create_connection((LOOPBACK, self.port), timeout=10) as conn:
            conn.sendall(" ".join(words).encode() + b"\r\n")
            return conn.recv(4096)

    def send(self, *words: str) -> socket.socket:
        """Send one command without waiting for its reply (the caller closes the socket)."""
        conn = socket.create_connection((LOOPBACK, self.port), timeout=10)
        conn.sendall(" ".join(words).encode() + b"\r\n")
        return conn


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("needs redis-server (.ci/run installs it)")
    server = RedisServer(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()
