"""``GenerationRun``: the engine's step outputs of one request folded into per-choice results
(tokens, text with stop strings applied, finish reasons) and the counts usage is made of."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.engine.outputs import RequestOutput
from backends.tokenizer import Tokenizer

if TYPE_CHECKING:
    from backends.kv_transfer.agent import RemoteLoad


class Choice:
    """One child sequence's progress as seen by the frontend."""

    __slots__ = ("index", "token_ids", "last_ids", "text", "sent", "finish_reason", "stop_reason", "done")

    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        #: the ids the last applied output added
        self.last_ids: list[int] = []
        #: the text so far, kept only when stop strings must be checked (else decoded at the end)
        self.text = ""
        #: how many characters of ``text`` were already streamed
        self.sent = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.done = False


class GenerationRun:
    """Fold ``RequestOutput``s of one request (all its children) into choices and usage.

    Stop strings are applied here (the engine works on token ids): the text is cut before the
    first stop string, the choice finishes with ``finish_reason="stop"`` and ``stop_reason`` set to
    that string, and when every choice is done the caller closes the engine stream (an abort).
    While streaming, the last ``len(longest stop) - 1`` characters are held back, so a stop string
    split across tokens is never sent.
    """

    __slots__ = (
        "tokenizer", "choices", "stops", "holdback", "prompt_tokens", "cached_tokens",
        "generated", "kv_transfer_params", "remaining", "remote",
    )

    def __init__(self, tokenizer: Tokenizer, n: int, stops: list[str] | None) -> None:
        self.tokenizer = tokenizer
        self.choices = [Choice(i) for i in range(n)]
        self.stops = stops
        self.holdback = max(len(s) for s in stops) - 1 if stops else 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        #: generated ids over all children (what the engine's accounting counts)
        self.generated = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.remaining = n
        #: P/D decode: what was pulled from a remote prefill for this request (None: nothing)
        self.remote: RemoteLoad | None = None

    def apply(self, out: RequestOutput) -> list[Choice]:
        """Take one step's output; return the choices it moved (done ones are not moved again)."""
        moved: list[Choice] = []
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        stops = self.stops
        for delta in out.deltas:
            self.generated += len(delta.token_ids)
            choice = self.choices[delta.index]
            if choice.done:
                continue
            moved.append(choice)
            choice.last_ids = delta.token_ids
            choice.token_ids += delta.token_ids
            if stops:
                self._check_stops(choice, self.tokenizer.decode(delta.token_ids))
                if choice.done:
                    continue
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
                choice.stop_reason = delta.stop_reason
                choice.done = True
                self.remaining -= 1
        return moved

    def _check_stops(self, choice: Choice, new_text: str) -> None:
        start = max(0, len(choice.text) - self.holdback)
        text = choice.text = choice.text + new_text
        best = -1
        hit = ""
        for s in self.stops or ():
            idx = text.find(s, start)
            if idx >= 0 and (best < 0 or idx < best):
                best, hit = idx, s
        if best >= 0:
            choice.text = text[:best]
            choice.finish_reason = "stop"
            choice.stop_reason = hit
            choice.done = True
            self.remaining -= 1

    @property
    def finished(self) -> bool:
        return self.remaining <= 0

    def final_text(self, choice: Choice) -> str:
        if self.stops:
            return choice.text
        return self.tokenizer.decode(choice.token_ids)

    def stream_text(self, choice: Choice) -> str:
        """The text of ``choice`` that may be sent now (call once per ``apply`` that moved it)."""
        if not self.stops:
            return self.tokenizer.decode(choice.last_ids)
        limit = len(choice.text) if choice.done else len(choice.text) - self.holdback
        if limit <= choice.sent:
            return ""
        piece = choice.text[choice.sent : limit]
        choice.sent = limit
        return piece
