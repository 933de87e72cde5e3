"""Receiving one backend's KV events: ZMQ SUB sockets, seq tracking, replay of missed batches.

The wire (``contract.kv_events``): a publisher sends ``(topic, seq, payload)`` per engine step;
``seq`` counts 0, 1, 2, ... from the publisher's start. Per ``EventSource`` (one engine: a backend,
or one data-parallel rank of it) a ``Stream`` checks each seq against the last one applied:

- the next one: applied;
- a gap (``seq > last + 1``): the missing batches are asked of the engine's replay socket (a
  ``DEALER`` to vLLM's ``ROUTER``: ``(b"", start_seq)`` -> ``(b"", topic, seq, payload)`` per buffered
  batch, then ``(b"", b"", END_SEQ, b"")``) and applied before this one. If the replay cannot fill
  the gap (no replay socket, no answer within ``replay_timeout_s``, or the engine's buffer no longer
  holds the first missing batch) the backend's entries are reset: the index forgets rather than
  believe blocks whose removal it may have missed;
- ``seq <= last``: the engine restarted (a new publisher counts from 0 again): the backend is reset;
- the first batch of a stream (at start, or after the socket saw the peer disconnect, i.e. a new
  connection that may be a new engine process): the backend is reset when it held anything (unless
  the batch is the very next seq: the same engine, reconnected), and with ``seq > 0`` the batches
  before it are fetched by replay (what the engine stored before the router listened, as far as its
  buffer goes);
- the peer disconnected *and* the backend's health check says it is down: the engine is gone, and
  one that comes back starts empty: the backend is reset at once (``engine_down``), so placement does
  not count on its old entries while it is away or before its first new batch.

Bind or connect (``subscriber_address``): an engine whose endpoint names a concrete host connects
its PUB there (vLLM's rule, ``contract.kv_events.publisher_binds``), so the router binds that
address; an endpoint the engine binds (``*``, ``::``, ``ipc://``) the router connects to, with the
backend's own host in place of ``*``/``[::]``. Several engines may connect to one address the
router binds (the usual "all engines publish to the router" set-up): one socket then serves them,
told apart by their topics (each must have its own).

Reading costs no wake-up of its own: the socket is a plain (non-asyncio) ZMQ socket that nobody
watches. Its batches wait in ZMQ's queue until ``SubSocket.drain`` takes them all at once; the owner
(``router.kv.service``) drains before placement reads the index and on a slow timer while no request
comes. On this machine a wake-up of the router's main thread for each message cost about as much
as everything else the events cost together (bench/RESULTS.md). The next batch of a running stream is
applied right there; anything that has to wait (a replay, a batch of more than ``APPLY_CHUNK``
events) goes to a task, and the socket is drained again when it is done, so batches stay in order.

A flood never blocks the event loop: a socket's reader applies what is queued in slices of
``SLICE_S`` seconds of work and yields to the loop between them (a huge batch is applied
``APPLY_CHUNK`` events at a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from contract.kv_events import (
    END_SEQ,
    KVEvent,
    KVEventBatch,
    decode_batch,
    publisher_binds,
    seq_from_bytes,
    seq_to_bytes,
)
from router.kv.index import KVIndex
from router.kv.metrics import KVMetrics

logger = logging.getLogger(__name__)

#: seconds of event work a reader does before it yields to the event loop
SLICE_S = 0.002
#: events applied in one go (a huge batch is cut into runs of this many)
APPLY_CHUNK = 64
#: the socket's receive high-water mark (messages queued before ZMQ drops; the engine's own is 100,000)
RCVHWM = 100_000
# plain ints: pyzmq's constants are enum members, whose operators cost microseconds per message
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one engine publishes: from the router's config or the backend's ``GET /kv_event_sources``."""

    backend_url: str
    #: the engine's endpoint as it reports it (``tcp://*:5557``, ``tcp://10.0.0.9:5557``, ``ipc://...``)
    endpoint: str
    replay: str | None = None
    topic: str = ""
    #: data-parallel rank (several ranks of one backend feed the same index entries)
    rank: int = 0
    #: the backend's name for metrics and logs
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.backend_url


