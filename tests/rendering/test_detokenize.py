"""rendering.detokenize: vLLM's incremental detokenization on tokenizers' DecodeStream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from rendering.detokenize import IncrementalDetokenizer, detokenize, prime_ids
from tests.rendering.byte_level import CHAR_BYTES
from tests.rendering.vllm_stream import vllm_032_steps

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = Tokenizer.from_file(str(ROOT / "models" / "tiny-llama" / "tokenizer.json"))
GOLDEN = [json.loads(line) for line in (Path(__file__).parent / "data" / "derender_chat.jsonl").open()]
VOCAB = TOKENIZER.get_vocab_size(with_added_tokens=True)
BOS, EOS, UNK, PAD = 1, 2, 0, 3


def ids_of(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False).ids


def byte_token(b: int) -> int:
    """The id of the byte-level token for one raw byte (the ByteLevel alphabet)."""
    # ByteLevel maps bytes to printable code points; encoding the character the byte stands for
    # would merge, so look the single-byte token up by decoding every id once.
    for token_id in range(VOCAB):
        if TOKENIZER.id_to_token(token_id) and _token_bytes(token_id) == bytes([b]):
            return token_id
    raise LookupError(b)


def _token_bytes(token_id: int) -> bytes | None:
    token = TOKENIZER.id_to_token(token_id)
    if token is None or token.startswith("<"):
        return None
    try:
        return bytes(CHAR_BYTES[ch] for ch in token)
    except KeyError:
        return None


@pytest.mark.parametrize("case", range(len(GOLDEN)))
def test_golden_text_unprimed(case: int) -> None:
    """All 30 recorded derenders, invalid bytes and out-of-vocabulary ids included."""
    golden = GOLDEN[case]
    ids = golden["request"]["generate_response"]["choices"][0]["token_ids"]
    assert detokenize(TOKENIZER, ids) == golden["response"]["choices"][0]["message"]["content"]


@pytest.mark.parametrize("case", range(len(GOLDEN)))
def test_golden_text_is_the_same_in_any_split(case: int) -> None:
    ids = GOLDEN[case]["request"]["generate_response"]["choices"][0]["token_ids"]
    whole = detokenize(TOKENIZER, ids)
    one_by_one = IncrementalDetokenizer(TOKENIZER)
    assert "".join(one_by_one.push_one(i) for i in ids) == whole
    pairs = IncrementalDetokenizer(TOKENIZER)
    assert "".join(pairs.push(ids[k : k + 2]) for k in range(0, len(ids), 2)) == whole


def test_multibyte_character_is_held_until_complete() -> None:
    euro = "€".encode()  # three bytes
    ids = [byte_token(b) for b in euro]
    d = IncrementalDetokenizer(TOKENIZER)
    assert d.push_one(ids[0]) == ""
    assert d.push_one(ids[1]) == ""
    assert d.push_one(ids[2]) == "€"


def test_character_incomplete_at_the_end_is_never_sent() -> None:
    ids = ids_of("ab") + [byte_token("€".encode()[0])]
    assert detokenize(TOKENIZER, ids) == "ab"


def test_invalid_bytes_become_replacement_characters() -> None:
    # a lone continuation byte can never start a character
    ids = ids_of("a") + [byte_token(0x80)] + ids_of("b")
    text = detokenize(TOKENIZER, ids)
    assert text.startswith("a") and text.endswith("b") and "\ufffd" in text
    one_by_one = IncrementalDetokenizer(TOKENIZER)
    assert "".join([one_by_one.push_one(i) for i in ids]) == text


def test_special_tokens_skipped_or_kept() -> None:
    ids = [BOS, *ids_of("hi"), EOS]
    assert detokenize(TOKENIZER, ids) == "hi"
    assert detokenize(TOKENIZER, ids, skip_special_tokens=False) == "<s>hi</s>"


def test_spaces_between_special_tokens_off_writes_them_raw() -> None:
    ids = [EOS, EOS, PAD]
    assert detokenize(TOKENIZER, ids, skip_special_tokens=False, spaces_between_special_tokens=False) == "</s></s><pad>"


def test_out_of_vocabulary_and_impossible_ids_decode_to_nothing() -> None:
    ids = ids_of("a") + [VOCAB, VOCAB + 300, -1, 2**40] + ids_of("b")
    assert detokenize(TOKENIZER, ids) == "ab"


def test_priming_with_the_prompt_keeps_the_first_token_as_vllm_does() -> None:
    prompt = ids_of("hello the")
    out = ids_of(" quick brown")
    primed = detokenize(TOKENIZER, out, prompt_ids=prompt)
    # the text of prompt + output, minus the prompt's text
    assert primed == TOKENIZER.decode(prompt + out)[len(TOKENIZER.decode(prompt)) :]


def _vllm_032(ids: list[int], prompt: list[int], skip: bool = True) -> str:
    """vLLM 0.32's detokenizer, plainly: the stream prefilled with the whole prompt."""
    return "".join(vllm_032_steps(TOKENIZER, prompt, [ids], skip))


