"""Server-sent events for the streaming routes: open the stream, write frames as produced."""

from __future__ import annotations

import socket

from aiohttp import web

DONE = b"data: [DONE]\n\n"


async def open_stream(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    """Send the headers of an SSE response; every later ``write`` goes out at once."""
    resp = web.StreamResponse(status=200, headers=headers)
    resp.content_type = "text/event-stream"
    resp.headers["Cache-Control"] = "no-cache"
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # small frames must not wait for the client's delayed ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await resp.prepare(request)
    return resp


def data_frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
