"""Incremental prompt encoding: a session's next prompt tokenized from where the last one can be reused.

``encode_prompt(tokenizer, text, previous)`` returns exactly ``tokenizer.encode(text,
add_special_tokens=False).ids`` and, when ``text`` shares a long prefix with ``previous.text``, tokenizes
only the text after a *clean cut* inside that prefix and reuses the previous ids before it.

Why a cut can be clean. A Hugging Face tokenizer encodes in fixed stages: added tokens are split out
of the text first (leftmost-longest literal matches), the normalizer rewrites each remaining segment,
the pre-tokenizer splits each segment into pieces, and the model (BPE, ...) tokenizes every piece on
its own: nothing merges across pieces. So ``ids(x) == ids(x[:p]) + ids(x[p:])`` whenever ``p`` is a
piece boundary of ``x`` that nothing in those stages can see across. This module proves that from the
tokenizer's declared structure, for the families it can reason about (``_analyze``), and encodes in
full whenever it cannot:

- no normalizer but NFC (another may rewrite across the cut; NFC cannot across an ASCII character, and
  every pre-tokenizer cut below is before one; added-token cuts are segment boundaries, normalized
  apart anyway), no truncation or padding, a per-piece model
  (BPE without dropout, WordPiece, WordLevel, Unigram), a post-processor that adds no ids when
  ``add_special_tokens=False``; added tokens matched on the raw text (not ``normalized``, and not
  ``encode_special_tokens``) without ``lstrip``/``rstrip``/``single_word`` (their match would depend
  on the text beside them);
- no added token can straddle ``p``: the two characters around ``p`` never occur side by side inside
  an added token;
- and either ``x[p:]`` starts with an added token (a segment boundary: the match is selected because
  nothing before ``p`` can reach over it), or the pre-tokenizer always splits between ``x[p-1]`` and
  ``x[p]`` and decides the pieces before ``p`` without looking past ``p``:

  * ``ByteLevel`` with GPT-2's regex (``use_regex``, or ``Split`` with that pattern + ``ByteLevel``),
    no prefix space: ``x[p-1]`` is not whitespace and ``x[p]`` is ASCII whitespace. No alternative of
    ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`` holds a
    non-space followed by a space (the optional space only leads) and the whitespace alternatives hold
    no non-space, so the match that covers ``x[p-1]`` ends at ``p`` whatever follows the space (the
    pieces before ``p`` are those of ``x[:p]`` alone; no look-ahead reaches past ``p``: a whitespace
    match cannot end at ``p``), and the regex has no look-behind: the scan from ``p`` is that of ``x[p:]``.
  * ``Split`` with Llama 3's / Qwen2's pattern + ``ByteLevel``: as above but ``?[^\\s\\p{L}\\p{N}]+[\\r\\n]*``
    takes newlines after punctuation, so ``x[p]`` must be a space or tab, or ``x[p-1]`` an ASCII
    letter or digit.
  * ``Metaspace`` with ``split``: ``x[p]`` is a space (or the replacement character), so the tail
    starts with the replacement and no prefix is added to it; with no ``split`` only added-token cuts.

  "Not whitespace" is taken conservatively (Python's ``isspace`` plus the characters some Unicode
  versions count as spaces) so that the tokenizer's regex engine agrees with it.

Every known clean cut of the text is remembered as a *mark* ``(position, number of tokens before it)``
in ``PromptState``. A text (or new tail) of up to ``whole_chars`` characters is encoded in one call
and marked only where it started and at its end: its inner cuts are an *open span*, found on demand
by the next turn, so a request that never has a next turn pays for no mark. A longer one is encoded
chunk by chunk between clean cuts (no dearer than one ``encode`` of a text that long), marked every
~``chunk_chars`` characters, at the last clean cut before the end, and at the end. The next turn
finds where its text departs from the previous one. Inside the open span it takes the last position
``p`` at or before that point that is a clean cut of both texts; the tokens before ``p`` are the old
ids minus those of the old text from ``p`` to the span's end (``ids(x) == ids(x[:p]) + ids(x[p:])``
for a clean cut, and the end is one), which one encode of that short old tail gives and checks (the
old ids must end with it). Elsewhere it takes the last mark at or before the departure that is also
a clean cut of the new text. Either way it checks on a window of a few characters around the cut that
the tokenizer itself does not merge across it (else: a plain full encode), and tokenizes from there. Marks before the cut stay valid for the new text: a mark ``q < p`` only reads
characters before ``p`` (an added token starting at ``q`` cannot reach over the clean cut ``p``).
The answer's token ids are never reused: a template re-renders the assistant's
turn as text, whose tokens need not be the ids the engine generated.

Encodes that only need ids use the tokenizer's offset-free path (``encode_batch_fast``, the same
pipeline without the character offsets: the same ids, ~25% less CPU) when the library has it, and for
the byte-level families on ASCII text ``rendering.pieces`` (the same ids again, with the pre-tokenizer's
regex run by Python's ``re`` and each piece's ids cached: ~3.5x less CPU). The window check of a reused
cut always asks the library itself.
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tokenizers

from rendering.pieces import GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, PieceEncoder
from rendering.specials import Ends, special_ends

__all__ = ["GPT2_PATTERN", "LLAMA3_PATTERN", "QWEN2_PATTERN", "CutRule", "PromptEncoder", "PromptState",
           "encode_prompt", "ids_encoder"]

#: whitespace every regex engine agrees on
_ASCII_SPACE = " \t\n\r\x0b\x0c"
#: characters that are not ``isspace()`` but some engine or Unicode version may count as \s
_MAYBE_SPACE = "\x1c\x1d\x1e\x1f\x85\xa0\u1680\u180e\u200b\u200c\u200d\u2028\u2029\u202f\u205f\u2060\u3000\ufeff"
#: a character surely matched by \S: the class text used in the candidate regexes
_SURE_NONSPACE_CLASS = r"[^\s" + re.escape(_MAYBE_SPACE) + "]"
#: characters each side of a reused cut that are re-encoded to check it (the proof needs none: the
#: check only runs the real tokenizer over the two pieces that meet at the cut)
_WINDOW = 16
_ASCII_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")

#: the models whose tokens depend only on the piece they are given
_PER_PIECE_MODELS = {"BPE", "WordPiece", "WordLevel", "Unigram"}
#: post-processors that add no ids when ``add_special_tokens=False`` (ByteLevel's only trims offsets)
_QUIET_POST_PROCESSORS = {"TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel"}


def ids_encoder(tokenizer: tokenizers.Tokenizer) -> Callable[[str], list[int]]:
    """``text -> tokenizer.encode(text, add_special_tokens=False).ids``, through the offset-free batch path
    when the library has it (the same ids: only the offsets, unused here, are left out)."""
    fast = getattr(tokenizer, "encode_batch_fast", None)
    if fast is None:
        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids
        return encode

    def encode_fast(text: str) -> list[int]:
        return fast([text], add_special_tokens=False)[0].ids
    return encode_fast


def _sure_nonspace(char: str) -> bool:
    return not char.isspace() and char not in _MAYBE_SPACE


class CutRule:
    """Where the pre-tokenizer of one tokenizer family provably splits, and where no added token can
    reach across: ``is_cut(text, p)`` says whether ``ids(text) == ids(text[:p]) + ids(text[p:])``
    holds by the rules in the module docstring."""

    def __init__(self, family: str, *, split_between: Callable[[str, str], bool] | None,
                 candidates: str, added: Sequence[str], pattern: str | None = None) -> None:
        #: a name for the family ("gpt2", "llama3", "metaspace", "metaspace-nosplit")
        self.family = family
        #: the pre-tokenizer's regex for the byte-level families (``rendering.pieces`` knows each)
        self.pattern = pattern
        #: the added tokens as the tokenizer matches them
        self.added = tuple(added)
        self._split_between = split_between
        #: added tokens, longest first (``str.startswith`` takes a tuple)
        self._added = tuple(sorted(set(added), key=len, reverse=True))
        #: every two adjacent characters inside an added token: a cut there could split its match
        self._inner_pairs = frozenset(tok[i:i + 2] for tok in self._added for i in range(len(tok) - 1))
        firsts = "".join(sorted({tok[0] for tok in self._added}))
        alternatives = [candidates] if candidates else []
        if firsts:
            alternatives.append(f"(?=[{re.escape(firsts)}])")
        #: finds candidate positions (a superset of the cuts); ``is_cut`` decides
        self._candidates = re.compile("|".join(alternatives)) if alternatives else None

    def is_cut(self, text: str, p: int) -> bool:
        """True when ``p`` is a clean cut of ``text`` (``p == len(text)`` always is; 0 is not used)."""
        n = len(text)
        if p >= n:
            return p == n
        if p <= 0:
            return False
        if text[p - 1:p + 1] in self._inner_pairs:
            return False
        if self._added and text.startswith(self._added, p):
            return True
        return self._split_between is not None and self._split_between(text[p - 1], text[p])

    def next_cut(self, text: str, start: int) -> int:
        """The first clean cut at or after ``start`` (``len(text)`` when there is none before the end)."""
        pattern = self._candidates
        n = len(text)
        pos = max(start, 1)
        while pattern is not None and pos < n:
            found = pattern.search(text, pos)
            if found is None:
                break
            p = found.start()
            if self.is_cut(text, p):
                return p
            pos = p + 1
        return n

    def prev_cut(self, text: str, end: int, floor: int) -> int:
        """The last clean cut ``p`` with ``floor < p < end``; ``floor`` when there is none."""
        for p in range(end - 1, floor, -1):
            if self.is_cut(text, p):
                return p
        return floor


def _gpt2_split(before: str, after: str) -> bool:
    return after in _ASCII_SPACE and _sure_nonspace(before)


def _llama3_split(before: str, after: str) -> bool:
    if after in " \t":
        return _sure_nonspace(before)
    return after in _ASCII_SPACE and before in _ASCII_ALNUM


def _metaspace_split(replacement: str) -> Callable[[str, str], bool]:
    def split(before: str, after: str) -> bool:
        return after == " " or after == replacement
    return split


def _pre_tokenizer_rule(spec: Any, added: Sequence[str], *, nfc: bool = False) -> tuple[CutRule | None, str]:
    """The cut rule for a pre-tokenizer's JSON, or None and why not."""
    if not isinstance(spec, dict):
        return None, "no pre-tokenizer: the model sees whole segments"
    kind = spec.get("type")
    if kind == "Sequence":
        steps = spec.get("pretokenizers") or []
        if (len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel"
                and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
                and not steps[1].get("add_prefix_space") and not steps[1].get("use_regex")):
            pattern = (steps[0].get("pattern") or {}).get("Regex")
            if pattern == GPT2_PATTERN:
                return CutRule("gpt2", split_between=_gpt2_split,
                               candidates=rf"(?<={_SURE_NONSPACE_CLASS})(?=[ \t\n\r\x0b\x0c])",
                               added=added, pattern=pattern), ""
            if pattern in (LLAMA3_PATTERN, QWEN2_PATTERN):
                return CutRule("llama3", split_between=_llama3_split,
                               candidates=rf"(?<={_SURE_NONSPACE_CLASS})(?=[ \t])|(?<=[A-Za-z0-9])(?=[\n\r\x0b\x0c])",
                               added=added, pattern=pattern), ""
            return None, "a Split pattern this module cannot reason about"
        return None, "a pre-tokenizer sequence this module cannot reason about"
    if kind == "ByteLevel":
        if spec.get("add_prefix_space"):
            return None, "ByteLevel adds a prefix space to every segment"
        if not spec.get("use_regex", True):
            return None, "ByteLevel without its regex does not split"
        return CutRule("gpt2", split_between=_gpt2_split,
                       candidates=rf"(?<={_SURE_NONSPACE_CLASS})(?=[ \t\n\r\x0b\x0c])", added=added,
                       pattern=GPT2_PATTERN), ""
    if kind == "Metaspace":
        replacement = spec.get("replacement", "\u2581")
        if not isinstance(replacement, str) or len(replacement) != 1:
            return None, "a Metaspace replacement that is not one character"
        scheme = spec.get("prepend_scheme")
        if scheme is None:  # older files: add_prefix_space
            scheme = "always" if spec.get("add_prefix_space", True) else "never"
        if scheme not in ("always", "first", "never"):
            return None, f"Metaspace prepend_scheme {scheme!r}"
        if spec.get("split", True):
            # under NFC only a cut before an ASCII space is a normalization boundary
            return CutRule("metaspace", split_between=_metaspace_split(" " if nfc else replacement),
                           candidates=f"(?=[ {re.escape(replacement)}])", added=added), ""
        return CutRule("metaspace-nosplit", split_between=None, candidates="", added=added), ""
    return None, f"pre-tokenizer {kind!r} is not one this module can reason about"


