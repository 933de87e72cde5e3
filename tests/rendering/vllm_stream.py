"""vLLM 0.32's detokenizer, plainly, as the tests' reference: one ``DecodeStream`` prefilled with the whole
prompt, stepped id by id; an id no tokenizer can hold decodes to nothing, and a broken prefix starts a new
stream at that id."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def vllm_032_steps(tokenizer: Tokenizer, prompt: list[int], steps: list[list[int]], skip: bool = True) -> list[str]:
    """The text of each step (one engine step's ids each)."""
    stream = DecodeStream(ids=prompt, skip_special_tokens=skip) if prompt else DecodeStream(skip_special_tokens=skip)
    texts = []
    for ids in steps:
        out = ""
        for token_id in ids:
            try:
                text = stream.step(tokenizer, token_id)
            except (TypeError, OverflowError):
                text = None
            except Exception as exc:
                assert str(exc).startswith("Invalid prefix")
                stream = DecodeStream(skip_special_tokens=skip)
                text = stream.step(tokenizer, token_id)
            out += text or ""
        texts.append(out)
    return texts
