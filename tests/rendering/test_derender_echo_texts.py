"""rendering.derender.echo_texts: the prompt text completions ``echo`` prepends (the router's tokens mode
and the backends' completions route both use it)."""

from __future__ import annotations

from rendering.derender import echo_texts
from rendering.model import DEFAULT_MODEL_DIR, load_model

MODEL = load_model(DEFAULT_MODEL_DIR)


def ids_of(text: str) -> list[int]:
    return MODEL.tokenizer.encode(text, add_special_tokens=False).ids


def test_a_text_prompt_is_echoed_as_sent() -> None:
    # as sent, not as decoded from its ids (which would differ: leading space, normalisation)
    assert echo_texts(MODEL, "  Hello", [[1, *ids_of("  Hello")]]) == ["  Hello"]


def test_a_batch_of_text_prompts_is_echoed_as_sent() -> None:
    assert echo_texts(MODEL, ["a", "b c"], [ids_of("a"), ids_of("b c")]) == ["a", "b c"]


def test_token_prompts_are_decoded_with_their_special_tokens() -> None:
    ids = [1, *ids_of("Hi there")]
    assert echo_texts(MODEL, ids, [ids]) == [MODEL.tokenizer.decode(ids, skip_special_tokens=False)]
    assert echo_texts(MODEL, ids, [ids])[0].startswith("<s>")
    batch = [[1, *ids_of("one")], ids_of("two")]
    assert echo_texts(MODEL, batch, batch) == [MODEL.tokenizer.decode(i, skip_special_tokens=False) for i in batch]
