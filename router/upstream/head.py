"""Building upstream request heads: HTTP/1.1, keep-alive, no hop-by-hop headers, no smuggling.

The head is built once per upstream leg from the client's headers; the body is never touched.
Header strings are encoded with UTF-8 + ``surrogateescape``, which gives back the exact bytes
aiohttp's server decoded them from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from contract.errors import BadRequestError

#: hop-by-hop headers (RFC 9110 §7.6.1, plus the non-standard Proxy-Connection); never forwarded
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
#: request headers the pool sets itself
_DROP = HOP_BY_HOP | {"host", "content-length"}
#: Connection tokens that name no header worth a second pass
_PLAIN_CONNECTION_TOKENS = frozenset({"keep-alive", "close", ""}) | _DROP

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: methods known to be tokens (others are checked against ``_TOKEN``)
_METHODS = frozenset(("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"))
#: request-target in origin form: starts with "/", no whitespace or control characters
_TARGET = re.compile(r"/[^\x00-\x20\x7f]*")


def build_request_head(
    method: str,
    path: str,
    host_header: str,
    headers: Iterable[tuple[str, str]],
    content_length: int,
) -> bytes:
    """Return the complete request head (request line, headers, blank line) as bytes.

    Drops hop-by-hop headers, the headers named in ``Connection``, ``Host`` and ``Content-Length``
    from ``headers``; sets ``Host: host_header`` and ``Content-Length: content_length`` (omitted for
    a body-less GET/HEAD). Raises ``BadRequestError`` for a method that is not a token, a path that
    is not origin-form, or a header name/value that could split the head (CR, LF, NUL, bad name).
    """
    return request_head(method, path, host_header, render_headers(headers), content_length)


def connection_options(values: Iterable[str]) -> frozenset[str]:
    """The header names that ``Connection`` header values list (lower case): hop-by-hop for this
    connection only (RFC 9110 §7.6.1), so never forwarded. ``close``, ``keep-alive`` and headers
    dropped anyway are left out: for almost every request the answer is empty."""
    options: set[str] = set()
    for value in values:
        for token in value.lower().split(","):
            token = token.strip(" \t")
            if token not in _PLAIN_CONNECTION_TOKENS:
                options.add(token)
    return frozenset(options)


def drop_connection_options(rendered: str, connection: Iterable[str]) -> str:
    """``rendered`` header lines (``name: value\r\n`` each, as ``render_headers`` makes them)
    without the headers the ``connection`` values name: the one place that drops them, for
    ``render_headers`` and for both client fronts (``router.front``)."""
    options = connection_options(connection)
    if not options:
        return rendered
    kept = [line for line in rendered.split("\r\n") if line and line.split(":", 1)[0].lower() not in options]
    return "".join(line + "\r\n" for line in kept)


def render_headers(headers: Iterable[tuple[str, str]]) -> str:
    """The end-to-end header lines of a request, validated and filtered once (a proxy renders them
    once per client request and reuses them for every upstream attempt)."""
    parts: list[str] = []
    connection: list[str] | None = None
    for name, value in headers:
        lname = name.lower()
        if lname in _DROP:
            if lname == "connection":
                if connection is None:
                    connection = []
                connection.append(value)
            continue
        if _TOKEN.fullmatch(name) is None:
            raise BadRequestError(f"invalid header name {name!r}: remove it or use letters, digits and '-' only")
        if "\r" in value or "\n" in value or "\x00" in value:
            raise _bad_value(name)
        parts.append(f"{name}: {value}\r\n")
    rendered = "".join(parts)
    # rare: the client's Connection header names end-to-end headers as hop-by-hop
    return drop_connection_options(rendered, connection) if connection else rendered


def render_values(headers: Iterable[tuple[str, str]]) -> str:
    """``render_headers`` for headers whose names the caller vouches for (its own constants: tokens, and
    none the pool sets or drops): only the values are checked (a proxy's own headers on every request)."""
    parts: list[str] = []
    for name, value in headers:
        if "\r" in value or "\n" in value or "\x00" in value:
            raise _bad_value(name)
        parts.append(f"{name}: {value}\r\n")
    return "".join(parts)


def _bad_value(name: str) -> BadRequestError:
    return BadRequestError(f"header {name} contains CR, LF or NUL: remove those characters")


def request_head(method: str, path: str, host_header: str, rendered: str, content_length: int) -> bytes:
    """The request head from header lines made by ``render_headers``."""
    if method not in _METHODS and _TOKEN.fullmatch(method) is None:
        raise BadRequestError(f"invalid HTTP method {method!r}: use a token such as POST or GET")
    if _TARGET.fullmatch(path) is None:
        raise BadRequestError(
            f"invalid request path {path!r}: it must start with '/' and contain no spaces or control characters"
        )
    if "\r" in host_header or "\n" in host_header or "\x00" in host_header:
        raise BadRequestError("invalid Host value: it contains CR, LF or NUL")
    if content_length or method not in ("GET", "HEAD"):
        if content_length < 0:
            raise BadRequestError(f"invalid content length {content_length}")
        length = f"Content-Length: {content_length}\r\n"
    else:
        length = ""
    return f"{method} {path} HTTP/1.1\r\nHost: {host_header}\r\n{rendered}{length}\r\n".encode(
        "utf-8", "surrogateescape")
