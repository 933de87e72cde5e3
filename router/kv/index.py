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
comes). A session lives on a backend while some block there is tagged with it.
``forget_session`` (the session table's evict hook) drops a session at once; the blocks it tagged
keep a dead tag until they go.

Chains. An engine serves a prefix hit only along the chain from block 0: a block behind an evicted
one is resident but useless to the next turn. So ``session_tokens`` answers, per backend, the
tokens of the session's chain that is resident **from block 0** up to its first hole, not the sum
of its blocks. Each block hangs under its parent (the block whose engine hash its event named, or
the previous block of the event) and knows its ``reach``: the tokens from block 0 through it when
its whole chain is resident, else the tokens before the chain's first hole. When a block goes, its
children hang under its parent behind a hole and their subtrees' reach drops to the prefix before
it (O(that subtree): vLLM frees a request's blocks tail first, so usually nothing); a block stored
after a hole, or whose parent was never seen, reaches only to the hole (0 for an unknown parent)
until a later event names its real parent (vLLM's full report mode re-reports a chain from block
0). Per (session, backend) the index keeps a tip: the stored or reported block of the session
with the longest reach (a later chain replaces it when it reaches as far); when the tip goes, its
parent is the tip (the same reach), and ``session_tokens`` reads the tip's reach: O(1) per
backend. The chain includes blocks other sessions stored (a shared system prompt): a session's
first turn counts the system prompt it hit. A tip that moved up into blocks its session did not
tag is not told when they go (the tags are bounded); it then counts nothing there (stale ids are
recognised by a per-id generation). A hole filled again by a re-store of the same hash (a new
block) does not revive the blocks after it until an event names them again: the index then
under-counts, never over-counts.

Answers. ``observe_hit`` takes the engine's own word from an answer's ``usage``
(``prompt_tokens_details.cached_tokens``): when the index claims more of the session on that
backend than the engine found, and has not yet seen that prompt's blocks stored (its events are
late or were lost), the session counts what the engine found until its next stored blocks arrive
from that backend.

Bound. ``max_blocks`` over all backends: past it the least recently stored or reused block goes
(one LRU across backends, a doubly linked list through the block ids, O(1) per store, reuse and
eviction), as a ``BlockRemoved`` would. Measured (``bench/kv_index.py``, CPython 3.11, 64-bit):
410 bytes per indexed block with one session tag and 16-byte engine hashes, all structures
included (block and chain arrays, per-backend hash table, content-key table, session tables and
tips; 362 before the chains); each further
tag on a block adds a few dozen bytes (at most ``MAX_TAGS`` per block). ``BYTES_PER_BLOCK`` is the
figure to budget memory with.

Layout. A block is an integer id into parallel arrays (content key, tokens, owner, LRU links,
tag); its engine hash is in a dict of id -> hash; sessions are integer serials, their tokens in
one dict keyed by serial and backend slot. Arrays and dicts of only ints, strs and bytes are
nothing Python's cyclic garbage collector walks, so a million indexed blocks and 100,000 sessions
add (almost) no work to its full collections (over a million small block objects one took
seconds here, and it stops the event loop, the proxy's with it).

Costs. ``apply``: O(blocks in the events), one blake2b per newly stored block (a reuse or a removal
hashes nothing), plus a removed block's subtree (see Chains). ``session_tokens``: O(backends holding
the session), one tip lookup each. ``prefix_tokens``:
one blake2b per prompt block, and it stops at the first block no backend holds; the answer is
built as backends drop out, O(prompt blocks + backends in the answer). ``reset_backend`` and
``remove_backend``: O(that backend's blocks).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from hashlib import blake2b
from types import MappingProxyType
from typing import Final

from contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash, KVEventBatch

#: sessions one block counts for at most (the most recent ones)
MAX_TAGS: Final = 8
#: bytes per indexed block to budget with (410 measured with one tag; bench/kv_index.py prints the figure)
BYTES_PER_BLOCK: Final = 420
#: the content key's "parent" of a prompt's first block
ROOT: Final = b""
#: token ids are hashed as 8-byte little-endian signed ints
_TOKEN_FORMAT: Final = "q"
_TOKEN_BYTES: Final = 8
_INDEXED_MEDIA: Final = (None, "GPU")
_EMPTY: Final[Mapping[str, int]] = MappingProxyType({})
#: a block's content key when its parent was unknown (a real key that hashes to 0 is stored as 1)
_NO_KEY: Final = 0
#: a block's tag when its sessions are in ``_more`` (a list)
_MANY: Final = -1
#: backend slots per session key (``serial << _SLOT_BITS | slot``)
_SLOT_BITS: Final = 16


def _key_of(parent: bytes, raw: bytes) -> tuple[int, bytes]:
    """The content key of a block (as the int stored, and as the bytes its children chain on):
    blake2b-64 of its parent's key bytes and its tokens' bytes."""
    digest = blake2b(parent + raw, digest_size=8).digest()
    key = int.from_bytes(digest, "little", signed=True)
    return (key, digest) if key != _NO_KEY else (1, (1).to_bytes(8, "little", signed=True))


def _key_bytes(key: int) -> bytes:
    return key.to_bytes(8, "little", signed=True)


def _token_bytes(token_ids: Sequence[int]) -> bytes | None:
    """The tokens as the hash reads them; None for ids that do not fit 64 bits (not a real prompt)."""
    try:
        return array(_TOKEN_FORMAT, token_ids).tobytes()
    except (OverflowError, TypeError):
        return None


def prompt_block_keys(prompt_ids: Sequence[int], block_size: int) -> list[int]:
    """The content keys of the prompt's full blocks of ``block_size`` tokens: the keys ``KVIndex``
    gives the same tokens when an engine stores them (a partial last block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    raw = _token_bytes(prompt_ids)
    if raw is None:
        return []
    step = block_size * _TOKEN_BYTES
    keys: list[int] = []
    parent = ROOT
    for start in range(0, (len(prompt_ids) // block_size) * step, step):
        key, parent = _key_of(parent, raw[start:start + step])
        keys.append(key)
    return keys


class _Backend:
    """One backend's resident blocks (engine hash -> block id) and its bit in the content-key table."""

    __slots__ = ("url", "slot", "bit", "blocks", "dups")

    def __init__(self, url: str, slot: int) -> None:
        self.url = url
        self.slot = slot
        self.bit = 1 << slot
        self.blocks: dict[ExternalBlockHash, int] = {}
        #: content key -> extra blocks of this backend with that key (two engine hashes, one content:
        #: e.g. a different LoRA or salt); absent when there is one, the usual case
        self.dups: dict[int, int] = {}


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
        #: whether any backend's events reach the index (``has_events`` of one): while none does, it holds
        #: no block and no session, and a reader may skip it (kept by ``_add_backend`` and ``remove_backend``)
        self.any_events = False
        self._slots: list[_Backend | None] = []
        # blocks, by id; id 0 is the LRU list's sentinel (next: the oldest block, prev: the newest)
        self._key = array("q", [_NO_KEY])
        self._tokens = array("i", [0])
        self._owner = array("i", [-1])
        self._prev = array("i", [0])
        self._next = array("i", [0])
        #: 0: no session; > 0: one session's serial; _MANY: the serials are in ``_more``
        self._tag = array("q", [0])
        # the chain: parent block id (0: none), first child, next and previous sibling; ``_gap``: 1 when
        # the block's real parent is not its ``_up`` (evicted, or never seen); ``_rooted``: 1 when the whole
        # chain from block 0 through the block is resident; ``_reach``: the tokens of that chain's resident
        # prefix from block 0 (through the block when rooted, else up to the first hole); ``_gen``: bumps
        # when the id is freed (a session tip holding a stale id is recognised)
        self._up = array("i", [0])
        self._kid = array("i", [0])
        self._sib = array("i", [0])
        self._psib = array("i", [0])
        self._gap = array("b", [0])
        self._rooted = array("b", [0])
        self._reach = array("q", [0])
        self._gen = array("q", [0])
        #: (serial << _SLOT_BITS | slot) -> the session's tip there (gen << 32 | block): its deepest block
        self._tip: dict[int, int] = {}
        #: (serial << _SLOT_BITS | slot) -> the tokens the engine last reported cached (``observe_hit``)
        self._cap: dict[int, int] = {}
        self._more: dict[int, list[int]] = {}
        self._ehash: dict[int, ExternalBlockHash] = {}
        self._free: list[int] = []
        #: content key -> bits of the backends holding a block with that key
        self._holders: dict[int, int] = {}
        # sessions: id -> serial (never reused); live serial -> bits of the backend slots holding some of
        # its tokens; (serial << _SLOT_BITS | slot) -> its tokens there
        self._serial_of: dict[str, int] = {}
        self._name_of: dict[int, str] = {}
        self._held: dict[int, int] = {}
        self._resident: dict[int, int] = {}
        self._next_serial = 1
        self._count = 0
        self._version = 0
        #: blocks dropped to stay within max_blocks (a counter, for metrics)
        self.evicted = 0
        self._catch_up: Callable[[], None] | None = None
        #: whether ``catch_up`` has a feeder to run (``set_catch_up``): a placement skips the call when not
        self.catch_up_hooked = False

    # ------------------------------------------------------------------ reads (placement)

    def set_catch_up(self, catch_up: Callable[[], None] | None) -> None:
        """What ``catch_up`` runs: the feeder's ``router.kv.service.KVEvents.catch_up`` (None: nothing)."""
        self._catch_up = catch_up
        self.catch_up_hooked = catch_up is not None

    def catch_up(self) -> None:
        """Apply the events that reached the router since they were last read (when a read is due): a
        reader of the index calls this once before its reads, since the feeder reads its sockets
        only when asked or on a slow timer (``router.kv.subscriber``)."""
        catch_up = self._catch_up
        if catch_up is not None:
            catch_up()

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
        return len(self._held)

    def backend_blocks(self, backend_url: str) -> int:
        backend = self._backends.get(backend_url)
        return 0 if backend is None else len(backend.blocks)

    def has_events(self, backend_url: str) -> bool:
        """Whether ``backend_url``'s events reach the index (some applied since it was last removed;
        a reset keeps it): for such a backend, none of a session's tokens there means none (placement
        trusts it instead of guessing). O(1)."""
        return backend_url in self._backends

    def session_tokens(self, session_id: str) -> Mapping[str, int]:
        """Backend URL -> the tokens of the session's resident chain from block 0 there (what its next
        turn would hit: the prefix up to the first evicted block); only backends holding some; O(those
        backends)."""
        serial = self._serial_of.get(session_id)
        if serial is None:
            return _EMPTY
        bits = self._held.get(serial, 0)
        if not bits:
            return _EMPTY
        tips = self._tip
        gen = self._gen
        reach = self._reach
        caps = self._cap
        slots = self._slots
        base = serial << _SLOT_BITS
        answer: dict[str, int] = {}
        while bits:
            low = bits & -bits
            bits ^= low
            where = base | (low.bit_length() - 1)
            tip = tips.get(where)
            if tip is None:
                continue
            block = tip & 0xFFFFFFFF
            if gen[block] != tip >> 32:
                continue  # the tip went and its session was not told (a dropped tag): not known
            tokens = reach[block]
            if caps:
                tokens = min(tokens, caps.get(where, tokens))
            if tokens > 0:
                answer[slots[low.bit_length() - 1].url] = tokens  # type: ignore[union-attr]
        return answer

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
        from_bytes = int.from_bytes
        for i in range(blocks):
            parent = blake2b(parent + raw[i * step:(i + 1) * step], digest_size=8).digest()
            key = from_bytes(parent, "little", signed=True) or 1
            held = holders.get(key, 0) & alive
            if i:
                lost = alive & ~held
                while lost:
                    low = lost & -lost
                    lost ^= low
                    answer[slots[low.bit_length() - 1].url] = i * size  # type: ignore[union-attr]
            alive = held
            if not alive:
                return answer
            if key == 1:
                parent = _key_bytes(1)
        while alive:
            low = alive & -alive
            alive ^= low
            answer[slots[low.bit_length() - 1].url] = blocks * size  # type: ignore[union-attr]
        return answer

    # ------------------------------------------------------------------ writes (answers)

    def observe_hit(self, session_id: str, backend_url: str, cached_tokens: int, prompt_tokens: int) -> None:
        """The engine at ``backend_url`` answered a request of ``session_id`` having found
        ``cached_tokens`` of its ``prompt_tokens`` cached (``usage.prompt_tokens_details``). When the
        index still claims more of the session there than that, and has not yet seen this prompt's
        blocks stored (its answer is below the prompt's full blocks: the events are late or were lost),
        the engine's word wins: the session counts ``cached_tokens`` there until its next stored
        blocks arrive from that backend. When the index already holds the prompt's chain, the report
        is history (the engine has filled what it lacked) and changes nothing. O(1)."""
        serial = self._serial_of.get(session_id)
        backend = self._backends.get(backend_url)
        if serial is None or backend is None or cached_tokens < 0:
            return
        where = serial << _SLOT_BITS | backend.slot
        tip = self._tip.get(where)
        if tip is None:
            return
        block = tip & 0xFFFFFFFF
        if self._gen[block] != tip >> 32:
            return
        claimed = min(self._reach[block], self._cap.get(where, self._reach[block]))
        full = prompt_tokens // self.block_size * self.block_size
        if cached_tokens < claimed < full:
            self._cap[where] = cached_tokens
            self._version += 1

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
        self.any_events = bool(self._backends)
        self._version += 1

    def forget_session(self, session_id: str) -> None:
        """Drop a session (it left the session table): its tokens count nowhere from now on."""
        serial = self._serial_of.pop(session_id, None)
        if serial is not None:
            self._name_of.pop(serial, None)
            bits = self._held.pop(serial, 0)
            base = serial << _SLOT_BITS
            while bits:
                low = bits & -bits
                bits ^= low
                where = base | (low.bit_length() - 1)
                self._resident.pop(where, None)
                self._tip.pop(where, None)
                self._cap.pop(where, None)
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
        self.any_events = True
        return backend

    def _serial(self, sid: str) -> int:
        serial = self._serial_of.get(sid)
        if serial is None:
            serial = self._next_serial
            self._next_serial += 1
            self._serial_of[sid] = serial
            self._name_of[serial] = sid
            self._held[serial] = 0
        return serial

    def _new_block(self, slot: int, ehash: ExternalBlockHash, key: int, tokens: int) -> int:
        free = self._free
        if free:
            block = free.pop()
            self._key[block] = key
            self._tokens[block] = tokens
            self._owner[block] = slot
        else:
            block = len(self._tokens)
            self._key.append(key)
            self._tokens.append(tokens)
            self._owner.append(slot)
            self._prev.append(0)
            self._next.append(0)
            self._tag.append(0)
            for column in (self._up, self._kid, self._sib, self._psib, self._gap, self._rooted, self._reach,
                           self._gen):
                column.append(0)
        self._ehash[block] = ehash
        self._count += 1
        return block

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
            if not self._block_size_learned and size > 0:
                self.block_size = size
                self._block_size_learned = True
        elif count == 1:
            per = len(tokens)  # a partial block (hash granularity below the block size)
        else:
            per = len(tokens) // count  # the tokens do not split: count them, match nothing
            chained = False
        if per < 1:
            return
        serial = self._serial(event.session_id) if event.session_id is not None else 0
        blocks = backend.blocks
        keys = self._key
        prev = self._prev
        nxt = self._next
        parent_hash = event.parent_block_hash
        # the chain's previous block id (0: none); ``linked``: that parent is known (or it is block 0)
        up = 0 if parent_hash is None else blocks.get(parent_hash, 0)
        linked = parent_hash is None or up != 0
        #: the chain so far: the previous block's key as bytes (ROOT at a prompt's start), or as the int
        #: stored (turned into bytes only if a block after it needs hashing), or None (unknown)
        parent: bytes | int | None
        if parent_hash is None:
            parent = ROOT
        else:
            parent_block = blocks.get(parent_hash)
            parent_key = keys[parent_block] if parent_block is not None else _NO_KEY
            parent = parent_key if parent_key != _NO_KEY else None
        if not chained:
            parent = None
        raw: bytes | None = None
        step = per * _TOKEN_BYTES
        holders = self._holders
        bit = backend.bit
        slot = backend.slot
        credit = 0  # tokens of new blocks tagged to ``serial``, credited once at the end
        up_of, kid, sib, psib = self._up, self._kid, self._sib, self._psib
        gap, is_rooted, reach = self._gap, self._rooted, self._reach
        for i, ehash in enumerate(hashes):
            block = blocks.get(ehash)
            if block is None:
                key = _NO_KEY
                if parent is not None:
                    if type(parent) is int:
                        parent = _key_bytes(parent)
                    if raw is None:
                        raw = _token_bytes(tokens) or b""
                    if raw:
                        key, parent = _key_of(parent, raw[i * step:(i + 1) * step])  # type: ignore[arg-type]
                    else:
                        parent = None
                block = blocks[ehash] = self._new_block(slot, ehash, key, per)
                # hang it under ``up`` (inlined ``_attach``: the hot path; its columns are 0 when new)
                if up:
                    up_of[block] = up
                    first = kid[up]
                    if first:
                        sib[block] = first
                        psib[first] = block
                    kid[up] = block
                    rooted = is_rooted[up]
                    is_rooted[block] = rooted
                    reach[block] = reach[up] + per if rooted else reach[up]
                elif linked:
                    is_rooted[block] = 1
                    reach[block] = per
                else:
                    gap[block] = 1
                if key != _NO_KEY:
                    bits = holders.get(key, 0)
                    if bits & bit:
                        backend.dups[key] = backend.dups.get(key, 0) + 1
                    else:
                        holders[key] = bits | bit
                if serial:
                    self._tag[block] = serial
                    credit += per
            else:
                # a reuse: most recent now; learn its content key if it had none (parent now known)
                before, after = prev[block], nxt[block]
                nxt[before] = after
                prev[after] = before
                key = keys[block]
                if key == _NO_KEY:
                    if parent is not None:
                        if type(parent) is int:
                            parent = _key_bytes(parent)
                        if raw is None:
                            raw = _token_bytes(tokens) or b""
                        if raw:
                            key, parent = _key_of(parent, raw[i * step:(i + 1) * step])  # type: ignore[arg-type]
                            keys[block] = key
                            self._hold(backend, key)
                        else:
                            parent = None
                else:
                    parent = key
                if gap[block] and linked and up != block:
                    self._unlink(block)  # its chain is known now: it hangs under its real parent
                    self._attach(block, up, True)
                    self._settle(self._kid[block])
                if serial:
                    self._tag_block(block, serial)
            last = prev[0]
            prev[block] = last
            nxt[block] = 0
            nxt[last] = block
            prev[0] = block
            up = block
            linked = True
        if credit:
            where = serial << _SLOT_BITS | slot
            self._resident[where] = self._resident.get(where, 0) + credit
            self._held[serial] |= bit
        if serial:
            where = serial << _SLOT_BITS | slot
            if where in self._resident:
                self._cap.pop(where, None)  # newer events: the engine's last word is history
                tips = self._tip
                tip = tips.get(where)
                if (tip is None or self._gen[tip & 0xFFFFFFFF] != tip >> 32
                        or reach[up] >= reach[tip & 0xFFFFFFFF]):
                    tips[where] = self._gen[up] << 32 | up

    # ------------------------------------------------------------------ the chains

    def _attach(self, block: int, up: int, linked: bool) -> None:
        """Hang ``block`` under ``up`` (0: none) and compute its reach; ``linked``: ``up`` is its real
        parent (or it is block 0), else a hole lies between them."""
        self._gap[block] = 0 if linked else 1
        if up:
            kid = self._kid
            first = kid[up]
            self._up[block] = up
            self._sib[block] = first
            self._psib[block] = 0
            if first:
                self._psib[first] = block
            kid[up] = block
        self._place(block)

    def _place(self, block: int) -> None:
        """The block's rooted flag and reach, from its parent's."""
        up = self._up[block]
        if self._gap[block]:
            self._rooted[block] = 0
            self._reach[block] = self._reach[up] if up else 0
        elif up:
            rooted = self._rooted[up]
            self._rooted[block] = rooted
            self._reach[block] = self._reach[up] + (self._tokens[block] if rooted else 0)
        else:
            self._rooted[block] = 1
            self._reach[block] = self._tokens[block]

    def _unlink(self, block: int) -> None:
        """Take ``block`` out of its parent's children (its own children stay with it)."""
        up = self._up[block]
        before, after = self._psib[block], self._sib[block]
        if before:
            self._sib[before] = after
        elif up:
            self._kid[up] = after
        if after:
            self._psib[after] = before
        self._up[block] = self._sib[block] = self._psib[block] = 0

    def _settle(self, first: int) -> None:
        """Recompute the reach of the siblings from ``first`` on and of all their descendants."""
        sib, kid = self._sib, self._kid
        stack = [first] if first else []
        while stack:
            block = stack.pop()
            self._place(block)
            if sib[block]:
                stack.append(sib[block])
            if kid[block]:
                stack.append(kid[block])

    def _cut(self, block: int) -> None:
        """``block`` goes: its children hang under its parent behind a hole (or alone when it had
        none), and their subtrees' reach drops to the prefix before it. O(its subtree)."""
        up = self._up[block]
        self._unlink(block)
        kid, sib, psib = self._kid, self._sib, self._psib
        child = kid[block]
        kid[block] = 0
        while child:
            after = sib[child]
            self._gap[child] = 1
            if up:
                self._up[child] = up
                head = kid[up]
                sib[child] = head
                psib[child] = 0
                if head:
                    psib[head] = child
                kid[up] = child
            else:
                self._up[child] = sib[child] = psib[child] = 0
            self._place(child)
            self._settle(kid[child])
            child = after

    def _hold(self, backend: _Backend, key: int) -> None:
        holders = self._holders
        bits = holders.get(key, 0)
        if bits & backend.bit:
            backend.dups[key] = backend.dups.get(key, 0) + 1
        else:
            holders[key] = bits | backend.bit

    def _release(self, backend: _Backend, key: int) -> None:
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

    def _tag_block(self, block: int, serial: int) -> None:
        tag = self._tag[block]
        if tag == serial:
            return
        live = self._held
        if tag == 0:
            self._tag[block] = serial
        elif tag > 0:
            if tag in live:
                self._more[block] = [tag, serial]
                self._tag[block] = _MANY
            else:
                self._tag[block] = serial  # a dead tag: replaced
        else:
            tags = self._more[block]
            if serial in tags:
                if tags[-1] != serial:
                    tags.remove(serial)
                    tags.append(serial)
                return
            tags.append(serial)
            if len(tags) > MAX_TAGS:
                kept = [s for s in tags if s in live]
                if len(kept) > MAX_TAGS:
                    self._credit(kept.pop(0), block, -1)
                self._more[block] = kept
        self._credit(serial, block, 1)

    def _credit(self, serial: int, block: int, sign: int) -> None:
        bits = self._held.get(serial)
        if bits is None:
            return  # a dead tag (forgotten, or emptied) counts for nothing
        slot = self._owner[block]
        where = serial << _SLOT_BITS | slot
        resident = self._resident
        left = resident.get(where, 0) + sign * self._tokens[block]
        if left > 0:
            resident[where] = left
            self._held[serial] = bits | (1 << slot)
            return
        resident.pop(where, None)
        self._tip.pop(where, None)
        self._cap.pop(where, None)
        bits &= ~(1 << slot)
        if bits:
            self._held[serial] = bits
            return
        del self._held[serial]
        name = self._name_of.pop(serial)
        if self._serial_of.get(name) == serial:
            del self._serial_of[name]

    def _drop(self, block: int, cut: bool = True) -> None:
        """Unlink ``block`` from the LRU list, its content key, its chain (``cut``: not when its whole
        backend goes) and its sessions, and free its id (not from its backend's dict: the caller does
        that)."""
        prev, nxt = self._prev, self._next
        before, after = prev[block], nxt[block]
        nxt[before] = after
        prev[after] = before
        self._count -= 1
        owner = self._slots[self._owner[block]]
        assert owner is not None
        key = self._key[block]
        if key != _NO_KEY:
            self._release(owner, key)
        tag = self._tag[block]
        if tag:
            # its sessions whose tip it is: their tip is its parent now (the same reach)
            up = self._up[block]
            tips = self._tip
            gone = self._gen[block] << 32 | block
            for serial in ((tag,) if tag > 0 else self._more[block]):
                where = serial << _SLOT_BITS | self._owner[block]
                if tips.get(where) == gone:
                    if up:
                        tips[where] = self._gen[up] << 32 | up
                    else:
                        del tips[where]
        if cut:
            self._cut(block)
        else:
            self._up[block] = self._kid[block] = self._sib[block] = self._psib[block] = 0
        self._gap[block] = self._rooted[block] = 0
        self._reach[block] = 0
        self._gen[block] += 1
        if tag > 0:
            self._credit(tag, block, -1)
        elif tag == _MANY:
            for serial in self._more.pop(block):
                self._credit(serial, block, -1)
        self._tag[block] = 0
        del self._ehash[block]
        self._free.append(block)

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
            self._drop(block, cut=False)
        backend.dups.clear()

    def _evict_over(self) -> None:
        nxt = self._next
        while self._count > self.max_blocks:
            oldest = nxt[0]
            owner = self._slots[self._owner[oldest]]
            assert owner is not None
            del owner.blocks[self._ehash[oldest]]
            self._drop(oldest)
            self.evicted += 1
