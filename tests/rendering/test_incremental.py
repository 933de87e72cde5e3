"""Unit tests of rendering.incremental: the reuse it makes and every path back to a full encode."""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

from rendering import incremental
from rendering.incremental import GPT2_PATTERN, QWEN2_PATTERN, PromptEncoder, PromptState, encode_prompt
from rendering.model import DEFAULT_MODEL_DIR
from rendering.render import Renderer

TURN1 = "<s><|user|>\nHello there, how are you?\n<|assistant|>\n"
TURN2 = TURN1 + "Fine, thanks! And you?\n<|user|>\nGood.\n<|assistant|>\n"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _variant(tokenizer: Tokenizer, **changes: object) -> Tokenizer:
    """The shipped tokenizer with parts of its JSON replaced."""
    spec = json.loads(tokenizer.to_str())
    spec.update(changes)
    return Tokenizer.from_str(json.dumps(spec))


def test_shipped_tokenizer_is_byte_level_gpt2(tokenizer: Tokenizer) -> None:
    encoder = PromptEncoder(tokenizer)
    assert encoder.rule is not None and encoder.rule.family == "gpt2", encoder.reason


def test_next_turn_reuses_everything_before_the_generation_prompt(tokenizer: Tokenizer) -> None:
    first = encode_prompt(tokenizer, TURN1, None)
    assert first.token_ids == _ids(tokenizer, TURN1) and first.reused_tokens == 0
    second = encode_prompt(tokenizer, TURN2, first)
    assert second.token_ids == _ids(tokenizer, TURN2)
    # the cut is between "<|assistant|>" and its "\n": all but the last token are reused
    assert second.reused_tokens == len(first.token_ids) - 1
    assert second.mark_pos[-1] == len(TURN2) and second.mark_count[-1] == len(second.token_ids)


def test_same_text_returns_the_same_state(tokenizer: Tokenizer) -> None:
    first = encode_prompt(tokenizer, TURN2, None)
    assert encode_prompt(tokenizer, TURN2, first) is first


def test_shorter_text_reuses_its_prefix(tokenizer: Tokenizer) -> None:
    long = encode_prompt(tokenizer, TURN2, None)
    short = encode_prompt(tokenizer, TURN1, long)
    assert short.token_ids == _ids(tokenizer, TURN1)


def test_template_that_rewrote_history_encodes_in_full(tokenizer: Tokenizer) -> None:
    first = encode_prompt(tokenizer, "<s><|system|>\nTurn 1\n" + TURN1[3:], None)
    text = "<s><|system|>\nTurn 2\n" + TURN2[3:]
    second = encode_prompt(tokenizer, text, first)
    assert second.token_ids == _ids(tokenizer, text)
    # nothing from the changed system prompt on is reused (the cut found in the open span is before " 2")
    assert 0 < second.reused_tokens <= len(_ids(tokenizer, "<s><|system|>\nTurn"))


def test_edit_in_the_middle_reuses_up_to_the_last_mark_before_it(tokenizer: Tokenizer) -> None:
    history = "".join(f"<|user|>\nquestion number {i} is here\n<|assistant|>\nanswer {i}\n" for i in range(60))
    encoder = PromptEncoder(tokenizer, chunk_chars=64, whole_chars=512)
    first = encoder.encode("<s>" + history, None)
    edited = "<s>" + history.replace("question number 40 ", "question number forty ")
    second = encoder.encode(edited, first)
    assert second.token_ids == _ids(tokenizer, edited)
    changed_at = edited.index("forty")
    reused_chars = max(p for p, k in zip(first.mark_pos, first.mark_count) if k == second.reused_tokens)
    assert 0 < changed_at - reused_chars <= 64 + 32


def test_cut_before_an_added_token(tokenizer: Tokenizer) -> None:
    first = encode_prompt(tokenizer, "<s>hello", None)
    second = encode_prompt(tokenizer, "<s>hello</s><s>more", first)
    assert second.token_ids == _ids(tokenizer, "<s>hello</s><s>more")
    assert second.reused_tokens == len(first.token_ids)  # "hello" | "</s>": an added token starts there


def test_no_cut_inside_an_added_token(tokenizer: Tokenizer) -> None:
    # the previous prompt ends with "<" and "/s"; the new one completes "</s>": the old tail is re-encoded
    first = encode_prompt(tokenizer, "<s>hello </", None)
    text = "<s>hello </s> x"
    second = encode_prompt(tokenizer, text, first)
    assert second.token_ids == _ids(tokenizer, text)
    assert 2 in second.token_ids and second.reused_tokens <= 2


