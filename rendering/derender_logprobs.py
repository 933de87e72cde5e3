"""Sample logprobs of a generate answer (token ids) -> the OpenAI logprobs objects (token strings).

The engine sends, per generated token, ``{token_id, logprob, rank, top_logprobs: [...]}`` with the
sampled token first in ``top_logprobs`` (``max(top_logprobs, 1)`` entries). The coordinator names
the tokens: ``token`` is the token decoded alone (special tokens kept), ``bytes`` its UTF-8
bytes (an id the tokenizer does not have is ``""`` with ``bytes: null``, as vLLM 0.32 answers); a token that decodes to a trailing U+FFFD (one byte of a multi-byte character) is decoded
with up to 4 preceding sampled tokens as context instead, as vLLM's logprobs processor repairs
byte-fallback pieces. ``return_tokens_as_token_ids`` names every token ``token_id:<id>``.

Chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`` with
the first ``top_logprobs`` entries (vLLM's chat route lists exactly that many). Completions:
``{text_offset, token_logprobs, tokens, top_logprobs: [{token: logprob}]}``, the offsets running on
over a stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import tokenizers
from msgspec import Struct

from rendering.generate_response import GenerateLogProb, GenerateLogProbsContent

_REPLACEMENT = "\ufffd"
#: preceding sampled tokens used to repair a partial character
_CONTEXT = 4


class ChatLogProb(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogProbsContent(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatLogProb]


class ChatLogProbs(Struct):
    content: list[ChatLogProbsContent] | None = None


class CompletionLogProbs(Struct, kw_only=True):
    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


def _decode(tokenizer: tokenizers.Tokenizer, ids: Sequence[int]) -> str:
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=False)
    except (TypeError, OverflowError):
        return ""


def repaired_token(tokenizer: tokenizers.Tokenizer, token_id: int, context: Sequence[int]) -> str:
    """The text ``token_id`` adds after ``context`` (its last sampled ids), or "" if none does."""
    for size in range(1, min(len(context), _CONTEXT) + 1):
        ctx = list(context[len(context) - size :])
        full = _decode(tokenizer, [*ctx, token_id])
        if full.endswith(_REPLACEMENT):
            continue
        # the context's own trailing partial pieces belong to this token's character
        clean = len(ctx)
        while clean > 0 and _decode(tokenizer, [ctx[clean - 1]]).endswith(_REPLACEMENT):
            clean -= 1
        prefix = _decode(tokenizer, ctx[:clean]) if clean else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
        common = 0
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


class LogprobNamer:
    """Names the tokens of one choice's logprobs (keeps the sampled-id context across steps)."""

    __slots__ = ("_tokenizer", "_as_ids", "_context", "_cache")

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, as_token_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_ids = as_token_ids
        self._context: list[int] = []
        self._cache: dict[int, str] = {}

    def _plain(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = _decode(self._tokenizer, [token_id])
        return text

    def name(self, token_id: int) -> str:
        if self._as_ids:
            return f"token_id:{token_id}"
        text = self._plain(token_id)
        if text.endswith(_REPLACEMENT):
            return repaired_token(self._tokenizer, token_id, self._context)
        return text

    def bytes_of(self, token_id: int, token: str) -> list[int] | None:
        if not self._as_ids and self._tokenizer.id_to_token(token_id) is None:
            return None
        return list(token.encode("utf-8", errors="replace"))

    def advance(self, sampled: int) -> None:
        context = self._context
        context.append(sampled)
        if len(context) > _CONTEXT:
            del context[0]

    def chat(self, entries: Sequence[GenerateLogProbsContent], top: int) -> ChatLogProbs:
        """The chat ``logprobs`` object for these positions (``top``: the request's top_logprobs)."""
        content = []
        for entry in entries:
            token = self.name(entry.token_id)
            tops = [self._chat_top(t) for t in entry.top_logprobs[:top]] if top else []
            content.append(ChatLogProbsContent(token=token, logprob=_clamp(entry.logprob),
                                               bytes=self.bytes_of(entry.token_id, token), top_logprobs=tops))
            self.advance(entry.token_id)
        return ChatLogProbs(content=content)

    def _chat_top(self, item: GenerateLogProb) -> ChatLogProb:
        token = self.name(item.token_id)
        return ChatLogProb(token=token, logprob=_clamp(item.logprob), bytes=self.bytes_of(item.token_id, token))

    def completion(self, entries: Sequence[GenerateLogProbsContent], offset: int) -> tuple[CompletionLogProbs, int]:
        """The completions ``logprobs`` object for these positions, text offsets from ``offset``;
        answers it and the offset after them."""
        out = CompletionLogProbs()
        for entry in entries:
            token = self.name(entry.token_id)
            out.text_offset.append(offset)
            out.tokens.append(token)
            out.token_logprobs.append(_clamp(entry.logprob))
            tops = {self.name(t.token_id): _clamp(t.logprob) for t in entry.top_logprobs}
            out.top_logprobs.append(tops or None)
            offset += len(token)
            self.advance(entry.token_id)
        return out, offset


def _clamp(value: Any) -> float:
    value = float(value)
    if value != value or value < -9999.0:  # NaN or below vLLM's floor
        return -9999.0
    return value