def _analyze(tokenizer: tokenizers.Tokenizer) -> tuple[CutRule | None, str]:
    """Read the tokenizer's declared structure: the cut rule, or None and why every encode is full."""
    nfc = False
    if tokenizer.normalizer is not None:
        # NFC is the one normalizer cuts survive: every ASCII character is a normalization boundary (a
        # starter that composes with nothing before it), so NFC(x) == NFC(x[:p]) + NFC(x[p:]) when x[p] is
        # ASCII, and NFC never turns a character that is not a space into one (the rules read the raw
        # text: x[p-1] stays a non-space, an ASCII letter or digit stays itself)
        if json.loads(tokenizer.normalizer.__getstate__()) != {"type": "NFC"}:
            return None, "the tokenizer has a normalizer other than NFC"
        nfc = True
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return None, "the tokenizer truncates or pads"
    if getattr(tokenizer, "encode_special_tokens", False):
        return None, "the tokenizer encodes special tokens as text (encode_special_tokens)"
    model = tokenizer.model
    if type(model).__name__ not in _PER_PIECE_MODELS:
        return None, f"model {type(model).__name__} is not known to tokenize piece by piece"
    if getattr(model, "dropout", None) not in (None, 0.0):
        return None, "BPE dropout makes encodes random"
    post = tokenizer.post_processor
    if post is not None:
        spec = json.loads(post.__getstate__())
        steps = spec.get("processors", []) if spec.get("type") == "Sequence" else [spec]
        for step in steps:
            if step.get("type") not in _QUIET_POST_PROCESSORS:
                return None, f"post-processor {step.get('type')!r} may change what an encode returns"
    added: list[str] = []
    for token in tokenizer.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word:
            return None, f"added token {token.content!r} matches depending on the text beside it"
        if token.normalized:
            # matched after normalization, in a second pass: its segment boundaries are not the first
            # pass's; without a normalizer the text is the same, but keep the proof simple
            return None, f"added token {token.content!r} is matched on normalized text"
        if token.content:
            added.append(token.content)
    pre = tokenizer.pre_tokenizer
    spec = json.loads(pre.__getstate__()) if pre is not None else None
    return _pre_tokenizer_rule(spec, added, nfc=nfc)


