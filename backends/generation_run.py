"""``GenerationRun``: the engine's step outputs of one request folded into per-choice results
(tokens, finish reasons, the text where this backend answers text itself) and the counts usage is
made of."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.engine.outputs import RequestOutput
from backends.tokenizer import Tokenizer
from rendering.derender import ChoiceText, DerenderOptions

if TYPE_CHECKING:
    from backends.kv_transfer.agent import RemoteLoad


class Choice:
    """One child sequence's progress as seen by the frontend."""

    __slots__ = ("index", "token_ids", "last_ids", "text", "pending", "finish_reason", "stop_reason", "done")

    def __init__(self, index: int, text: ChoiceText | None) -> None:
        self.index = index
        self.token_ids: list[int] = []
        #: the ids the last applied output added (up to a stop string's end)
        self.last_ids: list[int] = []
        #: the choice's text (detokenizer and stop strings), when the run answers text
        self.text = text
        #: text not streamed yet
        self.pending: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.done = False


class GenerationRun:
    """Fold ``RequestOutput``s of one request (all its children) into choices and usage.

    With ``text`` options the run answers text itself, through ``rendering.derender.ChoiceText`` (the
    coordinator's detokenizer and stop strings, vLLM's rules): a stop string ends its choice with
    ``finish_reason="stop"`` and ``stop_reason`` set to it, the ids after it are dropped, and when every
    choice is done the caller closes the engine stream (an abort). While streaming, the characters that
    may start a stop string are held back until they cannot. Without ``text`` (a derenderer answers,
    or ids are all that is asked for) only ids and counts are kept.
    """

    __slots__ = (
        "model", "choices", "prompt_tokens", "cached_tokens", "generated", "kv_transfer_params", "remaining", "remote",
    )

    def __init__(self, tokenizer: Tokenizer, n: int, text: DerenderOptions | None = None) -> None:
        model = tokenizer.model
        self.choices = [Choice(i, None if text is None else ChoiceText(model, text, None, True)) for i in range(n)]
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
        for delta in out.deltas:
            self.generated += len(delta.token_ids)
            choice = self.choices[delta.index]
            if choice.done:
                continue
            moved.append(choice)
            ids = delta.token_ids
            text = choice.text
            if text is not None:
                piece, ids = text.take(ids, delta.finish_reason, delta.stop_reason)
                if piece:
                    choice.pending.append(piece)
                if text.done:
                    self._finish(choice, text.finish_reason, text.stop_reason)
            elif delta.finish_reason is not None:
                self._finish(choice, delta.finish_reason, delta.stop_reason)
            choice.last_ids = ids
            choice.token_ids += ids
        return moved

    def _finish(self, choice: Choice, finish_reason: str | None, stop_reason: int | str | None) -> None:
        choice.finish_reason = finish_reason
        choice.stop_reason = stop_reason
        choice.done = True
        self.remaining -= 1

    @property
    def finished(self) -> bool:
        return self.remaining <= 0

    def final_text(self, choice: Choice) -> str:
        """The whole text of ``choice`` (a run with ``text`` options)."""
        return choice.text.text() if choice.text is not None else ""

    def stream_text(self, choice: Choice) -> str:
        """The text of ``choice`` that may be sent now (call once per ``apply`` that moved it)."""
        if not choice.pending:
            return ""
        piece = "".join(choice.pending)
        choice.pending.clear()
        return piece