def _host_of(backend_url: str) -> str:
    host = urlsplit(backend_url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def subscriber_address(endpoint: str, backend_url: str) -> tuple[bool, str]:
    """``(bind, address)`` of the router's socket for an engine's ``endpoint``: bind it when the
    engine connects (a concrete host), else connect, to the backend's host in place of a wildcard."""
    if not publisher_binds(endpoint):
        return True, endpoint
    return False, replay_address(endpoint, backend_url)


def replay_address(endpoint: str, backend_url: str) -> str:
    """Where to connect to a socket the engine bound (its replay socket always is): the backend's
    host in place of ``*`` or ``[::]``/``::``."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if host in ("*", "[::]", "::", "[*]", "0.0.0.0", ""):
        return f"tcp://{_host_of(backend_url)}{sep}{port}"
    return endpoint


class Stream:
    """One engine's run of batches: seq tracking and what to do on gaps and restarts (module docstring)."""

    def __init__(self, source: EventSource, index: KVIndex, metrics: KVMetrics, context: zmq.asyncio.Context,
                 *, replay_timeout_s: float, is_down: Callable[[], bool] | None = None) -> None:
        self.source = source
        self.index = index
        self.metrics = metrics
        self.context = context
        self.replay_timeout_s = replay_timeout_s
        self.topic = source.topic.encode()
        self.replay = replay_address(source.replay, source.backend_url) if source.replay else None
        #: seq of the last batch applied (None: no batch yet on this connection)
        self.last: int | None = None
        #: ``last`` before the connection dropped: a next batch right after it is the same engine going on
        self.previous: int | None = None
        #: batches applied since the stream started (the first one may reset)
        self.applied = 0
        self.closed = False
        #: the socket saw a peer disconnect and no batch came since
        self.disconnected = False
        #: whether the backend is unhealthy now (its health checker's view)
        self._is_down = is_down

    def peer_gone(self) -> None:
        """A peer of this stream's socket disconnected. With the backend also down, its engine is gone
        (a process that comes back has an empty cache): its entries are dropped now, not at its first
        batch, so placement does not count on them meanwhile."""
        self.restart()
        self.disconnected = True
        if self._is_down is not None and self._is_down():
            self.engine_down()

    def engine_down(self) -> None:
        """The backend turned unhealthy: after a disconnect, its entries go (``peer_gone``)."""
        if self.disconnected and self.index.backend_blocks(self.source.backend_url):
            logger.info("KV events of %s: the engine disconnected and its backend is down: its index entries reset",
                        self.source.label)
            self._reset("engine_down")

    def restart(self) -> None:
        """A peer disconnected: the next batch starts a new stream (it may come from a new engine
        process) unless it is the very next seq (the same engine, reconnected)."""
        if self.last is not None:
            self.previous = self.last
        self.last = None

    def take(self, seq: int, payload: bytes) -> Coroutine[Any, Any, None] | None:
        """One live message, applied at once when it is the next batch of a running stream and small
        (the usual case); otherwise the work that has to wait is returned, for the caller to run as a
        task before it reads on (a gap or restart: ``receive``; a batch of more than ``APPLY_CHUNK``
        events: applied in slices)."""
        if self.closed:
            return None
        last = self.last
        if last is None or seq != last + 1:
            return self.receive(seq, payload, Slicer())
        self.disconnected = False
        batch = self._decode(seq, payload)
        if batch is None:
            return None
        events = batch.events
        if len(events) > APPLY_CHUNK:
            return self._apply_batch(batch, Slicer())
        self._apply_run(events)
        return None

    async def receive(self, seq: int, payload: bytes, slicer: Slicer) -> None:
        """One live message: check its seq, fill a gap or reset, then apply it."""
        if self.closed:
            return
        self.disconnected = False
        last = self.last
        if last is not None and seq == last + 1:
            await self._apply(seq, payload, slicer)
            return
        label = self.source.label
        if last is None:
            previous, self.previous = self.previous, None
            if previous is not None and seq == previous + 1:
                await self._apply(seq, payload, slicer)
                return
            if self.index.backend_blocks(self.source.backend_url):
                self._reset("new_stream")
            if seq > 0:
                await self._fill(0, seq, slicer, catch_up=True)
        elif seq <= last:
            logger.info("KV events of %s: seq %d after %d, the engine restarted: its index entries reset",
                        label, seq, last)
            self._reset("restart")
            if seq > 0:
                await self._fill(0, seq, slicer, catch_up=True)
        else:
            self.metrics.gap(label)
            await self._fill(last + 1, seq, slicer, catch_up=False)
        if not self.closed:
            await self._apply(seq, payload, slicer)

    def _reset(self, reason: str) -> None:
        self.index.reset_backend(self.source.backend_url)
        self.metrics.reset(self.source.label, reason)

    def _decode(self, seq: int, payload: bytes) -> KVEventBatch | None:
        """Decode batch ``seq`` and count it as the stream's last; None (counted, logged) when it is garbage."""
        self.last = seq
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.metrics.error(self.source.label, "decode")
            logger.warning("KV events of %s: batch %d does not decode as a KVEventBatch; skipped",
                           self.source.label, seq)
            return None
        self.applied += 1
        return batch

    async def _apply(self, seq: int, payload: bytes, slicer: Slicer) -> None:
        batch = self._decode(seq, payload)
        if batch is not None:
            await self._apply_batch(batch, slicer)

    def _apply_run(self, events: list[KVEvent]) -> None:
        """Apply ``events`` (at most ``APPLY_CHUNK``) to the index and count them."""
        self.index.apply_events(self.source.backend_url, events)
        self.metrics.events(self.source.label, len(events))

    async def _apply_batch(self, batch: KVEventBatch, slicer: Slicer) -> None:
        events = batch.events
        if len(events) <= APPLY_CHUNK:
            self._apply_run(events)
            await slicer.maybe_yield()
            return
        for start in range(0, len(events), APPLY_CHUNK):
            if self.closed:
                return
            self._apply_run(events[start:start + APPLY_CHUNK])
            await slicer.maybe_yield()

    async def _fill(self, start: int, stop: int, slicer: Slicer, *, catch_up: bool) -> None:
        """Apply batches ``start`` .. ``stop - 1`` from the replay socket. A gap that stays open resets
        the backend; a catch-up (a stream's start) takes what the engine still holds."""
        label = self.source.label
        if self.replay is None:
            if not catch_up:
                self.metrics.replay(label, "unavailable")
                logger.warning("KV events of %s: batches %d..%d missed and no replay endpoint: its index entries "
                               "reset", label, start, stop - 1)
                self._reset("gap")
            return
        result = await self._replay(start, stop, slicer, catch_up=catch_up)
        self.metrics.replay(label, result)
        if result == "failed" and not catch_up and not self.closed:
            logger.warning("KV events of %s: batches %d..%d missed and the replay socket %s did not send them: "
                           "its index entries reset", label, start, stop - 1, self.replay)
            self._reset("gap")

    async def _replay(self, start: int, stop: int, slicer: Slicer, *, catch_up: bool) -> str:
        """Ask the replay socket for batches from ``start`` on and apply those below ``stop``. Returns
        ``filled``; ``partial`` when the engine's buffer began after ``start`` (for a gap the backend is
        reset first, then what the buffer held is applied); ``failed`` (no answer within
        ``replay_timeout_s``, or the answer ended before ``stop``); ``closed`` (the stream closed)."""
        assert self.replay is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        expected = start
        lost = False
        try:
            dealer.connect(self.replay)
            await dealer.send_multipart([b"", seq_to_bytes(start)])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.replay_timeout_s
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await dealer.poll(remaining * 1000, zmq.POLLIN):
                    return "failed"
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[0] or len(frames[2]) != 8:
                    self.metrics.error(self.source.label, "replay_frames")
                    continue
                _, topic, seq_raw, payload = frames
                if seq_raw == END_SEQ:
                    break
                seq = seq_from_bytes(seq_raw)
                if topic != self.topic or seq < expected:
                    continue
                if seq >= stop:
                    break
                if self.closed:
                    return "closed"
                if seq > expected:
                    if expected != start:
                        return "failed"  # a hole inside the answer: not how a replay buffer answers
                    lost = True  # the buffer no longer holds start .. seq - 1
                    if not catch_up:
                        self._reset("gap")
                await self._apply(seq, payload, slicer)
                expected = seq + 1
            if expected < stop:
                return "failed"
            return "partial" if lost else "filled"
        except (zmq.ZMQError, ValueError) as exc:
            logger.warning("KV events of %s: replay from %s failed: %s", self.source.label, self.replay, exc)
            return "failed"
        finally:
            dealer.close(linger=0)


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Slicer:
    """Yields to the event loop once a reader has worked ``SLICE_S`` seconds since the last yield."""

    __slots__ = ("deadline",)

    def __init__(self) -> None:
        self.deadline = time.perf_counter() + SLICE_S

    async def maybe_yield(self) -> None:
        if time.perf_counter() >= self.deadline:
            await asyncio.sleep(0)
            self.deadline = time.perf_counter() + SLICE_S


class SubSocket:
    """One SUB socket (bound or connected) and the streams it carries, told apart by topic."""

    def __init__(self, context: zmq.asyncio.Context, bind: bool, address: str, metrics: KVMetrics) -> None:
        self.context = context
        self.bind = bind
        self.address = address
        self.metrics = metrics
        self.streams: dict[bytes, Stream] = {}
        self._socket: zmq.Socket[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: work of one message that has to wait (a replay, a huge batch); the socket is not read meanwhile
        self._task: asyncio.Task[None] | None = None
        #: a drain is queued with ``call_soon`` (a slice ran out, or a waiting message's work is done)
        self._queued = False
        self._monitor_task: asyncio.Task[None] | None = None

    @property
    def key(self) -> tuple[bool, str]:
        return self.bind, self.address

    def add(self, stream: Stream) -> None:
        """Carry ``stream``; ``ValueError`` when its topic cannot be told from another's here."""
        topic = stream.topic
        if topic in self.streams:
            raise ValueError(f"two KV-event sources share {self.address} with the same topic {topic.decode()!r}: "
                             "give each engine its own topic")
        if self.streams and (not topic or b"" in self.streams):
            raise ValueError(f"several KV-event sources share {self.address}: each needs a non-empty topic of its own")
        self.streams[topic] = stream
        if self._socket is not None:
            self._socket.setsockopt(zmq.SUBSCRIBE, topic)

    def discard(self, stream: Stream) -> bool:
        """Stop carrying ``stream``; True when none is left (the socket should close)."""
        if self.streams.get(stream.topic) is stream:
            del self.streams[stream.topic]
            stream.closed = True
            if self._socket is not None and not self._socket.closed:
                self._socket.setsockopt(zmq.UNSUBSCRIBE, stream.topic)
        return not self.streams

    def start(self) -> None:
        # a plain socket (not an asyncio one), read by ``drain`` only
        socket = self.context.socket(zmq.SUB, socket_class=zmq.Socket)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, RCVHWM)
        for topic in self.streams:
            socket.setsockopt(zmq.SUBSCRIBE, topic)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)
        if self.bind:
            socket.bind(self.address)
        else:
            socket.connect(self.address)
        self._socket = socket
        self._loop = asyncio.get_running_loop()
        self._monitor_task = asyncio.create_task(self._watch(monitor), name=f"kv-events monitor {self.address}")

    async def close(self) -> None:
        for stream in self.streams.values():
            stream.closed = True
        await _cancel(self._task)
        if self._socket is not None:
            # the monitor stops while its PAIR is still open: libzmq's last monitor events would
            # otherwise block on a PAIR with no peer
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._socket.close(linger=0)
        await _cancel(self._monitor_task)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """A peer disconnected: the streams here start anew with their next batch."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    for stream in list(self.streams.values()):
                        stream.peer_gone()
        finally:
            monitor.close(linger=0)

    def _queue_drain(self) -> None:
        if not self._queued and self._loop is not None:
            self._queued = True
            self._loop.call_soon(self._drain_queued)

    def _drain_queued(self) -> None:
        self._queued = False
        self.drain()

    def drain(self) -> None:
        """Apply what the socket holds, for up to ``SLICE_S`` seconds (then the rest after the loop's
        next turn, ``_queue_drain``). Reads nothing while a message's work is waiting (it drains
        again when done) or once the socket is closed."""
        socket = self._socket
        if socket is None or socket.closed or self._loop is None:
            return
        # reading EVENTS also runs ZMQ's pending commands (a new peer's pipe: the subscription goes out),
        # which must happen while a message's work waits too
        if not socket.getsockopt(_EVENTS) & _POLLIN or self._task is not None:
            return
        streams = self.streams
        self.metrics.reads += 1
        deadline = time.perf_counter() + SLICE_S
        while socket.getsockopt(_EVENTS) & _POLLIN:
            if time.perf_counter() >= deadline:
                self._queue_drain()
                return
            try:
                frames = socket.recv_multipart(_NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or len(frames[1]) != 8:
                self.metrics.error(self.address, "frames")
                continue
            topic, seq_raw, payload = frames
            stream = streams.get(topic)
            if stream is None:
                stream = streams.get(b"")
                if stream is None:
                    continue  # a topic subscribed by prefix only, or just unsubscribed
            try:
                waiting = stream.take(seq_from_bytes(seq_raw), payload)
            except Exception:  # one bad batch must not end the reader
                logger.exception("KV events of %s: batch failed", stream.source.label)
                self.metrics.error(stream.source.label, "apply")
                continue
            if waiting is not None:
                task = self._task = asyncio.create_task(waiting, name=f"kv-events {self.address}")
                task.add_done_callback(functools.partial(self._finished, stream))
                return

    def _finished(self, stream: Stream, task: asyncio.Task[None]) -> None:
        """A message's work that had to wait is done: read on (unless the socket closed)."""
        self._task = None
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # one bad batch must not end the reader
            logger.error("KV events of %s: batch failed", stream.source.label, exc_info=exc)
            self.metrics.error(stream.source.label, "apply")
        self._queue_drain()