@dataclass(slots=True, eq=False)
class PromptState:
    """One session's last rendered prompt: its text, its ids (``encode(text).ids``, never to be mutated)
    and the clean cuts the next turn may start from. Read-only by convention (not ``frozen``: one is made
    per render, and a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``)."""

    text: str
    token_ids: list[int]
    #: known clean cuts of ``text``, ascending (the last one is ``len(text)``), and the number of
    #: tokens before each; empty when the tokenizer is not one whose cuts can be proven
    mark_pos: array = field(default_factory=lambda: array("q"), repr=False)
    mark_count: array = field(default_factory=lambda: array("q"), repr=False)
    #: how many leading ids were reused from the previous state (0: encoded in full)
    reused_tokens: int = 0
    #: where the open span starts (a mark, or 0): the text after it was encoded in one call and its
    #: inner clean cuts are found on demand; -1: none (every cut chunking made is marked)
    open_from: int = -1
    #: the encoder that made it (its tokenizer and rule); shared, not counted in ``nbytes``
    encoder: PromptEncoder | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """An estimate of the memory this state holds (text, id list with its int objects, marks)."""
        return (sys.getsizeof(self.text) + sys.getsizeof(self.token_ids) + 32 * len(self.token_ids)
                + sys.getsizeof(self.mark_pos) + sys.getsizeof(self.mark_count) + 120)


