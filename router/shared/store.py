"""``SharedState``: pins and Responses ids in Redis, written off the request path, read on first sight,
moves pushed by pub/sub; degrades to local state when Redis is down or slow. The design is in the
package docstring (``router.shared``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections import deque
from collections.abc import Awaitable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from router.config.schema import SharedStateConfig
from router.membership import BackendSet
from router.shared.agreement import OFF_FIRST_REASONS, first_choice
from router.shared.metrics import SharedMetrics
from router.sessions.responses import ResponseIndex
from router.sessions.table import EvictReason, SessionEntry, SessionTable

log = logging.getLogger(__name__)

#: ops per pipeline (a longer queue goes in several)
BATCH = 512
#: an unknown Responses id is read again after this long, then twice as long, ... within read_timeout_s
RETRY_FIRST_S = 0.004
#: a live connection is pinged this often (finds a Redis that went slow or away without traffic)
PING_EVERY_S = 1.0
#: start-up waits for the first connection attempt this much longer than its PING and SUBSCRIBE bounds
JOIN_SLACK_S = 0.5
_RESPONSES_PREFIX = "/v1/responses/"
#: what may go wrong talking to Redis: its errors, the socket's, and our own timeouts
_FAILURES = (RedisError, OSError, asyncio.TimeoutError)
#: what ``_bounded`` answers for a read that timed out or failed (``None`` is Redis's own "no such key")
_FAILED = object()

# KEYS[1] the id's key, KEYS[2] the list of ids (newest first); ARGV: value, bound, id key prefix, id
_REMEMBER_LUA = """
redis.call('SET', KEYS[1], ARGV[1])
local n = redis.call('LPUSH', KEYS[2], ARGV[4])
local bound = tonumber(ARGV[2])
while n > bound do
  local old = redis.call('RPOP', KEYS[2])
  if old then redis.call('DEL', ARGV[3] .. old) end
  n = n - 1
