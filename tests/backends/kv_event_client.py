"""A test's view of a backend's KV events: a real ZMQ SUB socket (and DEALER for replays), asyncio.

Sockets bind or connect only to ipc:// paths under a short temporary folder or to tcp://127.0.0.1.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from contract.kv_events import END_SEQ, KVEventBatch, decode_batch, seq_from_bytes, seq_to_bytes


@dataclass
class Received:
    topic: bytes
    seq: int
    payload: bytes

    @property
    def batch(self) -> KVEventBatch:
        return decode_batch(self.payload)


class IpcDir:
    """A short folder for ipc:// endpoints (their paths must stay under ~100 bytes)."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="kv", dir="/tmp")

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.path}/{name}"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class EventStream:
    """A SUB socket on a publisher's endpoint: connected (the publisher binds) or bound (it connects)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, *, bind: bool = False, topic: bytes = b"") -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        if bind:
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)

    async def recv(self, timeout: float = 5.0) -> Received:
        topic, seq, payload = await asyncio.wait_for(self.sub.recv_multipart(), timeout)
        return Received(topic, seq_from_bytes(seq), payload)

    async def sync(self, trigger: Callable[[], Awaitable[object]], timeout: float = 10.0) -> Received:
        """Wait until the subscription is live (ZMQ's slow joiner): fire ``trigger`` (e.g. a reset on
        an idle engine, which publishes at once) until a batch arrives; returns that batch."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await trigger()
            try:
                return await self.recv(timeout=0.05)
            except TimeoutError:
                if loop.time() > deadline:
                    raise AssertionError(f"no KV event reached the subscriber within {timeout}s") from None

    async def until(self, check: Callable[[list[Received]], bool], timeout: float = 10.0) -> list[Received]:
        """Receive until ``check(everything received so far)`` holds (bounded)."""
        got: list[Received] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not check(got):
            left = deadline - loop.time()
            if left <= 0:
                raise AssertionError(f"condition not met by the {len(got)} batches received in {timeout}s")
            got.append(await self.recv(timeout=left))
        return got

    def close(self) -> None:
        self.sub.close(linger=0)


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start_seq: int, timeout: float = 5.0) -> list[list[bytes]]:
    """Ask the replay socket for everything from ``start_seq``; the frames of each answer, END included."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", seq_to_bytes(start_seq)])
        answers: list[list[bytes]] = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), timeout)
            answers.append(frames)
            if frames[2] == END_SEQ:
                return answers
    finally:
        dealer.close(linger=0)
