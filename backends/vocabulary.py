"""Which token ids the simulated engine generates, chosen once at start-up from the model's tokenizer.

The engine must answer in the model's own vocabulary (a router detokenizes what it gets) and never
with special or added ids (``<s>``, ``<pad>``, ...), except ``eos`` when it ends a sequence. To keep
generated text readable and the multi-turn prefix property of a real chat (turn N+1's prompt begins
with turn N's prompt + answer), the engine draws from the model's *word* tokens: ids that decode on
their own to a space followed by letters (``" two"``) and that encode back to exactly themselves. With
a byte-level BPE tokenizer such tokens are whole pre-tokens, so an answer made of them re-encodes to
the same ids inside the next prompt.

A tokenizer without such tokens (an odd model) falls back to every non-special id that decodes to
non-empty text without U+FFFD, and then to every non-special id.
"""

from __future__ import annotations

import re

import tokenizers

_WORD = re.compile(r" [A-Za-z]+")


def generation_ids(tokenizer: tokenizers.Tokenizer) -> tuple[int, ...]:
    """The ids the engine may generate (sorted; never a special/added id)."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    added = set(tokenizer.get_added_tokens_decoder())
    candidates = [i for i in range(size) if i not in added]
    texts = tokenizer.decode_batch([[i] for i in candidates], skip_special_tokens=False)
    words = [(i, t) for i, t in zip(candidates, texts, strict=True) if _WORD.fullmatch(t)]
    if words:
        encoded = tokenizer.encode_batch([t for _, t in words], add_special_tokens=False)
        stable = tuple(i for (i, _), enc in zip(words, encoded, strict=True) if enc.ids == [i])
        if stable:
            return stable
    readable = tuple(i for i, t in zip(candidates, texts, strict=True) if t and "\ufffd" not in t)
    if readable:
        return readable
    if not candidates:
        raise ValueError("the tokenizer has no ids besides its special tokens; the engine cannot generate")
    return tuple(candidates)
