"""HTTP/1.x correctness (RFC 9110/9112) on both fronts, and the fronts' resource bounds.

Each test writes raw bytes to a real router (the raw front, and the aiohttp front as
``router.cli.serve`` builds it: ``JsonErrorAppRunner`` over the app), on 127.0.0.1 ephemeral
ports in front of in-process fake backends, and reads what comes back byte for byte.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.test_front_raw import GOOD, Conn, Factory, get, post, read_answer, served  # noqa: F401

FRONTS = ["raw", "aiohttp"]


async def open_front(router: Any, front: str) -> Conn:
    conn = await Conn.open(router.port if front == "raw" else router.aiohttp_port)
    router.opened.append(conn)
    return conn


def closes(answer: Any) -> bool:
    """The answer says the connection closes after it (HTTP/1.0 answers may say so by saying nothing)."""
    connection = (answer.header("connection") or "").lower()
    return connection == "close" or (answer.version == "HTTP/1.0" and connection != "keep-alive")


def chunked(path: str, body: bytes, *, version: str = "1.1", extra: str = "", trailer: str = "") -> bytes:
    head = f"POST {path} HTTP/{version}\r\nHost: router\r\nContent-Type: application/json\r\n" \
           f"Transfer-Encoding: chunked\r\n{extra}\r\n"
    return head.encode() + b"%x\r\n%b\r\n0\r\n" % (len(body), body) + trailer.encode() + b"\r\n"


# ------------------------------------------------------------------- 4. trailer fields


@pytest.mark.parametrize("front", FRONTS)
async def test_trailer_fields_are_neither_forwarded_nor_used_for_routing(served: Factory, front: str) -> None:
    router = await served()
    conn = await open_front(router, front)
    answer = await conn.ask(chunked("/v1/completions", GOOD, extra="X-Session-ID: head-sid\r\n",
                                    trailer="X-Session-ID: trailer-sid\r\nX-Trailer-Field: t\r\n"))
    assert answer.status == 200, answer.body[:200]
    assert answer.header("x-session-id") == "head-sid"
    seen = router.fakes[0].seen[-1]
    assert seen.body == GOOD
    assert seen.headers["x-session-id"] == ["head-sid"]
    assert "x-trailer-field" not in seen.headers
    # a trailer is no session id either: without one in the head, the trailer's is ignored
    answer = await conn.ask(chunked("/v1/completions", GOOD, trailer="X-Session-ID: only-trailer\r\n"))
    assert answer.status == 200 and answer.header("x-session-id") != "only-trailer"
    assert router.fakes[0].seen[-1].headers.get("x-session-id") != ["only-trailer"]
    assert (await router.once(get("/v1/sessions/only-trailer"))).status == 404


# ------------------------------------------------------- 5. headers named in Connection


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/%63ompletions"])  # hot, and relayed on the raw front
async def test_headers_named_in_connection_are_not_forwarded(served: Factory, front: str, path: str) -> None:
    router = await served()
    conn = await open_front(router, front)
    answer = await conn.ask(post(path, extra=(
        "Connection: keep-alive, X-Hop-One ,x-hop-two\r\nX-Hop-One: 1\r\nX-HOP-TWO: 2\r\nX-End: 3\r\n"
        "Connection: X-Hop-Three\r\nX-Hop-Three: 4\r\n")))
    assert answer.status == 200, answer.body[:200]
    assert answer.header("connection") is None  # still keep-alive
    seen = router.fakes[0].seen[-1].headers
    assert seen["x-end"] == ["3"]
    for hop in ("x-hop-one", "x-hop-two", "x-hop-three", "connection", "keep-alive"):
        assert hop not in seen, hop
    assert (await conn.ask(post(path))).status == 200


# ------------------------------------------------- 6. HTTP/1.0 with Transfer-Encoding


@pytest.mark.parametrize("front", FRONTS)
async def test_http_1_0_with_transfer_encoding_closes_after_the_answer(served: Factory, front: str) -> None:
    router = await served()
    conn = await open_front(router, front)
    answer = await conn.ask(chunked("/v1/completions", GOOD, version="1.0", extra="Connection: keep-alive\r\n"))
    assert answer.status == 200, answer.body[:200]
    assert router.fakes[0].seen[-1].body == GOOD
    assert closes(answer)
    assert await conn.closed_by_peer()


# --------------------------------------------------------------------------- 7. Host


HOSTS = {
    "missing": b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n",
    "duplicated": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nHost: b\r\nContent-Length: %d\r\n\r\n",
    "duplicated_same": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nhost: a\r\nContent-Length: %d\r\n\r\n",
    "space": b"POST /v1/completions HTTP/1.1\r\nHost: a b\r\nContent-Length: %d\r\n\r\n",
    "slash": b"POST /v1/completions HTTP/1.1\r\nHost: a/b\r\nContent-Length: %d\r\n\r\n",
    "userinfo": b"POST /v1/completions HTTP/1.1\r\nHost: user@a\r\nContent-Length: %d\r\n\r\n",
    "bad_port": b"POST /v1/completions HTTP/1.1\r\nHost: a:port\r\nContent-Length: %d\r\n\r\n",
}


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("name", list(HOSTS))
async def test_a_missing_duplicated_or_invalid_host_is_a_400(served: Factory, front: str, name: str) -> None:
    router = await served()
    conn = await open_front(router, front)
    answer = await conn.ask(HOSTS[name] % len(GOOD) + GOOD)
    assert answer.status == 400, (name, answer.body[:200])
    assert "Host" in answer.error()["message"]
    assert closes(answer)
    assert await conn.closed_by_peer()
    assert not router.fakes[0].seen


@pytest.mark.parametrize("front", FRONTS)
async def test_good_hosts_and_http_1_0_without_host_are_served(served: Factory, front: str) -> None:
    router = await served()
    for host in ("router", "127.0.0.1:8000", "[::1]:8000", "example.com.", "xn--bcher-kva.example:80", ""):
        conn = await open_front(router, front)
        if host == "":  # HTTP/1.0 needs none
            data = b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%b" % (len(GOOD), GOOD)
        else:
            data = b"POST /v1/completions HTTP/1.1\r\nHost: %b\r\nContent-Length: %d\r\n\r\n%b" % (
                host.encode(), len(GOOD), GOOD)
        answer = await conn.ask(data)
        assert answer.status == 200, (host, answer.body[:200])
