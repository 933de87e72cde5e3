"""The latency model: how long one engine step would take on a real GPU.

``seconds = speed * (base + per_prefill_token * prefill_tokens_computed + per_decode_seq * decode_seqs)``

At ``speed`` 1 (a small model on one GPU): a decode step takes 10 ms plus 20 µs per running
sequence (10-15 ms up to 256 sequences), and prefill runs at 4,000 tokens/s, so a 400-token prompt
adds 100 ms to its step and a 400-token stream lasts about 4-5 s. Only tokens actually computed
count: prefix-cache hits and pulled P/D blocks cost nothing. ``speed`` 0 means no sleeping at all.
"""

from __future__ import annotations

import msgspec


class LatencyModel(msgspec.Struct, frozen=True):
    base_s: float = 0.010
    per_prefill_token_s: float = 0.00025
    per_decode_seq_s: float = 0.00002

    def step_seconds(self, speed: float, prefill_tokens: int, decode_seqs: int) -> float:
        """Simulated duration of a step that computes ``prefill_tokens`` and decodes ``decode_seqs``."""
        if speed <= 0.0 or (prefill_tokens == 0 and decode_seqs == 0):
            return 0.0
        return speed * (
            self.base_s + self.per_prefill_token_s * prefill_tokens + self.per_decode_seq_s * decode_seqs
        )
