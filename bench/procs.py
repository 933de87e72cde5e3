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


def launch(name: str, cmd: Sequence[str], port: int, log_dir: str, *, ready_path: str = "/health",
           ready_statuses: tuple[int, ...] = (200, 503), timeout: float = 20.0, interval: float = 0.02,
           env: dict[str, str] | None = None, cwd: str | None = None, log_tail: int | None = None) -> Proc:
    """Start ``cmd`` (output to ``<log_dir>/<name>-<port>.log``) and wait until ``ready_path`` on
    ``port`` answers one of ``ready_statuses``. Raises ``AssertionError`` with the log (its last
    ``log_tail`` characters) when the process exits or is not ready within ``timeout`` seconds."""
    log_path = os.path.join(log_dir, f"{name}-{port}.log")
    with open(log_path, "wb") as log_file:
        popen = subprocess.Popen(list(cmd), stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd,
                                 env={**os.environ, **(env or {})})
    proc = Proc(list(cmd), port, popen, log_path)

    def log() -> str:
        text = proc.log()
        return text if log_tail is None else text[-log_tail:]

    try:
        wait_until(lambda: not proc.alive() or http_status(proc.url + ready_path) in ready_statuses,
                   timeout=timeout, interval=interval, what=f"{name} on port {port}")
    except AssertionError:
        proc.kill()
        raise AssertionError(f"{name} was not ready in {timeout:.0f}s:\n{log()}") from None
    if not proc.alive():
        raise AssertionError(f"{name} exited with {popen.returncode}:\n{log()}")
    return proc


def start_process(module: str, args: Sequence[str], port: int, log_dir: str, ready_path: str = "/health",
                  timeout: float = 20.0, env: dict[str, str] | None = None, cwd: str = REPO) -> Proc:
    """``python -m module args`` from the repository (or the source tree ``cwd``: its packages come first
    on the module path), ready when ``ready_path`` answers 200 or 503."""
    extra = dict(env or {})
    if "PYTHONUNBUFFERED" not in os.environ:
        extra.setdefault("PYTHONUNBUFFERED", "1")
    return launch(module, [sys.executable, "-m", module, *args], port, log_dir, ready_path=ready_path,
                  timeout=timeout, env=extra, cwd=cwd)


#: tries with a fresh free port when the one picked was taken before the child could bind it
PORT_TRIES = 3


def _start_on(module: str, args: Callable[[int], list[str]], port: int | None, log_dir: str,
              cwd: str = REPO, env: dict[str, str] | None = None) -> Proc:
    """``start_process`` on ``port``; with none given, on a free port, picked again (up to
    ``PORT_TRIES`` times) when another process took it between ``free_port`` and the child's bind."""
    if port is not None:
        return start_process(module, args(port), port, log_dir, env=env, cwd=cwd)
    for attempt in range(PORT_TRIES):
        port = free_port()
        try:
            return start_process(module, args(port), port, log_dir, env=env, cwd=cwd)
        except AssertionError as exc:
            if "address already in use" not in str(exc) or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")  # the loop returns or raises


def start_backend(log_dir: str, *extra: str, port: int | None = None, speed: str = "0", model: str = "session-sim") -> Proc:
    return _start_on("backends", lambda p: ["--host", LOOPBACK, "--port", str(p), "--speed", speed, "--model", model,
                                            *extra], port, log_dir)


def start_router(log_dir: str, *args: str, port: int | None = None, tree: str = REPO,
                 env: dict[str, str] | None = None) -> Proc:
    """The router on 127.0.0.1 with ``args``; ``tree``: the source tree it runs from (another revision's, e.g. a
    ``git archive`` of it), ``env``: added to its environment."""
    return _start_on("router", lambda p: ["--host", LOOPBACK, "--port", str(p), *args], port, log_dir, tree, env)
