"""``rendering.pieces``: the piece-cached byte-level encode gives the library's ids, always.

Random text for the shipped tokenizer and for small tokenizers of every byte-level family trained here
(GPT-2's ``ByteLevel`` regex, GPT-2's, Llama 3's and Qwen2's ``Split`` patterns, some under NFC):
``PieceEncoder(text) == tokenizer.encode(text, add_special_tokens=False).ids``. The text mixes ASCII
letters, digits, punctuation, apostrophes (the contractions), runs of spaces, tabs, newlines and CRs,
the added tokens and strings that look like them, and now and then a character outside ASCII (that
text goes to the library). The regex translated for ASCII is also checked piece by piece against the
library's own ``Split`` on ASCII text.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers

from rendering.incremental import PromptEncoder
from rendering.model import DEFAULT_MODEL_DIR
from rendering.pieces import (ASCII_PATTERNS, GPT2_PATTERN, LLAMA3_PATTERN, MAX_PIECE_CHARS, MAX_PIECE_IDS,
                             QWEN2_PATTERN, PieceEncoder)
from tests.rendering.test_incremental_property import FAMILIES, _trained

#: pieces of text the generators join: each stage of the pipeline has something to do with them
ATOMS = [
    "a", "Z", "word", "Hello", "don", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'", "''",
    "0", "7", "123", "45678", "3.14", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n ", "\t\n",
    ".", ",", "!?", "...", "()", "{}", "<", ">", "|", "<|user|>", "<|assistant|>", "<s>", "</s>", "<pad>",
    "<unk>", "</s><s>", "<s", "s>", "-", "_", "#", "@", "~", "`", "\\", "\"", "x_y", "CamelCase", "snake_case",
]
#: outside the ASCII the fast path takes
OTHERS = ["é", "ß", "\u00a0", "\u2028", "\x0b", "\x0c", "\x1c", "\x7f", "\x00", "你好", "😀", "\u0301"]


def _text(rnd: random.Random, size: int, *, others: bool) -> str:
    parts = []
    for _ in range(size):
        if others and rnd.random() < 0.03:
            parts.append(rnd.choice(OTHERS))
        else:
            parts.append(rnd.choice(ATOMS))
    return "".join(parts)


ascii_text = st.lists(st.sampled_from(ATOMS), max_size=40).map("".join)
any_text = st.lists(st.sampled_from(ATOMS + OTHERS), max_size=40).map("".join)


def _library(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


BYTE_LEVEL = ["llama3", "gpt2-split", "qwen2-nfc", "gpt2-nfc"]


@pytest.fixture(scope="module")
def tokenizers_by_name() -> dict[str, Tokenizer]:
    found = {"shipped": Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json")),
             "gpt2-byte-level": _trained(pre_tokenizers.ByteLevel(add_prefix_space=False))}
    for name in BYTE_LEVEL:
        found[name] = FAMILIES[name][0]()
    return found


@pytest.mark.parametrize("name", ["shipped", "gpt2-byte-level", *BYTE_LEVEL])
def test_the_prompt_encoder_takes_pieces_for_every_byte_level_family(
        name: str, tokenizers_by_name: dict[str, Tokenizer]) -> None:
    encoder = PromptEncoder(tokenizers_by_name[name])
    assert isinstance(encoder.ids, PieceEncoder), encoder.reason


@pytest.mark.parametrize("name", ["metaspace-first", "metaspace-nosplit", "nfkc-normalizer"])
def test_other_families_are_encoded_by_the_library(name: str) -> None:
    encoder = PromptEncoder(FAMILIES[name][0]())
    assert encoder.ids is encoder.library_ids


@pytest.mark.parametrize("name", ["shipped", "gpt2-byte-level", *BYTE_LEVEL])
def test_random_text_gets_the_library_ids(name: str, tokenizers_by_name: dict[str, Tokenizer]) -> None:
    tokenizer = tokenizers_by_name[name]
    library = _library(tokenizer)
    fallbacks = []

    def fallback(text: str) -> list[int]:
        fallbacks.append(text)
        return library(text)

    rule = PromptEncoder(tokenizer).rule
    assert rule is not None and rule.pattern is not None
    # a small cache, so that it is emptied and filled again along the way
    encoder = PieceEncoder(tokenizer, rule.pattern, rule.added, fallback, cuts=rule, max_entries=64)
    whole_sent: list[str] = []

    def whole_fallback(text: str) -> list[int]:
        whole_sent.append(text)
        return library(text)

    whole = PieceEncoder(tokenizer, rule.pattern, rule.added, whole_fallback, max_entries=64)  # no cuts

    @settings(max_examples=400, derandomize=True, deadline=None, database=None)
    @given(any_text)
    def check(text: str) -> None:
        expected = library(text)
        assert encoder(text) == expected, repr(text)
        assert whole(text) == expected, repr(text)

    check()
    rnd = random.Random(name)
    for size in (1, 5, 50, 400):
        for _ in range(40):
            text = _text(rnd, size, others=size >= 50)
            assert encoder(text) == library(text), repr(text)
            whole_sent.clear()
            assert whole(text) == library(text), repr(text)
            if re.search(r"[^\t\n\r\x20-\x7e]", text):  # without cuts: to the library whole
                assert whole_sent == [text]
            else:
                assert not whole_sent
    assert 0 < encoder.cached_pieces <= 64
    assert fallbacks and all(re.search(r"[^\t\n\r\x20-\x7e]", t) for t in fallbacks)


@pytest.mark.parametrize("name", ["shipped", "llama3"])
def test_text_with_a_few_other_characters_leaves_only_their_surroundings_to_the_library(
        name: str, tokenizers_by_name: dict[str, Tokenizer]) -> None:
    tokenizer = tokenizers_by_name[name]
    library = _library(tokenizer)
    sent: list[str] = []

    def fallback(text: str) -> list[int]:
        sent.append(text)
        return library(text)

    rule = PromptEncoder(tokenizer).rule
    assert rule is not None and rule.pattern is not None
    encoder = PieceEncoder(tokenizer, rule.pattern, rule.added, fallback, cuts=rule)
    prose = "The router keeps every session where its cache is, and it says why. " * 30
    text = prose + "Caf\u00e9 \u201cquoted\u201d text \u2014 then " + prose + "a smile \U0001F600.\n" + prose
    assert encoder(text) == library(text)
    assert sum(map(len, sent)) < 100, sent  # the words around the three runs, not the 6,000 characters
    sent.clear()
    at_start = "\u00e9" + prose
    assert encoder(at_start) == library(at_start) and sum(map(len, sent)) < 20
    sent.clear()
    no_cut = "x" * 500 + "\u00e9" + "y" * 500  # no clean cut near the run: the library from the start
    assert encoder(no_cut) == library(no_cut) and sent == [no_cut]


def test_long_pieces_are_tokenized_not_cached(tokenizers_by_name: dict[str, Tokenizer]) -> None:
    tokenizer = tokenizers_by_name["shipped"]
    encoder = PromptEncoder(tokenizer).ids
    assert isinstance(encoder, PieceEncoder)
    text = "a" * 5000 + " " * 300 + "!" * 200 + "\n"
    assert encoder(text) == _library(tokenizer)(text)
    assert encoder(text) == _library(tokenizer)(text)
    assert encoder.cached_pieces <= 1  # only the "\n"
    many_ids = " ~`@#$%^&*~`@#$%^&*"  # one short piece of more than MAX_PIECE_IDS ids
    assert len(_library(tokenizer)(many_ids)) > MAX_PIECE_IDS and len(many_ids) <= MAX_PIECE_CHARS
    assert encoder(many_ids) == _library(tokenizer)(many_ids)
    assert encoder.cached_pieces <= 1


@pytest.mark.parametrize("pattern", [GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN])
def test_the_ascii_pattern_cuts_where_the_library_does(pattern: str) -> None:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    ours = re.compile(ASCII_PATTERNS[pattern], re.ASCII)

    @settings(max_examples=600, derandomize=True, deadline=None, database=None)
    @given(ascii_text)
    def check(text: str) -> None:
        assert ours.findall(text) == [piece for piece, _ in split.pre_tokenize_str(text)], repr(text)

    check()


def test_ascii_patterns_are_the_unicode_ones_with_ascii_classes() -> None:
    assert ASCII_PATTERNS[GPT2_PATTERN] == (r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+"
                                            r"|\s+(?!\S)|\s+")
    assert ASCII_PATTERNS[LLAMA3_PATTERN] == (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}|"
                                              r" ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_nfc_leaves_ascii_alone_so_the_nfc_families_qualify() -> None:
    text = "".join(chr(c) for c in range(0x20, 0x7F)) + "\t\n\r"
    assert normalizers.NFC().normalize_str(text) == text
