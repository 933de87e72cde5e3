"""``router.kv.service.KVEvents`` with real ZMQ sockets: a test publisher (``TestPublisher``: XPUB +
ROUTER replay, vLLM's wire) the test drives, the router's subscriber in the same event loop.

Both ways (the engine binds ``ipc://``/``tcp://*`` and the router connects; the engine connects to
a concrete host and the router binds), seq tracking, a gap filled by replay, a gap the replay can
no longer fill, no replay socket at all, an engine restart (seq from 0), a reconnect, a catch-up at
start, topics demultiplexed on one bound socket, runtime membership changes, a flood."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from contract.kv_events import AllBlocksCleared
from router.config.schema import BackendConfig, KVEventsSettings
from router.kv.index import KVIndex
from router.kv.metrics import KVMetrics
from router.kv.service import KVEvents
from router.kv.subscriber import replay_address, subscriber_address
from router.membership import Backend, BackendPool
from tests.router.kv.events import removed, stored
from tests.router.kv.publisher import TestPublisher
from tests.support import eventually, free_port

URL = "http://127.0.0.1:8101"
URL2 = "http://127.0.0.1:8102"
T1 = list(range(100, 116))  # 4 blocks of 4
T2 = list(range(200, 216))
T3 = list(range(300, 316))


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


Make = Callable[..., Awaitable[tuple[KVEvents, KVIndex, KVMetrics, BackendPool]]]


@pytest.fixture
async def make_service() -> AsyncIterator[Make]:
    started: list[tuple[KVEvents, aiohttp.ClientSession]] = []

    async def make(configured: dict[str, BackendConfig], *, urls: tuple[str, ...] = (URL,),
                   max_blocks: int = 10_000, **settings: Any) -> tuple[KVEvents, KVIndex, KVMetrics, BackendPool]:
        index = KVIndex(max_blocks=max_blocks)
        metrics = KVMetrics(index)
        pool = BackendPool("default", [Backend(u) for u in urls])
        settings.setdefault("replay_timeout_s", 2.0)
        service = KVEvents(index, KVEventsSettings(**settings), lambda: [pool], metrics, configured=configured,
                           request_timeout_s=1.0)
        http = aiohttp.ClientSession()
        service.start(http)
        started.append((service, http))
        return service, index, metrics, pool

    yield make
    for service, http in started:
        await service.stop()
        await http.close()


def tokens_of(index: KVIndex, session: str) -> dict[str, int]:
    return dict(index.session_tokens(session))


def test_bind_or_connect_follows_vllms_rule() -> None:
    # the engine binds wildcards and ipc: the router connects, to the backend's host for "*"
    assert subscriber_address("tcp://*:5557", "http://10.1.2.3:8000") == (False, "tcp://10.1.2.3:5557")
    assert subscriber_address("tcp://[::]:5557", "http://[fd00::5]:8000") == (False, "tcp://[fd00::5]:5557")
    assert subscriber_address("ipc:///tmp/kv.sock", "http://10.1.2.3:8000") == (False, "ipc:///tmp/kv.sock")
    # a concrete host: the engine connects there, so the router binds it
    assert subscriber_address("tcp://127.0.0.1:5557", "http://10.1.2.3:8000") == (True, "tcp://127.0.0.1:5557")
    # the replay socket is always bound by the engine
    assert replay_address("tcp://*:5558", "http://10.1.2.3:8000") == "tcp://10.1.2.3:5558"
    assert replay_address("tcp://10.9.9.9:5558", "http://10.1.2.3:8000") == "tcp://10.9.9.9:5558"


async def test_engine_binds_ipc_router_connects_and_events_reach_the_index(
        zctx: zmq.asyncio.Context, make_service: Make, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    publisher = TestPublisher(zctx, endpoint)
    try:
        service, index, metrics, _ = await make_service({URL: BackendConfig(URL, kv_events=endpoint)})
        await publisher.subscribed()
        assert service.subscribed(URL)
        await publisher.send(stored(T1, "s1"))
        await publisher.send(stored(T2, "s2"), removed(T1, 3))
        await eventually(lambda: tokens_of(index, "s2") == {URL: 16}, timeout=5, what="s2's blocks indexed")
        assert tokens_of(index, "s1") == {URL: 12}
        assert metrics.event_counts == {URL: 3}
    finally:
        await publisher.close()


async def test_engine_connects_to_a_concrete_host_router_binds(zctx: zmq.asyncio.Context, make_service: Make) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service, index, _, _ = await make_service({URL: BackendConfig(URL, kv_events=endpoint)})
    publisher = TestPublisher(zctx, endpoint)  # connects: the router bound it already
    try:
        await publisher.subscribed()
        await publisher.send(stored(T1, "s1"))
        await eventually(lambda: tokens_of(index, "s1") == {URL: 16}, timeout=5, what="s1 indexed")
    finally:
        await publisher.close()


async def test_a_gap_is_filled_from_the_replay_socket(zctx: zmq.asyncio.Context, make_service: Make,
                                                      tmp_path: Path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    publisher = TestPublisher(zctx, endpoint, replay)
    try:
        _, index, metrics, _ = await make_service({URL: BackendConfig(URL, kv_events=endpoint, kv_replay=replay)})
        await publisher.subscribed()
        await publisher.send(stored(T1, "s1"))
        await eventually(lambda: tokens_of(index, "s1") == {URL: 16}, timeout=5, what="the first batch")
        await publisher.send(stored(T2, "s2"), live=False)  # lost on the way
        await publisher.send(removed(T1, 3), live=False)  # its last block: 12 tokens of its chain stay
        await publisher.send(stored(T3, "s3"))
        await eventually(lambda: tokens_of(index, "s3") == {URL: 16}, timeout=5, what="the batch after the gap")
        assert tokens_of(index, "s2") == {URL: 16}  # filled by the replay
        assert tokens_of(index, "s1") == {URL: 12}  # the replayed removal applied
        assert publisher.replay_requests == [1]
        assert metrics.gaps == {URL: 1} and metrics.replays == {(URL, "filled"): 1}
        assert metrics.resets == {}
    finally:
        await publisher.close()


async def test_a_socket_awaiting_a_replay_neither_reads_on_nor_spins(zctx: zmq.asyncio.Context,
                                                                       make_service: Make, tmp_path: Path) -> None:
    """Two engines publish to one address the router binds. While the reader waits for engine a's
    replay, what arrives meanwhile (b connecting, batches of both) waits unread, and the loop does
    not spin on the socket's signal; once the replay answers, everything is applied in order."""
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"ipc://{tmp_path}/replay.sock"
    _, index, metrics, _ = await make_service(
        {URL: BackendConfig(URL, kv_events=endpoint, kv_replay=replay, kv_topic="kv@a"),
         URL2: BackendConfig(URL2, kv_events=endpoint, kv_topic="kv@b")}, urls=(URL, URL2), replay_timeout_s=30.0)
    a = TestPublisher(zctx, endpoint, replay, topic="kv@a")
    b: TestPublisher | None = None
    try:
        await a.subscribed()
        await a.send(stored(T1, "s1"))
        await eventually(lambda: tokens_of(index, "s1") == {URL: 16}, timeout=5, what="a's first batch")
        a.replay_open.clear()
        await a.send(stored(T2, "s2"), live=False)  # lost on the way
        await a.send(removed(T1, 3))  # the gap shows: a replay is asked for
        await eventually(lambda: a.replay_requests == [1], timeout=5, what="the replay request")
        b = TestPublisher(zctx, endpoint, topic="kv@b")  # a new peer: its subscription goes out meanwhile
        await b.subscribed()
        await b.send(stored(T3, "s3"))
        await a.send(stored(T3, "s3"))
        cpu, window = time.process_time(), time.perf_counter()
        await asyncio.sleep(0.4)  # the window measured, not a wait for a condition
        used, window = time.process_time() - cpu, time.perf_counter() - window
        assert used < window / 2, f"the process used {used:.2f} s of CPU in {window:.2f} s waiting for the replay"
        assert tokens_of(index, "s2") == {} and metrics.event_counts == {URL: 1}
        a.replay_open.set()
        await eventually(lambda: tokens_of(index, "s3") == {URL: 16, URL2: 16}, timeout=5, what="every batch")
        assert tokens_of(index, "s2") == {URL: 16} and tokens_of(index, "s1") == {URL: 12}
        assert metrics.event_counts == {URL: 4, URL2: 1}
        assert metrics.replays == {(URL, "filled"): 1} and metrics.resets == {}
    finally:
        await a.close()
        if b is not None:
            await b.close()


