"""rendering.detokenize's clean-step table: a detokenizer that answers steps from ``clean_step_texts`` emits,
step by step, exactly what the plain decode stream (vLLM 0.32's) emits, whatever the ids: partial and
invalid UTF-8 byte tokens, special tokens, ids the tokenizer does not know, impossible ids, a primed
prompt, one or several ids per step, and ``push_one`` / ``push`` / ``push_steps`` mixed. Checked on the
shipped tokenizer and on a byte-level tokenizer trained here with added tokens of its own."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream

from rendering.detokenize import IncrementalDetokenizer, clean_step_texts
from rendering.model import DEFAULT_MODEL_DIR, load_model
from tests.rendering.byte_level import CHAR_BYTES
from tests.rendering.vllm_stream import vllm_032_steps

SHIPPED = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))


def _trained() -> Tokenizer:
    """A small byte-level BPE with special tokens and two added tokens that are not special."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=["<unk>", "<s>", "</s>"])
    corpus = ["Hello world, the quick fox. 你好世界 😀 👍🏽 é e\u0301 ß", "  code()\n\treturn x\n"] * 10
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens([AddedToken("<|tool|>", special=False), AddedToken("\n\n", special=False)])
    return tokenizer


TRAINED = _trained()


def _byte_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids of single-byte tokens that are not whole characters alone (UTF-8 lead and continuation
    bytes, and bytes that are never valid)."""
    out = []
    for token, token_id in tokenizer.get_vocab().items():
        if len(token) == 1 and CHAR_BYTES.get(token, 0) >= 0x80:
            out.append(token_id)
    return sorted(out)


def _ids(tokenizer: Tokenizer) -> st.SearchStrategy[int]:
    """Any id: known tokens, parts of characters and invalid bytes, special and added tokens, ids beyond
    the tokenizer's vocabulary, impossible ids."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    specials = sorted(tokenizer.get_added_tokens_decoder())
    return st.one_of(
        st.integers(min_value=0, max_value=size - 1),
        st.sampled_from(_byte_ids(tokenizer)),
        st.sampled_from(specials),
        st.integers(min_value=size, max_value=size + 50),
        st.integers(min_value=-3, max_value=-1),
    )