class PromptEncoder:
    """Encodes prompts for one tokenizer, incrementally when ``_analyze`` proves it can. Built once per
    tokenizer (``Renderer`` holds one); ``encode_prompt`` builds one when it is not given it.

    ``whole_chars``: a text (or new tail) up to this long is encoded in one call, its inner cuts left
    open (default ``64 * chunk_chars``, 32,768 characters: one call costs no more than chunks up to
    there, measured ~15% less at 5-22k characters; beyond, about the same, and chunking leaves marks
    every ``chunk_chars`` for a next turn that departs far back); longer ones are encoded ``chunk_chars``
    at a time."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, chunk_chars: int = 512,
                 max_back_marks: int = 8, whole_chars: int | None = None) -> None:
        self.tokenizer = tokenizer
        rule, reason = _analyze(tokenizer)
        #: None when every encode is a plain full one; ``reason`` says why
        self.rule = rule
        self.reason = reason
        self.chunk_chars = chunk_chars
        self.whole_chars = 64 * chunk_chars if whole_chars is None else whole_chars
        self.max_back_marks = max_back_marks
        #: ``text -> ids`` (no special tokens added) by the library alone, built once
        self.library_ids = ids_encoder(tokenizer)
        #: the same ids, piece by piece with a cache where the rule names a byte-level pattern
        #: (``rendering.pieces``), else the library's
        self.ids: Callable[[str], list[int]] = self.library_ids
        #: what ``add_special_tokens=True`` puts around the ids, when ``ids`` is the piece encoder and
        #: the post-processor is one ``rendering.specials`` reads; else None (the library adds them)
        self.ends: Ends | None = None
        if rule is not None and rule.pattern is not None:
            self.ids = PieceEncoder(tokenizer, rule.pattern, rule.added, self.library_ids, cuts=rule)
            self.ends = special_ends(tokenizer)

    def encode_ids(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=...).ids``, a stateless encode (completion
        prompts, ``/tokenize``, chat with special tokens): by the piece encoder where it applies."""
        if not add_special_tokens:
            return self.ids(text)
        ends = self.ends
        if ends is None:
            return self.tokenizer.encode(text, add_special_tokens=True).ids
        head, tail = ends
        ids = self.ids(text)
        return [*head, *ids, *tail] if head or tail else ids

    def encode(self, text: str, previous: PromptState | None = None) -> PromptState:
        """``PromptState`` of ``text``: its ids are exactly ``tokenizer.encode(text, add_special_tokens=False).ids``."""
        rule = self.rule
        if rule is None:
            return self._plain(text)
        if previous is None or previous.encoder is not self or not previous.mark_pos:
            return self._from_cut(text, 0, [], array("q"), array("q"))
        old = previous.text
        if text == old:
            return previous
        common = _common_prefix(old, text)
        positions, counts = previous.mark_pos, previous.mark_count
        if 0 <= previous.open_from < common:
            found = self._open_cut(previous, text, common)
            if found is False:
                return self._plain(text)
            if found is not None:
                p, k = found
                if not self._window_agrees(text, p):
                    return self._plain(text)
                index = bisect_right(positions, previous.open_from)  # the marks up to the span's start
                return self._from_cut(text, p, previous.token_ids[:k], positions[:index], counts[:index],
                                      reused=k)
        index = bisect_right(positions, common)
        for _ in range(self.max_back_marks):
            if index <= 0:
                break
            index -= 1
            p = positions[index]
            if p > 0 and rule.is_cut(text, p):
                if not self._window_agrees(text, p):
                    return self._plain(text)
                k = counts[index]
                return self._from_cut(text, p, previous.token_ids[:k],
                                      positions[:index + 1], counts[:index + 1], reused=k)
        return self._from_cut(text, 0, [], array("q"), array("q"))

    def _open_cut(self, previous: PromptState, text: str, common: int) -> tuple[int, int] | bool | None:
        """The last clean cut ``p`` of both ``previous.text`` and ``text`` in the previous state's open
        span, at or before ``common`` (where the texts depart), with the number of old tokens before it:
        the old ids minus those of ``old[p:]`` (one encode of that tail, which the old ids must end
        with). None: no such cut worth it (the tail to encode would be longer than the reused head);
        False: the tokenizer disagrees with the rule (encode in full)."""
        rule = self.rule
        assert rule is not None
        old = previous.text
        ids = previous.token_ids
        floor = previous.open_from
        n = len(old)
        if common == n and rule.is_cut(text, n):
            return n, len(ids)  # the new text extends the old one at a clean cut: nothing to encode
        pattern = rule._candidates
        if pattern is None:
            return None
        low = max(floor + 1, common - 2 * self.chunk_chars)
        candidates = [m.start() for m in pattern.finditer(text, low, common + 1)]
        for p in reversed(candidates):
            if p <= floor or n - p > max(p - floor, self.chunk_chars):
                return None  # re-encoding a long old tail would cost more than it saves
            if rule.is_cut(old, p) and rule.is_cut(text, p):
                tail = self.ids(old[p:])
                k = len(ids) - len(tail)
                if k <= 0 or ids[k:] != tail:
                    return False
                return p, k
        return None

    def _window_agrees(self, text: str, p: int) -> bool:
        """The tokenizer itself splits the few dozen characters around ``p`` at ``p``: a cheap check of the
        proof on the real tokenizer (a disagreement means the rule is wrong: encode in full)."""
        start, end = max(0, p - _WINDOW), min(len(text), p + _WINDOW)
        if end == p:
            return True
        encode = self.library_ids
        whole = encode(text[start:end])
        left = encode(text[start:p])
        return whole[:len(left)] == left and whole[len(left):] == encode(text[p:end])

    def _plain(self, text: str) -> PromptState:
        return PromptState(text, self.ids(text), array("q"), array("q"), encoder=self)

    def _from_cut(self, text: str, start: int, ids: list[int], mark_pos: array, mark_count: array,
                  *, reused: int = 0) -> PromptState:
        """Encode ``text[start:]`` (``start`` a clean cut, ``ids`` the ids of ``text[:start]``): in one call
        when it is short (marked at ``start`` and the end, its inner cuts left open), else chunk by chunk
        between clean cuts, marking each cut and the last one before the end."""
        rule = self.rule
        assert rule is not None
        encode = self.ids
        n = len(text)
        if n - start <= self.whole_chars:
            if start > 0 and (not mark_pos or mark_pos[-1] != start):
                mark_pos.append(start)
                mark_count.append(len(ids))
            tail = encode(text[start:]) if start else encode(text)
            if ids:
                ids += tail
            else:  # a first render: the encode's own list (no copy)
                ids = tail
            if n > start:
                mark_pos.append(n)
                mark_count.append(len(ids))
            return PromptState(text, ids, mark_pos, mark_count, reused_tokens=reused, encoder=self,
                               open_from=start)
        step = self.chunk_chars
        a = start
        while a < n:
            b = rule.next_cut(text, a + step) if a + step < n else n
            if b >= n:
                # the last chunk: also mark its last clean cut, where the next turn most likely departs
                floor = max(a, n - step)
                c = rule.prev_cut(text, n, floor)
                if c > floor:
                    ids += encode(text[a:c])
                    mark_pos.append(c)
                    mark_count.append(len(ids))
                    a = c
                ids += encode(text[a:])
                break
            ids += encode(text[a:b])
            mark_pos.append(b)
            mark_count.append(len(ids))
            a = b
        if not mark_pos or mark_pos[-1] != n:
            mark_pos.append(n)
            mark_count.append(len(ids))
        return PromptState(text, ids, mark_pos, mark_count, reused_tokens=reused, encoder=self)


def encode_prompt(tokenizer: tokenizers.Tokenizer, text: str, previous: PromptState | None) -> PromptState:
    """``PromptState`` of ``text`` (ids exactly ``tokenizer.encode(text, add_special_tokens=False).ids``),
    reusing ``previous`` (the same session's last state) where that is provably the same."""
    encoder = previous.encoder if previous is not None else None
    if encoder is None or encoder.tokenizer is not tokenizer:
        encoder = PromptEncoder(tokenizer)
        previous = None
    return encoder.encode(text, previous)


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (block compares, then a short scan)."""
    if b.startswith(a):
        return len(a)
    if a.startswith(b):
        return len(b)
    limit = min(len(a), len(b))
    lo = 0
    block = 4096
    while block >= 1:
        while lo + block <= limit and a[lo:lo + block] == b[lo:lo + block]:
            lo += block
        block //= 8
    while lo < limit and a[lo] == b[lo]:
        lo += 1
    return lo
