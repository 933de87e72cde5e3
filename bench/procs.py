"""Real child processes for tests, demos and benchmarks: free loopback ports, start, wait, stop by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago. They are bound all at once, so
    processes started together never share one (ports taken one at a time can repeat)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((LOOPBACK, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def wait_until(condition: Callable[[], bool], timeout: float = 15.0, interval: float = 0.02, what: str = "condition") -> None:
    """Poll ``condition`` until true; fail after ``timeout`` seconds (a bound, not a sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def http_status(url: str, timeout: float = 1.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


@dataclass
class Proc:
    """A child process started by a test; stopped by its PID."""

    args: list[str]
    port: int
    popen: subprocess.Popen[bytes] = field(repr=False)
    log_path: str = ""

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout)
        return int(self.popen.returncode)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""


def start_process(module: str, args: Sequence[str], port: int, log_dir: str, ready_path: str = "/health",
                  timeout: float = 20.0, env: dict[str, str] | None = None) -> Proc:
    log_path = os.path.join(log_dir, f"{module}-{port}.log")
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [sys.executable, "-m", module, *args]
    popen = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, env=full_env)
    log_file.close()
    proc = Proc(cmd, port, popen, log_path)
    try:
        wait_until(lambda: not proc.alive() or http_status(proc.url + ready_path) in (200, 503),
                   timeout=timeout, what=f"{module} on port {port}")
    except AssertionError:
        proc.kill()
        raise AssertionError(f"{module} did not start:\n{proc.log()}") from None
    if not proc.alive():
        raise AssertionError(f"{module} exited with {proc.popen.returncode}:\n{proc.log()}")
    return proc


def start_backend(log_dir: str, *extra: str, port: int | None = None, speed: str = "0", model: str = "session-sim") -> Proc:
    port = port or free_port()
    args = ["--host", LOOPBACK, "--port", str(port), "--speed", speed, "--model", model, *extra]
    return start_process("backends", args, port, log_dir)


def start_router(log_dir: str, *args: str, port: int | None = None) -> Proc:
    port = port or free_port()
    return start_process("router", ["--host", LOOPBACK, "--port", str(port), *args], port, log_dir)
