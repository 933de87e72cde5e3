"""``SharedState`` against a real redis-server: writes off the request path, pushes, first-sight reads,
bounds, and what happens when Redis is killed, comes back, or goes slow."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import redis.asyncio as redis

from router.config.schema import SharedStateConfig
from router.membership import Backend, BackendPool
from router.shared.agreement import first_choice
from router.sessions.responses import ResponseIndex
from router.sessions.table import SessionTable
from router.shared.metrics import SharedMetrics
from router.shared.store import SharedState, shown_url
from tests.router.shared.conftest import RedisServer
from tests.support import eventually, free_port


class Replica:
    """What one router process holds: its session table, Responses index and shared state."""

    def __init__(self, url: str, **settings: Any) -> None:
        pool = settings.pop("pool", "default")
        ttl_s = settings.pop("ttl_s", 600.0)
        max_ids = settings.pop("max_response_ids", 1000)
        self.sessions = SessionTable(1000, ttl_s)
        self.responses = ResponseIndex(max_ids)
        self.metrics = SharedMetrics({}, shared=True)
        config = msgspec.convert({"url": url, **settings}, SharedStateConfig)
        self.shared = SharedState(config, sessions=self.sessions, responses=self.responses, metrics=self.metrics,
                                  pool=pool, ttl_s=ttl_s, max_response_ids=max_ids)


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[Callable[..., Any]]:
    made: list[Replica] = []

    async def make(**settings: Any) -> Replica:
        replica = Replica(redis_server.url, **settings)
        replica.shared.start()
        made.append(replica)
        await eventually(lambda: replica.shared.up, timeout=5, what="the shared state up")
        return replica

    yield make
    for replica in made:
        await replica.shared.stop()


async def raw(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, decode_responses=True)


async def test_a_pin_moved_on_one_replica_is_pushed_to_one_that_knows_the_session_and_read_by_a_new_one(
        replicas: Callable[..., Any], redis_server: RedisServer) -> None:
    a, b, c = await replicas(), await replicas(), await replicas()
    for replica in (a, b):
        replica.sessions.touch("s1").pins["default"] = "http://b1"
    a.shared.pin_moved("s1", "default", "http://b2", "load")
    # pushed: b's entry follows without any read
    await eventually(lambda: b.sessions.get("s1").pins["default"] == "http://b2", timeout=5, what="the push")
    assert b.sessions.get("s1").off_first == "load"
    assert b.metrics.pushes == 1 and b.metrics.reads == {}
    assert a.metrics.pushes == 0  # its own message is skipped
    # stored with the session table's TTL
    client = await raw(redis_server)
    assert await client.hgetall("session-router:pins:s1") == {"default": "load http://b2"}
    assert 590 <= await client.ttl("session-router:pins:s1") <= 600
    await client.aclose()
    # c has never seen s1: it reads its pins once, on first sight
    entry = c.sessions.touch("s1")
    await c.shared.recall_pins(entry)
    assert entry.pins == {"default": "http://b2"} and entry.off_first == "load"
    assert c.metrics.reads == {("pins", "hit"): 1}
    fresh = c.sessions.touch("s-new")
    await c.shared.recall_pins(fresh)
    assert fresh.pins == {} and c.metrics.reads[("pins", "miss")] == 1


async def test_a_learnt_pin_is_judged_against_this_processes_own_first_choice(replicas: Callable[..., Any]) -> None:
    pool = BackendPool("default", [Backend("http://127.0.0.1:9001"), Backend("http://127.0.0.1:9002")])
    first = first_choice(pool, "s1")
    other = next(b for b in pool.members if b is not first)
    a, b = await replicas(), await replicas(pool=pool)
    b.sessions.touch("s1").pins["default"] = other.url
    b.sessions.get("s1").off_first = "load"
    a.shared.pin_moved("s1", "default", first.url, "repin")  # off the mover's first choice, not b's
    await eventually(lambda: b.sessions.get("s1").pins["default"] == first.url, timeout=5, what="the push")
    assert b.sessions.get("s1").off_first == ""
    a.shared.pin_moved("s1", "default", other.url, "")  # on the mover's first choice, off b's
    await eventually(lambda: b.sessions.get("s1").pins["default"] == other.url, timeout=5, what="the push")
    assert b.sessions.get("s1").off_first == "other"


async def test_a_responses_id_stored_on_one_replica_is_read_once_by_another(replicas: Callable[..., Any]) -> None:
    a, b = await replicas(), await replicas()
    a.responses.remember("resp_1", "http://b1", "sess-1")  # the proxy's call: told to the shared state
    await eventually(lambda: a.metrics.writes.get("resp") == 1, timeout=5, what="the write")
    body = msgspec.json.encode({"model": "m", "input": "hi", "previous_response_id": "resp_1"})
    await b.shared.recall_response("responses", body, "/v1/responses")
    assert b.responses.lookup("resp_1") == ("http://b1", "sess-1")
    await b.shared.recall_response("responses", body, "/v1/responses")  # known now: no second read
    assert b.metrics.reads == {("response", "hit"): 1}
    # a GET /v1/responses/{id} path (the catch-all route) too; unknown ids, other routes, bad bodies: nothing
    a.responses.remember("resp_2", "http://b2", None)
    await eventually(lambda: a.metrics.writes.get("resp") == 2, timeout=5, what="the write")
    await b.shared.recall_response("other", b"", "/v1/responses/resp_2?stream=false")
    assert b.responses.lookup("resp_2") == ("http://b2", None)
    await b.shared.recall_response("responses", msgspec.json.encode({"previous_response_id": "nope"}), "/v1/responses")
    await b.shared.recall_response("chat", body, "/v1/chat/completions")
    await b.shared.recall_response("responses", b"[1, 2", "/v1/responses")
    assert b.metrics.reads == {("response", "hit"): 2, ("response", "miss"): 1}
    assert "nope" not in b.responses
    assert b.metrics.writes == {}  # learnt ids are not written back


async def test_responses_ids_in_redis_are_bounded_by_max_response_ids(replicas: Callable[..., Any],
                                                                      redis_server: RedisServer) -> None:
    a = await replicas(max_response_ids=3)
    for i in range(5):
        a.responses.remember(f"r{i}", "http://b1", None)
    await eventually(lambda: a.metrics.writes.get("resp") == 5, timeout=5, what="the writes")
    client = await raw(redis_server)
    kept = sorted(k.rsplit(":", 1)[1] for k in await client.keys("session-router:resp:*"))
    assert kept == ["r2", "r3", "r4"]
    assert await client.lrange("session-router:resp-ids", 0, -1) == ["r4", "r3", "r2"]
    await client.aclose()


async def test_a_deleted_session_is_forgotten_in_redis(replicas: Callable[..., Any], redis_server: RedisServer) -> None:
    a = await replicas()
    a.sessions.touch("gone")
    a.shared.pin_moved("gone", "default", "http://b2", "load")
    client = await raw(redis_server)
    await eventually(lambda: client.exists("session-router:pins:gone"), timeout=5, what="the pin written")
    assert a.sessions.delete("gone")

    async def forgotten() -> bool:
        return not await client.exists("session-router:pins:gone")

    await eventually(forgotten, timeout=5, what="the pins deleted")
    await client.aclose()


async def test_redis_killed_degrades_to_local_state_and_recovers_when_it_is_back(
        replicas: Callable[..., Any], redis_server: RedisServer) -> None:
    a, b = await replicas(backoff_min_s=0.05, backoff_max_s=0.2), await replicas(backoff_min_s=0.05, backoff_max_s=0.2)
    b.sessions.touch("s1").pins["default"] = "http://b1"
    redis_server.kill()
    await eventually(lambda: not a.shared.up and not b.shared.up, timeout=5, what="both see Redis down")
    assert a.metrics.up == 0 and a.metrics.errors
    # reads are skipped at once (local state), writes wait in the queue
    entry = a.sessions.touch("s2")
    started = time.monotonic()
    await a.shared.recall_pins(entry)
    assert time.monotonic() - started < 0.01 and a.metrics.reads == {("pins", "skipped"): 1}
    a.shared.pin_moved("s1", "default", "http://b2", "repin")
    redis_server.start()
    await eventually(lambda: a.shared.up and b.shared.up, timeout=10, what="both reconnected")
    assert a.metrics.up == 1
    # the queued write went out once Redis was back (b re-subscribed meanwhile, or reads it)
    client = await raw(redis_server)

    async def written() -> bool:
        return await client.hget("session-router:pins:s1", "default") == "repin http://b2"

    await eventually(written, timeout=5, what="the queued write flushed")
    await client.aclose()
    a.shared.pin_moved("s1", "default", "http://b3", "load")
    await eventually(lambda: b.sessions.get("s1").pins["default"] == "http://b3", timeout=5, what="pushes again")
    # the connections to the Redis that died are not reused: the first write and read after it work
    errors = dict(a.metrics.errors)
    a.responses.remember("r-after", "http://b1", "s1")
    await eventually(lambda: a.metrics.writes.get("resp") == 1, timeout=5, what="the write")
    await b.shared.recall_response("other", b"", "/v1/responses/r-after")
    assert b.responses.lookup("r-after") == ("http://b1", "s1")
    assert a.metrics.errors == errors and a.metrics.dropped_writes == 0


async def test_a_full_queue_drops_and_counts(replicas: Callable[..., Any], redis_server: RedisServer) -> None:
    a = await replicas(queue_size=3, backoff_min_s=0.05, backoff_max_s=0.1)
    redis_server.kill()
    await eventually(lambda: not a.shared.up, timeout=5, what="Redis seen down")
    for i in range(5):
        a.shared.pin_moved(f"s{i}", "default", "http://b2", "load")
    assert a.metrics.dropped_writes == 2
    text = "\n".join(str(m) for m in a.metrics.collect())
    assert "shared_state_dropped_writes" in text


async def test_a_slow_redis_never_holds_a_read_past_the_read_timeout(
        replicas: Callable[..., Any], redis_server: RedisServer) -> None:
    a = await replicas(read_timeout_s=0.05, backoff_min_s=0.05, backoff_max_s=0.1)
    conn = redis_server.send("DEBUG", "SLEEP", "1.5")  # the server stalls for 1.5 s
    try:
        await asyncio.sleep(0.05)
        entry = a.sessions.touch("s1")
        started = time.monotonic()
        await a.shared.recall_pins(entry)
        assert time.monotonic() - started < 0.05 + 0.1
        assert a.metrics.read_timeouts == 1 and not a.shared.up
        started = time.monotonic()  # degraded: the next reads do not even wait
        body = msgspec.json.encode({"previous_response_id": "r1"})
        await a.shared.recall_response("responses", body, "/v1/responses")
        assert time.monotonic() - started < 0.01
    finally:
        conn.close()
    await eventually(lambda: a.shared.up, timeout=10, what="up again once Redis answers")


async def test_metrics_say_up_and_count(replicas: Callable[..., Any]) -> None:
    a = await replicas()
    families = {m.name: m for m in a.metrics.collect()}
    assert families["session_router_shared_state_up"].samples[0].value == 1
    assert {"session_router_off_first_choice", "session_router_shared_state_errors",
            "session_router_shared_state_read_timeouts", "session_router_shared_state_reads",
            "session_router_shared_state_writes", "session_router_shared_state_pushes"} <= set(families)
    local = SharedMetrics({"load": 2}, shared=False)
    assert [m.name for m in local.collect()] == ["session_router_off_first_choice"]


async def test_stop_flushes_what_is_queued(redis_server: RedisServer) -> None:
    a = Replica(redis_server.url)
    a.shared.start()
    await eventually(lambda: a.shared.up, timeout=5, what="up")
    for i in range(50):
        a.shared.pin_moved(f"s{i}", "default", "http://b2", "load")
    await a.shared.stop()
    client = await raw(redis_server)
    assert len(await client.keys("session-router:pins:*")) == 50
    await client.aclose()


async def test_a_sessions_first_pin_is_kept_from_the_first_writer_and_not_pushed(
        replicas: Callable[..., Any], redis_server: RedisServer) -> None:
    a, b = await replicas(), await replicas()
    b.sessions.touch("s").pins["default"] = "http://b2"
    a.shared.pin_moved("s", "default", "http://b1", "", new=True)
    await eventually(lambda: a.metrics.writes.get("pin") == 1, timeout=5, what="a's write")
    b.shared.pin_moved("s", "default", "http://b2", "load", new=True)  # placed concurrently, wrote second
    await eventually(lambda: b.metrics.writes.get("pin") == 1, timeout=5, what="b's write")
    client = await raw(redis_server)
    assert await client.hgetall("session-router:pins:s") == {"default": " http://b1"}
    await client.aclose()
    # a new session's pin is not pushed: b keeps its own until a move
    a.shared.pin_moved("s", "default", "http://b3", "load")  # a move is
    await eventually(lambda: b.sessions.get("s").pins["default"] == "http://b3", timeout=5, what="the move")
    assert b.metrics.pushes == 1
    c = await replicas()
    entry = c.sessions.touch("s")
    await c.shared.recall_pins(entry)
    assert entry.pins == {"default": "http://b3"}


async def test_joined_waits_for_a_stalled_redis_to_answer_the_first_connection(redis_server: RedisServer) -> None:
    # the process listens only after ``joined``: a Redis slow to answer its first PING is waited for
    # (within the PING's and SUBSCRIBE's bounds), so the first requests are not served without it
    conn = redis_server.send("DEBUG", "SLEEP", "0.6")
    a = Replica(redis_server.url, write_timeout_s=2.0)
    try:
        await asyncio.sleep(0.05)  # the stall has begun (the PING below queues behind it)
        a.shared.start()
        started = time.monotonic()
        assert await a.shared.joined() is True
        assert 0.3 < time.monotonic() - started < 2 * 2.0
        assert a.metrics.up == 1
    finally:
        conn.close()
        await a.shared.stop()


async def test_joined_gives_up_at_once_on_a_refused_connection_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    # nothing listens on this loopback port: the first attempt fails at once, start-up goes on; the log
    # names the URL without its password
    a = Replica(f"redis://router:s3cret@127.0.0.3:{free_port()}/0", write_timeout_s=2.0, backoff_min_s=0.05,
                backoff_max_s=0.1)
    a.shared.start()
    try:
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="router.shared.store"):
            assert await a.shared.joined() is False
        assert time.monotonic() - started < 2.0
        assert a.metrics.up == 0
        assert any("not reachable at start-up" in r.getMessage() and "redis://router:***@127.0.0.3:" in r.getMessage()
                   for r in caplog.records)
        assert not any("s3cret" in r.getMessage() for r in caplog.records)
    finally:
        await a.shared.stop()


def test_logs_show_a_redis_url_without_its_password() -> None:
    assert shown_url("redis://:pw@10.0.0.5:6379/0") == "redis://:***@10.0.0.5:6379/0"
    assert shown_url("rediss://app:p%40ss@[fd00::1]:6380/2") == "rediss://app:***@[fd00::1]:6380/2"
    assert shown_url("redis://10.0.0.5:6379/0") == "redis://10.0.0.5:6379/0"
    assert shown_url("unix:///run/redis.sock") == "unix:///run/redis.sock"


async def test_joined_is_bounded_when_redis_never_answers() -> None:
    # a listener that accepts and never answers: the first PING times out, start-up goes on
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        a = Replica(f"redis://127.0.0.1:{port}/0", write_timeout_s=0.2, backoff_min_s=0.05, backoff_max_s=0.1)
        a.shared.start()
        try:
            started = time.monotonic()
            assert await a.shared.joined() is False
            assert time.monotonic() - started < 2 * 0.2 + 0.5 + 0.5
        finally:
            await a.shared.stop()
