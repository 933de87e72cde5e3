"""HTTP/1.x response heads for the raw front: status lines, Date/Server, header lines, chunks.

Everything here renders bytes once; nothing parses. Header strings are encoded UTF-8 with
``surrogateescape``, as aiohttp does (so bytes a client sent come back unchanged).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from email.utils import formatdate
from http import HTTPStatus

from aiohttp.http import SERVER_SOFTWARE


JSON_CONTENT_TYPE = "application/json"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"

_REASONS = {s.value: s.phrase for s in HTTPStatus}


def _render_status_line(status: int, http10: bool) -> bytes:
    return f"HTTP/{'1.0' if http10 else '1.1'} {status} {_REASONS.get(status, 'Unknown')}\r\n".encode()


#: every known status line, rendered once at import (read-only afterwards)
_STATUS_LINES = {(status, v10): _render_status_line(status, v10) for status in _REASONS for v10 in (False, True)}


def status_line(status: int, http10: bool) -> bytes:
    """``HTTP/1.1 200 OK\\r\\n``."""
    line = _STATUS_LINES.get((status, http10))
    return line if line is not None else _render_status_line(status, http10)


class DateServer:
    """The ``Date`` and ``Server`` lines, rendered at most once per second."""

    __slots__ = ("_second", "_lines", "_server")

    def __init__(self, server: str = SERVER_SOFTWARE) -> None:
        self._second = -1
        self._lines = b""
        self._server = server

    def lines(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._lines = f"Date: {formatdate(now, usegmt=True)}\r\nServer: {self._server}\r\n".encode()
        return self._lines


def header_lines(headers: Iterable[tuple[str, str]]) -> bytes:
    """``name: value\\r\\n`` for each pair (the values were checked where they came from)."""
    return "".join([f"{name}: {value}\r\n" for name, value in headers]).encode("utf-8", "surrogateescape")


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (``data`` must not be empty: that is the last chunk)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def error_headers(request_id: str) -> list[tuple[str, str]]:
    return [("Content-Type", JSON_CONTENT_TYPE), ("X-Request-Id", request_id)]
