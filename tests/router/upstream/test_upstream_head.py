"""build_request_head: request line, Host/Content-Length, hop-by-hop removal, no header injection."""

from __future__ import annotations

import httptools
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.errors import BadRequestError, ConfigError
from router.upstream import UpstreamLimits, UpstreamTimeouts, build_request_head, render_values, request_head


class _Parsed:
    def __init__(self, data: bytes) -> None:
        self.headers: list[tuple[str, str]] = []
        self.url = b""
        self.complete = False
        parser = httptools.HttpRequestParser(self)
        parser.feed_data(data)
        self.method = parser.get_method().decode()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode(), value.decode("utf-8", "surrogateescape")))

    def on_message_complete(self) -> None:
        self.complete = True

    def names(self) -> list[str]:
        return [n.lower() for n, _ in self.headers]

    def get(self, name: str) -> list[str]:
        return [v for n, v in self.headers if n.lower() == name.lower()]


def test_head_is_valid_http_with_host_and_length() -> None:
    body = b'{"prompt": "hi"}'
    head = build_request_head(
        "POST",
        "/v1/completions?x=1",
        "127.0.0.1:8100",
        [("Content-Type", "application/json"), ("X-Session-ID", "abc"), ("Accept", "*/*")],
        len(body),
    )
    assert head.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8100\r\n")
    assert head.endswith(b"\r\n\r\n")
    parsed = _Parsed(head + body)
    assert parsed.complete and parsed.method == "POST" and parsed.url == b"/v1/completions?x=1"
    assert parsed.get("content-length") == [str(len(body))]
    assert parsed.get("x-session-id") == ["abc"]
    assert parsed.get("content-type") == ["application/json"]
    assert parsed.get("host") == ["127.0.0.1:8100"]


def test_hop_by_hop_host_and_length_are_dropped() -> None:
    headers = [
        ("Host", "evil.example:1"),
        ("Content-Length", "999"),
        ("Connection", "keep-alive, X-Private, Upgrade"),
        ("Keep-Alive", "timeout=5"),
        ("Proxy-Authorization", "Basic Zm9v"),
        ("Proxy-Authenticate", "Basic"),
        ("Proxy-Connection", "keep-alive"),
        ("TE", "trailers"),
        ("Trailer", "X-Checksum"),
        ("Transfer-Encoding", "chunked"),
        ("Upgrade", "websocket"),
        ("X-Private", "named in Connection"),
        ("X-Request-Id", "req-1"),
        ("Authorization", "Bearer token"),
    ]
    head = build_request_head("POST", "/v1/chat/completions", "10.0.0.1:80", headers, 2)
    parsed = _Parsed(head + b"{}")
    assert parsed.complete
    assert sorted(parsed.names()) == ["authorization", "content-length", "host", "x-request-id"]
    assert parsed.get("host") == ["10.0.0.1:80"]
    assert parsed.get("content-length") == ["2"]


def test_header_named_in_connection_before_it_is_dropped() -> None:
    head = build_request_head("GET", "/", "h:1", [("X-Early", "1"), ("Connection", "x-early"), ("X-Keep", "2")], 0)
    parsed = _Parsed(head)
    assert sorted(parsed.names()) == ["host", "x-keep"]


def test_get_without_body_has_no_content_length_but_post_has_zero() -> None:
    assert b"content-length" not in build_request_head("GET", "/health", "h:1", [], 0).lower()
    assert b"Content-Length: 0\r\n" in build_request_head("POST", "/x", "h:1", [], 0)


def test_non_ascii_header_bytes_pass_unchanged() -> None:
    raw = "caf\u00e9".encode().decode("utf-8", "surrogateescape")  # how aiohttp decodes header bytes
    odd = b"\xff\xfe".decode("utf-8", "surrogateescape")
    head = build_request_head("POST", "/x", "h:1", [("X-Name", raw), ("X-Odd", odd)], 0)
    assert "X-Name: café\r\n".encode() in head
    assert b"X-Odd: \xff\xfe\r\n" in head


