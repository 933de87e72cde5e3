"""The built-in tokenizer: exact round trips, ids stable across processes, readable generated ids,
and the chat template's prefix property (what makes multi-turn prefix caching work)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.tokenizer import BOS_ID, BYTE_BASE, EOS_ID, ROLES, WORDS, Tokenizer

TOK = Tokenizer()


@given(st.text())
@settings(max_examples=300, deadline=None)
def test_any_text_round_trips(text: str) -> None:
    # lone surrogates are not Unicode text (they cannot be UTF-8 encoded): not our domain
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return
    ids = TOK.encode(text)
    assert all(0 <= i < TOK.vocab_size for i in ids)
    assert TOK.decode(ids) == text


@pytest.mark.parametrize("text", ["", " ", "the", " the", "Hello, world!\n", "na\u00efve caf\u00e9 \u65e5\u672c \U0001f600",
                                  "tab\tand\r\nnewline", "the the  the", "unknownword of"])
def test_round_trip_examples(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text


def test_words_use_word_ids_and_other_text_uses_bytes() -> None:
    assert TOK.encode("the of") == [TOK.bare_base + WORDS.index("the"), TOK.spaced_base + WORDS.index("of")]
    assert TOK.encode("\u00e9") == [BYTE_BASE + 0xC3, BYTE_BASE + 0xA9]
    assert TOK.encode("x", add_bos=True) == [BOS_ID, BYTE_BASE + ord("x")]


def test_every_generated_id_decodes_to_a_readable_word() -> None:
    assert TOK.gen_token_max - TOK.gen_token_min == len(WORDS)
    for i in range(TOK.gen_token_min, TOK.gen_token_max):
        piece = TOK.decode([i])
        assert piece.startswith(" ") and piece[1:].isalpha(), (i, piece)
        # a generated word re-encodes to itself, so an answer's text gives back its ids
        assert TOK.encode(piece) == [i]


def test_special_ids_decode_to_nothing_and_bad_ids_raise() -> None:
    assert TOK.decode([BOS_ID, TOK.spaced_base, EOS_ID]) == " " + WORDS[0]
    assert TOK.decode([BOS_ID], skip_special_tokens=False) == "<s>"
    with pytest.raises(ValueError, match="out of vocabulary"):
        TOK.decode([TOK.vocab_size])
    with pytest.raises(ValueError):
        TOK.decode([-1])
    assert TOK.out_of_vocab([1, 2, TOK.vocab_size + 5]) == TOK.vocab_size + 5
    assert TOK.out_of_vocab([1, 2]) is None


_SNIPPET = (
    "import json; from backends.tokenizer import Tokenizer; t = Tokenizer();"
    "print(json.dumps([t.vocab_size, t.gen_token_min, t.gen_token_max,"
    " t.encode('Stable ids: the quick brown fox \u00e9!', add_bos=True),"
    " t.apply_chat_template([('system', 'be brief'), ('user', 'hello there')])]))"
)


def test_ids_are_stable_across_processes() -> None:
    runs = [
        subprocess.run([sys.executable, "-c", _SNIPPET], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}, timeout=30).stdout
        for seed in ("1", "2")
    ]
    assert runs[0] == runs[1]
    here = [TOK.vocab_size, TOK.gen_token_min, TOK.gen_token_max,
            TOK.encode("Stable ids: the quick brown fox \u00e9!", add_bos=True),
            TOK.apply_chat_template([("system", "be brief"), ("user", "hello there")])]
    assert json.loads(runs[0]) == here
    # pinned: a change of the word list or the template changes every id after it
    assert here[:3] == [2256, 259, 1255]


def test_chat_template_shape() -> None:
    ids = TOK.apply_chat_template([("user", "hi")])
    nl = BYTE_BASE + 10
    assert ids == [BOS_ID, TOK.role_id("user"), nl, *TOK.encode("hi"), nl, TOK.role_id("assistant"), nl]
    assert TOK.decode(ids) == "<|user|>\nhi\n<|assistant|>\n"
    no_prompt = TOK.apply_chat_template([("user", "hi")], add_generation_prompt=False)
    assert no_prompt == ids[:-2]
    with pytest.raises(ValueError, match="unknown message role"):
        TOK.apply_chat_template([("robot", "hi")])
    assert set(ROLES) >= {"system", "user", "assistant"}


@given(
    turns=st.lists(st.tuples(st.text(max_size=40), st.lists(st.integers(259, 1254), max_size=12)),
                   min_size=1, max_size=5),
    system=st.text(max_size=30),
)
@settings(max_examples=200, deadline=None)
def test_next_turn_starts_with_previous_prompt_plus_answer(turns: list[tuple[str, list[int]]], system: str) -> None:
    """Turn N+1's ids == turn N's prompt ids + turn N's answer ids + the new message."""
    messages: list[tuple[str, str]] = [("system", system)]
    for user_text, answer_ids in turns:
        try:
            user_text.encode("utf-8")
        except UnicodeEncodeError:
            return
        messages.append(("user", user_text))
        prompt = TOK.apply_chat_template(messages)
        answer = TOK.decode(answer_ids)
        messages.append(("assistant", answer))
        next_prompt = TOK.apply_chat_template(messages + [("user", "next")])
        assert next_prompt[: len(prompt) + len(answer_ids)] == prompt + answer_ids
