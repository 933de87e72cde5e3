"""A KV-event publisher the tests drive: vLLM's wire (``contract.kv_events``) on real ZMQ sockets.

An ``XPUB`` (wire-compatible with vLLM's ``PUB``; it also lets the test wait until the router's
``SUB`` has subscribed) that binds or connects by vLLM's rule, and a ``ROUTER`` replay socket
answering ``(client, b"", start_seq)`` as vLLM does. The test chooses what is sent: a batch can be
kept back from the live socket (a gap, still in the replay buffer), the seq can restart (a new
engine process), the buffer can be trimmed (batches older than it are gone).
"""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio

from contract.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    publisher_binds,
    seq_from_bytes,
    seq_to_bytes,
)


class TestPublisher:
    __test__ = False  # not a test class

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, replay: str | None = None,
                 topic: str = "") -> None:
        self.context = context
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.pub = context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # tests decide what is lost, not the high-water mark
        if publisher_binds(endpoint):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.replay_endpoint = replay
        self.router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if replay is not None:
            self.router = context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay)
            self._replay_task = asyncio.create_task(self._serve_replay())
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        #: cleared: replay requests are taken but not answered until it is set again
        self.replay_open = asyncio.Event()
        self.replay_open.set()

    async def subscribed(self, timeout: float = 10.0) -> None:
        """Wait until a subscriber's subscription reached this socket."""
        while True:
            frame = await asyncio.wait_for(self.pub.recv(), timeout)
            if frame[:1] == b"\x01":
                return

    async def send(self, *events: BlockStored | BlockRemoved | AllBlocksCleared, live: bool = True) -> int:
        """Publish one batch (its seq returned); ``live=False`` keeps it off the PUB socket (a gap)
        but in the replay buffer."""
        seq = self.seq
        self.seq += 1
        payload = encode_batch(KVEventBatch(ts=float(seq), events=list(events), data_parallel_rank=0))
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([self.topic, seq_to_bytes(seq), payload])
        return seq

    async def send_raw(self, *frames: bytes) -> None:
        await self.pub.send_multipart(list(frames))

    def restart(self) -> None:
        """A new engine process: seq from 0 again, nothing buffered."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_raw = frames
            start = seq_from_bytes(start_raw)
            self.replay_requests.append(start)
            await self.replay_open.wait()
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart([client, b"", self.topic, seq_to_bytes(seq), payload])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
