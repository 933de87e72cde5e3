"""Stop strings, applied by the coordinator as vLLM's detokenizer applies them.

A ``--tokens-only`` engine does not detokenize, so it cannot stop on a string: the router
checks the text it derenders instead, with vLLM 0.32's rules (``vllm/v1/engine/detokenizer.py``):

- the text is checked each time a token adds characters, in the window where a new match can
  be (the new characters plus ``len(stop) - 1`` before them);
- of the stop strings found there, the one that ends first wins (ties: the request's list
  order); the choice ends with ``finish_reason: "stop"`` and ``stop_reason`` = that string;
- the text is cut where the match starts, or where it ends with ``include_stop_str_in_output``;
- no check happens while the choice has produced ``min_tokens`` tokens or fewer;
- while streaming, the last ``output_text_buffer_length`` = ``max(len(stop)) - 1`` characters
  are held back (none with ``include_stop_str_in_output``), so a client never sees the start of
  a stop string that later completes; they are sent when the choice ends.
"""

from __future__ import annotations

from collections.abc import Sequence


def stop_list(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """The request's ``stop`` as a tuple (vLLM accepts a string or a list)."""
    if not stop:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop)


def buffer_length(stop: Sequence[str], include_stop_str_in_output: bool) -> int:
    """vLLM's ``output_text_buffer_length``: characters held back while streaming."""
    if not stop or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stop) - 1


class StopStrings:
    """The stop-string state of one choice: what may be sent now, and which string matched.

    ``feed(text)`` takes the characters the detokenizer produced for one token and answers the
    characters that may be sent now; after a match, ``matched`` is the stop string and the
    answer already ends where vLLM cuts the text. ``flush()`` answers what is still held back
    (call it when the choice ends some other way). Memory stays bounded: only the last
    ``max(len(stop)) - 1`` characters are kept.
    """

    __slots__ = ("_stop", "_include", "_hold", "_keep", "_tail", "_unsent", "matched")

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        if not stop:
            raise ValueError("StopStrings needs at least one stop string")
        self._stop = tuple(stop)
        self._include = include_stop_str_in_output
        #: characters held back while streaming
        self._hold = buffer_length(self._stop, include_stop_str_in_output)
        #: characters of earlier text a new match can start in
        self._keep = max(len(s) for s in self._stop) - 1
        #: the last characters of the text (at most ``_keep``), the unsent ones at its end
        self._tail = ""
        self._unsent = 0
        self.matched: str | None = None

    @property
    def held(self) -> int:
        """How many characters are held back now."""
        return self._unsent

    def feed(self, text: str, *, check: bool = True) -> str:
        """Add one token's characters; answer what may be sent now.

        ``check=False`` adds the text without looking for a stop string (vLLM does not check
        while ``min_tokens`` is not yet exceeded).
        """
        if not text or self.matched is not None:
            return ""
        tail = self._tail
        whole = tail + text
        sent = len(tail) - self._unsent  # characters of ``whole`` already sent
        if check:
            size = len(whole)
            new = len(text)
            best: str | None = None
            best_at = best_end = 0
            for stop in self._stop:
                start = size - new - len(stop) + 1
                at = whole.find(stop, start if start > 0 else 0)
                if at >= 0 and (best is None or at + len(stop) < best_end):
                    best, best_at, best_end = stop, at, at + len(stop)
            if best is not None:
                self.matched = best
                end = best_end if self._include else best_at
                self._tail = ""
                self._unsent = 0
                return whole[sent:end] if end > sent else ""
        end = len(whole) - self._hold
        if end < sent:
            end = sent
        keep = self._keep
        if keep:
            self._tail = whole[-keep:] if len(whole) > keep else whole
            self._unsent = len(whole) - end
        else:
            self._tail = ""
            self._unsent = 0
        return whole[sent:end]

    def flush(self) -> str:
        """The held-back characters (the choice ended without a match)."""
        if not self._unsent:
            return ""
        out = self._tail[len(self._tail) - self._unsent :]
        self._unsent = 0
        return out