async def test_a_gap_the_replay_buffer_no_longer_holds_resets_the_backend(
        zctx: zmq.asyncio.Context, make_service: Make, tmp_path: Path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    publisher = TestPublisher(zctx, endpoint, replay)
    try:
        _, index, metrics, _ = await make_service({URL: BackendConfig(URL, kv_events=endpoint, kv_replay=replay)})
        await publisher.subscribed()
        await publisher.send(stored(T1, "s1"))
        await eventually(lambda: tokens_of(index, "s1") == {URL: 16}, timeout=5, what="the first batch")
        await publisher.send(removed(T1, 0, 1, 2, 3), live=False)  # lost, and gone from the buffer too
        await publisher.send(stored(T2, "s2"), live=False)
        del publisher.buffer[:2]  # the buffer now starts at seq 2
        await publisher.send(stored(T3, "s3"))
        await eventually(lambda: tokens_of(index, "s3") == {URL: 16}, timeout=5, what="the batch after the gap")
        # s1's blocks may have been removed in the lost batch: forgotten; what the buffer held is applied
        assert tokens_of(index, "s1") == {}
        assert tokens_of(index, "s2") == {URL: 16}
        assert metrics.resets == {(URL, "gap"): 1}
        assert metrics.replays == {(URL, "partial"): 1}
    finally:
        await publisher.close()


async def test_a_gap_without_a_replay_socket_resets_the_backend(zctx: zmq.asyncio.Context, make_service: Make,
                                                                tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    publisher = TestPublisher(zctx, endpoint)
    try:
        _, index, metrics, _ = await make_service({URL: BackendConfig(URL, kv_events=endpoint)})
        await publisher.subscribed()
        await publisher.send(stored(T1, "s1"))
        await eventually(lambda: tokens_of(index, "s1") == {URL: 16}, timeout=5, what="the first batch")
        await publisher.send(removed(T1, 3), live=False)  # its last block: 12 tokens of its chain stay
        await publisher.send(stored(T2, "s2"))
        await eventually(lambda: tokens_of(index, "s2") == {URL: 16}, timeout=5, what="the batch after the gap")
        assert tokens_of(index, "s1") == {}
        assert metrics.resets == {(URL, "gap"): 1} and metrics.replays == {(URL, "unavailable"): 1}
    finally:
        await publisher.close()


async def test_an_engine_restart_resets_its_entries(zctx: zmq.asyncio.Context, make_service: Make,
                                                    tmp_path: Path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    publisher = TestPublisher(zctx, endpoint, replay)
    try:
        _, index, metrics, _ = await make_service({URL: BackendConfig(URL, kv_events=endpoint, kv_replay=replay)})
        await publisher.subscribed()
        await publisher.send(stored(T1, "s1"))
        await publisher.send(stored(T2, "s2"))
        await eventually(lambda: tokens_of(index, "s2") == {URL: 16}, timeout=5, what="two batches")
        publisher.restart()  # seq counts from 0 again: what the old process held is gone
        await publisher.send(stored(T3, "s3"))
        await eventually(lambda: tokens_of(index, "s3") == {URL: 16}, timeout=5, what="the new process's batch")
        assert tokens_of(index, "s1") == {} and tokens_of(index, "s2") == {}
        assert metrics.resets == {(URL, "restart"): 1}
    finally:
        await publisher.close()


async def test_all_blocks_cleared_drops_the_backends_entries(zctx: zmq.asyncio.Context, make_service: Make,
                                                             tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    publisher = TestPublisher(zctx, endpoint)
    try:
        _, index, _, _ = await make_service({URL: BackendConfig(URL, kv_events=endpoint)})
        await publisher.subscribed()
        await publisher.send(stored(T1, "s1"))
        await publisher.send(AllBlocksCleared(), stored(T2, "s2"))
        await eventually(lambda: tokens_of(index, "s2") == {URL: 16}, timeout=5, what="the clear and the store")
        assert tokens_of(index, "s1") == {}
    finally:
        await publisher.close()


async def test_a_late_subscriber_catches_up_from_the_replay_buffer(zctx: zmq.asyncio.Context, make_service: Make,
                                                                   tmp_path: Path) -> None:
    """Batches published before the router listened are fetched when its first batch says seq > 0."""
    endpoint, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    publisher = TestPublisher(zctx, endpoint, replay)
    try:
        await publisher.send(stored(T1, "s1"))  # nobody listens yet
        await publisher.send(stored(T2, "s2"))
        _, index, metrics, _ = await make_service({URL: BackendConfig(URL, kv_events=endpoint, kv_replay=replay)})
        await publisher.subscribed()
        await publisher.send(stored(T3, "s3"))
        await eventually(lambda: tokens_of(index, "s3") == {URL: 16}, timeout=5, what="the live batch")
        assert tokens_of(index, "s1") == {URL: 16} and tokens_of(index, "s2") == {URL: 16}
        assert publisher.replay_requests == [0]
        assert metrics.resets == {}
    finally:
        await publisher.close()


async def test_engines_sharing_one_bound_address_are_told_apart_by_topic(
        zctx: zmq.asyncio.Context, make_service: Make) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    _, index, _, _ = await make_service({URL: BackendConfig(URL, kv_events=endpoint, kv_topic="kv@a"),
                                         URL2: BackendConfig(URL2, kv_events=endpoint, kv_topic="kv@b")},
                                        urls=(URL, URL2))
    a = TestPublisher(zctx, endpoint, topic="kv@a")
    b = TestPublisher(zctx, endpoint, topic="kv@b")
    try:
        await a.subscribed()
        await b.subscribed()
        await a.send(stored(T1, "s1"))
        await b.send(stored(T1, "s1"))
        await b.send(stored(T2, "s2"))
        await eventually(lambda: tokens_of(index, "s2") == {URL2: 16}, timeout=5, what="b's batches")
        await eventually(lambda: tokens_of(index, "s1") == {URL: 16, URL2: 16}, timeout=5, what="a's batch")
    finally:
        await a.close()
        await b.close()


async def test_backends_joining_and_leaving_at_runtime(zctx: zmq.asyncio.Context, make_service: Make,
                                                       tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    publisher = TestPublisher(zctx, endpoint)
    try:
        service, index, _, pool = await make_service({URL2: BackendConfig(URL2, kv_events=endpoint)}, urls=(URL,))
        assert not service.subscribed(URL2)
        joiner = pool.add(Backend(URL2))
        service.backend_added(joiner)
        await publisher.subscribed()
        await publisher.send(stored(T1, "s1"))
        await eventually(lambda: tokens_of(index, "s1") == {URL2: 16}, timeout=5, what="the joiner's events")
        pool.remove(URL2)
        service.backend_removed(joiner)
        assert tokens_of(index, "s1") == {} and not service.subscribed(URL2)
        # the follower notices a change made behind its back too (within a second)
        pool.add(Backend(URL2))
        await eventually(lambda: service.subscribed(URL2), timeout=5, what="the backend followed again")
    finally:
        await publisher.close()


async def test_a_flood_is_applied_in_slices_that_let_the_loop_run(zctx: zmq.asyncio.Context, make_service: Make,
                                                                  tmp_path: Path) -> None:
    """100,000 events (10,000 batches) queued at once: the loop keeps ticking while they are applied."""
    endpoint = f"ipc://{tmp_path}/kv.sock"
    publisher = TestPublisher(zctx, endpoint)
    try:
        _, index, metrics, _ = await make_service({URL: BackendConfig(URL, kv_events=endpoint)},
                                                  max_blocks=1_000_000)
        await publisher.subscribed()
        for b in range(10_000):
            tokens = [b * 16 + i for i in range(16)]
            await publisher.send(*(stored(tokens[:4 * (1 + e % 4)], f"s{b % 500}") for e in range(10)))
        worst = 0.0
        tick = flood_started = time.perf_counter()
        while metrics.event_counts.get(URL, 0) < 100_000:
            await asyncio.sleep(0)
            now = time.perf_counter()
            worst = max(worst, now - tick)
            tick = now
        flood_s = time.perf_counter() - flood_started
        assert index.blocks == 40_000
        # slices of a few ms: the longest stall is a small fraction of the flood (0.25 s floor for a loaded machine)
        bound = max(0.25, flood_s / 10)
        assert worst < bound, f"the loop stalled {worst * 1000:.0f} ms while the {flood_s:.1f} s flood was applied"
    finally:
        await publisher.close()


@pytest.mark.parametrize("health_first", [True, False])
async def test_an_engine_gone_and_its_backend_down_is_reset_at_once(zctx: zmq.asyncio.Context, make_service: Make,
                                                                    tmp_path: Path, health_first: bool) -> None:
    """The ZMQ peer disconnected and the health check says the backend is down: its entries go now,
    not when the restarted engine's first batch arrives; the next engine's batches count again."""
    endpoint = f"ipc://{tmp_path}/kv.sock"
    publisher = TestPublisher(zctx, endpoint)
    service, index, metrics, pool = await make_service({URL: BackendConfig(URL, kv_events=endpoint)})
    backend = pool.members[0]
    await publisher.subscribed()
    await publisher.send(stored(T1, "s1"))
    await eventually(lambda: tokens_of(index, "s1") == {URL: 16}, timeout=5, what="the first batch")
    if health_first:
        # the backend is only slow (health timeouts), its engine still connected: nothing is dropped
        backend.healthy = False
        service.health_changed(backend, False)
        assert tokens_of(index, "s1") == {URL: 16}
        await publisher.close()  # the engine process goes away
    else:
        await publisher.close()  # the engine process goes away: a reconnect may follow, nothing dropped yet
        await eventually(lambda: _disconnected(service), timeout=5,
                         what="the disconnect seen")
        assert tokens_of(index, "s1") == {URL: 16}
        backend.healthy = False  # then its health check fails
        service.health_changed(backend, False)
    await eventually(lambda: tokens_of(index, "s1") == {}, timeout=5, what="the entries dropped")
    assert metrics.resets == {(URL, "engine_down"): 1}
    restarted = TestPublisher(zctx, endpoint)
    try:
        backend.healthy = True
        service.health_changed(backend, True)
        await restarted.subscribed()
        await restarted.send(stored(T2, "s2"))
        await eventually(lambda: tokens_of(index, "s2") == {URL: 16}, timeout=5, what="the new engine's batch")
        assert metrics.resets == {(URL, "engine_down"): 1}
    finally:
        await restarted.close()


def _disconnected(service: KVEvents) -> bool:
    return any(stream.disconnected for stream in service.streams_of(URL))


async def test_batches_wait_for_a_reader_of_the_index_or_the_idle_timer(
        zctx: zmq.asyncio.Context, make_service: Make, tmp_path: Path) -> None:
    """Nothing wakes the router for a batch: a stream of batches waits in ZMQ's queue until the index's
    ``catch_up`` (placement calls it) or the idle timer drains it, all in one read."""
    endpoint = f"ipc://{tmp_path}/kv.sock"
    publisher = TestPublisher(zctx, endpoint)
    try:
        _, index, metrics, _ = await make_service({URL: BackendConfig(URL, kv_events=endpoint)},
                                                  idle_read_interval_s=0.05)
        await publisher.subscribed()
        # with nobody reading the index, the idle timer applies a batch
        await publisher.send(stored(T1, "first"))
        await eventually(lambda: tokens_of(index, "first") == {URL: 16}, timeout=5, what="the idle timer's read")
    finally:
        await publisher.close()
    publisher = TestPublisher(zctx, f"ipc://{tmp_path}/kv2.sock")
    try:
        _, index, metrics, _ = await make_service(
            {URL: BackendConfig(URL, kv_events=f"ipc://{tmp_path}/kv2.sock")}, idle_read_interval_s=60.0)
        await publisher.subscribed()
        reads = metrics.reads
        for b in range(20):  # one batch every 10 ms: the loop runs between them (pacing, not a condition)
            await publisher.send(stored([1000 + 16 * b + i for i in range(16)], f"s{b}"))
            await asyncio.sleep(0.01)
        # the I/O thread has them, the loop ran 20 times, and no read took them: nobody asked
        assert metrics.event_counts.get(URL, 0) == 0 and metrics.reads == reads

        def caught_up() -> bool:
            index.catch_up()
            return metrics.event_counts.get(URL, 0) == 20

        await eventually(caught_up, timeout=5, what="every batch applied by catch_up")
        assert all(tokens_of(index, f"s{b}") == {URL: 16} for b in range(20))
        assert metrics.reads - reads <= 2, metrics.reads - reads  # one read took them (two if one came late)
        families = {m.name: m for m in metrics.collect()}
        assert families["session_router_kv_event_reads"].samples[0].value == metrics.reads
    finally:
        await publisher.close()
    # min_read_interval_s: a catch_up within it of the last read reads nothing
    publisher = TestPublisher(zctx, f"ipc://{tmp_path}/kv3.sock")
    try:
        _, index, metrics, _ = await make_service(
            {URL: BackendConfig(URL, kv_events=f"ipc://{tmp_path}/kv3.sock")}, idle_read_interval_s=60.0,
            min_read_interval_s=0.3)
        await publisher.subscribed()

        def applied(session: str) -> bool:
            index.catch_up()
            return tokens_of(index, session) == {URL: 16}

        await publisher.send(stored(T1, "a"))
        await eventually(lambda: applied("a"), timeout=5, what="the first batch")
        read_a = time.monotonic()  # just after the read that applied it
        await publisher.send(stored(T2, "b"))
        await eventually(lambda: applied("b"), timeout=5, what="the second batch")
        assert time.monotonic() - read_a >= 0.29
    finally:
        await publisher.close()


async def test_placement_asks_the_service_to_read_only_while_it_has_sockets(zctx: zmq.asyncio.Context,
                                                                           tmp_path: Path) -> None:
    """``KVIndex.catch_up`` (every placement) reaches the service only while some backend's events are
    subscribed: a router whose backends publish none pays nothing for the index's upkeep."""
    endpoint = f"ipc://{tmp_path}/kv.sock"
    index = KVIndex(max_blocks=1000)
    pool = BackendPool("default", [Backend(URL)])
    service = KVEvents(index, KVEventsSettings(replay_timeout_s=2.0, min_read_interval_s=0.0), lambda: [pool],
                       KVMetrics(index), configured={URL2: BackendConfig(URL2, kv_events=endpoint)},
                       request_timeout_s=1.0)
    asked = [0]
    read = service.catch_up

    def counted() -> None:
        asked[0] += 1
        read()

    service.catch_up = counted  # type: ignore[method-assign]
    http = aiohttp.ClientSession()
    publisher = TestPublisher(zctx, endpoint)
    try:
        service.start(http)
        index.catch_up()
        assert asked[0] == 0  # no socket: nothing is configured for URL (and its sources are not read yet)
        assert not index.catch_up_hooked  # so a placement does not even call it
        joiner = pool.add(Backend(URL2))
        service.backend_added(joiner)
        await publisher.subscribed()
        index.catch_up()
        assert asked[0] == 1 and index.catch_up_hooked
        await publisher.send(stored(T1, "s1"))

        def applied() -> bool:
            index.catch_up()
            return tokens_of(index, "s1") == {URL2: 16}

        await eventually(applied, timeout=5, what="the batch read by catch_up")
        pool.remove(URL2)
        service.backend_removed(joiner)
        before = asked[0]
        index.catch_up()
        assert asked[0] == before and not service.subscribed(URL2) and not index.catch_up_hooked
    finally:
        await publisher.close()
        await service.stop()
        await http.close()
