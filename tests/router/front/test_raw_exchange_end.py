"""``Exchange.end(last)`` on the raw front: a stream's final piece goes out with its end in one send, framed
as ``write`` frames it (a chunk before the last chunk; raw on HTTP/1.0; nothing for HEAD)."""

from __future__ import annotations

import asyncio

import httptools
import pytest

from router.front.raw_exchange import Exchange
from router.front.wire import DateServer


class _Conn:
    """The part of a client connection an exchange uses; writes are recorded."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport = None
        self.dates = DateServer()
        self.closing = False
        self.write_paused = False
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def abort(self) -> None:
        raise AssertionError("not aborted")

    async def drained(self) -> None:
        return None


def _body(wire: bytes) -> bytes:
    """The body an HTTP client reads from ``wire`` (chunked framing undone)."""
    parts: list[bytes] = []
    done: list[bool] = []

    class Reader:
        def on_body(self, body: bytes) -> None:
            parts.append(body)

        def on_message_complete(self) -> None:
            done.append(True)

    parser = httptools.HttpResponseParser(Reader())
    parser.feed_data(wire)
    assert done, "the answer is complete"
    return b"".join(parts)


async def _stream(http10: bool = False, head: bool = False) -> _Conn:
    conn = _Conn()
    exchange = Exchange(conn)  # type: ignore[arg-type]
    exchange.complete = True
    exchange.http10 = http10
    exchange.head_only = head
    await exchange.start(200, [("Content-Type", "text/event-stream")])
    await exchange.write(b"data: 1\n\n")
    await exchange.end(b"data: 2\n\ndata: [DONE]\n\n")
    await exchange.end(b"again")  # a second end sends nothing
    return conn


async def test_the_last_piece_goes_with_the_end_in_one_write() -> None:
    conn = await _stream()
    assert len(conn.writes) == 2 and conn.writes[1] == b"17\r\ndata: 2\n\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    assert _body(b"".join(conn.writes)) == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


async def test_http_1_0_and_head() -> None:
    conn = await _stream(http10=True)
    assert conn.writes[1:] == [b"data: 2\n\ndata: [DONE]\n\n"]
    head = await _stream(head=True)
    assert len(head.writes) == 1 and head.writes[0].endswith(b"\r\n\r\n")  # the head alone


@pytest.mark.parametrize("last", [b"", b"x"])
async def test_end_without_writes_sends_the_head_with_it(last: bytes) -> None:
    conn = _Conn()
    exchange = Exchange(conn)  # type: ignore[arg-type]
    exchange.complete = True
    await exchange.start(200, [])
    await exchange.end(last)
    assert len(conn.writes) == 1 and _body(conn.writes[0]) == last
