"""session-backend with ``--kv-events-config``, in process over real HTTP (127.0.0.1) and real ZMQ
sockets (ipc:// in a temporary folder, tcp://127.0.0.1): what a subscriber sees for chat and
completion requests, prefix hits, evictions and resets; seq; replay; both socket directions;
``GET /kv_event_sources``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from backends.app import create_app
from backends.engine.config import EngineConfig
from backends.engine.kv_cache import hash_full_blocks
from backends.render_routes import create_render_app
from contract.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    decode_batch,
    decode_event_sources,
    seq_from_bytes,
)
from rendering.model import DEFAULT_MODEL_DIR, load_model
from tests.backends.kv_event_client import EventStream, IpcDir, Received, free_tcp_endpoint, replay

MODEL = "sim-model"
BS = 16


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


def events_config(**fields: Any) -> KVEventsConfig:
    return msgspec.convert({"enable_kv_cache_events": True, "publisher": "zmq", **fields}, KVEventsConfig)


Start = Callable[..., Awaitable[Any]]


@pytest.fixture
def start_backend(aiohttp_client: Any) -> Start:
    async def start(kv_events: KVEventsConfig | None, int_hashes: bool = True, **engine: Any) -> Any:
        config = EngineConfig(**{"speed": 0.0, "model": MODEL, "block_size": BS, **engine})
        return await aiohttp_client(create_app(config, kv_events=kv_events, kv_events_int_hashes=int_hashes))
    return start


async def reset(client: Any) -> bool:
    resp = await client.post("/reset_prefix_cache")
    assert resp.status == 200
    return bool((await resp.json())["success"])


def stored_events(got: list[Received]) -> list[BlockStored]:
    return [e for r in got for e in r.batch.events if isinstance(e, BlockStored)]


def has_session(session: str) -> Callable[[list[Received]], bool]:
    return lambda got: any(e.session_id == session for e in stored_events(got))


async def subscribed(ctx: zmq.asyncio.Context, client: Any, endpoint: str, *, bind: bool = False) -> EventStream:
    """A SUB socket whose subscription is live (synced by resets of the idle engine)."""
    stream = EventStream(ctx, endpoint, bind=bind)
    first = await stream.sync(lambda: reset(client))
    assert first.batch.events == [AllBlocksCleared()]
    return stream


async def completion(client: Any, prompt: list[int], max_tokens: int = 1, headers: dict[str, str] | None = None,
                     **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/completions", headers=headers or {}, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


LONG = "Tell me about the weather in the mountains in spring and in autumn, please, in detail. " * 3


@pytest.mark.parametrize("channel", ["body", "header", "vllm_xargs"])
async def test_a_chat_requests_blocks_arrive_tagged_with_its_session(
        channel: str, start_backend: Start, ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    client = await start_backend(events_config(endpoint=ipc.endpoint("pub"), topic="kv@b0"))
    stream = await subscribed(ctx, client, ipc.endpoint("pub"))
    session = f"sess-{channel}"
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}
    headers = {}
    if channel == "body":
        body["session_id"] = session
    elif channel == "header":
        headers["X-Session-ID"] = session
    else:
        body["vllm_xargs"] = {"session_id": session}
    try:
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status == 200, await resp.text()
        prompt_tokens = (await resp.json())["usage"]["prompt_tokens"]
        got = await stream.until(has_session(session))
        first = next(e for e in stored_events(got) if e.session_id == session)
        assert first.parent_block_hash is None and first.block_size == BS and first.medium == "GPU"
        assert len(first.block_hashes) == prompt_tokens // BS  # every full block of the prompt, one run
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first.block_hashes)  # vLLM's default
        assert len(first.token_ids) == BS * len(first.block_hashes)
        assert all(r.topic == b"kv@b0" for r in got)
    finally:
        stream.close()


async def test_completion_blocks_carry_the_prompts_tokens_and_chain(
        start_backend: Start, ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the engine's own 16-byte keys
    client = await start_backend(events_config(endpoint=ipc.endpoint("pub")), int_hashes=False)
    stream = await subscribed(ctx, client, ipc.endpoint("pub"))
    prompt = list(range(10, 50))  # the shipped model has 393 ids
    try:
        await completion(client, prompt, max_tokens=10, session_id="s-tok")
        got = await stream.until(lambda g: len(stored_events(g)) >= 2)
        first, second = stored_events(got)[:2]
        assert first.token_ids == prompt[:32] and len(first.block_hashes) == 2
        assert first.block_hashes == hash_full_blocks(prompt, BS)[:2]
        assert second.parent_block_hash == first.block_hashes[-1]  # the generated tokens fill block 3
        assert second.token_ids[:8] == prompt[32:] and second.session_id == "s-tok"
        seqs = [r.seq for r in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # +1 per batch
    finally:
        stream.close()


async def test_a_second_turns_prefix_hit_is_reported_with_the_new_session(
        start_backend: Start, ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    client = await start_backend(events_config(endpoint=ipc.endpoint("pub")))
    stream = await subscribed(ctx, client, ipc.endpoint("pub"))
    turn1 = list(range(50, 90))
    turn2 = turn1[:32] + list(range(300, 320))
    try:
        await completion(client, turn1, session_id="agent-1")
        turn1_hashes = stored_events(await stream.until(has_session("agent-1")))[0].block_hashes
        # the second turn asks for full reports (vLLM's kv_cache_report_mode, via vllm_xargs)
        await completion(client, turn2, headers={"X-Session-ID": "agent-2"},
                         vllm_xargs={"kv_cache_report_mode": "full"})
        events = stored_events(await stream.until(lambda g: len(stored_events(g)) >= 2))
        reuse, new = events[0], events[1]
        assert reuse.session_id == "agent-2" and reuse.parent_block_hash is None
        assert reuse.block_hashes == turn1_hashes and reuse.token_ids == turn1[:32]
        assert new.session_id == "agent-2" and new.parent_block_hash == turn1_hashes[-1]
        assert new.token_ids == turn2[32:48]
    finally:
        stream.close()


async def test_eviction_under_a_small_cache_publishes_block_removed(
        start_backend: Start, ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    client = await start_backend(events_config(endpoint=ipc.endpoint("pub")), num_blocks=8)
    stream = await subscribed(ctx, client, ipc.endpoint("pub"))
    try:
        await completion(client, list(range(3, 67)), session_id="first")  # 4 cached blocks
        first = stored_events(await stream.until(has_session("first")))[0].block_hashes
        await completion(client, list(range(100, 200)), session_id="second")  # needs 7 of 8 blocks
        got = await stream.until(has_session("second"))
        removed = [e for r in got for e in r.batch.events if isinstance(e, BlockRemoved)]
        assert len(removed) == 3 and {e.block_hashes[0] for e in removed} <= set(first)
    finally:
        stream.close()


async def test_reset_prefix_cache_publishes_all_blocks_cleared(
        start_backend: Start, ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    client = await start_backend(events_config(endpoint=ipc.endpoint("pub")))
    stream = await subscribed(ctx, client, ipc.endpoint("pub"))
    try:
        await completion(client, list(range(100, 140)), session_id="s")
        before = await stream.until(has_session("s"))
        assert await reset(client) is True
        [cleared] = await stream.until(lambda g: len(g) == 1)
        assert cleared.batch.events == [AllBlocksCleared()] and cleared.seq == before[-1].seq + 1
        resp = await client.post("/reset_prefix_cache?reset_running_requests=true")
        assert resp.status == 400 and "not supported" in (await resp.json())["error"]["message"]
    finally:
        stream.close()


async def test_the_replay_socket_returns_missed_batches_then_end_seq(
        start_backend: Start, ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    client = await start_backend(events_config(endpoint=ipc.endpoint("pub"), replay_endpoint=ipc.endpoint("replay")))
    stream = await subscribed(ctx, client, ipc.endpoint("pub"))
    try:
        for i in range(3):
            await completion(client, list(range(10 + 40 * i, 50 + 40 * i)), session_id=f"s{i}")
        live = await stream.until(has_session("s2"))
        # a subscriber that joined late asks for everything from seq 0
        answers = await replay(ctx, ipc.endpoint("replay"), 0)
        assert answers[-1][2] == b"\xff" * 8
        replayed = {seq_from_bytes(a[2]): a[3] for a in answers[:-1]}
        assert sorted(replayed) == list(range(len(replayed)))  # 0, 1, 2, ... nothing missing
        for r in live:
            assert replayed[r.seq] == r.payload  # the very bytes published
        assert any(e.session_id == "s0" for p in replayed.values() for e in decode_batch(p).events
                   if isinstance(e, BlockStored))
    finally:
        stream.close()


async def test_a_concrete_host_endpoint_makes_the_backend_connect(
        start_backend: Start, ctx: zmq.asyncio.Context) -> None:
    endpoint = free_tcp_endpoint()
    stream = EventStream(ctx, endpoint, bind=True)  # as the router does for such an endpoint
    client = await start_backend(events_config(endpoint=endpoint))
    try:
        await stream.sync(lambda: reset(client))
        await completion(client, list(range(100, 140)), session_id="via-connect")
        await stream.until(has_session("via-connect"))
        sources = decode_event_sources(await (await client.get("/kv_event_sources")).read())
        assert sources[0].endpoint == endpoint
    finally:
        stream.close()


async def test_kv_event_sources_reports_the_resolved_config_by_dp_rank(
        start_backend: Start, ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    client = await start_backend(events_config(endpoint="tcp://*:0", replay_endpoint=ipc.endpoint("replay"),
                                               topic="kv@x", buffer_steps=50))
    resp = await client.get("/kv_event_sources")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/json")
    raw = await resp.json()
    assert list(raw) == ["0"]
    endpoint = raw["0"]["endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
    assert raw["0"] == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                        "replay_endpoint": ipc.endpoint("replay"), "buffer_steps": 50, "hwm": 100000,
                        "max_queue_size": 100000, "topic": "kv@x"}
    stream = await subscribed(ctx, client, endpoint)  # the reported endpoint is the live one
    stream.close()


@pytest.mark.parametrize("kv_events", [None, '{"enable_kv_cache_events": false}',
                                       '{"enable_kv_cache_events": true, "publisher": "null"}'])
async def test_kv_event_sources_is_empty_when_nothing_publishes(kv_events: str | None, start_backend: Start) -> None:
    config = msgspec.json.decode(kv_events, type=KVEventsConfig) if kv_events else None
    client = await start_backend(config)
    resp = await client.get("/kv_event_sources")
    assert resp.status == 200 and await resp.read() == b"{}"
    assert await reset(client) is True  # the route works without events too


async def test_a_tokens_only_engine_serves_kv_event_sources(aiohttp_client: Any, ipc: IpcDir) -> None:
    config = events_config(endpoint=ipc.endpoint("pub"))
    client = await aiohttp_client(create_app(EngineConfig(speed=0.0, model=MODEL), tokens_only=True,
                                             kv_events=config))
    sources = decode_event_sources(await (await client.get("/kv_event_sources")).read())
    assert sources == {0: config}


async def test_a_render_server_has_no_kv_event_sources(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_render_app(load_model(DEFAULT_MODEL_DIR, served_model_name=MODEL,
                                                               max_model_len=None)))
    resp = await client.get("/kv_event_sources")
    assert resp.status == 200 and await resp.read() == b"{}"


async def test_a_decode_instance_reports_pulled_blocks_for_the_request_that_loaded_them(
        aiohttp_client: Any, ipc: IpcDir, ctx: zmq.asyncio.Context) -> None:
    """P/D: the blocks a decode instance pulls from the prefill are stored blocks of the decode request
    (tagged with its session), as vLLM's decode instance reports them once the transfer lands."""
    def engine(role: str) -> EngineConfig:
        return EngineConfig(speed=0.0, model=MODEL, block_size=BS, role=role)
    prefill = await aiohttp_client(create_app(engine("prefill")), server_kwargs={"host": "127.0.0.1"})
    decode = await aiohttp_client(create_app(engine("decode"), kv_events=events_config(endpoint=ipc.endpoint("pub"))),
                                  server_kwargs={"host": "127.0.0.1"})
    stream = await subscribed(ctx, decode, ipc.endpoint("pub"))
    tokens = list(range(300, 375))  # 4 full blocks and 11 tokens
    session = {"X-Session-ID": "pd-sess"}
    placeholder = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}
    try:
        resp = await prefill.post("/inference/v1/generate", headers=session, json={
            "token_ids": tokens, "sampling_params": {"max_tokens": 1}, "kv_transfer_params": placeholder})
        params = (await resp.json())["kv_transfer_params"]
        resp = await decode.post("/inference/v1/generate", headers=session, json={
            "token_ids": tokens, "sampling_params": {"max_tokens": 4}, "kv_transfer_params": params})
        assert resp.status == 200
        assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # pulled, not computed
        pulled = stored_events(await stream.until(has_session("pd-sess")))[0]
        assert pulled.session_id == "pd-sess" and pulled.parent_block_hash is None
        assert pulled.token_ids == tokens[:64] and len(pulled.block_hashes) == 4
    finally:
        stream.close()