def test_prime_ids_are_the_tail_unless_the_prompt_ends_inside_a_character() -> None:
    prompt = ids_of("the quick brown fox jumps over the lazy dog " * 10)
    assert len(prompt) > 32
    assert prime_ids(TOKENIZER, prompt) == prompt[-8:]  # their text ends with a whole character
    specials = prompt + [2] * 8  # the last 8 are skipped special tokens: their text says nothing
    assert prime_ids(TOKENIZER, specials) == specials[-32:]
    assert prime_ids(TOKENIZER, prompt[:3]) == prompt[:3]
    euro = [byte_token(b) for b in "€".encode()]
    split = prompt + euro[:2]  # the text ends with two bytes of a three-byte character
    assert prime_ids(TOKENIZER, split) == split


@settings(max_examples=400, deadline=None)
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=VOCAB + 10), max_size=80),
    ids=st.lists(st.integers(min_value=0, max_value=VOCAB + 10), min_size=1, max_size=20),
    skip=st.booleans(),
)
def test_primed_text_is_vllm_032s_for_any_prompt(prompt: list[int], ids: list[int], skip: bool) -> None:
    got = IncrementalDetokenizer(TOKENIZER, prompt_ids=prompt, skip_special_tokens=skip).push(ids)
    assert got == _vllm_032(ids, prompt, skip)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=VOCAB + 20), max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=6),
    skip=st.booleans(),
)
def test_any_split_gives_the_same_text(ids: list[int], cuts: list[int], skip: bool) -> None:
    whole = detokenize(TOKENIZER, ids, skip_special_tokens=skip)
    d = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=skip)
    bounds = sorted({0, len(ids), *(c for c in cuts if c <= len(ids))})
    parts = [d.push(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert "".join(parts) == whole
    for part in parts:  # never half a character: every delta is valid UTF-8 on its own
        part.encode("utf-8")


class _BrokenOnce:
    """A DecodeStream stand-in whose first stream fails as tokenizers does on a broken prefix."""

    made = 0

    def __init__(self, skip_special_tokens: bool = True) -> None:
        type(self).made += 1
        self.first = type(self).made == 1

    def step(self, tokenizer: Tokenizer, token_id: int) -> str | None:
        if self.first and token_id == 99:
            raise Exception("Invalid prefix encountered while decoding")
        if self.first and token_id == 98:
            raise Exception("some other tokenizer failure")
        return f"<{token_id}>"


def test_a_broken_prefix_restarts_the_stream_at_that_token(monkeypatch: pytest.MonkeyPatch) -> None:
    import rendering.detokenize as module

    _BrokenOnce.made = 0
    monkeypatch.setattr(module, "DecodeStream", _BrokenOnce)
    d = module.IncrementalDetokenizer(TOKENIZER)
    assert d.push([1, 99, 2]) == "<1><99><2>"
    assert _BrokenOnce.made == 2
    _BrokenOnce.made = 0
    d = module.IncrementalDetokenizer(TOKENIZER)
    assert d.push_one(99) == "<99>"
    _BrokenOnce.made = 0
    d = module.IncrementalDetokenizer(TOKENIZER)
    with pytest.raises(Exception, match="other"):
        d.push([98])


def test_the_shipped_tokenizer_has_a_byte_level_decoder() -> None:
    from rendering.detokenize import byte_level_decoder
    from rendering.model import load_model

    assert byte_level_decoder(TOKENIZER)
    assert load_model(ROOT / "models" / "tiny-llama").byte_level_decoder
    metaspace = Tokenizer.from_str(TOKENIZER.to_str())
    from tokenizers import decoders

    metaspace.decoder = decoders.Metaspace()
    assert not byte_level_decoder(metaspace)  # not proven for other decoders: answers are stepped
    metaspace.decoder = None
    assert not byte_level_decoder(metaspace)


@settings(max_examples=500, deadline=None)
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=VOCAB + 10), max_size=80),
    ids=st.lists(st.integers(min_value=0, max_value=VOCAB + 10), max_size=24),
    skip=st.booleans(),
    spaces=st.booleans(),
)
def test_a_whole_answer_in_one_decode_is_the_streams_text(prompt: list[int], ids: list[int], skip: bool,
                                                          spaces: bool) -> None:
    """push_final (one decode when it can) == vLLM 0.32's stream stepped id by id, whatever the ids."""
    d = IncrementalDetokenizer(TOKENIZER, prompt_ids=prompt, skip_special_tokens=skip,
                               spaces_between_special_tokens=spaces, one_shot=True)
    stepped = IncrementalDetokenizer(TOKENIZER, prompt_ids=prompt, skip_special_tokens=skip,
                                     spaces_between_special_tokens=spaces).push(ids)
    assert d.push_final(ids) == stepped
    if spaces or skip:
        assert stepped == _vllm_032(ids, prompt, skip)


