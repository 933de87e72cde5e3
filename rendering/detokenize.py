"""Incremental detokenization of generated token ids, as vLLM's fast detokenizer does it.

vLLM (``FastIncrementalDetokenizer``) steps Hugging Face tokenizers' ``DecodeStream`` once per
output token, after priming it with a short suffix of the prompt, and its text is the
concatenation of the steps. ``DecodeStream`` holds back the bytes of a UTF-8 character that is
not complete yet, so no step ever ends inside a multi-byte character; byte sequences that can
never become valid UTF-8 come out as U+FFFD exactly as vLLM's do, and a character still
incomplete when generation ends is never sent (vLLM drops it too). Ids the tokenizer does not
know (the model's vocabulary can be larger than the tokenizer's) decode to nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

#: vLLM primes with the shortest prompt suffix of at least this many ids that decodes cleanly,
_PRIME_MIN = 4
#: looking at suffixes shorter than this; with none clean it primes with the whole prompt.
_PRIME_MAX = 24
_REPLACEMENT = "\ufffd"
#: what DecodeStream raises when a tokenizer's output stopped growing monotonically (vLLM then
#: starts a new stream at the current token, and so do we)
_INVALID_PREFIX = "Invalid prefix encountered"


def prime_ids(tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int]) -> Sequence[int]:
    """The prompt suffix vLLM primes its decode stream with (the whole prompt when short)."""
    n = len(prompt_ids)
    if n > _PRIME_MIN:
        for size in range(_PRIME_MIN, min(n + 1, _PRIME_MAX)):
            suffix = prompt_ids[n - size :]
            if _REPLACEMENT not in tokenizer.decode(list(suffix)):
                return suffix
    return prompt_ids


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
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        if prompt_ids:
            step = self._stream.step
            for token_id in prime_ids(tokenizer, prompt_ids):
                try:
                    step(tokenizer, token_id)
                except Exception:  # priming only positions the stream; a bad prompt id is skipped
                    pass
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
