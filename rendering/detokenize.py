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

import json
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
    return _prime(tokenizer, prompt_ids, skip_special_tokens)[0]


def _prime(tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int],
           skip_special_tokens: bool) -> tuple[list[int], str | None]:
    """``prime_ids`` and, when it was decoded on the way, the text of those ids (else None)."""
    if len(prompt_ids) > _SHORT_TAIL:
        short = list(prompt_ids[-_SHORT_TAIL:])
        try:
            text = tokenizer.decode(short, skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError):
            text = ""
        if text and not text.endswith(_REPLACEMENT):
            return short, text
    tail = list(prompt_ids[-_PRIME_TAIL:])
    if len(tail) < len(prompt_ids):
        try:
            clean = not tokenizer.decode(tail, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT)
        except (TypeError, OverflowError):
            clean = True
        if not clean:
            return list(prompt_ids), None
    return tail, None


def _stream(tokenizer: tokenizers.Tokenizer, prime: list[int], skip_special_tokens: bool) -> DecodeStream:
    if prime:
        try:
            return DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError):  # an id no tokenizer can hold: start unprimed
            pass
    return DecodeStream(skip_special_tokens=skip_special_tokens)


def byte_level_decoder(tokenizer: tokenizers.Tokenizer) -> bool:
    """The tokenizer's decoder is ``ByteLevel`` alone: a decode is the UTF-8 text of the ids' bytes put
    end to end (``IncrementalDetokenizer.push_final`` may then decode a whole answer in one call)."""
    decoder = tokenizer.decoder
    if decoder is None:
        return False
    try:
        spec = json.loads(decoder.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return False
    return isinstance(spec, dict) and spec.get("type") == "ByteLevel"


def clean_step_texts(tokenizer: tokenizers.Tokenizer) -> tuple[str | None, ...] | None:
    """For a tokenizer whose decoder is ``ByteLevel`` alone (else None): per token id, what a decode
    stream that skips special tokens emits for that id when it steps from a *clean* state (its last
    step emitted text), or None where the stream must step itself.

    Such a decoder's text of some ids is the UTF-8 text of their bytes put end to end (invalid
    sequences as U+FFFD). After a step that emitted text, the stream's text so far ends with a whole
    character that is not U+FFFD, and its window holds the ids since its previous emission. Then the
    next id's bytes decode on their own, so when they are whole UTF-8 (no U+FFFD in the id's own
    text) and not empty, the stream emits exactly that text, and is clean again, with a window of
    that one id. The other ids (a part of a character, a skipped special token, U+FFFD itself) are
    None."""
    if not byte_level_decoder(tokenizer):
        return None
    size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    texts = tokenizer.decode_batch([[token_id] for token_id in range(size)], skip_special_tokens=True)
    return tuple(text if text and _REPLACEMENT not in text else None for text in texts)


class IncrementalDetokenizer:
    """One output sequence's text, one token at a time (one instance per choice).

    With ``clean_texts`` (``clean_step_texts``; special tokens skipped), a step from a clean state
    whose id has a clean text is answered from that table without the decode stream. The stream is
    then behind: before its next step it is opened again on the last such id, which puts it in the
    state it would have reached (its window is that one id, its prefix that id's text)."""

    __slots__ = ("_tokenizer", "_stream", "_skip", "_added", "_last_special", "_prime", "_prime_text",
                 "_one_shot", "_clean_texts", "_clean", "_behind")

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        one_shot: bool = False,
        clean_texts: Sequence[str | None] | None = None,
    ) -> None:
        """``one_shot``: the tokenizer's decoder is byte-level (``byte_level_decoder``), so that
        ``push_final`` may decode a whole answer in one call; ``clean_texts``: that tokenizer's
        ``clean_step_texts`` (used only when special tokens are skipped)."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._prime: list[int]
        self._prime_text: str | None
        if prompt_ids:
            self._prime, self._prime_text = _prime(tokenizer, prompt_ids, skip_special_tokens)
        else:
            self._prime, self._prime_text = [], ""
        #: made at the first step (a whole answer decoded in one call needs none)
        self._stream: DecodeStream | None = None
        # vLLM writes consecutive special tokens without a separator only when they are kept
        # and the request turned spaces_between_special_tokens off.
        self._added: dict[int, str] | None = None
        self._last_special = False
        if not skip_special_tokens and not spaces_between_special_tokens:
            added = {tid: tok.content for tid, tok in tokenizer.get_added_tokens_decoder().items()}
            self._added = added or None
        self._one_shot = one_shot and self._added is None
        self._clean_texts = clean_texts if skip_special_tokens else None
        #: the last step emitted text: the next may come from ``_clean_texts``
        self._clean = False
        #: the id of the last step answered from the table while the stream was not stepped (else -1)
        self._behind = -1

    def _open(self) -> DecodeStream:
        """The stream to step: made at the first step, made again after steps answered from the table."""
        if self._behind >= 0:
            stream = self._stream = DecodeStream(ids=[self._behind], skip_special_tokens=self._skip)
            self._behind = -1
            return stream
        stream = self._stream = _stream(self._tokenizer, self._prime, self._skip)
        return stream

    def _recover(self, token_id: int, exc: Exception) -> str | None:
        """``step`` failed: an impossible id decodes to nothing; a broken prefix restarts."""
        if isinstance(exc, (TypeError, OverflowError)):  # an id no tokenizer can hold (negative, > u32)
            return None
        if not str(exc).startswith(_INVALID_PREFIX):
            raise exc
        stream = self._stream = DecodeStream(skip_special_tokens=self._skip)
        return stream.step(self._tokenizer, token_id)

    def push_one(self, token_id: int) -> str:
        """The text ``token_id`` completes ("" while a character is still incomplete)."""
        clean = self._clean_texts
        if clean is not None and self._clean and 0 <= token_id < len(clean):
            text = clean[token_id]
            if text is not None:
                self._behind = token_id
                return text
        stream = self._stream
        if stream is None or self._behind >= 0:
            stream = self._open()
        try:
            text = stream.step(self._tokenizer, token_id)
        except Exception as exc:
            text = self._recover(token_id, exc)
        if clean is not None:
            self._clean = bool(text)
        if self._added is not None:
            special = self._added.get(token_id)
            if special is not None and self._last_special:
                text = special
            self._last_special = special is not None
        return text or ""

    def push_steps(self, steps: Iterable[list[int]]) -> list[str]:
        """``[push(ids) for ids in steps]``: the text of each step in turn (one engine step's ids each)."""
        one, push = self.push_one, self.push
        return [one(ids[0]) if len(ids) == 1 else push(ids) for ids in steps]

    def push(self, token_ids: Iterable[int]) -> str:
        """The new text for ``token_ids``; never ends inside a multi-byte UTF-8 character."""
        step = self.push_one
        if self._added is None and self._clean_texts is None:
            stream = self._stream
            if stream is None:
                stream = self._open()
            stream_step = stream.step
            tokenizer = self._tokenizer
            parts: list[str] = []
            for token_id in token_ids:
                try:
                    text = stream_step(tokenizer, token_id)
                except Exception as exc:
                    text = self._recover(token_id, exc)
                    stream_step = self._stream.step  # type: ignore[union-attr]  # _recover made one
                if text:
                    parts.append(text)
            return "".join(parts) if len(parts) != 1 else parts[0]
        return "".join([step(token_id) for token_id in token_ids])

    def push_final(self, token_ids: list[int]) -> str:
        """``push(token_ids)`` when they are the sequence's last ids (a whole answer): the same text.

        With a byte-level decoder and nothing pushed before, one ``decode`` of the prime + ``token_ids``
        gives it, minus the prime's text: such a decode is the UTF-8 text of the ids' bytes end to end,
        and when it holds no U+FFFD every byte sequence in it is whole and valid, so the stream's steps
        (each the text of the bytes up to a character boundary) add up to the same text and hold
        nothing back at the end. Otherwise (a U+FFFD anywhere, an id no tokenizer can hold, a text that
        does not extend the prime's) it steps the stream as ``push`` does."""
        if self._one_shot and self._stream is None and token_ids:
            tokenizer = self._tokenizer
            prime = self._prime
            skip = self._skip
            try:
                prefix = self._prime_text
                if prefix is None:
                    prefix = self._prime_text = tokenizer.decode(prime, skip_special_tokens=skip)
                full = tokenizer.decode(prime + token_ids if prime else token_ids, skip_special_tokens=skip)
            except (TypeError, OverflowError):
                full = None
            if full is not None and _REPLACEMENT not in full and full.startswith(prefix):
                return full[len(prefix):]
        return self.push(token_ids)


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
