"""Multi-turn conversations on one backend: the prefix cache hits on earlier turns, the engine's
per-session counters equal the sum of the responses' usage, and the Responses API store with
``previous_response_id``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backends.app import create_app
from backends.engine.config import EngineConfig
from tests.support import cached_of

BLOCK = 16


@pytest.fixture
async def client(aiohttp_client: Any) -> Any:
    return await aiohttp_client(create_app(EngineConfig(speed=0.0, block_size=BLOCK)))


def whole_blocks(n: int) -> int:
    return n // BLOCK * BLOCK


async def test_multi_turn_chat_hits_the_prefix_cache(client: Any) -> None:
    sid = "conv-multi-turn-1"
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a helpful assistant that answers in a few words."},
        {"role": "user", "content": "Tell me about the river and the mountain near the old city."},
    ]
    usages = []
    previous_prompt = 0
    for turn in range(4):
        resp = await client.post("/v1/chat/completions",
                                 json={"messages": messages, "max_tokens": 20, "ignore_eos": True, "seed": turn},
                                 headers={"X-Session-ID": sid})
        assert resp.status == 200
        assert resp.headers["X-Session-ID"] == sid
        data = await resp.json()
        usage = data["usage"]
        usages.append(usage)
        cached = cached_of(usage)
        if turn == 0:
            assert usage["prompt_tokens_details"] is None  # nothing cached: null, as vLLM answers
        else:
            # everything up to the end of the previous prompt was cached, in whole blocks
            assert cached >= whole_blocks(previous_prompt), (turn, usage, previous_prompt)
            assert cached < usage["prompt_tokens"]
        previous_prompt = usage["prompt_tokens"]
        messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
        messages.append({"role": "user", "content": f"And what about turn {turn + 2}?"})

    stats = await (await client.get(f"/v1/sessions/{sid}")).json()
    assert stats == {
        "requests": 4,
        "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
        "cached_tokens": sum(cached_of(u) for u in usages),
        "generated_tokens": sum(u["completion_tokens"] for u in usages),
    }
    assert stats["cached_tokens"] > 0


async def test_turn_two_prompt_extends_turn_one_prompt_plus_answer(client: Any) -> None:
    """The property behind the cache hits, checked through /tokenize with a real answer."""
    messages = [{"role": "user", "content": "First question?"}]
    first = await (await client.post("/tokenize", json={"messages": messages})).json()
    resp = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 9,
                                                            "ignore_eos": True, "return_token_ids": True})
    answer = (await resp.json())["choices"][0]
    messages += [{"role": "assistant", "content": answer["message"]["content"]},
                 {"role": "user", "content": "Second?"}]
    second = await (await client.post("/tokenize", json={"messages": messages})).json()
    head = first["tokens"] + answer["token_ids"]
    assert second["tokens"][: len(head)] == head


async def test_sessions_are_kept_apart(client: Any) -> None:
    body = {"messages": [{"role": "user", "content": "same words in two sessions " * 4}], "max_tokens": 4}
    a = await (await client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "A"})).json()
    b = await (await client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "B"})).json()
    # the cache is shared by the engine (like vLLM's): B hits A's blocks, accounted to B
    assert cached_of(b["usage"]) >= whole_blocks(a["usage"]["prompt_tokens"] - 1)
    sa = await (await client.get("/v1/sessions/A")).json()
    sb = await (await client.get("/v1/sessions/B")).json()
    assert sa["requests"] == sb["requests"] == 1
    assert sa["cached_tokens"] == 0
    assert sb["cached_tokens"] == cached_of(b["usage"])


# ---- Responses API ------------------------------------------------------------------------


async def create(client: Any, **body: Any) -> tuple[Any, dict[str, Any]]:
    resp = await client.post("/v1/responses", json={"max_output_tokens": 8, **body})
    return resp, await resp.json()


# vLLM's ResponsesResponse keys, in its order
RESPONSE_KEYS = ["id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object", "output",
                 "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background",
                 "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt", "reasoning", "service_tier",
                 "status", "text", "top_logprobs", "truncation", "usage", "user", "input_messages", "output_messages"]


async def test_responses_shape_store_and_get(client: Any) -> None:
    resp, data = await create(client, input="Hello responses", metadata={"k": "v"})
    assert resp.status == 200
    assert data["id"].startswith("resp_") and data["object"] == "response"
    assert data["status"] in ("completed", "incomplete")
    [item] = data["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    [part] = item["content"]
    assert part["type"] == "output_text" and part["text"]
    u = data["usage"]
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    # vLLM 0.32's usage and object key sets (rendering.responses_objects, shared with the router's tokens mode)
    assert u["input_tokens_details"] == {"cached_tokens": 0, "input_tokens_per_turn": [], "cached_tokens_per_turn": []}
    assert list(data) == RESPONSE_KEYS
    assert data["metadata"] == {"k": "v"}
    got = await client.get(f"/v1/responses/{data['id']}")
    assert got.status == 200
    assert await got.json() == data


async def test_store_false_is_not_kept(client: Any) -> None:
    _, data = await create(client, input="forget me", store=False)
    assert (await client.get(f"/v1/responses/{data['id']}")).status == 404
    resp, _ = await create(client, input="next", previous_response_id=data["id"])
    assert resp.status == 404


async def test_previous_response_id_prepends_history(client: Any) -> None:
    _, first = await create(client, input="Tell me about the sea and the island.", instructions="Be brief.")
    answer = first["output"][0]["content"][0]["text"]
    resp, second = await create(client, input=[{"role": "user", "content": "And the ship?"}],
                                previous_response_id=first["id"], instructions="Be brief.")
    assert resp.status == 200, second
    assert second["previous_response_id"] == first["id"]
    # the same tokens as sending the whole conversation by hand
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about the sea and the island."},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And the ship?"}]
    expected = await (await client.post("/tokenize", json={"messages": messages})).json()
    assert second["usage"]["input_tokens"] == expected["count"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= whole_blocks(first["usage"]["input_tokens"])
    # a third turn chains through the second
    _, third = await create(client, input="Thanks.", previous_response_id=second["id"])
    assert third["usage"]["input_tokens"] > second["usage"]["input_tokens"] + second["usage"]["output_tokens"] - 1


async def test_responses_session_accounting(client: Any) -> None:
    _, one = await create(client, input="count this", session_id="resp-sess")
    _, two = await create(client, input="and this", previous_response_id=one["id"],
                          vllm_xargs={"session_id": "resp-sess"})
    stats = await (await client.get("/v1/sessions/resp-sess")).json()
    assert stats == {
        "requests": 2,
        "prompt_tokens": one["usage"]["input_tokens"] + two["usage"]["input_tokens"],
        "cached_tokens": sum(r["usage"]["input_tokens_details"]["cached_tokens"] for r in (one, two)),
        "generated_tokens": one["usage"]["output_tokens"] + two["usage"]["output_tokens"],
    }


async def test_responses_stream_events_and_store(client: Any) -> None:
    resp = await client.post("/v1/responses", json={"input": "stream it", "max_output_tokens": 6, "stream": True,
                                                    "seed": 3})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = await resp.text()
    events = []
    for frame in raw.split("\n\n"):
        if not frame:
            continue
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        payload = json.loads(data_line[6:])
        assert payload["type"] == event_line[7:]
        events.append(payload)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4: 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(d["delta"] for d in deltas)
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] >= 1
    stored = await (await client.get(f"/v1/responses/{final['id']}")).json()
    assert stored == final
    # the same request without streaming gives the same text
    _, plain = await create(client, input="stream it", max_output_tokens=6, seed=3)
    assert plain["output"][0]["content"][0]["text"] == text


async def test_store_is_bounded(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(EngineConfig(speed=0.0), max_stored_responses=2))
    ids = [(await create(client, input=f"n{i}", max_output_tokens=1))[1]["id"] for i in range(3)]
    assert (await client.get(f"/v1/responses/{ids[0]}")).status == 404
    assert (await client.get(f"/v1/responses/{ids[1]}")).status == 200
    assert (await client.get(f"/v1/responses/{ids[2]}")).status == 200
