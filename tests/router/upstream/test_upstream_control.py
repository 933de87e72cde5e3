"""UpstreamPool.control (the small control requests: P/D releases, engine aborts) and
UpstreamTimeouts.capped, against a real aiohttp server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from contract.errors import UpstreamTimeoutError
from router.upstream import UpstreamPool, UpstreamTimeouts, request_head

TIMEOUTS = UpstreamTimeouts(connect_s=2.0, first_byte_s=5.0, total_s=10.0)


def test_capped_bounds_every_timeout() -> None:
    assert TIMEOUTS.capped(3.0) == UpstreamTimeouts(connect_s=2.0, first_byte_s=3.0, total_s=3.0)
    assert TIMEOUTS.capped(20.0) == UpstreamTimeouts(connect_s=2.0, first_byte_s=5.0, total_s=20.0)


async def test_control_returns_the_status_and_frees_the_connection() -> None:
    seen: list[bytes] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"ok": True}, status=404 if request.path == "/missing" else 200)

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    async with TestServer(app, host="127.0.0.1") as server:
        pool = UpstreamPool(TIMEOUTS)
        try:
            host, port = "127.0.0.1", server.port
            assert port is not None
            for path, status in (("/abort", 200), ("/missing", 404)):
                head = request_head("POST", path, f"{host}:{port}", "", 2)
                assert await pool.control(host, port, head, b"{}", bound_s=1.0) == status
            assert seen == [b"{}", b"{}"]
            assert pool.connects == 1  # the answer was read whole: the connection went back to the pool
        finally:
            await pool.close()


async def test_control_is_bounded_by_bound_s() -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response()

    app = web.Application()
    app.router.add_post("/slow", slow)
    async with TestServer(app, host="127.0.0.1") as server:
        pool = UpstreamPool(TIMEOUTS)
        try:
            assert server.port is not None
            head = request_head("POST", "/slow", f"127.0.0.1:{server.port}", "", 0)
            with pytest.raises(UpstreamTimeoutError):
                await pool.control("127.0.0.1", server.port, head, b"", bound_s=0.3)
        finally:
            await pool.close()
