"""``ZmqPublisher``: vLLM 0.32's ZMQ KV-event publisher (PUB + replay ROUTER), fed without blocking.

What vLLM does (``ZmqEventPublisher``): the scheduler ``put``s each step's batch on a
``queue.Queue(max_queue_size)`` -- a blocking put, so a full queue stalls the engine -- and a thread
numbers the batches 0, 1, 2, ..., encodes them, sends ``(topic, seq, payload)`` on the PUB socket,
keeps the last ``buffer_steps`` for the replay socket and answers replay requests between batches
(polling the ROUTER, then waiting up to 100 ms on the queue). Frames and the bind/connect rule are in
``contract/kv_events.py``.

What we do, the same on the wire:

- ``publish`` (the engine's thread) gives the batch its seq, then appends it to a bounded queue and
  returns; it never blocks and never raises. **A full queue drops the batch and counts it**
  (``dropped``, ``session_backend_kv_event_batches_total{outcome="dropped"}``); its seq is used all
  the same, so a subscriber sees a gap in ``seq``, asks the replay socket, and -- the batch never
  reached the replay buffer -- gets the batches after it (the first replayed seq is above the one it
  asked for): it knows events were lost and must resync that engine (drop what it holds for it).
- One thread owns the sockets: it waits in ``zmq.Poller`` on the replay socket and a wake-up pipe
  (written only when the queue goes from empty to not empty, so an idle publisher costs nothing),
  sends every queued batch (PUB never blocks: past ``hwm`` queued messages ZMQ drops them, as in
  vLLM), keeps ``buffer_steps`` of them in a ring for replay, and answers replay requests: every
  buffered batch with ``seq >= start_seq``, then ``END_SEQ``. The ROUTER's send high-water mark is
  ``buffer_steps + 1`` so a whole replay fits (ZMQ's default of 1,000 would drop the middle of a
  long one).
- ``tcp://*:0`` binds an ephemeral port on this backend's address (``VLLM_HOST_IP`` if set, else
  ``--host`` when it names one address; otherwise start-up fails, as in vLLM) and the resolved
  endpoint is what ``GET /kv_event_sources`` reports. Any other endpoint is bound or connected to
  exactly as written (``publisher_binds``); the replay endpoint is always bound.
- ``start`` opens the sockets in the caller's thread (a bind error is a ``PublisherError`` at
  start-up); ``close`` lets the thread send what is queued, closes both sockets with a short linger
  (so a last batch still leaves on a connect endpoint) and terminates the ZMQ context.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import deque

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Counter

from contract.kv_events import (
    END_SEQ,
    SEQ_BYTES,
    KVEventBatch,
    KVEventsConfig,
    encode_batch,
    publisher_binds,
    seq_to_bytes,
)

log = logging.getLogger(__name__)

EPHEMERAL_TCP = "tcp://*:0"
#: how long closing sockets may still send what they hold
CLOSE_LINGER_MS = 500
#: the thread wakes at least this often (a safety net; wake-ups come from the pipe)
POLL_MS = 1000
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")


class PublisherError(RuntimeError):
    """A socket of ``--kv-events-config`` could not be bound or connected."""


class PublisherMetrics:
    """``session_backend_kv_event_batches_total{outcome}`` and ``..._kv_event_replays_total``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        batches = Counter("session_backend_kv_event_batches", "KV-event batches (one per engine step with events): "
                          "published on the PUB socket, or dropped because the publisher's queue was full "
                          "(--kv-events-config max_queue_size).", ["outcome"], registry=registry)
        self.published = batches.labels("published")
        self.dropped = batches.labels("dropped")
        self.replays = Counter("session_backend_kv_event_replays", "Replay requests answered on the KV-event "
                               "replay socket.", registry=registry)


