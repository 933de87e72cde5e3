"""``check_vocabulary``: the token ids a model accepts in a prompt, refused as vLLM refuses them;
``check_generate_body``: the same for a client's own ``/inference/v1/generate`` body.

Its own module, with no import beyond the error tree, because the router's remote-render client uses
it too, and text mode must not load the template engine (``tests/router/tokens/test_text_mode_unchanged``).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from contract.errors import BadRequestError


class _Prompt(msgspec.Struct):
    """The one field of a ``GenerateRequest`` checked here."""

    token_ids: list[int] | None = None


_prompt_decoder = msgspec.json.Decoder(_Prompt)


def check_vocabulary(ids: Sequence[int], max_token_id: int) -> None:
    """The 400 vLLM's input processor answers for a prompt with a token id below 0 or past the
    vocabulary (``max_token_id``: the larger of the tokenizer's and ``config.json``'s, as vLLM's).

    vLLM's render server does not check it, and an engine that takes only tokens (``vllm serve
    --tokens-only``) has no tokenizer, so its input processor skips the check and its engine core dies
    on such an id (seen on vLLM 0.32.0, ``bench/vllm_tokens_live.py``): no prompt goes to an engine
    without this check."""
    if ids:
        low = min(ids)
        if low < 0:
            raise _outside(low)
        _check_top(ids, max_token_id)


def check_generate_body(body: bytes, max_token_id: int) -> None:
    """The ``token_ids`` of a ``/inference/v1/generate`` body past the vocabulary: refused with vLLM's
    400. Only that: the engine checks the rest itself and answers its own 400 (an empty list, a negative
    id, a body that is not a ``GenerateRequest``; ``bench/vllm_tokens_live.py`` records those answers)."""
    try:
        prompt = _prompt_decoder.decode(body)
    except msgspec.MsgspecError:
        return
    if prompt.token_ids:
        _check_top(prompt.token_ids, max_token_id)


def _check_top(ids: Sequence[int], max_token_id: int) -> None:
    top = max(ids)
    if top > max_token_id:
        raise _outside(top)


def _outside(token: int) -> BadRequestError:
    return BadRequestError(f"Token id {token} is out of vocabulary")
