"""Reading an engine's SSE stream: the bytes of each ``data:`` event, whatever the chunking.

``/inference/v1/generate`` with ``"stream": true`` sends one ``data: {json}`` event per step and ends
with ``data: [DONE]``. The upstream client hands over chunks as the socket delivers them, so an event
may be split across chunks or several may arrive in one; ``SSEEvents.feed`` returns the complete
events' data so far and keeps the rest. Events end with a blank line (LF LF, as vLLM and
session-backend write them). Lines other than ``data:`` (comments, ``event:``, ``id:``)
are skipped; a multi-line ``data`` event is joined with newlines, as the SSE specification says.
"""

from __future__ import annotations

DONE = b"[DONE]"


class SSEEvents:
    """Incremental SSE parser: bytes in, the ``data`` payload of every complete event out."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data of each event completed by ``chunk`` (events without data are skipped)."""
        if not self._buffer and chunk.startswith(b"data: ") and chunk.endswith(b"\n\n"):
            # the usual case: whole single-line data events, one or more, and nothing else (every
            # newline is in a blank line before "data: ", or in the last one)
            between = chunk.count(b"\n\ndata: ")
            if chunk.count(b"\n") == 2 * between + 2:
                return chunk[6:-2].split(b"\n\ndata: ") if between else [chunk[6:-2]]
        buffer = self._buffer + chunk if self._buffer else chunk
        parts = buffer.split(b"\n\n")
        self._buffer = parts.pop()  # what follows the last blank line: an event not complete yet
        events: list[bytes] = []
        for part in parts:
            if part[:6] == b"data: " and b"\n" not in part:
                events.append(part[6:])  # a single-line data event
            else:
                data = _event_data(part)
                if data is not None:
                    events.append(data)
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet complete (what a stream that broke off left unfinished)."""
        return self._buffer


def _event_data(event: bytes) -> bytes | None:
    lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    lines = [line[1:] if line[:1] == b" " else line for line in lines]
    return lines[0] if len(lines) == 1 else b"\n".join(lines)
