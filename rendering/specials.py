"""``special_ends``: the ids a tokenizer's post-processor puts around one sequence.

``tokenizer.encode(text, add_special_tokens=True)`` is the encode without special tokens, then the
post-processor's template for a single sequence: fixed ids before it and after it (Llama 3's
``<|begin_of_text|>``, RoBERTa's ``<s> … </s>``, BERT's ``[CLS] … [SEP]``). The template does not depend
on the text, so once its two ends are read from the tokenizer's declared post-processor, any encoder
that gives the library's ids without special tokens (``rendering.pieces``) gives them with special
tokens too: ``head + ids(text) + tail``.

Read here (anything else is None: the caller asks the library):

- no post-processor, or ``ByteLevel`` (it only trims offsets): nothing around the text;
- ``TemplateProcessing`` whose ``single`` template holds sequence ``A`` once, between special tokens
  (each named in ``special_tokens`` with its ids);
- ``RobertaProcessing`` / ``BertProcessing``: ``cls`` before, ``sep`` after;
- a ``Sequence`` of these with at most one that adds ids.

The caller must also know the encode itself does not truncate or pad (``rendering.incremental``'s
``_analyze`` checks it for the piece encoder).
"""

from __future__ import annotations

import json
from typing import Any

import tokenizers

#: ``(head, tail)``: the ids before and after the sequence's own
Ends = tuple[list[int], list[int]]
_NOTHING: Ends = ([], [])


def special_ends(tokenizer: tokenizers.Tokenizer) -> Ends | None:
    """The ids ``add_special_tokens=True`` adds before and after one sequence; None when the
    post-processor is not one read here."""
    post = tokenizer.post_processor
    if post is None:
        return _NOTHING
    spec = json.loads(post.__getstate__())
    steps = spec.get("processors", []) if spec.get("type") == "Sequence" else [spec]
    found: Ends = _NOTHING
    for step in steps:
        ends = _step_ends(step)
        if ends is None:
            return None
        if ends != _NOTHING:
            if found != _NOTHING:
                return None  # two steps that add ids: their order of application is not worth proving
            found = ends
    return found


def _step_ends(step: dict[str, Any]) -> Ends | None:
    kind = step.get("type")
    if kind == "ByteLevel":
        return _NOTHING
    if kind in ("RobertaProcessing", "BertProcessing"):
        return [int(step["cls"][1])], [int(step["sep"][1])]
    if kind == "TemplateProcessing":
        return _template_ends(step)
    return None


def _template_ends(step: dict[str, Any]) -> Ends | None:
    specials = step.get("special_tokens") or {}
    head: list[int] = []
    tail: list[int] = []
    seen_sequence = False
    for piece in step.get("single") or []:
        if "Sequence" in piece:
            if seen_sequence or piece["Sequence"].get("id") != "A":
                return None
            seen_sequence = True
        elif "SpecialToken" in piece:
            token = specials.get(piece["SpecialToken"].get("id"))
            if token is None:
                return None
            (tail if seen_sequence else head).extend(int(i) for i in token["ids"])
        else:
            return None
    return (head, tail) if seen_sequence else None