class ZmqPublisher:
    """The PUB socket, the replay ROUTER, the bounded queue between the engine and them."""

    def __init__(self, config: KVEventsConfig, *, host: str = "127.0.0.1",
                 metrics: PublisherMetrics | None = None) -> None:
        self._requested = config
        self._host = host
        self._metrics = metrics
        self.config = config  #: the resolved config once started (what /kv_event_sources reports)
        self._queue: deque[tuple[int, KVEventBatch]] = deque()
        self._max_queue = config.max_queue_size
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._next_seq = 0
        self.dropped = 0
        self.published = 0
        self._closing = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """True while the publishing thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> KVEventsConfig:
        """Open the sockets (bind or connect) and start the thread; returns the resolved config."""
        if self._thread is not None:
            return self.config
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        replay: zmq.Socket[bytes] | None = None
        try:
            pub.set_hwm(self._requested.hwm)
            endpoint = self._open(pub, self._requested.endpoint, bind=publisher_binds(self._requested.endpoint))
            replay_endpoint = self._requested.replay_endpoint
            if replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, self._requested.buffer_steps + 1)
                replay_endpoint = self._open(replay, replay_endpoint, bind=True)
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            ctx.term()
            raise
        self._ctx, self._pub, self._replay = ctx, pub, replay
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.config = msgspec.structs.replace(self._requested, enable_kv_cache_events=True, publisher="zmq",
                                              endpoint=endpoint, replay_endpoint=replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        how = "bound" if publisher_binds(self._requested.endpoint) else "connected to"
        log.info("KV events: publishing on %s (%s)%s", endpoint, how,
                 f", replay on {replay_endpoint}" if replay_endpoint else "")
        return self.config

    def _open(self, sock: zmq.Socket[bytes], endpoint: str, *, bind: bool) -> str:
        try:
            if endpoint == EPHEMERAL_TCP:
                host = os.environ.get("VLLM_HOST_IP") or self._host
                if host in _WILDCARD_HOSTS:
                    raise PublisherError(f"--kv-events-config: {endpoint} needs this node's address: give --host "
                                         "one address or set VLLM_HOST_IP")
                if ":" in host:
                    sock.setsockopt(zmq.IPV6, 1)
                    host = f"[{host}]"
                sock.bind(f"tcp://{host}:0")
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if bind:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as exc:
            raise PublisherError(f"--kv-events-config: cannot {'bind' if bind else 'connect to'} {endpoint}: "
                                 f"{exc}") from None

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, close the sockets, stop the thread (idempotent)."""
        thread = self._thread
        if thread is None or self._closing:
            return
        self._closing = True
        self._wake()
        thread.join(timeout)
        if thread.is_alive():  # pragma: no cover - the thread never blocks; do not free its sockets
            log.warning("KV events: the publisher thread did not stop within %gs", timeout)
            return
        if self._ctx is not None:
            self._ctx.term()
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()

    # -- the engine's side ----------------------------------------------------------------------
    def publish(self, batch: KVEventBatch) -> None:
        """Queue one step's batch (never blocks; a full queue drops it and counts)."""
        seq = self._next_seq
        self._next_seq = seq + 1
        queue = self._queue
        if self._closing or len(queue) >= self._max_queue:
            self.dropped += 1
            if self._metrics is not None:
                self._metrics.dropped.inc()
            return
        queue.append((seq, batch))
        if len(queue) == 1:  # it was empty: the thread may be waiting
            self._wake()

    def _wake(self) -> None:
        w = self._wake_w
        if w is None:
            return
        try:
            w.send(b"\0")
        except OSError:  # the pipe is full: a wake-up is already pending
            pass

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        pub, replay, wake_r = self._pub, self._replay, self._wake_r
        assert pub is not None and wake_r is not None
        poller = zmq.Poller()
        poller.register(wake_r, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                self._send_queued(pub)
                if self._closing:
                    self._send_queued(pub)
                    return
                for sock, _event in poller.poll(POLL_MS):
                    if sock is replay:
                        self._serve_replays()
                    else:
                        try:
                            while wake_r.recv(4096):
                                pass
                        except BlockingIOError:
                            pass
        except Exception:  # pragma: no cover - a bug; the engine goes on without events
            log.exception("KV events: the publisher thread failed; no more events are published")
        finally:
            pub.close(linger=CLOSE_LINGER_MS)
            if replay is not None:
                replay.close(linger=CLOSE_LINGER_MS)

    def _send_queued(self, pub: zmq.Socket[bytes]) -> None:
        queue = self._queue
        topic = self._topic
        buffer = self._buffer
        metrics = self._metrics
        while queue:
            seq, batch = queue.popleft()
            payload = encode_batch(batch)
            seq_bytes = seq_to_bytes(seq)
            try:
                pub.send_multipart((topic, seq_bytes, payload), flags=zmq.NOBLOCK)
            except zmq.Again:  # pragma: no cover - PUB drops past its high-water mark instead
                pass
            buffer.append((seq, seq_bytes, payload))
            self.published += 1
            if metrics is not None:
                metrics.published.inc()

    def _serve_replays(self) -> None:
        replay = self._replay
        assert replay is not None
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
                log.warning("KV events: ignoring a replay request of %d frames; send (b'', start_seq as 8 bytes "
                            "big-endian) from a DEALER socket", len(frames))
                continue
            client, _, raw = frames
            start = int.from_bytes(raw, "big")
            for seq, seq_bytes, payload in self._buffer:
                if seq >= start:
                    replay.send_multipart((client, b"", self._topic, seq_bytes, payload))
            replay.send_multipart((client, b"", b"", END_SEQ, b""))
            if self._metrics is not None:
                self._metrics.replays.inc()
