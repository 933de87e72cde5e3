"""What receiving KV events costs the router's process, per batch, against the floor of any message
from another process.

A publisher process sends vLLM's KV-event wire (``(topic, seq, KVEventBatch)``, one ``BlockStored``
of one new 16-token block per batch: what a ``--speed 0`` backend sends per request) at ``--rate``
batches per second over ``ipc://``. This process receives them on a uvloop event loop that does
nothing else, and its CPU time (all threads: libzmq's I/O thread included) is read over the measured
window, per batch received. Readers, measured in turn, each against a fresh publisher:

- ``router``: the router's own reader (``router.kv.subscriber.SubSocket`` + ``Stream``) applying every
  batch to a ``KVIndex``, drained as an idle router drains it: every ``[kv_events]
  idle_read_interval_s`` (nothing wakes it for a batch; ``router.kv.service``);
- ``router-busy``: the same, drained every ``min_read_interval_s`` by a timer of its own, as a router
  placing requests at least that often drains it (here the timer's own wake-ups are counted too,
  which a busy router's placements do not add);
- ``zmq``: a bare SUB socket whose FD the loop watches, each message received and dropped as it
  comes (no decode, no index): a ZMQ reader woken for every message, as the router's was before;
- ``unix``: a Unix datagram socket read by a loop callback: the floor of waking up for a message
  another process sent.

The batches arrive one at a time (the rate is far below what the reader can take), so each one
wakes ``zmq`` and ``unix``; the ``router`` rows take what arrived since their last drain together.
libzmq's I/O thread still wakes for each message whatever the reader does: the floor of a ZMQ message.

    python -m bench.kv_reader [--rate 1000] [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import uvloop
import zmq
import zmq.asyncio

from contract.kv_events import BlockStored, KVEventBatch, encode_batch, seq_to_bytes
from router.config.schema import KVEventsSettings
from router.kv.index import KVIndex
from router.kv.metrics import KVMetrics
from router.kv.subscriber import EventSource, Stream, SubSocket

BLOCK = 16
TOPIC = b"kv"
READERS = ("router", "router-busy", "zmq", "unix")
#: seconds the publisher waits before its first batch (the subscriber connects meanwhile)
SETTLE_S = 0.5


def _batch(seq: int) -> bytes:
    tokens = list(range(seq * BLOCK, (seq + 1) * BLOCK))
    event = BlockStored(block_hashes=[seq.to_bytes(16, "big")], parent_block_hash=None, token_ids=tokens,
                        block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None, session_id=f"s{seq % 64}")
    return encode_batch(KVEventBatch(ts=float(seq), events=[event], data_parallel_rank=0))


def _paced(count: int, rate: float, send: Callable[[int], None]) -> None:
    time.sleep(SETTLE_S)
    start = time.perf_counter()
    for seq in range(count):
        send(seq)
        due = start + (seq + 1) / rate
        while (left := due - time.perf_counter()) > 0:
            time.sleep(left)


def publish_zmq(address: str, count: int, rate: float) -> None:
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(address)
    payloads = [_batch(seq) for seq in range(count)]
    _paced(count, rate, lambda seq: pub.send_multipart([TOPIC, seq_to_bytes(seq), payloads[seq]]))
    time.sleep(0.2)
    pub.close()
    context.term()


def publish_unix(path: str, count: int, rate: float) -> None:
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    payloads = [_batch(seq) for seq in range(count)]
    try:
        _paced(count, rate, lambda seq: sender.sendto(payloads[seq], path))
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # the receiver measured its window and closed
    sender.close()


class Window:
    """Counts messages; reads this process's CPU time once ``skip`` arrived and again at ``skip + count``."""

    def __init__(self, skip: int, count: int, loop: asyncio.AbstractEventLoop) -> None:
        self.skip, self.end, self.seen = skip, skip + count, 0
        self.cpu = self.wall = 0.0
        self.done: asyncio.Future[float] = loop.create_future()

    def tick(self, n: int = 1) -> None:
        before = self.seen
        self.seen += n
        if before < self.skip <= self.seen:
            self.cpu, self.wall = time.process_time(), time.perf_counter()
        if before < self.end <= self.seen and not self.done.done():
            self.done.set_result((time.process_time() - self.cpu) / (self.seen - self.skip))


