"""The text routes' tokenizer: the loaded model's own (``rendering.model.RenderModel``), so that every
route of a backend (text in/out, tokens in/out, render) speaks one vocabulary.

- ``encode`` is Hugging Face tokenizers' ``encode`` (``add_bos`` = ``add_special_tokens``: the
  tokenizer's own post-processor decides what that adds, as vLLM's completions route does);
- ``apply_chat_template`` renders the model's chat template with ``rendering.template.ChatTemplate``
  (the render code the router and render servers use) and encodes the text without adding special
  tokens again (the template writes ``bos_token`` itself);
- ``decode`` is the tokenizer's ``decode``. The engine generates only ids from
  ``generation_ids`` (whole word tokens, ``backends.vocabulary``) and ``eos``, so decoding each step's
  ids on their own gives exactly the text of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from backends.vocabulary import generation_ids
from rendering.model import RenderModel
from rendering.template import ChatTemplate


class Tokenizer:
    """One model's tokenizer and chat template, built once at start-up."""

    def __init__(self, model: RenderModel) -> None:
        self.model = model
        self._tok = model.tokenizer
        self.vocab_size = model.vocab_size
        self.eos_token_id = model.eos_token_id
        #: the ids the engine generates (never special ids; eos aside)
        self.generation_ids = generation_ids(model.tokenizer)
        self._template = (
            ChatTemplate(model.chat_template, special_tokens={"bos_token": model.bos_token, "eos_token": model.eos_token})
            if model.chat_template is not None
            else None
        )

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

    # ---- chat template -----------------------------------------------------------------
    def apply_chat_template(
        self, messages: Iterable[tuple[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``(role, text)`` messages rendered with the model's chat template.

        Raises ``ValueError`` when the model has no template; a template error is the template's
        ``BadRequestError`` (vLLM answers 400 for it).
        """
        if self._template is None:
            raise ValueError("the model has no chat template (no chat_template.jinja, none in tokenizer_config.json)")
        text = self._template.render([{"role": role, "content": content} for role, content in messages],
                                     add_generation_prompt=add_generation_prompt)
        return self._tok.encode(text, add_special_tokens=False).ids
