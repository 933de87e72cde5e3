"""The backends' tokenizer is the model's (the shipped tiny-llama): round trips, the ids the engine
generates (readable whole words, never special ids), the chat template through rendering/, and the
template's prefix property with generated answers (what makes multi-turn prefix caching work)."""

from __future__ import annotations

import json

import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.tokenizer import Tokenizer
from backends.vocabulary import generation_ids
from rendering.model import DEFAULT_MODEL_DIR, load_model
from rendering.render import Renderer

MODEL = load_model(DEFAULT_MODEL_DIR)
TOK = Tokenizer(MODEL)
RENDERER = Renderer(MODEL)


def encode(text: str) -> list[int]:
    return MODEL.tokenizer.encode(text, add_special_tokens=False).ids


def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
    return MODEL.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_any_text_round_trips(text: str) -> None:
    try:  # lone surrogates are not Unicode text (they cannot be UTF-8 encoded): not our domain
        text.encode("utf-8")
    except UnicodeEncodeError:
        return
    ids = encode(text)
    assert all(0 <= i < MODEL.vocab_size for i in ids)
    assert decode(ids) == text


def test_encode_is_the_model_tokenizers() -> None:
    raw = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    text = "hello world, naïve 日本語"
    assert encode(text) == raw.encode(text, add_special_tokens=False).ids
    assert MODEL.vocab_size == raw.get_vocab_size(with_added_tokens=True) == 393
    assert TOK.eos_token_id == 2


def test_generated_ids_are_readable_words_and_never_special() -> None:
    ids = TOK.generation_ids
    special = set(MODEL.tokenizer.get_added_tokens_decoder())
    assert len(ids) >= 20 and not special & set(ids) and TOK.eos_token_id not in ids
    for i in ids:
        text = decode([i])
        assert text.startswith(" ") and text[1:].isalpha(), (i, text)
        assert encode(text) == [i]
    # a sequence of them decodes to the concatenation of the single decodes (per-step decoding is exact)
    seq = [ids[k % len(ids)] for k in range(0, 200, 7)]
    assert decode(seq) == "".join(decode([i]) for i in seq)


def test_generation_ids_fall_back_when_a_tokenizer_has_no_word_tokens() -> None:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "x": 1, "y": 2}, unk_token="<unk>"))
    tok.add_special_tokens(["<unk>"])
    assert generation_ids(tok) == (1, 2)


def test_special_ids_decode_to_nothing() -> None:
    assert decode([1, 2]) == "" and decode([1, 2], skip_special_tokens=False) == "<s></s>"


def chat_ids(messages: list[tuple[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """The prompt ids the backends' chat route runs: ``rendering.render`` (the model's template)."""
    body = {"messages": [{"role": r, "content": c} for r, c in messages],
            "add_generation_prompt": add_generation_prompt}
    return RENDERER.render_chat(json.dumps(body).encode()).request.token_ids


def test_chat_template_is_the_models() -> None:
    ids = chat_ids([("user", "hi")])
    assert decode(ids, skip_special_tokens=False) == "<s><|user|>\nhi\n<|assistant|>\n"
    assert ids[0] == 1  # the template writes bos itself; encoding adds nothing
    no_prompt = chat_ids([("user", "hi")], add_generation_prompt=False)
    assert decode(no_prompt, skip_special_tokens=False) == "<s><|user|>\nhi\n"


@given(
    turns=st.lists(st.tuples(st.text(max_size=40), st.lists(st.integers(0, 10**6), max_size=12)),
                   min_size=1, max_size=5),
    system=st.text(max_size=30),
)
@settings(max_examples=150, deadline=None)
def test_next_turn_starts_with_previous_prompt_plus_answer(turns: list[tuple[str, list[int]]], system: str) -> None:
    """Turn N+1's ids == turn N's prompt ids + turn N's answer ids + the rest, when the answer is made of
    generated ids (what the engine produces), whatever the users wrote."""
    pool = TOK.generation_ids
    messages: list[tuple[str, str]] = [("system", system)]
    for user_text, picks in turns:
        try:
            user_text.encode("utf-8")
        except UnicodeEncodeError:
            return
        answer_ids = [pool[p % len(pool)] for p in picks]
        messages.append(("user", user_text))
        prompt = chat_ids(messages)
        answer = decode(answer_ids)
        messages.append(("assistant", answer))
        next_prompt = chat_ids(messages + [("user", "next")])
        assert next_prompt[: len(prompt) + len(answer_ids)] == prompt + answer_ids
