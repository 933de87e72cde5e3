"""HTTP/1.x over raw sockets for tests: a client connection and its answers (what a front sent,
byte for byte), and a scripted server whose connections a test drives (what an upstream pool or
the router's proxy meets)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

#: a small, valid completions body
GOOD = b'{"model": "m", "prompt": "hello"}'


# ------------------------------------------------------------------------------ the client side


@dataclass
class Answer:
    version: str
    status: int
    #: the status line and headers as sent, up to and with the blank line
    head: bytes
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def error(self) -> dict[str, Any]:
        """The OpenAI-shaped error of a 4xx/5xx answer."""
        assert (self.header("content-type") or "").startswith("application/json"), self.headers
        payload = json.loads(self.body)
        assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
        assert payload["error"]["code"] == self.status
        return payload["error"]


async def read_answer(reader: asyncio.StreamReader, *, head_only: bool = False, timeout: float = 10.0) -> Answer:
    """One answer: its head, then its body as framed (Content-Length, chunked or to EOF); no body for
    ``head_only``, 1xx, 204 and 304. Every read waits at most ``timeout``."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    version, status = lines[0].split(" ", 2)[:2]
    headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:] if line)]
    answer = Answer(version, int(status), head, headers, b"")
    length = answer.header("content-length")
    if head_only or answer.status in (204, 304) or answer.status < 200:
        return answer
    if length is not None:
        answer.body = await asyncio.wait_for(reader.readexactly(int(length)), timeout)
    elif answer.header("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readline(), timeout)).strip(), 16)
            data = await asyncio.wait_for(reader.readexactly(size + 2), timeout)
            if size == 0:
                break
            body += data[:-2]
        answer.body = body
    else:  # close-delimited
        answer.body = await asyncio.wait_for(reader.read(), timeout)
    return answer


def post(path: str, body: bytes = GOOD, *, version: str = "1.1", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode("latin-1") + body


def get(path: str, *, method: str = "GET", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: router\r\n{extra}\r\n".encode("latin-1")


class Conn:
    """One raw client connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> "Conn":
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def ask(self, data: bytes, *, head_only: bool = False) -> Answer:
        await self.send(data)
        return await read_answer(self.reader, head_only=head_only)

    async def closed_by_peer(self) -> bool:
        """True when the server closed the connection (EOF, or a reset after it closed)."""
        try:
            return await asyncio.wait_for(self.reader.read(1), 10) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.writer.close()


# ------------------------------------------------------------------------------ the server side


class ServerConn:
    """One accepted connection of a ``RawServer``, with helpers for scripted behaviour."""

    def __init__(self, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.index = index
        self.reader = reader
        self.writer = writer
        #: the last request read
        self.request = b""

    async def read_request(self) -> bytes | None:
        """One request (head + Content-Length body), or None at EOF."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        self.request = head + (await self.reader.readexactly(length) if length else b"")
        return self.request

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def wait_closed_by_peer(self) -> None:
        """Return when the client closed (EOF or reset). Bounded by the caller."""
        try:
            while await self.reader.read(65536):
                pass
        except ConnectionError:
            pass

    async def closed_by_peer(self) -> bool:
        """Read until the client closes the connection; True then (bounded by the caller)."""
        await self.wait_closed_by_peer()
        return True

    def close(self) -> None:
        self.writer.close()


Handler = Callable[[ServerConn], Awaitable[None]]


class RawServer:
    """An asyncio server on 127.0.0.1 (ephemeral port) that runs ``handler`` on each connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.port = 0
        self.conns: list[ServerConn] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = ServerConn(self.connections, reader, writer)
        self.connections += 1
        self.conns.append(conn)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self.handler(conn)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for conn in self.conns:
            conn.writer.close()
        await self._server.wait_closed()
