"""``SSEEvents``: the data of each event of an engine stream, however the bytes are chunked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@pytest.mark.parametrize("chunk", [b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n', b"data: x\n\ndata: \n\n",
                                   b"data: x\n\n\ndata: y\n\n", b"data: x\n\ndata: y\ndata: z\n\n",
                                   b"data: x\n\n: note\n\ndata: y\n\n", b"data: x\n\ndata: y\n\n\n\n",
                                   b"data: x\n\ndata: y\n\ndata: partial"])
def test_several_events_in_one_chunk(chunk: bytes) -> None:
    by_byte = SSEEvents()
    expected: list[bytes] = []
    for i in range(len(chunk)):
        expected += by_byte.feed(chunk[i:i + 1])
    whole = SSEEvents()
    assert whole.feed(chunk) == expected and whole.pending == by_byte.pending


def _spec_data(stream: bytes) -> list[bytes]:
    """The SSE specification's reading of a stream of LF-ended lines: each blank line dispatches the
    data lines before it (joined with LF), when there were any."""
    out: list[bytes] = []
    data: list[bytes] | None = None
    for line in stream.split(b"\n")[:-1]:
        if not line:
            if data is not None:
                out.append(b"\n".join(data))
            data = None
        elif line.startswith(b"data:"):
            value = line[5:]
            (data := data if data is not None else []).append(value[1:] if value[:1] == b" " else value)
    return out


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(st.one_of(
        st.binary(max_size=12).filter(lambda b: b"\n" not in b).map(lambda b: b"data: " + b + b"\n\n"),
        st.sampled_from([b": comment\n\n", b"event: x\ndata: a\ndata: b\n\n", b"\n", b"data:tight\n\n",
                         b"id: 3\n\n", b"data: [DONE]\n\n", b"data: a\ndata: b\n\n", b"data: c\nid: 1\n\n"]),
    ), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6),
)
def test_any_stream_in_any_chunks_is_read_as_the_specification_says(events: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(events)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    reader = SSEEvents()
    out: list[bytes] = []
    for a, b in zip(bounds, bounds[1:]):
        out += reader.feed(stream[a:b])
    assert out == _spec_data(stream) and reader.pending in (b"", b"\n")  # a stray blank line is no event