def _answer(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    """An answer's ids: runs of text (what a model mostly writes, multi-byte characters too) and odd ids
    between them."""
    def encoded(chars: st.SearchStrategy[str]) -> st.SearchStrategy[list[int]]:
        return st.text(chars, max_size=30).map(lambda t: tokenizer.encode(t, add_special_tokens=False).ids)

    words = encoded(st.sampled_from("the quick brown fox, hello world. é ß 你好 😀\n"))
    text = encoded(st.characters(codec="utf-8", exclude_categories=["Cs"]))
    odd = st.lists(_ids(tokenizer), min_size=1, max_size=3)
    return st.lists(st.one_of(words, words, text, odd), max_size=6).map(lambda parts: [i for part in parts for i in part])


def _reference(tokenizer: Tokenizer, prompt: list[int], steps: list[list[int]]) -> list[str]:
    return vllm_032_steps(tokenizer, prompt, steps)


def _steps(draw: Callable[..., object], tokenizer: Tokenizer) -> list[list[int]]:
    ids = draw(_answer(tokenizer))
    sizes = draw(st.lists(st.sampled_from([1, 1, 1, 1, 2, 3]), min_size=len(ids), max_size=len(ids)))
    steps, at = [], 0
    for size in sizes:
        if at >= len(ids):
            break
        steps.append(ids[at:at + size])
        at += size
    return steps  # type: ignore[return-value]


class _Counted:
    """A DecodeStream that counts its steps (all instances together)."""

    steps = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._stream = DecodeStream(*args, **kwargs)  # type: ignore[arg-type]

    def step(self, tokenizer: Tokenizer, token_id: int) -> str | None:
        type(self).steps += 1
        return self._stream.step(tokenizer, token_id)


@pytest.mark.parametrize("tokenizer", [SHIPPED, TRAINED], ids=["shipped", "trained"])
def test_steps_from_the_table_are_the_streams_steps(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    import rendering.detokenize as module

    table = clean_step_texts(tokenizer)
    assert table is not None
    monkeypatch.setattr(module, "DecodeStream", _Counted)
    _Counted.steps = 0
    pushed = 0

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        nonlocal pushed
        steps = _steps(data.draw, tokenizer)
        prompt = data.draw(st.lists(_ids(tokenizer).filter(lambda i: i >= 0), max_size=20))
        # how each step is pushed: 0 push_one/push, 1 push_steps of a run, 2 push
        how = data.draw(st.lists(st.integers(min_value=0, max_value=2), min_size=len(steps), max_size=len(steps)))
        d = IncrementalDetokenizer(tokenizer, prompt_ids=prompt, clean_texts=table)
        got: list[str] = []
        k = 0
        while k < len(steps):
            if how[k] == 1:  # a run of steps in one call
                run = steps[k:k + 4]
                got.extend(d.push_steps(run))
                k += len(run)
                continue
            ids = steps[k]
            got.append(d.push_one(ids[0]) if how[k] == 0 and len(ids) == 1 else d.push(ids))
            k += 1
        assert got == _reference(tokenizer, prompt, steps)
        pushed += sum(map(len, steps))

    check()
    assert _Counted.steps < pushed * 0.85  # the table did answer many steps (~30% of them)


def test_the_table_has_only_whole_characters() -> None:
    table = clean_step_texts(SHIPPED)
    assert table is not None and len(table) == SHIPPED.get_vocab_size(with_added_tokens=True)
    assert all(table[special] is None for special in (0, 1, 2, 3))  # skipped special tokens emit nothing
    for token_id in _byte_ids(SHIPPED):  # a lone byte >= 0x80 is never a whole character
        assert table[token_id] is None
    hello = SHIPPED.encode(" hello", add_special_tokens=False).ids
    assert [table[i] for i in hello] == [SHIPPED.decode([i]) for i in hello] and None not in [table[i] for i in hello]
    assert load_model(DEFAULT_MODEL_DIR).clean_step_texts == table
    trained = clean_step_texts(TRAINED)
    assert trained is not None and trained[TRAINED.token_to_id("<|tool|>")] == "<|tool|>"


def test_no_table_for_other_decoders() -> None:
    metaspace = Tokenizer.from_str(SHIPPED.to_str())
    metaspace.decoder = decoders.Metaspace()
    assert clean_step_texts(metaspace) is None
    metaspace.decoder = None
    assert clean_step_texts(metaspace) is None


def test_the_table_is_not_used_when_special_tokens_are_kept() -> None:
    table = [None] * 4 + ["WRONG"] * (SHIPPED.get_vocab_size() - 4)
    ids = SHIPPED.encode(" the quick fox", add_special_tokens=False).ids
    kept = IncrementalDetokenizer(SHIPPED, skip_special_tokens=False, clean_texts=table)
    assert kept.push(ids) == " the quick fox"
    skipped = IncrementalDetokenizer(SHIPPED, clean_texts=table)  # a wrong table shows: it is used
    assert skipped.push(ids) != " the quick fox"


def test_a_lone_byte_after_table_steps_is_held_as_the_stream_holds_it() -> None:
    euro = "€".encode()
    byte_of = {CHAR_BYTES[token]: token_id for token, token_id in SHIPPED.get_vocab().items()
               if len(token) == 1 and token in CHAR_BYTES}
    ids = SHIPPED.encode(" a b c", add_special_tokens=False).ids + [byte_of[b] for b in euro]
    ids += SHIPPED.encode(" d", add_special_tokens=False).ids
    d = IncrementalDetokenizer(SHIPPED, clean_texts=clean_step_texts(SHIPPED))
    texts = d.push_steps([[i] for i in ids])
    assert texts == _reference(SHIPPED, [], [[i] for i in ids])
    assert "".join(texts) == " a b c€ d" and texts[-5:-2] == ["", "", "€"]
