"""Byte-level BPE encoding piece by piece, with the pieces' ids cached across requests.

A Hugging Face tokenizer of the byte-level BPE families (GPT-2's ``ByteLevel`` with its regex, Llama 3's
and Qwen2's ``Split`` + ``ByteLevel``) encodes in fixed stages: the added tokens are split out of the
text (leftmost-longest literal matches), the pre-tokenizer's regex cuts each remaining segment into
pieces, each piece's bytes are mapped to ``ByteLevel``'s alphabet, and BPE tokenizes every piece on
its own. Measured on this project's 1 KB chat prompts, the regex stage is nearly all of an encode's
cost (``pre_tokenize_str`` alone ~460 of ~480 µs), because the library runs GPT-2's Unicode pattern
through Oniguruma.

``PieceEncoder`` does the same stages for text made only of printable ASCII, tab, newline and
carriage return (nearly all prompts of code and English), with Python's ``re`` and the pattern
written for ASCII (``ASCII_PATTERNS``: ``\\p{L}`` is ``[A-Za-z]``, ``\\p{N}`` is ``[0-9]``, and ``\\s``
meets only tab, newline, CR and space there, which both engines count as whitespace; both engines
try alternatives in order and backtrack alike). Each segment between added tokens is matched on its
own (``findall(text, start, end)``: the segment's end is the string's end for the ``(?!\\S)``
look-ahead, as in the library, and the patterns look behind nothing). A piece's ids come from a
bounded cache, else from the tokenizer's own model (``tokenizer.model.tokenize`` of the piece mapped
through ``ByteLevel``'s own table, read from the library at start-up). So the ids are the library's,
``tokenizer.encode(text, add_special_tokens=False).ids``. With special tokens, ``PromptEncoder.encode_ids``
puts around them what the post-processor adds (``rendering.specials``).

Text with other characters (curly quotes, accents, emoji) is cut at *clean cuts*, positions ``p``
with ``ids(x) == ids(x[:p]) + ids(x[p:])`` that ``rendering.incremental.CutRule`` proves from the
tokenizer's structure (the incremental render encodes chunk by chunk between the same cuts): from
the last clean cut before a run of such characters to the first one after it, the library encodes;
the ASCII stretches between take the pieces. Without a rule the whole text goes to the library.
``tests/rendering/test_pieces.py`` checks the equality on random text for every family here.

Which tokenizers qualify is decided by ``rendering.incremental._analyze`` (no normalizer but NFC,
which leaves ASCII as it is; a per-piece model; added tokens matched on the raw text without
``lstrip``/``rstrip``/``single_word``; no truncation or padding): its rule names the pattern.

Memory: at most ``max_entries`` pieces are cached, each of at most ``MAX_PIECE_CHARS`` characters and
``MAX_PIECE_IDS`` ids (the cache is emptied when full). With the defaults that is ~17 MB at the very
most (~500 bytes an entry: the key, the id tuple, its ints and the table slot); prose fills a few
thousand entries.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Protocol

import tokenizers
from tokenizers import pre_tokenizers

#: GPT-2's pre-tokenizer pattern (ByteLevel's ``use_regex``, also written out in ``Split``)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
#: Llama 3's and Qwen2's patterns (``Split`` before a regex-less ``ByteLevel``)
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _for_ascii(pattern: str) -> str:
    """``pattern`` for text of ASCII letters, digits, punctuation and ASCII whitespace: the Unicode
    classes as their ASCII members (inside a class, ``\\p{L}`` is ``A-Za-z``; alone, ``[A-Za-z]``)."""
    out = []
    depth = 0
    i = 0
    while i < len(pattern):
        if pattern.startswith("\\p{L}", i) or pattern.startswith("\\p{N}", i):
            members = "A-Za-z" if pattern[i + 3] == "L" else "0-9"
            out.append(members if depth else f"[{members}]")
            i += 5
            continue
        char = pattern[i]
        if char == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        out.append(char)
        i += 1
    return "".join(out)


#: the pre-tokenizer patterns this module knows, written for ASCII text (``re.ASCII``)
ASCII_PATTERNS = {pattern: _for_ascii(pattern) for pattern in (GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN)}
#: a character outside printable ASCII, tab, newline and CR: the library encodes around it
_OTHER = re.compile(r"[^\t\n\r\x20-\x7e]")
#: the first character of that set after a run of others
_ASCII = re.compile(r"[\t\n\r\x20-\x7e]")
#: how far back from a run of other characters a clean cut is looked for (else the library encodes
#: from the previous cut on)
CUT_LOOKBACK = 64
#: the characters of such text, which ``ByteLevel`` maps one to one
_ASCII_TEXT = "\t\n\r" + "".join(chr(c) for c in range(0x20, 0x7F))
#: longer pieces (long words, whitespace or punctuation runs) are tokenized every time, not cached
MAX_PIECE_CHARS = 32
#: nor are pieces of more ids than this (rare words, random strings)
MAX_PIECE_IDS = 8
#: cached pieces at most (then the cache is emptied and fills again)
MAX_ENTRIES = 1 << 15


class Cuts(Protocol):
    """Clean cuts of a text (``rendering.incremental.CutRule``)."""

    def next_cut(self, text: str, start: int) -> int:
        """The first clean cut at or after ``start``; ``len(text)`` when there is none."""
        ...

    def prev_cut(self, text: str, end: int, floor: int) -> int:
        """The last clean cut ``p`` with ``floor < p < end``; ``floor`` when there is none."""
        ...


class PieceEncoder:
    """``text -> ids``, exactly ``tokenizer.encode(text, add_special_tokens=False).ids`` (module
    docstring); ``fallback`` encodes the text this class leaves to the library, ``cuts`` says where
    text with other characters may be cut (None: such text goes to ``fallback`` whole)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, pattern: str, added: Sequence[str],
                 fallback: Callable[[str], list[int]], *, cuts: Cuts | None = None,
                 max_entries: int = MAX_ENTRIES) -> None:
        self._split = re.compile(ASCII_PATTERNS[pattern], re.ASCII).findall
        self._other = _OTHER.search
        self._fallback = fallback
        self._cuts = cuts
        self._model = tokenizer.model
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._alphabet = str.maketrans({c: byte_level.pre_tokenize_str(c)[0][0] for c in _ASCII_TEXT})
        #: the added tokens to split out (longest first: at one position the longest matches)
        ascii_added = sorted((t for t in set(added) if not _OTHER.search(t)), key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, ascii_added))) if ascii_added else None
        self._added_ids: dict[str, int] = {}
        for content in ascii_added:
            token_id = tokenizer.token_to_id(content)
            if token_id is None:
                raise ValueError(f"added token {content!r} has no id")
            self._added_ids[content] = token_id
        self._cache: dict[str, tuple[int, ...]] = {}
        self._max_entries = max_entries

    def __call__(self, text: str) -> list[int]:
        other = self._other(text)
        if other is not None:
            if self._cuts is None:
                return self._fallback(text)
            return self._mixed(text, other.start())
        return self._ascii(text)

    def _mixed(self, text: str, other: int) -> list[int]:
        """The ids of ``text``, whose first character outside the ASCII set is at ``other``: the ASCII
        stretches between clean cuts by pieces, from the last cut before each run of other characters
        to the first cut after it by the library."""
        cuts = self._cuts
        assert cuts is not None
        out: list[int] = []
        n = len(text)
        pos = 0
        while True:
            floor = max(pos, other - CUT_LOOKBACK)
            cut = cuts.prev_cut(text, other + 1, floor)
            # ``pos`` is a clean cut (or 0); with no cut close before the run the library starts there
            start = cut if cut > floor else pos
            if start > pos:
                out += self._ascii(text[pos:start])
            back = _ASCII.search(text, other)
            end = cuts.next_cut(text, back.start()) if back is not None else n
            out += self._fallback(text[start:end])
            if end >= n:
                return out
            pos = end
            found = self._other(text, pos)
            if found is None:
                out += self._ascii(text[pos:])
                return out
            other = found.start()

    def _ascii(self, text: str) -> list[int]:
        """The ids of ``text``, every character of which is in the ASCII set."""
        out: list[int] = []
        added = self._added
        if added is None:
            self._pieces(text, 0, len(text), out)
            return out
        pos = 0
        for found in added.finditer(text):
            start = found.start()
            if start > pos:
                self._pieces(text, pos, start, out)
            out.append(self._added_ids[found.group()])
            pos = found.end()
        if pos < len(text):
            self._pieces(text, pos, len(text), out)
        return out

    def _pieces(self, text: str, start: int, end: int, out: list[int]) -> None:
        """Append the ids of the segment ``text[start:end]`` (no added token inside) to ``out``."""
        get = self._cache.get
        for piece in self._split(text, start, end):
            ids = get(piece)
            if ids is None:
                ids = self._tokenize(piece)
            out += ids

    def _tokenize(self, piece: str) -> tuple[int, ...]:
        ids = tuple(token.id for token in self._model.tokenize(piece.translate(self._alphabet)))
        if len(piece) <= MAX_PIECE_CHARS and len(ids) <= MAX_PIECE_IDS:
            cache = self._cache
            if len(cache) >= self._max_entries:
                cache.clear()
            cache[piece] = ids
        return ids

    @property
    def cached_pieces(self) -> int:
        return len(self._cache)
