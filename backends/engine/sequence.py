"""The engine core's internal request (one per ``EngineCoreRequest``) and its child sequences.

``Request`` copies what the core needs from the wire request, ``session_id`` included; with
``sampling_params.n > 1`` it owns n ``Sequence`` children (vLLM's parallel sampling), each of which
inherits the parent's ``session_id`` and is scheduled on its own.

Token generation is deterministic: a child's RNG is seeded from ``sampling_params.seed`` (and the
child index) when given, else from a stable hash of the prompt token ids and the child index. Ids are
drawn uniformly from ``gen_token_ids`` when the config names them (the model's vocabulary), else from
``[gen_token_min, gen_token_max)``; unless ``ignore_eos``, each token may be
``eos_token_id`` with probability ``eos_probability`` (not before ``min_tokens``).
"""

from __future__ import annotations

import enum
import hashlib
import random
from typing import Any

from backends.engine.kv_cache import hash_block, token_bytes
from backends.engine.request import SamplingParams


class SeqStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


#: vLLM's RequestOutputKind.FINAL_ONLY: deliver one output when the request has finished
OUTPUT_KIND_FINAL_ONLY = 2


class Request:
    """One ``EngineCoreRequest`` inside the core."""

    __slots__ = (
        "request_id",
        "session_id",
        "prompt_token_ids",
        "num_prompt_tokens",
        "n",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "eos_token_id",
        "seed",
        "arrival_time",
        "added_at",
        "priority",
        "cache_salt",
        "kv_transfer_params",
        "final_only",
        "children",
        "num_unfinished",
        "prompt_block_hashes",
        "prompt_digest",
        "accounted",
        "sampling_params",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        session_id: str | None = None,
        n: int = 1,
        max_tokens: int = 16,
        min_tokens: int = 0,
        stop_token_ids: frozenset[int] | None = None,
        eos_token_id: int | None = None,
        seed: int | None = None,
        arrival_time: float = 0.0,
        added_at: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        final_only: bool = False,
        sampling_params: SamplingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.session_id = session_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.n = n
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.stop_token_ids = stop_token_ids
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.arrival_time = arrival_time
        self.added_at = added_at
        self.priority = priority
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params
        self.final_only = final_only
        self.children: list[Sequence] = []
        self.num_unfinished = 0
        self.prompt_block_hashes: list[bytes] = []
        self.prompt_digest = b""
        #: counted in the per-session accounting when it finishes (False for abort notifications)
        self.accounted = True
        #: the wire sampling parameters as received (the fields above are the effective values)
        self.sampling_params = sampling_params

    @property
    def num_cached_tokens(self) -> int:
        """Child 0's prompt tokens not computed here (0 until it is first scheduled)."""
        if not self.children:
            return 0
        return max(self.children[0].num_cached_tokens, 0)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.output_token_ids) for c in self.children)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class Sequence:
    """One child sequence: the unit the scheduler batches and the KV cache holds blocks for."""

    __slots__ = (
        "request",
        "index",
        "seq_id",
        "session_id",
        "prompt_token_ids",
        "num_prompt_tokens",
        "output_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "blocks",
        "num_keyed_blocks",
        "block_hashes",
        "cache_salt",
        "status",
        "max_output",
        "min_tokens",
        "stop_token_ids",
        "eos_token_id",
        "eos_probability",
        "token_lo",
        "token_span",
        "token_pool",
        "rng",
        "scheduled_time",
        "first_token_time",
        "last_token_time",
        "finish_reason",
        "stop_reason",
        "num_preemptions",
    )

    def __init__(
        self,
        request: Request,
        index: int,
        *,
        max_output: int,
        eos_probability: float,
        token_lo: int,
        token_hi: int,
        token_pool: tuple[int, ...] | None = None,
    ) -> None:
        self.request = request
        self.index = index
        self.seq_id = request.request_id if request.n == 1 else f"{index}_{request.request_id}"
        self.session_id = request.session_id
        self.prompt_token_ids = request.prompt_token_ids
        self.num_prompt_tokens = request.num_prompt_tokens
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        #: prompt tokens found in the prefix cache at the first scheduling; -1 = not scheduled yet
        self.num_cached_tokens = -1
        self.blocks: list[int] = []
        #: how many of ``blocks`` (from the start) have been registered in the prefix cache
        self.num_keyed_blocks = 0
        self.block_hashes = list(request.prompt_block_hashes)
        self.cache_salt = request.cache_salt
        self.status = SeqStatus.WAITING
        self.max_output = max_output
        self.min_tokens = request.min_tokens
        self.stop_token_ids = request.stop_token_ids
        self.eos_token_id = request.eos_token_id
        self.eos_probability = eos_probability if request.eos_token_id is not None else 0.0
        self.token_lo = token_lo
        #: ids are ``token_pool[k]`` (or ``token_lo + k``) for k uniform in ``[0, token_span)``
        self.token_pool = token_pool or None
        self.token_span = len(token_pool) if token_pool else max(token_hi - token_lo, 1)
        self.rng = random.Random(_child_seed(request, index))
        #: engine monotonic times (0.0 = not yet): first admitted to the running batch (a
        #: re-admission after preemption does not move it), first and last sampled token
        self.scheduled_time = 0.0
        self.first_token_time = 0.0
        self.last_token_time = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` across the prompt and the output."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def block_hash(self, i: int, block_size: int) -> bytes:
        """Key of full block ``i`` (computed lazily, chained)."""
        hashes = self.block_hashes
        while len(hashes) <= i:
            j = len(hashes)
            parent = hashes[j - 1] if j else b"\x00" * 16
            hashes.append(
                hash_block(
                    parent,
                    self.tokens(j * block_size, (j + 1) * block_size),
                    self.cache_salt if j == 0 else None,
                )
            )
        return hashes[i]

    def sample(self) -> int:
        """Draw the next token id (deterministic per sequence)."""
        rand = self.rng.random
        p_eos = self.eos_probability
        if p_eos and rand() < p_eos and len(self.output_token_ids) >= self.min_tokens:
            return self.eos_token_id  # type: ignore[return-value]
        pool = self.token_pool
        k = int(rand() * self.token_span)
        tok = pool[k] if pool is not None else self.token_lo + k
        stop = self.stop_token_ids
        if stop is not None and len(self.output_token_ids) < self.min_tokens:
            # min_tokens suppresses stop ids: redraw a few times (the range may be all stop ids)
            for _ in range(4):
                if tok not in stop:
                    break
                k = int(rand() * self.token_span)
                tok = pool[k] if pool is not None else self.token_lo + k
        return tok


def _child_seed(request: Request, index: int) -> bytes:
    if request.seed is not None:
        return b"seed:%d:%d" % (request.seed, index)
    if not request.prompt_digest:
        request.prompt_digest = hashlib.blake2b(token_bytes(request.prompt_token_ids), digest_size=16).digest()
    return request.prompt_digest + b":%d" % index
