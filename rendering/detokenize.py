"""Incremental detokenization of generated token ids, as vLLM's fast detokenizer does it.

vLLM 0.32 (``FastIncrementalDetokenizer``) steps Hugging Face tokenizers' ``DecodeStream`` once
per output token, the stream prefilled with the prompt's ids (``DecodeStream(ids=prompt)``), and
its text is the concatenation of the steps. Prefilling with the prompt's last ids gives the same
steps as the whole prompt whenever the prompt's text ends with a complete character (the stream
only compares the text from its prefix on), so only those are given, and the whole prompt when
the text ends inside a character (there the stream's output depends on the whole prefix). ``DecodeStream`` holds back the bytes of a UTF-8 character that is
not complete yet, so no step ever ends inside a multi-byte character; byte sequences that can
never become valid UTF-8 come out as U+FFFD exactly as vLLM's do, and a character still
incomplete when generation ends is never sent (vLLM drops it too). Ids the tokenizer does not
know (the model's vocabulary can be larger than the tokenizer's) decode to nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

#: prompt ids given to the stream: a short tail first (cheap to check and to prefill), the longer
#: one when the short one decodes to nothing (skipped special tokens) or ends inside a character
_SHORT_TAIL = 8
_PRIME_TAIL = 32
_REPLACEMENT = "\ufffd"
#: what DecodeStream raises when a tokenizer's output stopped growing monotonically (vLLM then
#: starts a new stream at the current token, and so do we)
_INVALID_PREFIX = "Invalid prefix encountered"


def prime_ids(tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int], *,
              skip_special_tokens: bool = True) -> list[int]:
    """The prompt ids to prefill the decode stream with: the last ones, or all of them when the
    prompt's text ends inside a character (then the result differs with the prefix).

    The last 8 ids do when their text is not empty and ends with a whole character: that character's
    bytes all lie in them, so the prompt's text ends with it too (any tail whose text ends on a
    character boundary gives the whole prompt's steps); otherwise the last 32 are checked as below."""
    if len(prompt_ids) > _SHORT_TAIL:
        short = list(prompt_ids[-_SHORT_TAIL:])
        try:
            text = tokenizer.decode(short, skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError):
            text = ""
        if text and not text.endswith(_REPLACEMENT):
            return short
    tail = list(prompt_ids[-_PRIME_TAIL:])
    if len(tail) < len(prompt_ids):
        try:
            clean = not tokenizer.decode(tail, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT)
        except (TypeError, OverflowError):
            clean = True
        if not clean:
            return list(prompt_ids)
    return tail


def _stream(tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int] | None,
            skip_special_tokens: bool) -> DecodeStream:
    if prompt_ids:
        try:
            return DecodeStream(ids=prime_ids(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens),
                                skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError):  # an id no tokenizer holds: start unprimed
            pass
    return DecodeStream(skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """One output sequence's text, one token at a time (one instance per choice)."""

    __slots__ = ("_tokenizer", "_stream", "_skip", "_added", "_last_special")

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = _stream(tokenizer, prompt_ids, skip_special_tokens)
        # vLLM writes consecutive special tokens without a separator only when they are kept
        # and the request turned spaces_between_special_tokens off.
        self._added: dict[int, str] | None = None
        self._last_special = False
        if not skip_special_tokens and not spaces_between_special_tokens:
            added = {tid: tok.content for tid, tok in tokenizer.get_added_tokens_decoder().items()}
            self._added = added or None

    def _recover(self, token_id: int, exc: Exception) -> str | None:
        """``step`` failed: an impossible id decodes to nothing; a broken prefix restarts."""
        if isinstance(exc, (TypeError, OverflowError)):  # an id no tokenizer can hold (negative, > u32)
            return None
        if not str(exc).startswith(_INVALID_PREFIX):
            raise exc
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        return self._stream.step(self._tokenizer, token_id)

    def push_one(self, token_id: int) -> str:
        """The text ``token_id`` completes ("" while a character is still incomplete)."""
        try:
            text = self._stream.step(self._tokenizer, token_id)
        except Exception as exc:
            text = self._recover(token_id, exc)
        if self._added is not None:
            special = self._added.get(token_id)
            if special is not None and self._last_special:
                text = special
            self._last_special = special is not None
        return text or ""

    def push(self, token_ids: Iterable[int]) -> str:
        """The new text for ``token_ids``; never ends inside a multi-byte UTF-8 character."""
        step = self.push_one
        if self._added is None:
            stream_step = self._stream.step
            tokenizer = self._tokenizer
            parts: list[str] = []
            for token_id in token_ids:
                try:
                    text = stream_step(tokenizer, token_id)
                except Exception as exc:
                    text = self._recover(token_id, exc)
                    stream_step = self._stream.step
                if text:
                    parts.append(text)
            return "".join(parts) if len(parts) != 1 else parts[0]
        return "".join([step(token_id) for token_id in token_ids])


def detokenize(
    tokenizer: tokenizers.Tokenizer,
    token_ids: Iterable[int],
    *,
    prompt_ids: Sequence[int] | None = None,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> str:
    """The whole text of ``token_ids`` as vLLM's incremental detokenizer produces it."""
    return IncrementalDetokenizer(
        tokenizer,
        prompt_ids=prompt_ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    ).push(token_ids)
