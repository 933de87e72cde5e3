"""The command line: exit codes, the listening line, graceful SIGTERM drain, SO_REUSEPORT workers.

Process tests run ``router.cli.run`` in real child processes on 127.0.0.1 with a small app
factory defined here (``drain_app``: a stream that finishes only when the test says so), so the
drain is observed exactly; one test drives the real ``python -m router`` in front of a real
loopback backend.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from contract.errors import ConfigError
from router.cli import main
from router.serve import listening_line, run_worker
from router.config import RouterConfig, build_config
from tests.support import refused

REPO = Path(__file__).resolve().parents[2]
RELEASE_ENV = "SESSION_ROUTER_TEST_RELEASE"
LINE = re.compile(rb"session-router listening on http://127\.0\.0\.1:(\d+)\r?\n")
PROC_TIMEOUT = 20.0


# ------------------------------------------------------------- app factories for the children


def drain_app(config: RouterConfig) -> web.Application:
    """``GET /stream`` writes ``first``, waits for the release file, then 3 chunks. Events are
    appended to ``<release>.log`` so the test sees the order of stream end and app cleanup."""
    release = os.environ[RELEASE_ENV]
    log = release + ".log"

    def note(event: str) -> None:
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()} {event}\n")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def pid(request: web.Request) -> web.Response:
        return web.Response(text=str(os.getpid()))

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "text/plain"
        await resp.prepare(request)
        await resp.write(b"first\n")
        try:
            while not os.path.exists(release):  # a condition the test sets, polled
                await asyncio.sleep(0.01)
            for i in range(3):
                await resp.write(f"chunk {i}\n".encode())
            await resp.write_eof()
            note("stream-done")
        except asyncio.CancelledError:
            note("stream-cancelled")
            raise
        return resp

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        note("startup")
        yield
        note("cleanup")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/pid", pid)
    app.router.add_get("/stream", stream)
    app.cleanup_ctx.append(lifecycle)
    return app


def stuck_cleanup_app(config: RouterConfig) -> web.Application:
    """``drain_app`` whose clean-up never finishes (a peer gone with the supervisor)."""
    app = drain_app(config)
    log = os.environ[RELEASE_ENV] + ".log"

    async def stuck(app: web.Application) -> AsyncIterator[None]:
        yield
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()} cleanup-stuck\n")
        await asyncio.Event().wait()

    app.cleanup_ctx.append(stuck)
    return app


def broken_app(config: RouterConfig) -> web.Application:
    raise ConfigError("broken on purpose: the fixture app refuses to start")


# ------------------------------------------------------------------------------ helpers

RUN_SNIPPET = """\
import sys
from router.cli import run
from router.serve import configure_logging
from router.config import build_config
config = build_config(sys.argv[2:])
configure_logging(config.log_level)
sys.exit(run(config, app_factory=sys.argv[1]))
"""


class Child:
    """A child process started by a test (stopped by PID), with its stdout read line by line."""

    def __init__(self, args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> None:
        self.stderr_path = tmp_path / f"stderr-{time.monotonic_ns()}.txt"
        with open(self.stderr_path, "wb") as stderr:
            self.popen = subprocess.Popen(
                [sys.executable, *args],
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        self._buffer = b""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def read_port(self, timeout: float = PROC_TIMEOUT) -> int:
        """Wait (bounded) for the listening line and return its port."""
        assert self.popen.stdout is not None
        fd = self.popen.stdout.fileno()
        deadline = time.monotonic() + timeout
        while (match := LINE.search(self._buffer)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no listening line within {timeout}s; stderr:\n{self.stderr()}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise AssertionError(f"exited ({self.popen.wait()}) before listening; stderr:\n{self.stderr()}")
                self._buffer += chunk
        return int(match[1])

    def wait(self, timeout: float = PROC_TIMEOUT) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout}s; stderr:\n{self.stderr()}") from None

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.stop()


def start_fixture_router(children: list[Child], tmp_path: Path, factory: str, *, config: str = "",
                         extra: tuple[str, ...] = ()) -> Child:  # fmt: skip
    config_path = tmp_path / "router.toml"
    config_path.write_text(config)
    args = ["-c", RUN_SNIPPET, f"tests.router.test_config_cli:{factory}", "--config", str(config_path),
            "--host", "127.0.0.1", "--port", "0", "--backend", "http://127.0.0.1:9", *extra]  # fmt: skip
    child = Child(args, tmp_path, env={RELEASE_ENV: str(tmp_path / "release")})
    children.append(child)
    return child


def wait_until(condition, timeout: float = PROC_TIMEOUT, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def open_stream(port: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PROC_TIMEOUT)
    conn.request("GET", "/stream")
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline() == b"first\n"  # the handler is in flight now
    return conn, resp


def events(tmp_path: Path) -> list[str]:
    path = tmp_path / "release.log"
    return path.read_text().split("\n")[:-1] if path.exists() else []


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


# ------------------------------------------------------------------------- in-process


def test_main_reports_config_errors_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", "ftp://127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == (
        "session-router: --backend: backend URL 'ftp://127.0.0.1:1': only http:// URLs are supported\n"
    )
    assert main([]) == 2
    assert capsys.readouterr().err == (
        "session-router: give at least one backend with --backend or in the config file's [[backends]]\n"
    )
    assert main(["--port", "x", "--backend", "http://127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith("session-router: argument --port: invalid int value: 'x'")


def test_listening_line_shape() -> None:
    assert listening_line("127.0.0.1", 8000) == "session-router listening on http://127.0.0.1:8000"
    assert listening_line("::1", 8000) == "session-router listening on http://[::1]:8000"


def test_a_taken_port_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv(RELEASE_ENV, str(tmp_path / "release"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = build_config(["--port", str(port), "--backend", "http://127.0.0.1:9"])
        assert run_worker(config, app_factory="tests.router.test_config_cli:drain_app") == 1
    assert capsys.readouterr().err.startswith(f"session-router: cannot listen on 127.0.0.1:{port}: ")
    assert events(tmp_path) == [f"{os.getpid()} startup", f"{os.getpid()} cleanup"]  # cleaned up anyway


def test_a_worker_takes_its_start_up_heap_out_of_the_collector_before_it_is_ready() -> None:
    """``settle_heap``: once the app is built and listening, what start-up made is frozen (out of
    the garbage collector's passes) before the ready callback runs; the worker then serves and
    stops on SIGTERM as before."""
    config = build_config(["--port", "0", "--backend", "http://127.0.0.1:9"])
    seen: list[tuple[int, int]] = []

    def ready(port: int) -> None:
        seen.append((port, gc.get_freeze_count()))
        os.kill(os.getpid(), signal.SIGTERM)  # the worker's own handler stops it

    before = gc.get_freeze_count()
    try:
        assert run_worker(config, on_ready=ready) == 0
    finally:
        gc.unfreeze()  # this test process must not keep the frozen heap
    ((port, frozen),) = seen
    assert port > 0 and frozen > before + 1000, (port, before, frozen)


def test_a_factory_config_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    config = build_config(["--port", "0", "--backend", "http://127.0.0.1:9"])
    assert run_worker(config, app_factory="tests.router.test_config_cli:broken_app") == 2
    assert capsys.readouterr().err == "session-router: broken on purpose: the fixture app refuses to start\n"


# --------------------------------------------------------------------- real processes


@pytest.mark.slow
def test_python_m_router_exits_2_on_a_bad_config(tmp_path: Path, children: list[Child]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('load_factor = "high"\n[[backends]]\nurl = "http://127.0.0.1:9"\n')
    child = Child(["-m", "router", "--config", str(config)], tmp_path)
    children.append(child)
    assert child.wait() == 2
    assert child.stderr() == "session-router: load_factor: expected float, got str\n"


@pytest.mark.slow
def test_sigterm_stops_accepting_lets_the_stream_finish_and_exits_0(tmp_path: Path, children: list[Child]) -> None:
    child = start_fixture_router(children, tmp_path, "drain_app", config="drain_timeout_s = 30\n")
    port = child.read_port()
    assert get(port, "/health") == (200, "ok")
    conn, resp = open_stream(port)

    os.kill(child.pid, signal.SIGTERM)
    wait_until(lambda: refused(port), what="the listening socket to close")
    assert child.popen.poll() is None  # still draining the stream
    (tmp_path / "release").touch()
    assert resp.read() == b"chunk 0\nchunk 1\nchunk 2\n"
    conn.close()
    assert child.wait() == 0
    assert events(tmp_path) == [f"{child.pid} startup", f"{child.pid} stream-done", f"{child.pid} cleanup"]


@pytest.mark.slow
@pytest.mark.parametrize("drain_timeout_s", [0.3, 0])
def test_the_drain_is_bounded_by_drain_timeout(tmp_path: Path, children: list[Child], drain_timeout_s: float) -> None:
    child = start_fixture_router(children, tmp_path, "drain_app", config=f"drain_timeout_s = {drain_timeout_s}\n")
    port = child.read_port()
    conn, resp = open_stream(port)
    started = time.monotonic()
    os.kill(child.pid, signal.SIGTERM)
    assert child.wait() == 0  # never released: cancelled after the drain timeout
    assert time.monotonic() - started < 10
    with pytest.raises(http.client.IncompleteRead):
        resp.read()
    conn.close()
    assert events(tmp_path) == [f"{child.pid} startup", f"{child.pid} stream-cancelled", f"{child.pid} cleanup"]


@pytest.mark.slow
def test_workers_share_the_port_restart_and_drain(tmp_path: Path, children: list[Child]) -> None:
    child = start_fixture_router(children, tmp_path, "drain_app", config="workers = 2\ndrain_timeout_s = 30\n")
    port = child.read_port()
    assert child.popen.poll() is None

    pids = worker_pids(port)
    assert all(parent_of(pid) == child.pid for pid in pids)

    # a worker that dies is replaced
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    fresh: set[int] = set()

    def saw_a_replacement() -> bool:
        try:
            status, body = get(port, "/pid")
        except OSError:
            return False
        fresh.add(int(body))
        return bool(fresh - pids)

    wait_until(saw_a_replacement, what="a restarted worker")
    replacement = (fresh - pids).pop()
    assert parent_of(replacement) == child.pid and victim not in fresh

    # SIGTERM to the supervisor drains every worker: an open stream finishes, then exit 0
    conn, resp = open_stream(port)
    os.kill(child.pid, signal.SIGTERM)
    wait_until(lambda: refused(port), what="every worker to stop listening")
    (tmp_path / "release").touch()
    assert resp.read() == b"chunk 0\nchunk 1\nchunk 2\n"
    conn.close()
    assert child.wait() == 0
    assert "stream-done" in " ".join(events(tmp_path))
    for pid in pids | {replacement}:
        assert not os.path.exists(f"/proc/{pid}")


def gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie waiting for a reaper we do not control."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def worker_pids(port: int) -> set[int]:
    pids: set[int] = set()

    def saw_two() -> bool:
        pids.add(int(get(port, "/pid")[1]))
        return len(pids) == 2

    wait_until(saw_two, what="answers from two worker processes")
    return pids


@pytest.mark.slow
def test_workers_leave_the_group_and_stop_when_the_supervisor_dies(tmp_path: Path, children: list[Child]) -> None:
    child = start_fixture_router(children, tmp_path, "drain_app", config="workers = 2\n")
    port = child.read_port()
    pids = worker_pids(port)
    # a group-wide signal (Ctrl-C in a terminal, `timeout`, killpg) reaches the supervisor only
    assert all(os.getpgid(pid) == pid != os.getpgid(child.pid) for pid in pids)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    wait_until(lambda: all(gone(pid) for pid in pids), what="orphaned workers to stop")
    assert all(f"{pid} cleanup" in events(tmp_path) for pid in pids)  # they drained, not died
    wait_until(lambda: refused(port), what="the port to close")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_an_orphaned_worker_whose_cleanup_hangs_exits_without_spinning(tmp_path: Path, children: list[Child]) -> None:
    """The supervisor dies outright and the workers' clean-up never finishes: they wait idle (the
    lifeline, readable for good at EOF, once kept the loop at 100% CPU), and exit once
    ``drain_timeout_s`` + ``LIFELINE_GRACE_S`` is up instead of living on."""
    from router.serve import LIFELINE_GRACE_S

    child = start_fixture_router(children, tmp_path, "stuck_cleanup_app", config="workers = 2\ndrain_timeout_s = 0.2\n")
    port = child.read_port()
    pids = worker_pids(port)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    wait_until(lambda: all(f"{pid} cleanup-stuck" in events(tmp_path) for pid in pids), what="the stuck clean-ups")
    before = {pid: cpu_seconds(pid) for pid in pids}
    started = time.monotonic()
    wait_until(lambda: time.monotonic() - started >= 2.0, what="two seconds")  # a measuring window
    used = {pid: cpu_seconds(pid) - before[pid] for pid in pids}
    assert all(seconds < 0.5 for seconds in used.values()), used  # a spinning loop uses ~2 s in 2 s
    wait_until(lambda: all(gone(pid) for pid in pids), timeout=LIFELINE_GRACE_S + 10, what="the orphans to exit")


@pytest.mark.slow
def test_a_worker_that_cannot_start_stops_the_group(tmp_path: Path, children: list[Child]) -> None:
    child = start_fixture_router(children, tmp_path, "broken_app", config="workers = 2\n")
    assert child.wait() == 2
    assert "session-router: broken on purpose" in child.stderr()
    assert LINE.search(child.popen.stdout.read() if child.popen.stdout else b"") is None


@pytest.mark.slow
async def test_the_real_router_drains_a_proxied_stream_on_sigterm(tmp_path: Path) -> None:
    """``python -m router`` in front of a real loopback backend: SIGTERM mid-stream, exit 0."""
    release = asyncio.Event()
    started = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        started.set()
        await release.wait()
        await resp.write(b'data: {"choices": [{"index": 0, "text": "b"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    backend_app = web.Application()
    backend_app.router.add_get("/health", health)
    backend_app.router.add_post("/v1/completions", completions)
    backend = TestServer(backend_app, host="127.0.0.1")
    await backend.start_server()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", "0",
        "--backend", f"http://127.0.0.1:{backend.port}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    try:
        async with asyncio.timeout(PROC_TIMEOUT):
            line = await proc.stdout.readline()  # type: ignore[union-attr]
        match = LINE.match(line)
        assert match, line + await proc.stderr.read()  # type: ignore[union-attr]
        port = int(match[1])
        async with aiohttp.ClientSession() as client, asyncio.timeout(PROC_TIMEOUT):
            body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 2}
            async with client.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                assert resp.status == 200
                first = await resp.content.readuntil(b"\n\n")
                assert b'"text": "a"' in first
                await started.wait()
                proc.send_signal(signal.SIGTERM)
                while not refused(port):  # a condition, bounded by the surrounding timeout
                    await asyncio.sleep(0.01)
                assert proc.returncode is None
                release.set()
                rest = await resp.content.read()
        assert rest == b'data: {"choices": [{"index": 0, "text": "b"}]}\n\ndata: [DONE]\n\n'
        async with asyncio.timeout(PROC_TIMEOUT):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await backend.close()


@pytest.mark.slow
def test_the_admin_api_on_its_own_port(tmp_path: Path, children: list[Child]) -> None:
    with socket.socket() as probe:  # a free port for the admin API (the data port is 0)
        probe.bind(("127.0.0.1", 0))
        admin_port = probe.getsockname()[1]
    config = tmp_path / "admin.toml"
    config.write_text(f'admin_port = {admin_port}\nadmin_token = "s3cret"\n[[backends]]\nurl = "http://127.0.0.1:9"\n')
    child = Child(["-m", "router", "--config", str(config), "--port", "0"], tmp_path)
    children.append(child)
    port = child.read_port()
    conn = http.client.HTTPConnection("127.0.0.1", admin_port, timeout=5)
    conn.request("GET", "/admin/backends", headers={"Authorization": "Bearer s3cret"})
    resp = conn.getresponse()
    assert resp.status == 200 and b"http://127.0.0.1:9" in resp.read()
    conn.close()
    assert get(port, "/admin/backends")[0] == 404  # not on the data port
    os.kill(child.pid, signal.SIGTERM)
    assert child.wait() == 0
    assert refused(admin_port) and refused(port)


# ------------------------------------------------------- what a new user types (issue 11, item 22)


def _pyproject_version() -> str:
    import tomllib

    with open(REPO / "pyproject.toml", "rb") as fh:
        return str(tomllib.load(fh)["project"]["version"])


@pytest.mark.parametrize("module", ["router", "backends"])
def test_version_on_both_commands_is_the_package_version(module: str) -> None:
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", module, "--version"], cwd=REPO, capture_output=True, text=True,
                         timeout=PROC_TIMEOUT)
    assert out.returncode == 0, out.stderr
    prog = {"router": "session-router", "backends": "session-backend"}[module]
    assert out.stdout.strip() == f"{prog} {version('session-router')}"
    assert version("session-router") == _pyproject_version()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--backend", "http://127.0.0.1:8100,http://127.0.0.1:8101"],
         "--backend: 'http://127.0.0.1:8100,http://127.0.0.1:8101' names 2 backends; give each backend its own "
         "--backend flag: --backend http://127.0.0.1:8100 --backend http://127.0.0.1:8101"),
        (["--decode", "http://127.0.0.1:1, http://127.0.0.1:2"],
         "--decode: 'http://127.0.0.1:1, http://127.0.0.1:2' names 2 backends; give each backend its own "
         "--decode flag: --decode http://127.0.0.1:1 --decode http://127.0.0.1:2"),
        (["--backend", "127.0.0.1:8100"],
         "--backend: backend URL '127.0.0.1:8100' has no scheme: add one, e.g. http://127.0.0.1:8100"),
        (["--backend", "localhost:8100"],
         "--backend: backend URL 'localhost:8100' has no scheme: add one, e.g. http://localhost:8100"),
        (["--backend", "http://127.0.0.1:8100,"],
         "--backend: backend URL 'http://127.0.0.1:8100,' holds a comma: give one URL per backend"),
    ],
)
def test_backend_flag_mistakes_say_what_to_write_instead(argv: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(argv)
    assert info.value.message.startswith(expected), info.value.message


def test_a_comma_in_a_config_file_url_names_the_entry(tmp_path: Path) -> None:
    from router.config import load_config

    path = tmp_path / "r.toml"
    path.write_text('[[backends]]\nurl = "http://127.0.0.1:1,http://127.0.0.1:2"\n')
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.message.startswith("backends[0].url: backend URL 'http://127.0.0.1:1,http://127.0.0.1:2' "
                                         "holds a comma: give one URL per backend"), info.value.message


@pytest.mark.parametrize("level", ["INFO", "info", "Warning", "DEBUG"])
def test_router_log_level_is_case_insensitive(level: str, tmp_path: Path) -> None:
    assert build_config(["--backend", "http://127.0.0.1:1", "--log-level", level]).log_level == level.lower()
    path = tmp_path / "r.toml"
    path.write_text(f'log_level = "{level}"\n[[backends]]\nurl = "http://127.0.0.1:1"\n')
    assert build_config(["--config", str(path)]).log_level == level.lower()


def test_the_command_line_modules_import_downward_only() -> None:
    """``router.cli`` -> ``router.supervisor`` -> ``router.serve``: never back up."""
    import ast

    def imported(module: str) -> set[str]:
        tree = ast.parse((REPO / "router" / f"{module}.py").read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        return {name for name in names if name in ("router.cli", "router.supervisor", "router.serve")}

    assert imported("serve") == set()
    assert imported("supervisor") == {"router.serve"}
    assert imported("cli") == {"router.serve", "router.supervisor"}
