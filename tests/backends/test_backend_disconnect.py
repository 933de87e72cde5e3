"""A client that disconnects mid-request: the engine request is aborted at once (counted as
``finished_reason="abort"``), nothing stays running, and ``/load`` returns to 0. Real sockets that
really close, against a backend at speed 1 (so the request is still running when they do)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.app import create_app
from backends.engine.config import EngineConfig
from backends.frontend import ENGINE
from tests.support import eventually

MODEL = "disc-model"
LABELS = {"model_name": MODEL, "engine": "0"}


@pytest.fixture
async def client(aiohttp_client: Any) -> Any:
    return await aiohttp_client(create_app(EngineConfig(speed=1.0, model=MODEL)))


async def metrics(client: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = await (await client.get("/metrics")).text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def key(name: str, **extra: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (name, tuple(sorted({**LABELS, **extra}.items())))


ABORTS = key("vllm:request_success_total", finished_reason="abort")
RUNNING = key("vllm:num_requests_running")


wait_for = functools.partial(eventually, timeout=5.0)


async def raw_post(port: int, path: str, body: dict[str, Any]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nX-Session-ID: disc-sess\r\n\r\n".encode() + payload
    )
    await writer.drain()
    return reader, writer


async def aborted_cleanly(client: Any, aborts_before: float) -> None:
    async def done() -> bool:
        m = await metrics(client)
        return m.get(ABORTS, 0.0) == aborts_before + 1 and m[RUNNING] == 0

    await wait_for(done, what="the engine to abort the request")
    assert await (await client.get("/load")).json() == {"server_load": 0}
    engine = client.server.app[ENGINE]
    assert engine.num_running == 0 and engine.num_waiting == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "a long story", "max_tokens": 4000, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000,
                                  "ignore_eos": True}),
        ("/inference/v1/generate", {"token_ids": [1, 300, 301], "sampling_params": {"max_tokens": 4000,
                                                                                     "ignore_eos": True}}),
        ("/v1/responses", {"input": "go on", "max_output_tokens": 4000}),
    ],
)
async def test_disconnect_mid_stream_aborts(client: Any, path: str, body: dict[str, Any]) -> None:
    before = (await metrics(client)).get(ABORTS, 0.0)
    started = time.monotonic()
    reader, writer = await raw_post(client.server.port, path, {**body, "stream": True})
    seen = b""
    while seen.count(b"data: ") < 3:  # the stream is flowing
        chunk = await asyncio.wait_for(reader.read(65536), timeout=5)
        assert chunk, "server closed the stream early"
        seen += chunk
    assert seen.startswith(b"HTTP/1.1 200")
    assert (await metrics(client))[RUNNING] == 1
    writer.close()
    await aborted_cleanly(client, before)
    # at speed 1, 4000 tokens take far longer than this: the request was cut short
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "a long story", "max_tokens": 4000, "ignore_eos": True}),
        ("/inference/v1/generate", {"token_ids": [1, 300, 301], "sampling_params": {"max_tokens": 4000,
                                                                                     "ignore_eos": True}}),
    ],
)
async def test_disconnect_while_waiting_for_a_non_stream_answer_aborts(client: Any, path: str,
                                                                       body: dict[str, Any]) -> None:
    before = (await metrics(client)).get(ABORTS, 0.0)
    reader, writer = await raw_post(client.server.port, path, body)

    async def running() -> bool:
        return (await metrics(client))[RUNNING] == 1

    await wait_for(running, what="the request to run")
    assert await (await client.get("/load")).json() == {"server_load": 1}
    writer.close()
    await aborted_cleanly(client, before)
    # the aborted request is accounted to its session with what it generated
    stats = await (await client.get("/v1/sessions/disc-sess")).json()
    assert stats["requests"] == 1 and stats["generated_tokens"] < 4000


async def test_server_keeps_serving_after_disconnects(client: Any) -> None:
    for _ in range(3):
        reader, writer = await raw_post(client.server.port, "/v1/completions",
                                        {"prompt": "x", "max_tokens": 4000, "stream": True})
        await asyncio.wait_for(reader.readuntil(b"data: "), timeout=5)
        writer.close()
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status == 200

    async def idle() -> bool:
        return (await metrics(client))[RUNNING] == 0

    await wait_for(idle, what="all aborted requests to leave the engine")
