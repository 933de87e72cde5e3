"""``check_vocabulary``: the token ids a model accepts in a prompt, refused as vLLM refuses them.

Its own module, with no import beyond the error tree, because the router's remote-render client uses
it too, and text mode must not load the template engine (``tests/router/tokens/test_text_mode_unchanged``).
"""

from __future__ import annotations

from collections.abc import Sequence

from contract.errors import BadRequestError


def check_vocabulary(ids: Sequence[int], max_token_id: int) -> None:
    """The 400 vLLM's input processor answers for a prompt with a token id below 0 or past the
    vocabulary (``max_token_id``: the larger of the tokenizer's and ``config.json``'s, as vLLM's).

    vLLM's render server does not check it, and an engine that takes only tokens (``vllm serve
    --tokens-only``) has no tokenizer, so its input processor skips the check and its engine core dies
    on such an id (seen on vLLM 0.32.0, ``bench/vllm_tokens_live.py``): no prompt goes to an engine
    without this check."""
    if ids:
        low, top = min(ids), max(ids)
        if low < 0:
            raise BadRequestError(f"Token id {low} is out of vocabulary")
        if top > max_token_id:
            raise BadRequestError(f"Token id {top} is out of vocabulary")
