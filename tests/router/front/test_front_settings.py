"""The ``[front]`` settings that were constants take effect in a served router (a real process,
the config file through ``router.serve`` to both fronts): ``keepalive_timeout_s`` closes an idle
keep-alive connection, ``max_head_bytes`` bounds a request head (the raw front), ``listen_backlog``
is the listening socket's accept backlog."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.raw_http import Conn, get
from tests.router.test_config_cli import Child, children  # noqa: F401  (the fixture that stops them by PID)

FRONTS = ["raw", "aiohttp"]


def start(children: list[Child], tmp_path: Path, front: str, settings: str) -> int:  # noqa: F811
    config = tmp_path / "router.toml"
    config.write_text(f'[[backends]]\nurl = "http://127.0.0.9:8100"\n\n[front]\nkind = "{front}"\n{settings}')
    child = Child(["-m", "router", "--config", str(config), "--port", "0"], tmp_path)
    children.append(child)
    return child.read_port()


@pytest.mark.parametrize("front", FRONTS)
async def test_keepalive_timeout_closes_an_idle_connection(children: list[Child], tmp_path: Path,  # noqa: F811
                                                           front: str) -> None:
    port = start(children, tmp_path, front, "keepalive_timeout_s = 0.5\n")
    conn = await Conn.open(port)
    try:
        answer = await conn.ask(get("/health"))
        assert answer.status in (200, 503) and answer.header("connection") != "close"
        # idle past 0.5 s: the router closes it (the default, 75 s, would not within the bound)
        assert await conn.closed_by_peer()
    finally:
        conn.close()


async def test_max_head_bytes_bounds_the_request_head(children: list[Child], tmp_path: Path) -> None:  # noqa: F811
    port = start(children, tmp_path, "raw", "max_head_bytes = 2048\n")
    conn = await Conn.open(port)
    try:
        answer = await conn.ask(get("/health", extra="X-Pad: " + "a" * 1500 + "\r\n"))
        assert answer.status in (200, 503)
        answer = await conn.ask(get("/health", extra="X-Pad: " + "a" * 2100 + "\r\n"))
        assert answer.status == 400 and "head too large" in answer.error()["message"]
        assert "2048 bytes" in answer.error()["message"]
        assert await conn.closed_by_peer()
    finally:
        conn.close()


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listening socket's backlog")
@pytest.mark.parametrize("front", FRONTS)
def test_listen_backlog_is_the_listening_sockets_backlog(children: list[Child], tmp_path: Path,  # noqa: F811
                                                         front: str) -> None:
    port = start(children, tmp_path, front, "listen_backlog = 7\n")
    # for a listening socket, ss's Send-Q column is its accept backlog
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    assert rows and all(row[0] == "LISTEN" and row[2] == "7" for row in rows), out
