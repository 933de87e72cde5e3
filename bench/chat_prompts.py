"""Chat request bodies of a chosen size for the tokens-mode benchmarks: deterministic, one per
session, each a small multi-turn conversation (system, user, assistant, user) whose message
contents add up to about ``chars`` characters; and ``/v1/completions`` bodies whose prompt is the
same conversation's contents, one after the other.

    chat_bodies(100, chars=1000, model="tiny-llama", max_tokens=8, stream=False)
    completion_bodies(100, chars=1000, model="tiny-llama", max_tokens=8)

Every body differs from the others from its first message on (the session number is in the
system prompt), so no cache shared between sessions can answer one body from another's work.
"""

from __future__ import annotations

import random

import msgspec

#: whole words of the shipped tiny tokenizer's vocabulary (about 5 characters per token, as ordinary
#: English text with a real model's tokenizer), so a prompt's size in characters says its size in tokens
WORDS = (
    "the quick brown fox jumps over the lazy dog one two three alpha beta gamma delta hello world chat "
    "user assistant system model token prefix cache session router server request response"
).split()


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:max(1, chars)].rstrip() + "."


def chat_messages(index: int, chars: int) -> list[dict[str, str]]:
    """Session ``index``'s conversation: four messages, ``chars`` characters of content in all."""
    rng = random.Random(index)
    system = f"You are assistant number {index}. Answer briefly."
    rest = max(40, chars - len(system))
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": _text(rng, rest * 4 // 10)},
        {"role": "assistant", "content": _text(rng, rest * 3 // 10)},
        {"role": "user", "content": _text(rng, rest - rest * 4 // 10 - rest * 3 // 10)},
    ]


def chat_body(index: int, *, chars: int, model: str, max_tokens: int, stream: bool,
              ignore_eos: bool = True) -> dict[str, object]:
    """One ``/v1/chat/completions`` body. ``ignore_eos`` (vLLM's extension) makes every answer
    exactly ``max_tokens`` long, so per-token figures divide by the right count."""
    body: dict[str, object] = {"model": model, "messages": chat_messages(index, chars), "max_tokens": max_tokens,
                               "stream": stream, "temperature": 0}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def chat_bodies(n: int, *, chars: int, model: str, max_tokens: int, stream: bool,
                ignore_eos: bool = True) -> list[str]:
    """``n`` bodies as JSON text (what ``bench.loadgen.LoadSpec.bodies`` takes)."""
    return [msgspec.json.encode(chat_body(i, chars=chars, model=model, max_tokens=max_tokens, stream=stream,
                                          ignore_eos=ignore_eos)).decode() for i in range(n)]


def completion_bodies(n: int, *, chars: int, model: str, max_tokens: int) -> list[str]:
    """``n`` ``/v1/completions`` bodies as JSON text: session ``i``'s prompt is its conversation's
    contents joined by blank lines (the prompt is encoded with special tokens, as vLLM does)."""
    return [msgspec.json.encode({
        "model": model, "prompt": "\n\n".join(m["content"] for m in chat_messages(i, chars)),
        "max_tokens": max_tokens, "temperature": 0}).decode() for i in range(n)]