def test_no_cut_inside_a_whitespace_run(tokenizer: Tokenizer) -> None:
    # "a\n\n" alone ends in one "\n\n" piece; followed by text GPT-2's regex splits it "\n" + "\n"
    first = encode_prompt(tokenizer, "<s>a\n\n", None)
    second = encode_prompt(tokenizer, "<s>a\n\nb", first)
    assert second.token_ids == _ids(tokenizer, "<s>a\n\nb")
    assert second.reused_tokens == 2  # "<s>", "a": the cut is before the run


@pytest.mark.parametrize(("old", "new"), [
    ("<s>ok 👍", "<s>ok 👍🏽 yes"),           # an emoji modifier joins the previous character's cluster
    ("<s>caf e", "<s>caf e\u0301 au lait"),  # a combining accent after the common prefix
    ("<s>x 你", "<s>x 你好"),                  # multi-byte characters split over several byte tokens
])
def test_common_prefix_ending_inside_a_multi_byte_sequence(tokenizer: Tokenizer, old: str, new: str) -> None:
    first = encode_prompt(tokenizer, old, None)
    second = encode_prompt(tokenizer, new, first)
    assert second.token_ids == _ids(tokenizer, new)
    # the reused tokens stop at the space before the last word (never inside a character's bytes)
    assert second.reused_tokens == len(_ids(tokenizer, old[:old.rindex(" ")]))


@pytest.mark.parametrize("normalizer", [{"type": "NFKC"}, {"type": "Lowercase"},
                                        {"type": "Sequence", "normalizers": [{"type": "NFC"}]}])
def test_normalizer_other_than_nfc_means_full_encodes(tokenizer: Tokenizer, normalizer: dict[str, object]) -> None:
    variant = _variant(tokenizer, normalizer=normalizer)
    encoder = PromptEncoder(variant)
    assert encoder.rule is None and "normalizer" in encoder.reason
    first = encoder.encode(TURN1)
    second = encoder.encode(TURN2, first)
    assert second.token_ids == _ids(variant, TURN2) and second.reused_tokens == 0


def test_nfc_keeps_cuts_before_ascii_only(tokenizer: Tokenizer) -> None:
    nfc = _variant(tokenizer, normalizer={"type": "NFC"})
    encoder = PromptEncoder(nfc)
    assert encoder.rule is not None, encoder.reason
    # the new text puts a combining accent right after the old end: NFC composes "e" + U+0301 into "é"
    first = encoder.encode("<s>x cafe")
    text = "<s>x cafe\u0301 au lait"
    second = encoder.encode(text, first)
    assert second.token_ids == _ids(nfc, text)
    assert second.reused_tokens == len(_ids(nfc, "<s>x"))


@pytest.mark.parametrize(("changes", "reason"), [
    ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}},
     "prefix space"),
    ({"pre_tokenizer": {"type": "Whitespace"}}, "Whitespace"),
    ({"pre_tokenizer": None}, "no pre-tokenizer"),
    ({"truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}},
     "truncates"),
])
def test_structures_the_rules_refuse(tokenizer: Tokenizer, changes: dict[str, object], reason: str) -> None:
    variant = _variant(tokenizer, **changes)
    encoder = PromptEncoder(variant)
    assert encoder.rule is None and reason in encoder.reason
    state = encoder.encode(TURN2, encoder.encode(TURN1))
    assert state.token_ids == _ids(variant, TURN2) and state.reused_tokens == 0


def test_post_processors_that_add_no_ids_are_accepted(tokenizer: Tokenizer) -> None:
    trims = _variant(tokenizer, post_processor={"type": "ByteLevel", "add_prefix_space": False,
                                                "trim_offsets": True, "use_regex": True})
    encoder = PromptEncoder(trims)
    assert encoder.rule is not None, encoder.reason
    state = encoder.encode(TURN2, encoder.encode(TURN1))
    assert state.token_ids == _ids(trims, TURN2) and state.reused_tokens > 0