@pytest.mark.parametrize("case", range(len(GOLDEN)))
def test_golden_text_in_one_decode(case: int) -> None:
    ids = GOLDEN[case]["request"]["generate_response"]["choices"][0]["token_ids"]
    d = IncrementalDetokenizer(TOKENIZER, one_shot=True)
    assert d.push_final(ids) == GOLDEN[case]["response"]["choices"][0]["message"]["content"]


def test_one_decode_is_used_only_where_it_is_proven(monkeypatch: pytest.MonkeyPatch) -> None:
    """Valid text: one decode, no stream; a U+FFFD, an impossible id or an earlier push: the stream."""
    import rendering.detokenize as module

    made: list[int] = []

    def Counting(*args: object, **kwargs: object) -> DecodeStream:  # noqa: N802 (stands in for the class)
        made.append(1)
        return DecodeStream(*args, **kwargs)

    monkeypatch.setattr(module, "DecodeStream", Counting)
    prompt = ids_of("hello the")
    assert IncrementalDetokenizer(TOKENIZER, prompt_ids=prompt, one_shot=True).push_final(ids_of(" quick €")) == " quick €"
    assert made == []
    euro = [byte_token(b) for b in "€".encode()]
    broken = ids_of(" a") + euro[:2] + ids_of(" b")  # an invalid sequence in the middle: U+FFFD
    assert (IncrementalDetokenizer(TOKENIZER, prompt_ids=prompt, one_shot=True).push_final(broken)
            == _vllm_032(broken, prompt))
    assert made == [1]
    assert IncrementalDetokenizer(TOKENIZER, one_shot=True).push_final(ids_of("a") + [-1]) == "a"
    assert made == [1, 1]
    d = IncrementalDetokenizer(TOKENIZER, prompt_ids=prompt, one_shot=True)
    assert d.push(ids_of(" x")) + d.push_final(ids_of(" y")) == " x y"
    assert made == [1, 1, 1]
    assert IncrementalDetokenizer(TOKENIZER, prompt_ids=prompt).push_final(ids_of(" z")) == " z"  # not one_shot
    assert made == [1, 1, 1, 1]
