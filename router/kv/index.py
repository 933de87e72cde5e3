"""The router's KV index: which backend holds which blocks, and so how many of a session's (or a
prompt's) tokens are resident where. Fed by the backends' KV events (``router.kv.service``),
read by placement once per request.

Keys. Engines name blocks by their own hash (vLLM: sha256 over cbor by default, or a Python hash;
our backends: 16-byte keys). The index keeps those per backend only to resolve an event's
``parent_block_hash`` and a ``BlockRemoved``; it keys the content itself by a **router-side chained
hash of token ids**: ``key(block) = blake2b-64(key(parent) || token ids as 8-byte little-endian
ints)`` (``b""`` for the first block of a prompt). So a prompt's blocks get the same keys however
the engine hashes (``prompt_block_keys``), and ``prefix_tokens`` works in tokens mode against any
engine. A block whose parent the index does not know (evicted here, or a missed event) is kept
with no content key: it counts for its sessions but cannot match a prompt. Content keys ignore
LoRA, multimodal inputs and ``cache_salt`` (vLLM's ``extra_keys``): two prompts with the same
tokens but a different adapter or salt look alike to ``prefix_tokens``. Only the device tier
(``medium`` "GPU" or unset) and KV-cache group 0 are indexed: a CPU-offload tier's or another
group's events name the same hashes and would otherwise remove the GPU blocks.

Sessions. A ``BlockStored`` carries the session of the request that stored the blocks, or that
reported reusing them (vLLM 0.32, ``kv_cache_report_mode = "full"``): a block already resident is
re-tagged to that session too, so a block may count for several sessions (a shared system prompt).
A block keeps at most ``MAX_TAGS`` sessions, the most recent (the oldest tag drops when another
comes). Per session the index keeps backend URL -> resident tokens, updated as blocks come, go and
are re-tagged, so ``session_tokens`` is one dict lookup. ``forget_session`` (the session table's
evict hook) drops a session at once; the blocks it tagged keep a dead tag until they go.

Bound. ``max_blocks`` over all backends: past it the least recently stored or reused block goes
(one LRU across backends, an intrusive doubly linked list, O(1) per store, reuse and eviction), as
a ``BlockRemoved`` would. Measured (``bench/kv_index.py``, CPython 3.11, 64-bit): about
``BYTES_PER_BLOCK`` bytes per indexed block with one session tag and 16-byte engine hashes, all
structures included (block record, per-backend hash table, content-key table, session tables);
each further tag on a block adds a few dozen bytes (at most ``MAX_TAGS`` per block).

Costs. ``apply``: O(blocks in the events), one blake2b per newly stored block (a reuse or a removal
hashes nothing). ``session_tokens``: O(1), the session's own live map (no copy). ``prefix_tokens``:
one blake2b per prompt block, and it stops at the first block no backend holds; the answer is
built as backends drop out, O(prompt blocks + backends in the answer). ``reset_backend`` and
``remove_backend``: O(that backend's blocks).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from hashlib import blake2b
from types import MappingProxyType
from typing import Final

from contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash, KVEventBatch

#: sessions one block counts for at most (the most recent ones)
MAX_TAGS: Final = 8
#: measured bytes per indexed block (module docstring; bench/kv_index.py prints the current figure)
BYTES_PER_BLOCK: Final = 420
#: the content key's "parent" of a prompt's first block
ROOT: Final = b""
#: token ids are hashed as 8-byte little-endian signed ints
_TOKEN_FORMAT: Final = "q"
_TOKEN_BYTES: Final = 8
_INDEXED_MEDIA: Final = (None, "GPU")
_EMPTY: Final[Mapping[str, int]] = MappingProxyType({})


def _chain(parent: bytes, raw: bytes) -> bytes:
    """The content key of a block: blake2b-64 of its parent's key and its tokens' bytes."""
    return blake2b(parent + raw, digest_size=8).digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes | None:
    """The tokens as the hash reads them; None for ids that do not fit 64 bits (not a real prompt)."""
    try:
        return array(_TOKEN_FORMAT, token_ids).tobytes()
    except (OverflowError, TypeError):
        return None


def prompt_block_keys(prompt_ids: Sequence[int], block_size: int) -> list[int]:
    """The content keys (as ints) of the prompt's full blocks of ``block_size`` tokens: the keys
    ``KVIndex`` gives the same tokens when an engine stores them (a partial last block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    raw = _token_bytes(prompt_ids)
    if raw is None:
        return []
    step = block_size * _TOKEN_BYTES
    keys: list[int] = []
    parent = ROOT
    for start in range(0, (len(prompt_ids) // block_size) * step, step):
        parent = _chain(parent, raw[start:start + step])
        keys.append(int.from_bytes(parent, "big"))
    return keys


class _Session:
    """One session's resident tokens per backend URL. ``live`` is False once forgotten or empty:
    blocks may still hold the record (a dead tag), which then counts for nothing."""

    __slots__ = ("sid", "tokens", "live")

    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.tokens: dict[str, int] = {}
        self.live = True


class _Block:
    """One resident block of one backend, and its place in the index-wide LRU list."""

    __slots__ = ("owner", "ehash", "key", "tokens", "tags", "prev", "next")

    def __init__(self, owner: _Backend | None, ehash: ExternalBlockHash | None, key: bytes | None,
                 tokens: int) -> None:
        self.owner = owner
        self.ehash = ehash
        #: content key (None: the parent was unknown, so it cannot match a prompt)
        self.key = key
        self.tokens = tokens
        #: None, one session, or a list of up to MAX_TAGS sessions (oldest first)
        self.tags: _Session | list[_Session] | None = None
        self.prev: _Block = self
        self.next: _Block = self


class _Backend:
    """One backend's resident blocks by engine hash, and its bit in the content-key table."""

    __slots__ = ("url", "slot", "bit", "blocks", "dups")

    def __init__(self, url: str, slot: int) -> None:
        self.url = url
        self.slot = slot
        self.bit = 1 << slot
        self.blocks: dict[ExternalBlockHash, _Block] = {}
        #: content key -> extra blocks of this backend with that key (two engine hashes, one content:
        #: e.g. a different LoRA or salt); absent when there is one, the usual case
        self.dups: dict[bytes, int] = {}


class KVIndex:
    """Where each session's (and each prompt's) KV is resident; see the module docstring."""

    def __init__(self, *, max_blocks: int, block_size_hint: int = 16) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        if block_size_hint < 1:
            raise ValueError(f"block_size_hint must be at least 1, got {block_size_hint}")
        self.max_blocks = max_blocks
        #: tokens per block prompts are cut into: the hint until the first stored block says
        self.block_size = block_size_hint
        self._block_size_learned = False
        self._backends: dict[str, _Backend] = {}
        self._slots: list[_Backend | None] = []
        self._sessions: dict[str, _Session] = {}
        #: content key -> bits of the backends holding a block with that key
        self._holders: dict[bytes, int] = {}
        self._lru = _Block(None, None, None, 0)  # sentinel of the circular list: next = oldest
        self._count = 0
        self._version = 0
        #: blocks dropped to stay within max_blocks (a counter, for metrics)
        self.evicted = 0

    # ------------------------------------------------------------------ reads (placement)

    @property
    def version(self) -> int:
        """Bumps on every change (for callers' caches)."""
        return self._version

    @property
    def blocks(self) -> int:
        """Blocks indexed, over all backends."""
        return self._count

    @property
    def sessions(self) -> int:
        """Sessions with resident tokens somewhere."""
        return len(self._sessions)

    def backend_blocks(self, backend_url: str) -> int:
        backend = self._backends.get(backend_url)
        return 0 if backend is None else len(backend.blocks)

    def session_tokens(self, session_id: str) -> Mapping[str, int]:
        """Backend URL -> the session's resident tokens there (only backends holding some). The
        index's own live map, not a copy: read it, do not keep it across an ``apply``."""
        session = self._sessions.get(session_id)
        return _EMPTY if session is None else session.tokens

    def prefix_tokens(self, prompt_ids: Sequence[int]) -> dict[str, int]:
        """Backend URL -> the longest prefix of ``prompt_ids`` resident there, in tokens (whole
        blocks of ``block_size``); backends holding none are absent."""
        holders = self._holders
        if not holders:
            return {}
        size = self.block_size
        blocks = len(prompt_ids) // size
        if blocks == 0:
            return {}
        raw = _token_bytes(prompt_ids)
        if raw is None:
            return {}
        step = size * _TOKEN_BYTES
        answer: dict[str, int] = {}
        slots = self._slots
        alive = -1  # every bit: all backends still match
        parent = ROOT
        for i in range(blocks):
            parent = blake2b(parent + raw[i * step:(i + 1) * step], digest_size=8).digest()
            held = holders.get(parent, 0) & alive
            if i:
                lost = alive & ~held
                while lost:
                    low = lost & -lost
                    lost ^= low
                    answer[slots[low.bit_length() - 1].url] = i * size  # type: ignore[union-attr]
            alive = held
            if not alive:
                return answer
        while alive:
            low = alive & -alive
            alive ^= low
            answer[slots[low.bit_length() - 1].url] = blocks * size  # type: ignore[union-attr]
        return answer

    # ------------------------------------------------------------------ writes (events)

    def apply(self, backend_url: str, batch: KVEventBatch) -> None:
        """Apply one engine step's events of ``backend_url``, in order. O(blocks named); never awaits."""
        self.apply_events(backend_url, batch.events)

    def apply_events(self, backend_url: str, events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        """``apply`` for a run of events (the service cuts a huge batch into slices)."""
        backend = self._backends.get(backend_url)
        if backend is None:
            backend = self._add_backend(backend_url)
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                self._store(backend, event)  # type: ignore[arg-type]
                if self._count > self.max_blocks:
                    self._evict_over()
            elif kind is BlockRemoved:
                self._remove(backend, event)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                self._clear(backend)
            self._version += 1

    def reset_backend(self, backend_url: str) -> None:
        """Forget every block of ``backend_url`` (engine restart, ``AllBlocksCleared``, lost events)."""
        backend = self._backends.get(backend_url)
        if backend is not None:
            self._clear(backend)
            self._version += 1

    def remove_backend(self, backend_url: str) -> None:
        """Forget ``backend_url`` altogether (it left its pool)."""
        backend = self._backends.pop(backend_url, None)
        if backend is None:
            return
        self._clear(backend)
        self._slots[backend.slot] = None
        while self._slots and self._slots[-1] is None:
            self._slots.pop()
        self._version += 1

    def forget_session(self, session_id: str) -> None:
        """Drop a session (it left the session table): its tokens count nowhere from now on."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            session.live = False
            session.tokens = {}
            self._version += 1

    # ------------------------------------------------------------------ internals

    def _add_backend(self, url: str) -> _Backend:
        slots = self._slots
        slot = next((i for i, held in enumerate(slots) if held is None), len(slots))
        backend = _Backend(url, slot)
        if slot == len(slots):
            slots.append(backend)
        else:
            slots[slot] = backend
        self._backends[url] = backend
        return backend

    def _session(self, sid: str) -> _Session:
        session = self._sessions.get(sid)
        if session is None:
            session = self._sessions[sid] = _Session(sid)
        return session

    def _store(self, backend: _Backend, event: BlockStored) -> None:
        if event.medium not in _INDEXED_MEDIA or event.group_idx:
            return
        hashes = event.block_hashes
        count = len(hashes)
        if not count:
            return
        tokens = event.token_ids
        size = event.block_size
        chained = True
        if len(tokens) == count * size:
            per = size
            if not self._block_size_learned and count and size > 0:
                self.block_size = size
                self._block_size_learned = True
        elif count == 1:
            per = len(tokens)  # a partial block (hash granularity below the block size)
        else:
            per = len(tokens) // count  # the tokens do not split: count them, match nothing
            chained = False
        if per < 1:
            return
        session = self._session(event.session_id) if event.session_id is not None else None
        blocks = backend.blocks
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            parent: bytes | None = ROOT
        else:
            parent_block = blocks.get(parent_hash)
            parent = parent_block.key if parent_block is not None else None
        raw: bytes | None = None
        step = per * _TOKEN_BYTES
        tail = self._lru
        holders = self._holders
        bit = backend.bit
        credit = 0  # tokens of new blocks tagged to ``session``, credited once at the end
        for i, ehash in enumerate(hashes):
            block = blocks.get(ehash)
            if block is None:
                key = None
                if parent is not None and chained:
                    if raw is None:
                        raw = _token_bytes(tokens) or b""
                    if raw:
                        key = blake2b(parent + raw[i * step:(i + 1) * step], digest_size=8).digest()
                block = _Block(backend, ehash, key, per)
                blocks[ehash] = block
                self._count += 1
                if key is not None:
                    bits = holders.get(key, 0)
                    if bits & bit:
                        self._hold(backend, key)
                    else:
                        holders[key] = bits | bit
                if session is not None:
                    block.tags = session
                    credit += per
            else:
                # a reuse: most recent now; learn its content key if it had none (parent now known)
                block.prev.next = block.next
                block.next.prev = block.prev
                if block.key is None and parent is not None and chained:
                    if raw is None:
                        raw = _token_bytes(tokens) or b""
                    if raw:
                        block.key = blake2b(parent + raw[i * step:(i + 1) * step], digest_size=8).digest()
                        self._hold(backend, block.key)
                if session is not None:
                    self._tag(block, session)
            last = tail.prev
            block.prev = last
            block.next = tail
            last.next = block
            tail.prev = block
            parent = block.key
        if credit:
            assert session is not None and session.live
            session.tokens[backend.url] = session.tokens.get(backend.url, 0) + credit

    def _hold(self, backend: _Backend, key: bytes) -> None:
        holders = self._holders
        bits = holders.get(key, 0)
        if bits & backend.bit:
            backend.dups[key] = backend.dups.get(key, 0) + 1
        else:
            holders[key] = bits | backend.bit

    def _release(self, backend: _Backend, key: bytes) -> None:
        dups = backend.dups
        extra = dups.get(key)
        if extra is not None:
            if extra > 1:
                dups[key] = extra - 1
            else:
                del dups[key]
            return
        holders = self._holders
        bits = holders.get(key, 0) & ~backend.bit
        if bits:
            holders[key] = bits
        else:
            holders.pop(key, None)

    def _tag(self, block: _Block, session: _Session) -> None:
        tags = block.tags
        if tags is session:
            return
        if tags is None:
            block.tags = session
        elif type(tags) is _Session:
            block.tags = [tags, session] if tags.live else session
        else:
            assert isinstance(tags, list)
            if session in tags:
                if tags[-1] is not session:
                    tags.remove(session)
                    tags.append(session)
                return
            tags.append(session)
            if len(tags) > MAX_TAGS:
                live = [s for s in tags if s.live]
                if len(live) > MAX_TAGS:
                    self._credit(live.pop(0), block, -1)
                block.tags = live
        self._credit(session, block, 1)

    def _credit(self, session: _Session, block: _Block, sign: int) -> None:
        if not session.live:
            return
        url = block.owner.url  # type: ignore[union-attr]
        tokens = session.tokens
        left = tokens.get(url, 0) + sign * block.tokens
        if left > 0:
            tokens[url] = left
            return
        tokens.pop(url, None)
        if not tokens:
            session.live = False
            if self._sessions.get(session.sid) is session:
                del self._sessions[session.sid]

    def _drop(self, block: _Block) -> None:
        """Unlink ``block`` from the LRU list, its content key and its sessions (not its backend's dict)."""
        block.prev.next = block.next
        block.next.prev = block.prev
        self._count -= 1
        owner = block.owner
        assert owner is not None
        if block.key is not None:
            self._release(owner, block.key)
        tags = block.tags
        if tags is not None:
            if type(tags) is _Session:
                self._credit(tags, block, -1)
            else:
                for session in tags:  # type: ignore[union-attr]
                    self._credit(session, block, -1)
            block.tags = None

    def _remove(self, backend: _Backend, event: BlockRemoved) -> None:
        if event.medium not in _INDEXED_MEDIA or event.group_idx:
            return
        blocks = backend.blocks
        for ehash in event.block_hashes:
            block = blocks.pop(ehash, None)
            if block is not None:
                self._drop(block)

    def _clear(self, backend: _Backend) -> None:
        blocks = backend.blocks
        backend.blocks = {}
        for block in blocks.values():
            self._drop(block)
        backend.dups.clear()

    def _evict_over(self) -> None:
        head = self._lru
        while self._count > self.max_blocks:
            oldest = head.next
            owner = oldest.owner
            assert owner is not None
            del owner.blocks[oldest.ehash]  # type: ignore[arg-type]
            self._drop(oldest)
            self.evicted += 1
