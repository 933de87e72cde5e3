"""``SSEEvents``: the data of each event of an engine stream, however the bytes are chunked."""

from __future__ import annotations

import pytest

from router.tokens.sse import SSEEvents

STREAM = b'data: {"a":1}\n\ndata: {"b":2}\n\n: a comment\n\nevent: x\ndata: line1\ndata: line2\n\ndata: [DONE]\n\n'
EVENTS = [b'{"a":1}', b'{"b":2}', b"line1\nline2", b"[DONE]"]


def test_one_chunk() -> None:
    assert SSEEvents().feed(STREAM) == EVENTS


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16])
def test_any_chunking(size: int) -> None:
    events = SSEEvents()
    out: list[bytes] = []
    for i in range(0, len(STREAM), size):
        out += events.feed(STREAM[i:i + size])
    assert out == EVENTS and events.pending == b""


def test_an_unfinished_event_waits() -> None:
    events = SSEEvents()
    assert events.feed(b'data: {"a"') == []
    assert events.pending == b'data: {"a"'
    assert events.feed(b":1}\n\n") == [b'{"a":1}']


def test_data_without_a_space() -> None:
    assert SSEEvents().feed(b"data:x\n\n") == [b"x"]


@pytest.mark.parametrize("chunk", [b"data: x\n\n", b"data: a\ndata: b\n\n", b"data: x\n", b"data: x\n\ndata: y\n\n",
                                   b"event: e\ndata: x\n\n", b"data: x\r\n\r\n"])
def test_the_one_event_shortcut_agrees_with_the_general_parse(chunk: bytes) -> None:
    general = SSEEvents()
    general.feed(b"")  # nothing buffered, so the shortcut may apply; compare with a byte-by-byte parse
    by_byte: list[bytes] = []
    for i in range(len(chunk)):
        by_byte += general.feed(chunk[i:i + 1])
    assert SSEEvents().feed(chunk) == by_byte
