"""``rendering.specials`` and ``PromptEncoder.encode_ids``: encodes with special tokens by the piece
encoder give the library's ``encode(text, add_special_tokens=True).ids``, for every post-processor the
module reads, and the library answers for the others.

Each case is a byte-level tokenizer (the shipped one, or one trained here) given a post-processor, then
random text (ASCII, and now and then other characters) encoded both ways.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer, pre_tokenizers, processors

from rendering.incremental import PromptEncoder
from rendering.model import DEFAULT_MODEL_DIR, load_model
from rendering.pieces import PieceEncoder
from rendering.render import Renderer
from rendering.specials import special_ends
from tests.rendering.test_incremental_property import FAMILIES, _trained
from tests.rendering.test_pieces import _text


def _template(single: str, specials: list[tuple[str, int]]) -> processors.PostProcessor:
    return processors.TemplateProcessing(single=single, pair="$A $B", special_tokens=specials)


#: name -> (post-processor factory for a tokenizer, the ends it adds; None: the library's job)
POST: dict[str, tuple[Callable[[Tokenizer], processors.PostProcessor | None], tuple[list[int], list[int]] | None]] = {
    "none": (lambda t: None, ([], [])),
    "byte-level": (lambda t: processors.ByteLevel(trim_offsets=True), ([], [])),
    "bos": (lambda t: _template("<s> $A", [("<s>", t.token_to_id("<s>"))]), ([1], [])),
    "bos-eos": (lambda t: _template("<s> $A </s>", [("<s>", t.token_to_id("<s>")), ("</s>", t.token_to_id("</s>"))]),
                ([1], [2])),
    "two-ahead": (lambda t: _template("<s> <pad> $A", [("<s>", t.token_to_id("<s>")), ("<pad>", t.token_to_id("<pad>"))]),
                  ([1, 3], [])),
    "roberta": (lambda t: processors.RobertaProcessing(("</s>", t.token_to_id("</s>")), ("<s>", t.token_to_id("<s>"))),
                ([1], [2])),
    "bert": (lambda t: processors.BertProcessing(("</s>", t.token_to_id("</s>")), ("<s>", t.token_to_id("<s>"))),
             ([1], [2])),
    "sequence": (lambda t: processors.Sequence([processors.ByteLevel(), _template("<s> $A", [("<s>", 1)])]),
                 ([1], [])),
    # two steps that add ids: not read, the library answers
    "two-adders": (lambda t: processors.Sequence([_template("<s> $A", [("<s>", 1)]),
                                                  _template("$A </s>", [("</s>", 2)])]), None),
}


@pytest.fixture(scope="module")
def trained() -> dict[str, Tokenizer]:
    return {"gpt2-byte-level": _trained(pre_tokenizers.ByteLevel(add_prefix_space=False)),
            "llama3": FAMILIES["llama3"][0]()}


def _with_post(base: Tokenizer, post: Callable[[Tokenizer], processors.PostProcessor | None]) -> Tokenizer:
    tokenizer = Tokenizer.from_str(base.to_str())
    made = post(tokenizer)
    if made is not None:
        tokenizer.post_processor = made
    return tokenizer


@pytest.mark.parametrize("post", sorted(POST))
@pytest.mark.parametrize("family", ["gpt2-byte-level", "llama3"])
def test_encodes_with_special_tokens_are_the_librarys(family: str, post: str, trained: dict[str, Tokenizer]) -> None:
    factory, ends = POST[post]
    tokenizer = _with_post(trained[family], factory)
    assert (tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>"), tokenizer.token_to_id("<pad>")) == (1, 2, 3)
    assert special_ends(tokenizer) == ends
    encoder = PromptEncoder(tokenizer)
    assert isinstance(encoder.ids, PieceEncoder)
    assert encoder.ends == ends
    rnd = random.Random(f"{family}/{post}")
    texts = ["", " ", "<s>", "Hello world"] + [_text(rnd, rnd.randint(1, 60), others=rnd.random() < 0.3)
                                            for _ in range(150)]
    for text in texts:
        for special in (True, False):
            assert encoder.encode_ids(text, add_special_tokens=special) == \
                tokenizer.encode(text, add_special_tokens=special).ids, (text, special)


def test_the_shipped_tokenizer_adds_nothing_around_a_prompt() -> None:
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    encoder = PromptEncoder(tokenizer)
    assert encoder.ends == ([], [])
    rnd = random.Random(7)
    for _ in range(100):
        text = _text(rnd, rnd.randint(0, 80), others=True)
        assert encoder.encode_ids(text, add_special_tokens=True) == tokenizer.encode(text).ids


def test_a_template_that_is_not_one_sequence_between_specials_is_not_read(trained: dict[str, Tokenizer]) -> None:
    tokenizer = _with_post(trained["llama3"], lambda t: _template("<s> $B", [("<s>", 1)]))
    assert special_ends(tokenizer) is None
    tokenizer = _with_post(trained["llama3"], lambda t: _template("$A <s> $A", [("<s>", 1)]))
    assert special_ends(tokenizer) is None


def test_tokenizers_without_the_piece_encoder_leave_specials_to_the_library() -> None:
    tokenizer = FAMILIES["metaspace-first"][0]()
    tokenizer.post_processor = _template("<s> $A </s>", [("<s>", tokenizer.token_to_id("<s>")),
                                                          ("</s>", tokenizer.token_to_id("</s>"))])
    encoder = PromptEncoder(tokenizer)
    assert encoder.ends is None
    for text in ["", "Hello world", "two  spaces\nand a line"]:
        assert encoder.encode_ids(text, add_special_tokens=True) == tokenizer.encode(text).ids


def test_the_renderer_adds_the_post_processors_ids_to_completions_chat_and_tokenize(tmp_path: Path) -> None:
    """A model folder whose tokenizer wraps a prompt in ``<s> … </s>``: completion prompts, chats with
    ``add_special_tokens`` and ``/tokenize`` get the library's ids, specials included."""
    folder = tmp_path / "bos-eos"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = _template("<s> $A </s>", [("<s>", 1), ("</s>", 2)])
    tokenizer.save(str(folder / "tokenizer.json"))
    renderer = Renderer(load_model(folder))
    texts = ["Hello there, how are you?", "Une phrase en français, s'il vous plaît.\n\n  Done."]
    for text in texts:
        expected = tokenizer.encode(text).ids
        assert expected[0] == 1 and expected[-1] == 2
        [generate] = renderer.render_completions(json.dumps({"prompt": text, "max_tokens": 4}).encode())
        assert generate.token_ids == expected
        [generate] = renderer.render_completions(json.dumps({"prompt": text, "max_tokens": 4,
                                                             "add_special_tokens": False}).encode())
        assert generate.token_ids == tokenizer.encode(text, add_special_tokens=False).ids
        answer = json.loads(renderer.tokenize(json.dumps({"prompt": text}).encode()))
        assert answer["tokens"] == expected and answer["count"] == len(expected)
        chat = {"messages": [{"role": "user", "content": text}], "add_special_tokens": True}
        rendered = renderer.render_chat(json.dumps(chat).encode())
        template_text = renderer.chat_text(rendered.chat)
        assert rendered.request.token_ids == tokenizer.encode(template_text).ids