end
return n
"""


class _Previous(msgspec.Struct):
    """The one field of a Responses request read before placement (when the shared state is on)."""

    previous_response_id: Any = None


_previous_decoder = msgspec.json.Decoder(_Previous)
_move_encoder = msgspec.json.Encoder()
_move_decoder = msgspec.json.Decoder(tuple[str, str, str, str, str])


def shown_url(url: str) -> str:
    """``url`` with its password (``redis://user:password@host``) replaced by ``***``, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


class SharedState:
    """One process's view of the shared state; ``start``/``stop`` by the app's lifecycle."""

    def __init__(self, config: SharedStateConfig, *, sessions: SessionTable, responses: ResponseIndex,
                 metrics: SharedMetrics, pool: BackendSet | str, ttl_s: float, max_response_ids: int) -> None:
        """``pool``: the pool the proxy places (whose pin ``SessionEntry.off_first`` describes; a pin
        learnt from another process is judged against this process's first choice there), or its name
        alone (the reason received is then taken as is)."""
        self.config = config
        #: the URL as logs show it: without its password
        self.shown_url = shown_url(config.url)
        self.sessions = sessions
        self.responses = responses
        self.metrics = metrics
        self.pool = pool if isinstance(pool, BackendSet) else None
        self.pool_name = pool if isinstance(pool, str) else pool.name
        self.ttl = max(1, math.ceil(ttl_s))
        #: a pin learnt here is not written back before this long (as ``Agreement.refresh_s``)
        self.refresh_s = ttl_s / 2
        self.max_response_ids = max_response_ids
        #: this process's id on the pub/sub channel (its own messages come back and are skipped)
        self.origin = uuid.uuid4().hex[:16]
        prefix = config.key_prefix
        self._pins_prefix = prefix + "pins:"
        self._resp_prefix = prefix + "resp:"
        self._resp_list = prefix + "resp-ids"
        self.channel = prefix + "pins"
        self._client: redis.Redis | None = None
        self._script: Any = None
        self._queue: deque[tuple[Any, ...]] = deque()
        self._wake = asyncio.Event()
        self._up_event = asyncio.Event()
        self._down_event = asyncio.Event()
        #: the keeper's first connection attempt is over (connected, or failed)
        self._tried = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._was_up = False
        #: a batch being sent (``stop`` waits for it too)
        self._sending = False
        metrics.up = 0
        responses.on_remember = self.response_stored if max_response_ids > 0 else None
        sessions.add_evict_hook(self._evicted)

    @property
    def up(self) -> bool:
        return self._up_event.is_set()

    def _new_client(self) -> redis.Redis:
        """A client without redis-py's own retries: a failure marks the shared state down at once and the
        keeper reconnects (with backoff) instead of a request waiting on retries."""
        timeout = self.config.write_timeout_s
        return redis.Redis.from_url(
            self.config.url, decode_responses=True, socket_timeout=timeout, socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._client = self._new_client()
        self._script = self._client.register_script(_REMEMBER_LUA)
        self._tasks = [asyncio.create_task(self._keep(), name="shared-state-keeper"),
                       asyncio.create_task(self._write(), name="shared-state-writer")]

    async def joined(self) -> bool:
        """Wait for the keeper's first connection attempt, then say whether it connected. Called at
        start-up before the process listens: a replica or worker that serves before it has joined
        would skip the reads of its first requests and place them by its own view (a follow-up to
        another process's Responses id would miss its backend). The attempt is bounded by the
        client's timeouts (a PING and a SUBSCRIBE of ``write_timeout_s`` each); a Redis that refuses
        or does not answer in time leaves the process serving from local state, reconnecting."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._tried.wait(), 2 * self.config.write_timeout_s + JOIN_SLACK_S)
        if not self.up:
            log.warning("shared state (%s) not reachable at start-up; serving from local state until it "
                        "connects (check the URL and that Redis runs)", self.shown_url)
        return self.up

    async def stop(self, flush_timeout_s: float = 1.0) -> None:
        """Flush what is queued (bounded), then stop the tasks and close the connections."""
        if self._queue and self.up:
            self._wake.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._drained(), flush_timeout_s)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._set_down()
        if self._client is not None:
            with contextlib.suppress(*_FAILURES):
                await self._client.aclose()
            self._client = None

    async def _drained(self) -> None:
        while (self._queue or self._sending) and self.up:
            await asyncio.sleep(0.005)

    def _set_up(self) -> None:
        self._down_event.clear()
        self._up_event.set()
        self.metrics.up = 1

    def _set_down(self) -> None:
        self._up_event.clear()
        self._down_event.set()
        self.metrics.up = 0

    def _failed(self, op: str, exc: BaseException) -> None:
        """A failure talking to Redis: counted, and the shared state is down until the keeper reconnects."""
        self.metrics.error(op)
        if self.up:
            log.warning("shared state (%s) unreachable on %s (%s: %s); going on with local state, reconnecting",
                        self.shown_url, op, type(exc).__name__, exc)
        self._set_down()

    # ------------------------------------------------------------------ writes (never awaited)
    def pin_moved(self, session_id: str, pool: str, url: str, reason: str, *, publish: bool = True,
                  new: bool = False) -> None:
        """Record ``session_id``'s pin in ``pool`` (``reason``: why it was placed there); ``publish``: tell
        the other processes (False: only keep the key alive); ``new``: a session's first pin, kept only
        if no other process wrote one first (``HSETNX``) and not published (the others that know the
        session placed it themselves; the ones that do not read it on first sight)."""
        self._enqueue(("pin", session_id, pool, url, reason, publish and not new, new))

    def response_stored(self, response_id: str, backend_url: str, session_id: str | None) -> None:
        self._enqueue(("resp", response_id, backend_url, session_id or ""))

    def _evicted(self, entry: SessionEntry, reason: EvictReason) -> None:
        if reason == "deleted":  # DELETE /v1/sessions/{id}: forgotten everywhere
            self._enqueue(("forget", entry.session_id))

    def _enqueue(self, op: tuple[Any, ...]) -> None:
        queue = self._queue
        if len(queue) >= self.config.queue_size:
            self.metrics.dropped_writes += 1
            return
        queue.append(op)
        self._wake.set()

    async def _write(self) -> None:
        """Drain the queue: each batch one pipeline, sent as soon as Redis is up."""
        queue = self._queue
        while True:
            await self._wake.wait()
            self._wake.clear()
            while queue:
                if not self.up:
                    await self._up_event.wait()
                    continue
                batch = [queue.popleft() for _ in range(min(BATCH, len(queue)))]
                self._sending = True
                try:
                    await asyncio.wait_for(self._send(batch), self.config.write_timeout_s)
                except _FAILURES as exc:
                    self.metrics.dropped_writes += len(batch)
                    self._failed("write", exc)
                finally:
                    self._sending = False

    async def _send(self, batch: list[tuple[Any, ...]]) -> None:
        client = self._client
        assert client is not None
        sent: dict[str, int] = {}
        async with client.pipeline(transaction=False) as pipe:
            await self._queue_ops(pipe, batch, sent)
            await pipe.execute()
        counts = self.metrics.writes  # counted once Redis has them
        for kind, count in sent.items():
            counts[kind] = counts.get(kind, 0) + count

    async def _queue_ops(self, pipe: Any, batch: list[tuple[Any, ...]], counts: dict[str, int]) -> None:
        for op in batch:
            kind = op[0]
            if kind == "pin":
                _, session_id, pool, url, reason, publish, new = op
                key = self._pins_prefix + session_id
                if new:
                    pipe.hsetnx(key, pool, f"{reason} {url}")
                else:
                    pipe.hset(key, pool, f"{reason} {url}")
                pipe.expire(key, self.ttl)
                if publish:
                    pipe.publish(self.channel, _move_encoder.encode((self.origin, session_id, pool, url, reason)))
            elif kind == "resp":
                _, response_id, url, session_id = op
                await self._script(keys=[self._resp_prefix + response_id, self._resp_list],
                                   args=[f"{url}\t{session_id}", self.max_response_ids, self._resp_prefix, response_id],
                                   client=pipe)  # queued on the pipeline (loaded first if needed)
            else:
                pipe.delete(self._pins_prefix + op[1])
            counts[kind] = counts.get(kind, 0) + 1

    # ------------------------------------------------------------------ reads (first sight only)
    async def recall_pins(self, entry: SessionEntry) -> None:
        """A session this process has no entry for until now: its pins as the others left them (one
        ``HGETALL``, at most ``read_timeout_s``; skipped while Redis is down)."""
        found = await self._read("pins", "hgetall", self._pins_prefix + entry.session_id)
        if not found:
            return
        entry.shared_until = asyncio.get_running_loop().time() + self.refresh_s
        for pool, value in found.items():
            reason, _, url = value.partition(" ")
            if url:
                entry.pins[pool] = url
                if pool == self.pool_name:
                    entry.off_first = self._off_first(entry.session_id, url, reason)

    async def recall_response(self, kind: str, body: bytes, target: str) -> None:
        """Before a Responses request is resolved: a ``previous_response_id`` (route ``responses``) or a
        ``/v1/responses/{id}`` path (route ``other``) unknown locally is read once from the shared
        state and remembered locally when another process stored it."""
        if kind == "responses":
            try:
                previous = _previous_decoder.decode(body).previous_response_id
            except (msgspec.DecodeError, msgspec.ValidationError):
                return  # not a JSON object: the proxy answers it
            if not isinstance(previous, str) or not previous:
                return
            response_id = previous
        elif kind == "other" and target.startswith(_RESPONSES_PREFIX):
            response_id = target[len(_RESPONSES_PREFIX):].partition("?")[0].partition("/")[0]
            if not response_id:
                return
        else:
            return
        if self.max_response_ids == 0 or response_id in self.responses:
            return
        found = await self._read("response", "get", self._resp_prefix + response_id)
        if found is None and self.up:
            # The id may be on its way: the replica that stored it wrote it off its request path, and the
            # client can be faster than that write. Read again, backing off, within read_timeout_s.
            found = await self._read_again(self._resp_prefix + response_id)
        if found:
            url, _, session_id = found.partition("\t")
            self.responses.remember(response_id, url, session_id or None, share=False)

    async def _bounded(self, call: Awaitable[Any], timeout_s: float) -> Any:
        """One read of Redis within ``timeout_s``: its answer, or ``_FAILED`` (timed out or failed;
        counted, and the connection judged by ``_failed``)."""
        try:
            return await asyncio.wait_for(call, timeout_s)
        except asyncio.TimeoutError as exc:
            self.metrics.read_timeouts += 1
            self._failed("read", exc)
        except _FAILURES as exc:
            self._failed("read", exc)
        return _FAILED

    async def _read_again(self, key: str) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.read_timeout_s
        pause = RETRY_FIRST_S
        reads = self.metrics.reads
        client = self._client
        assert client is not None
        while loop.time() + pause < deadline and self.up:
            await asyncio.sleep(pause)
            pause *= 2
            found = await self._bounded(client.get(key), max(0.001, deadline - loop.time()))
            if found is _FAILED:
                return None
            if found:
                reads[("response", "late")] = reads.get(("response", "late"), 0) + 1
                return found
        return None

    async def _read(self, kind: str, command: str, key: str) -> Any:
        reads = self.metrics.reads
        if not self.up:
            reads[(kind, "skipped")] = reads.get((kind, "skipped"), 0) + 1
            return None
        client = self._client
        assert client is not None
        found = await self._bounded(getattr(client, command)(key), self.config.read_timeout_s)
        if found is _FAILED:
            return None
        result = "hit" if found else "miss"
        reads[(kind, result)] = reads.get((kind, result), 0) + 1
        return found

    # ------------------------------------------------------------------ connection + pushed moves
    async def _keep(self) -> None:
        """Connect (PING), subscribe and listen until something fails; then back off and again."""
        backoff = self.config.backoff_min_s
        client = self._client
        assert client is not None
        while True:
            try:
                await asyncio.wait_for(client.ping(), self.config.write_timeout_s)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                try:
                    await asyncio.wait_for(pubsub.subscribe(self.channel), self.config.write_timeout_s)
                    if not self.up:  # a reconnect is news (it said when it went down); the first one is not
                        (log.warning if self._was_up else log.info)("shared state (%s) connected", self.shown_url)
                        self._was_up = True
                    self._set_up()
                    self._tried.set()
                    self._wake.set()  # flush what queued meanwhile
                    backoff = self.config.backoff_min_s
                    await self._listen(client, pubsub)
                finally:
                    with contextlib.suppress(*_FAILURES):
                        await asyncio.wait_for(pubsub.aclose(), self.config.write_timeout_s)
            except _FAILURES as exc:
                self._failed("connect" if not self.up else "subscribe", exc)
            self._tried.set()
            # whatever the pool holds was connected to the Redis that failed (maybe restarted since):
            # closed, so that the next command connects afresh instead of failing on a dead socket
            with contextlib.suppress(*_FAILURES):
                await asyncio.wait_for(client.connection_pool.disconnect(), self.config.write_timeout_s)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.backoff_max_s)

    async def _listen(self, client: redis.Redis, pubsub: Any) -> None:
        """Apply other processes' pin moves until the connection fails or a read/write marked it down."""
        loop = asyncio.get_running_loop()
        next_ping = loop.time() + PING_EVERY_S
        down = self._down_event
        while not down.is_set():
            message = await pubsub.get_message(timeout=min(PING_EVERY_S, 0.25))
            if message is not None and message.get("type") == "message":
                self._apply_move(message["data"])
            if loop.time() >= next_ping:
                await asyncio.wait_for(client.ping(), self.config.write_timeout_s)
                next_ping = loop.time() + PING_EVERY_S

    def _apply_move(self, data: str | bytes) -> None:
        try:
            origin, session_id, pool, url, reason = _move_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.metrics.error("message")
            return
        if origin == self.origin:
            return
        entry = self.sessions.get(session_id)
        if entry is None:  # not known here: read on first sight
            return
        entry.pins[pool] = url
        if pool == self.pool_name:
            entry.off_first = self._off_first(session_id, url, reason)
        entry.shared_until = asyncio.get_running_loop().time() + self.refresh_s
        self.metrics.pushes += 1

    def _off_first(self, session_id: str, url: str, reason: str) -> str:
        """``SessionEntry.off_first`` for a pin learnt from another process: "" when ``url`` is this
        process's first choice, else the mover's reason (one pass over the pool, off the request path)."""
        if self.pool is not None:
            first = first_choice(self.pool, session_id)
            if first is not None and first.url == url:
                return ""
            reason = reason or "other"
        return reason if not reason or reason in OFF_FIRST_REASONS else "other"
