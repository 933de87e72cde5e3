"""The engine side's tokenizer: the loaded model's own (``rendering.model.RenderModel``), so that every
route of a backend (text in/out, tokens in/out, render) speaks one vocabulary. Prompts are rendered by
``rendering.render`` (chat template included); this holds what the engine and its runs need:

- ``encode`` is Hugging Face tokenizers' ``encode`` (``add_bos`` = ``add_special_tokens``);
- ``decode`` is the tokenizer's ``decode`` (a tokens-in request's ``output_mode: "text"``, the
  Responses route's text). The engine generates only ids from ``generation_ids`` (whole word
  tokens, ``backends.vocabulary``) and ``eos``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from backends.vocabulary import generation_ids
from rendering.model import RenderModel


class Tokenizer:
    """One model's tokenizer, built once at start-up."""

    def __init__(self, model: RenderModel) -> None:
        self.model = model
        self._tok = model.tokenizer
        self.vocab_size = model.vocab_size
        self.eos_token_id = model.eos_token_id
        #: the ids the engine generates (never special ids; eos aside)
        self.generation_ids = generation_ids(model.tokenizer)

    # ---- text <-> ids -------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_bos).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ``ValueError`` for an id outside the vocabulary."""
        bad = self.out_of_vocab(ids)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of vocabulary (size {self.vocab_size})")
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def out_of_vocab(self, ids: Iterable[int]) -> int | None:
        """The first id that is negative or not in the vocabulary, else None."""
        size = self.vocab_size
        for i in ids:
            if not 0 <= i < size:
                return i
        return None
