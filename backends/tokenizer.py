"""The engine side of the loaded model's tokenizer (``rendering.model.RenderModel``), so that every route
of a backend (text in/out, tokens in/out, render) speaks one vocabulary. Prompts are rendered and
answers derendered by ``rendering/`` (chat template, tokenizer, detokenizer, stop strings); this holds
what the engine and its runs need: the model, its ``eos`` id and ``generation_ids``, the ids the
engine generates (whole word tokens, never special ids: ``backends.vocabulary``).
"""

from __future__ import annotations

from backends.vocabulary import generation_ids
from rendering.model import RenderModel


class Tokenizer:
    """One model's tokenizer facts for the engine, built once at start-up."""

    def __init__(self, model: RenderModel) -> None:
        self.model = model
        self.eos_token_id = model.eos_token_id
        #: the ids the engine generates (never special ids; eos aside)
        self.generation_ids = generation_ids(model.tokenizer)