@pytest.mark.parametrize(
    "name,value",
    [
        ("X-Session-ID", "abc\r\nX-Injected: 1"),
        ("X-Session-ID", "abc\nGET / HTTP/1.1"),
        ("X-Session-ID", "abc\rdef"),
        ("X-Session-ID", "abc\x00def"),
        ("X-Bad Name", "v"),
        ("X-Bad:Name", "v"),
        ("X-Bad\r\nName", "v"),
        ("", "v"),
    ],
)
def test_header_injection_is_rejected(name: str, value: str) -> None:
    with pytest.raises(BadRequestError) as info:
        build_request_head("POST", "/v1/completions", "h:1", [("Accept", "*/*"), (name, value)], 0)
    assert info.value.status == 400
    assert "header" in info.value.message


@pytest.mark.parametrize("value", ["abc\r\nX-Injected: 1", "abc\nGET / HTTP/1.1", "abc\rdef", "abc\x00def"])
def test_the_proxys_own_header_values_are_checked_too(value: str) -> None:
    """``render_values`` (names the caller's constants) checks values as ``render_headers`` does."""
    rendered = render_values([("X-Request-ID", "r-1"), ("X-Session-ID", "s-1")])
    assert rendered == "X-Request-ID: r-1\r\nX-Session-ID: s-1\r\n"
    with pytest.raises(BadRequestError) as info:
        render_values([("X-Request-ID", "r-1"), ("X-Session-ID", value)])
    assert info.value.status == 400 and "X-Session-ID" in info.value.message


@pytest.mark.parametrize("method", ["GET", "POST", "PROPFIND", "M-SEARCH"])
def test_any_token_method_is_sent(method: str) -> None:
    head = request_head(method, "/x", "h:1", "", 2)
    assert head.startswith(f"{method} /x HTTP/1.1\r\nHost: h:1\r\n".encode())


@pytest.mark.parametrize(
    "method,path,host",
    [
        ("POST", "/x HTTP/1.1\r\nX: y", "h:1"),
        ("POST", "/x y", "h:1"),
        ("POST", "http://127.0.0.1:9/x", "h:1"),
        ("POST", "", "h:1"),
        ("PO ST", "/x", "h:1"),
        ("POST\r\n", "/x", "h:1"),
        ("POST", "/x", "h:1\r\nX-Injected: 1"),
        ("POST", "/x", "h:1\nX: 1"),
        ("POST", "/x", "h:1\x00"),
        ("GET POST", "/x", "h:1"),
    ],
)
def test_bad_request_line_or_host_is_rejected(method: str, path: str, host: str) -> None:
    with pytest.raises(BadRequestError):
        build_request_head(method, path, host, [], 0)


def test_config_structs_validate() -> None:
    assert UpstreamTimeouts().total_s == 600.0
    assert UpstreamLimits().max_idle_per_host == 256
    with pytest.raises(ConfigError):
        UpstreamTimeouts(connect_s=0)
    with pytest.raises(ConfigError):
        UpstreamLimits(read_high_water=10, read_low_water=20)
    with pytest.raises(ConfigError):
        UpstreamLimits(max_idle_per_host=-1)


_names = st.from_regex(r"[A-Za-z][A-Za-z0-9\-]{0,20}", fullmatch=True).filter(
    lambda n: n.lower() not in {"host", "content-length", "connection", "keep-alive", "proxy-authenticate",
                                "proxy-authorization", "proxy-connection", "te", "trailer", "transfer-encoding",
                                "upgrade"}
)
_safe_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.strip)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_names, _safe_values), max_size=8), st.binary(max_size=64))
def test_property_safe_headers_round_trip(headers: list[tuple[str, str]], body: bytes) -> None:
    head = build_request_head("POST", "/v1/completions", "127.0.0.1:8100", headers, len(body))
    parsed = _Parsed(head + body)
    assert parsed.complete
    assert [(n, v) for n, v in parsed.headers if n.lower() not in ("host", "content-length")] == headers


@settings(max_examples=200, deadline=None)
@given(_names, _safe_values, st.sampled_from(["\r", "\n", "\x00", "\r\n"]), _safe_values)
def test_property_control_characters_never_reach_the_wire(name: str, left: str, bad: str, right: str) -> None:
    with pytest.raises(BadRequestError):
        build_request_head("POST", "/x", "h:1", [(name, left + bad + right)], 0)