async def read_router(address: str, window: Window, timeout: float, interval_s: float) -> float:
    """The router's reader, drained every ``interval_s``."""
    context = zmq.asyncio.Context()
    index = KVIndex(max_blocks=10**6)
    metrics = KVMetrics(index)
    source = EventSource("http://127.0.0.1:1", address, topic=TOPIC.decode(), name="bench")
    sub = SubSocket(context, False, address, metrics)
    sub.add(Stream(source, index, metrics, context, replay_timeout_s=1.0))
    real_events = metrics.events

    def counted(backend: str, count: int) -> None:
        real_events(backend, count)
        window.tick(count)

    metrics.events = counted  # type: ignore[method-assign]
    sub.start()
    loop = asyncio.get_running_loop()

    def drain() -> None:
        sub.drain()
        timer[0] = loop.call_later(interval_s, drain)

    timer = [loop.call_later(interval_s, drain)]
    try:
        return await asyncio.wait_for(window.done, timeout)
    finally:
        timer[0].cancel()
        await sub.close()
        context.destroy(linger=0)


async def read_zmq(address: str, window: Window, timeout: float) -> float:
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB, socket_class=zmq.Socket)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(address)
    events, pollin, noblock = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)

    def drain() -> None:
        while sub.getsockopt(events) & pollin:
            sub.recv_multipart(noblock)
            window.tick()

    loop = asyncio.get_running_loop()
    fd = sub.getsockopt(zmq.FD)
    loop.add_reader(fd, drain)
    loop.call_soon(drain)
    try:
        return await asyncio.wait_for(window.done, timeout)
    finally:
        loop.remove_reader(fd)
        sub.close(linger=0)
        context.destroy(linger=0)


async def read_unix(path: str, window: Window, timeout: float) -> float:
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.setblocking(False)

    def drain() -> None:
        while True:
            try:
                receiver.recv(65536)
            except BlockingIOError:
                return
            window.tick()

    loop = asyncio.get_running_loop()
    loop.add_reader(receiver.fileno(), drain)
    try:
        return await asyncio.wait_for(window.done, timeout)
    finally:
        loop.remove_reader(receiver.fileno())
        receiver.close()


def measure(reader: str, rate: float, seconds: float, tmp: str) -> float:
    """µs of this process's CPU per message received, ``reader`` against a fresh publisher."""
    skip = int(rate * 0.5)
    count = int(rate * seconds)
    timeout = SETTLE_S + seconds + 30.0
    target = os.path.join(tmp, f"{reader}-{time.monotonic_ns()}.sock")
    spawn = multiprocessing.get_context("spawn")
    if reader == "unix":
        if os.path.exists(target):
            os.unlink(target)
        publisher = spawn.Process(target=publish_unix, args=(target, skip + count + int(rate * 0.2), rate))
    else:
        target = "ipc://" + target
        publisher = spawn.Process(target=publish_zmq, args=(target, skip + count + int(rate * 0.2), rate))

    async def run() -> float:
        window = Window(skip, count, asyncio.get_running_loop())
        if reader == "router":
            return await read_router(target, window, timeout, KVEventsSettings().idle_read_interval_s)
        if reader == "router-busy":
            return await read_router(target, window, timeout, KVEventsSettings().min_read_interval_s)
        if reader == "zmq":
            return await read_zmq(target, window, timeout)
        return await read_unix(target, window, timeout)

    if reader == "unix":
        # the receiver binds the path before the publisher sends to it
        async def bound_first() -> float:
            task = asyncio.ensure_future(run())
            await asyncio.sleep(0)
            publisher.start()
            return await task
        try:
            return uvloop.run(bound_first()) * 1e6
        finally:
            publisher.join(timeout=10)
    publisher.start()
    try:
        return uvloop.run(run()) * 1e6
    finally:
        publisher.join(timeout=10)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=1000.0, help="batches per second (default 1000)")
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per reader and round (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    args = p.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.rounds < 1:
        p.error("--rate, --seconds and --rounds must be positive")
    results: dict[str, list[float]] = {r: [] for r in READERS}
    with tempfile.TemporaryDirectory(prefix="bench-kv-reader-") as tmp:
        for rnd in range(args.rounds):
            order = READERS[rnd % len(READERS):] + READERS[:rnd % len(READERS)]
            for reader in order:
                us = measure(reader, args.rate, args.seconds, tmp)
                results[reader].append(us)
                print(f"round {rnd + 1} {reader:<12} {us:6.1f} µs CPU per batch", file=sys.stderr, flush=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"`python -m bench.kv_reader --rate {args.rate:g} --seconds {args.seconds:g} --rounds {args.rounds}` "
          f"(load average {load}); µs of the process's CPU per batch received, median [range] over rounds:\n")
    print("| reader | µs per batch |")
    print("|---|---:|")
    for reader in READERS:
        values = results[reader]
        print(f"| {reader} | {statistics.median(values):.1f} [{min(values):.1f}–{max(values):.1f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