def test_unknown_post_processor_is_refused(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(incremental, "_QUIET_POST_PROCESSORS", frozenset({"BertProcessing"}))
    encoder = PromptEncoder(tokenizer)
    assert encoder.rule is None and "TemplateProcessing" in encoder.reason


def test_added_token_with_rstrip_is_refused(tokenizer: Tokenizer) -> None:
    variant = Tokenizer.from_str(tokenizer.to_str())
    variant.add_special_tokens([AddedToken("<|eot|>", rstrip=True)])
    encoder = PromptEncoder(variant)
    assert encoder.rule is None and "<|eot|>" in encoder.reason


def test_special_tokens_encoded_as_text_is_refused(tokenizer: Tokenizer) -> None:
    variant = Tokenizer.from_str(tokenizer.to_str())
    variant.encode_special_tokens = True
    encoder = PromptEncoder(variant)
    assert encoder.rule is None and "encode_special_tokens" in encoder.reason
    state = encoder.encode("<s>hello</s><s>x", encoder.encode("<s>hello"))
    assert state.token_ids == _ids(variant, "<s>hello</s><s>x") and state.reused_tokens == 0


def test_bpe_dropout_is_refused(tokenizer: Tokenizer) -> None:
    spec = json.loads(tokenizer.to_str())
    spec["model"]["dropout"] = 0.5
    encoder = PromptEncoder(Tokenizer.from_str(json.dumps(spec)))
    assert encoder.rule is None and "dropout" in encoder.reason


def test_state_of_another_tokenizer_is_not_reused(tokenizer: Tokenizer) -> None:
    other = Tokenizer.from_str(tokenizer.to_str())
    first = encode_prompt(other, TURN1, None)
    second = encode_prompt(tokenizer, TURN2, first)
    assert second.token_ids == _ids(tokenizer, TURN2) and second.reused_tokens == 0
    assert second.encoder is not None and second.encoder.tokenizer is tokenizer


def test_state_without_marks_is_not_reused(tokenizer: Tokenizer) -> None:
    encoder = PromptEncoder(tokenizer)
    bare = PromptState(text=TURN1, token_ids=_ids(tokenizer, TURN1), encoder=encoder)
    second = encoder.encode(TURN2, bare)
    assert second.token_ids == _ids(tokenizer, TURN2) and second.reused_tokens == 0


def test_window_check_catches_a_wrong_cut(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """If the rule ever claimed a cut the tokenizer merges across, the window re-encode sees it and the
    prompt is encoded in full: here the rule is made to accept a cut inside a word."""
    encoder = PromptEncoder(tokenizer)
    first = encoder.encode("<s>hel")
    assert encoder.rule is not None
    monkeypatch.setattr(encoder.rule, "is_cut", lambda text, p: True)
    second = encoder.encode("<s>hello world", first)
    assert second.token_ids == _ids(tokenizer, "<s>hello world") and second.reused_tokens == 0


def test_long_text_without_cuts(tokenizer: Tokenizer) -> None:
    text = "<s>" + "你好世界" * 500
    first = encode_prompt(tokenizer, text, None)
    second = encode_prompt(tokenizer, text + "!!", first)
    assert first.token_ids == _ids(tokenizer, text)
    assert second.token_ids == _ids(tokenizer, text + "!!")


def test_nbytes_grows_with_the_prompt(tokenizer: Tokenizer) -> None:
    small = encode_prompt(tokenizer, TURN1, None)
    large = encode_prompt(tokenizer, TURN1 * 50, None)
    assert 0 < small.nbytes < large.nbytes
    assert large.nbytes >= len(large.text) + 8 * len(large.token_ids)


def test_pre_tokenizer_families_are_recognised() -> None:
    """Metaspace and the Split + ByteLevel families map to their rules (the property test trains real ones)."""

    def family(pre: object) -> str | None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre
        rule = PromptEncoder(tok).rule
        return rule.family if rule else None

    def split(pattern: str) -> object:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    assert family(split(GPT2_PATTERN)) == "gpt2"
    assert family(split(QWEN2_PATTERN)) == "llama3"
    assert family(split(r"\w+|\s+")) is None
    assert family(pre_tokenizers.Metaspace(prepend_scheme="never")) == "metaspace"
    assert family(pre_tokenizers.Metaspace(split=False)) == "metaspace-nosplit"
    assert family(pre_tokenizers.Whitespace()) is None


def test_renderer_renders_the_next_turn_incrementally(renderer: Renderer) -> None:
    """``Renderer.render_chat(previous=...)`` encodes with this module: same ids as a render without state,
    most of them reused."""
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    first = renderer.render_chat(json.dumps({"model": "tiny-llama", "messages": messages}).encode())
    messages += [{"role": "assistant", "content": "Fine, thanks!"}, {"role": "user", "content": "Good."}]
    body = json.dumps({"model": "tiny-llama", "messages": messages}).encode()
    second = renderer.render_chat(body, previous=first.prompt)
    assert second.request.token_ids == renderer.render_chat(body).request.token_ids
    assert second.prompt.reused_tokens == len(first.request.token_ids) - 1


def _counting(encoder: PromptEncoder) -> list[str]:
    """Record every text the encoder hands the tokenizer."""
    seen: list[str] = []
    ids = encoder.ids

    def counted(text: str) -> list[int]:
        seen.append(text)
        return ids(text)

    encoder.ids = counted  # type: ignore[method-assign]
    return seen


def test_a_short_prompt_without_state_is_one_encode_and_no_inner_marks(tokenizer: Tokenizer) -> None:
    encoder = PromptEncoder(tokenizer)
    seen = _counting(encoder)
    state = encoder.encode(TURN2)
    assert seen == [TURN2] and state.token_ids == _ids(tokenizer, TURN2)
    assert list(state.mark_pos) == [len(TURN2)] and list(state.mark_count) == [len(state.token_ids)]
    assert state.open_from == 0


def test_the_next_turn_finds_a_cut_in_the_open_span(tokenizer: Tokenizer) -> None:
    encoder = PromptEncoder(tokenizer)
    old = "<s><|user|>\n" + " ".join(f"word{i}" for i in range(40)) + " the end\n<|assistant|>\n"
    new = old.replace(" the end\n", " the other end\n")
    first = encoder.encode(old)
    seen = _counting(encoder)
    second = encoder.encode(new, first)
    assert second.token_ids == _ids(tokenizer, new)
    # the texts depart at "e"nd / "o"ther: the last clean cut at or before that is the space before it
    cut = old.index(" end")
    assert second.reused_tokens == len(_ids(tokenizer, old[:cut]))
    assert seen[0] == old[cut:]  # the old tail after the cut, encoded once to count the tokens before it
    assert seen[-1] == new[cut:]  # then the new tail; between them only the few-character check window
    assert all(len(text) <= max(len(new) - cut, 2 * incremental._WINDOW) for text in seen)
    assert second.open_from == cut and cut in second.mark_pos


def test_old_tail_that_disagrees_means_a_full_encode(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cut the rule wrongly claimed inside a word: the old ids do not end with the old tail's ids."""
    encoder = PromptEncoder(tokenizer)
    first = encoder.encode("<s>hello there")
    assert encoder.rule is not None
    monkeypatch.setattr(encoder.rule, "is_cut", lambda text, p: True)
    monkeypatch.setattr(encoder.rule, "_candidates", re.compile(""))  # every position is a candidate
    second = encoder.encode("<s>hello thorough", first)
    assert second.token_ids == _ids(tokenizer, "<s>hello thorough") and second.reused_tokens == 0


def test_a_long_prompt_is_encoded_in_chunks_with_marks(tokenizer: Tokenizer) -> None:
    encoder = PromptEncoder(tokenizer, chunk_chars=64, whole_chars=256)
    text = "<s>" + "the quick brown fox jumps over the lazy dog. " * 20
    assert len(text) > encoder.whole_chars
    seen = _counting(encoder)
    state = encoder.encode(text)
    assert state.token_ids == _ids(tokenizer, text) and len(seen) > 2
    assert len(state.mark_pos) > 2 and state.open_from == -1


def test_a_stateless_1k_token_prompt_is_one_encode_call(tokenizer: Tokenizer) -> None:
    """The default encoder encodes a ~1,000-token chat (~5,500 characters) in one call: measured cheaper
    than chunks there (bench/render_server.py), and marked only at its end (the rest is an open span)."""
    encoder = PromptEncoder(tokenizer)
    text = "<s>" + "the quick brown fox jumps over the lazy dog. " * 125
    assert 5000 < len(text) <= encoder.whole_chars
    seen = _counting(encoder)
    state = encoder.encode(text)
    assert state.token_ids == _ids(tokenizer, text) and seen == [text]
    assert list(state.mark_pos) == [len(text)] and state.open_from == 0


def test_ids_encoder_gives_encode_ids(tokenizer: Tokenizer) -> None:
    from rendering.incremental import ids_encoder
    encode = ids_encoder(tokenizer)
    for text in ("", TURN2, "你好 👍🏽 e\u0301 </s><s>", "\n\n  \t x"):
        assert encode(text) == _ids(tokenizer, text)
