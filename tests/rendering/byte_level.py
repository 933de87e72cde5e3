"""The byte-level (GPT-2) alphabet the tiny-llama tokenizer's byte tokens are spelled in: each raw byte
stands for one printable character. Tests use it to find the token of one lone byte."""

from __future__ import annotations


def _byte_chars() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


#: raw byte -> the character that spells it in a byte-level token
BYTE_CHARS: dict[int, str] = _byte_chars()
#: the inverse: a byte-level token's character -> the raw byte
CHAR_BYTES: dict[str, int] = {c: b for b, c in BYTE_CHARS.items()}
