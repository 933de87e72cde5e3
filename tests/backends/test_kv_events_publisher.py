"""``ZmqPublisher`` over real ZMQ sockets (ipc:// in a temporary folder, tcp://127.0.0.1): frames,
seq, the replay socket and its bound, the bounded queue (drops counted, a seq gap left), bind and
connect endpoints, ``tcp://*:0`` on the backend's address, start-up errors, shutdown."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from backends.kv_events.publisher import PublisherError, PublisherMetrics, ZmqPublisher
from contract.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    KVEventBatch,
    KVEventsConfig,
    decode_batch,
    seq_from_bytes,
)
from tests.backends.kv_event_client import EventStream, IpcDir, free_tcp_endpoint, replay
from tests.support import eventually


@pytest.fixture
def ipc() -> Iterator[IpcDir]:
    folder = IpcDir()
    yield folder
    folder.remove()


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def config(**fields: object) -> KVEventsConfig:
    return msgspec.convert({"enable_kv_cache_events": True, "publisher": "zmq", **fields}, KVEventsConfig)


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(ts=1000.0 + i, events=[BlockRemoved(block_hashes=[i], medium="GPU")], data_parallel_rank=0)


def replayed_seqs(answers: list[list[bytes]]) -> list[int]:
    return [seq_from_bytes(a[2]) for a in answers[:-1]]


async def test_a_full_queue_drops_counts_and_leaves_a_seq_gap(ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    registry = CollectorRegistry()
    pub = ZmqPublisher(config(endpoint=ipc.endpoint("pub"), replay_endpoint=ipc.endpoint("replay"),
                              max_queue_size=1), metrics=PublisherMetrics(registry))
    pub.publish(batch(0))  # queued (the thread is not running yet: nothing drains)
    pub.publish(batch(1))  # the queue is full: dropped, never blocks
    assert pub.dropped == 1
    assert registry.get_sample_value("session_backend_kv_event_batches_total", {"outcome": "dropped"}) == 1
    pub.start()
    try:
        pub.publish(batch(2))
        await eventually(lambda: pub.published == 2, timeout=5, what="two batches sent")
        answers = await replay(ctx, pub.config.replay_endpoint or "", 0)
        # the dropped batch's seq (1) is missing: a subscriber sees the gap and that replay cannot fill it
        assert replayed_seqs(answers) == [0, 2]
        assert [decode_batch(a[3]) for a in answers[:-1]] == [batch(0), batch(2)]
        assert registry.get_sample_value("session_backend_kv_event_batches_total", {"outcome": "published"}) == 2
    finally:
        pub.close()


async def test_replay_answers_from_start_seq_within_buffer_steps(ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    pub = ZmqPublisher(config(endpoint=ipc.endpoint("pub"), replay_endpoint=ipc.endpoint("replay"),
                              buffer_steps=3, topic="kv@b0"))
    pub.start()
    try:
        for i in range(5):
            pub.publish(batch(i))
        await eventually(lambda: pub.published == 5, timeout=5, what="five batches sent")
        answers = await replay(ctx, ipc.endpoint("replay"), 0)
        assert replayed_seqs(answers) == [2, 3, 4]  # only the last buffer_steps are kept
        for frames, i in zip(answers[:-1], (2, 3, 4), strict=True):
            empty, topic, _seq, payload = frames
            assert empty == b"" and topic == b"kv@b0" and decode_batch(payload) == batch(i)
        assert answers[-1] == [b"", b"", END_SEQ, b""]  # vLLM's end marker
        assert replayed_seqs(await replay(ctx, ipc.endpoint("replay"), 4)) == [4]
        assert (await replay(ctx, ipc.endpoint("replay"), 9)) == [[b"", b"", END_SEQ, b""]]
    finally:
        pub.close()


async def test_a_malformed_replay_request_is_ignored(ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    pub = ZmqPublisher(config(endpoint=ipc.endpoint("pub"), replay_endpoint=ipc.endpoint("replay")))
    pub.start()
    try:
        pub.publish(batch(0))
        await eventually(lambda: pub.published == 1, timeout=5, what="one batch sent")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(ipc.endpoint("replay"))
        await dealer.send_multipart([b"", b"\x00\x01"])  # not 8 bytes: no answer
        await dealer.send_multipart([b"", b"\x00" * 8])
        first = await dealer.recv_multipart()
        assert seq_from_bytes(first[2]) == 0  # the answer to the second request, nothing before it
        assert (await dealer.recv_multipart())[2] == END_SEQ
        dealer.close(linger=0)
    finally:
        pub.close()


async def test_a_subscriber_sees_every_batch_in_order_with_seq_plus_one(ipc: IpcDir,
                                                                        ctx: zmq.asyncio.Context) -> None:
    pub = ZmqPublisher(config(endpoint=ipc.endpoint("pub")))
    pub.start()
    stream = EventStream(ctx, ipc.endpoint("pub"))
    try:
        async def probe() -> None:
            pub.publish(KVEventBatch(ts=1.0, events=[AllBlocksCleared()], data_parallel_rank=0))
        first = await stream.sync(probe)
        for i in range(20):
            pub.publish(batch(i))
        got = await stream.until(lambda g: len(g) > 0 and g[-1].batch == batch(19))
        got = [r for r in got if r.batch.events != [AllBlocksCleared()]]
        assert [r.seq for r in got] == list(range(got[0].seq, got[0].seq + 20))
        assert got[0].seq > first.seq and [r.batch for r in got] == [batch(i) for i in range(20)]
        assert all(r.topic == b"" for r in got)
    finally:
        stream.close()
        pub.close()


async def test_a_concrete_host_endpoint_connects_to_a_bound_subscriber(ctx: zmq.asyncio.Context) -> None:
    endpoint = free_tcp_endpoint()
    stream = EventStream(ctx, endpoint, bind=True)  # the router's side binds
    pub = ZmqPublisher(config(endpoint=endpoint))
    pub.start()
    try:
        assert pub.config.endpoint == endpoint

        async def probe() -> None:
            pub.publish(batch(7))
        received = await stream.sync(probe)
        assert received.batch == batch(7)
    finally:
        stream.close()
        pub.close()


async def test_tcp_star_zero_binds_an_ephemeral_port_on_the_backends_address(
        ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    pub = ZmqPublisher(config(endpoint="tcp://*:0", replay_endpoint="tcp://*:0"), host="127.0.0.1")
    resolved = pub.start()
    stream = EventStream(ctx, resolved.endpoint)
    try:
        assert resolved.endpoint.startswith("tcp://127.0.0.1:") and not resolved.endpoint.endswith(":0")
        assert resolved.replay_endpoint is not None and resolved.replay_endpoint.startswith("tcp://127.0.0.1:")
        assert resolved.replay_endpoint != resolved.endpoint

        async def probe() -> None:
            pub.publish(batch(1))
        assert (await stream.sync(probe)).batch == batch(1)
        assert replayed_seqs(await replay(ctx, resolved.replay_endpoint, 0))[0] == 0
    finally:
        stream.close()
        pub.close()


def test_tcp_star_zero_without_an_address_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    with pytest.raises(PublisherError, match="needs this node's address"):
        ZmqPublisher(config(endpoint="tcp://*:0"), host="0.0.0.0").start()


def test_an_endpoint_that_cannot_be_bound_fails_at_start(ipc: IpcDir) -> None:
    with pytest.raises(PublisherError, match="cannot bind ipc://.*/missing/pub"):
        ZmqPublisher(config(endpoint=ipc.endpoint("missing/pub"))).start()


async def test_close_sends_what_is_queued_and_frees_the_endpoints(ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    endpoint = free_tcp_endpoint()
    stream = EventStream(ctx, endpoint, bind=True)
    pub = ZmqPublisher(config(endpoint=endpoint, replay_endpoint=ipc.endpoint("replay")))
    pub.start()

    async def probe() -> None:
        pub.publish(batch(0))
    try:
        await stream.sync(probe)
        for i in range(1, 50):
            pub.publish(batch(i))
        pub.close()
        assert not pub.running
        got = await stream.until(lambda g: len(g) > 0 and g[-1].batch == batch(49))
        assert got[-1].batch == batch(49)  # queued batches left before the sockets closed
        pub.publish(batch(99))  # after close: dropped, counted, no error
        assert pub.dropped == 1
        # the replay endpoint is free again: a new publisher binds it
        again = ZmqPublisher(config(endpoint=ipc.endpoint("pub2"), replay_endpoint=ipc.endpoint("replay")))
        again.start()
        again.close()
    finally:
        stream.close()
        pub.close()
