"""P/D on the backends, in process over real loopback HTTP: a prefill instance holds KV blocks, a
decode instance pulls them over the side channel (``POST /internal/kv/pull``), preloads them and
decodes; every failure recomputes, is counted by reason and still answers 200; the allow-list
refuses hosts before any connection; held blocks are freed on pull, on timeout and on abort."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.__main__ import config_from_args as cli_config
from backends.__main__ import model_from_args, parse_args
from backends.app import create_app, create_side_channel_app
from backends.engine.config import EngineConfig
from backends.frontend import ENGINE, FRONTEND
from backends.kv_transfer.allow_list import AllowList, is_loopback_host, parse_allow_entry
from backends.kv_transfer.metrics import FAILURE_REASONS
from backends.kv_transfer.wire import PULL_PATH, RELEASE_PATH, KVPullRequest, parse_remote_params, prompt_digest
from tests.support import cached_of, eventually

BS = 16
PLACEHOLDER = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
LONG_TEXT = "the sea and the river run to the mountain " * 8


def cfg(role: str, **kw: Any) -> EngineConfig:
    return EngineConfig(speed=kw.pop("speed", 0.0), role=role, block_size=BS, **kw)


async def scrape(client: Any) -> dict[tuple[str, str], float]:
    """``/metrics`` as {(sample name, the one extra label value or ""): value}."""
    text = await (await client.get("/metrics")).text()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = [v for k, v in s.labels.items() if k not in ("model_name", "engine")]
            out[(s.name, extra[0] if extra else "")] = s.value
    return out


wait_for = functools.partial(eventually, timeout=5.0)


async def post(client: Any, path: str, body: dict[str, Any], session: str | None = "pd-sess") -> tuple[int, Any]:
    headers = {"X-Session-ID": session} if session else {}
    resp = await client.post(path, json=body, headers=headers)
    return resp.status, await resp.json()


BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": LONG_TEXT, "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": LONG_TEXT}], "max_tokens": 4},
    "/inference/v1/generate": {"token_ids": list(range(300, 300 + 75)), "sampling_params": {"max_tokens": 4}},
}


def prefill_body(path: str) -> dict[str, Any]:
    body = json.loads(json.dumps(BODIES[path]))
    if path == "/inference/v1/generate":
        body["sampling_params"]["max_tokens"] = 1
    else:
        body["max_tokens"] = 1
    body["kv_transfer_params"] = dict(PLACEHOLDER)
    return body


async def prefill_params(prefill: Any, path: str, session: str | None = "pd-sess") -> dict[str, Any]:
    status, data = await post(prefill, path, prefill_body(path), session)
    assert status == 200, data
    assert data["usage"]["completion_tokens"] == 1
    return data["kv_transfer_params"]


@pytest.fixture
async def prefill(aiohttp_client: Any) -> Any:
    return await aiohttp_client(create_app(cfg("prefill")), server_kwargs={"host": "127.0.0.1"})


@pytest.fixture
async def decode(aiohttp_client: Any) -> Any:
    return await aiohttp_client(create_app(cfg("decode")), server_kwargs={"host": "127.0.0.1"})


# ---- parameters and the allow-list --------------------------------------------------------------

GOOD = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e", "remote_request_id": "r",
        "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 8200, "tp_size": 1}


@pytest.mark.parametrize(
    ("change", "valid"),
    [
        ({}, True),
        ({"remote_block_ids": [[1, 2], [3]]}, True),  # one list per KV-cache group
        ({"remote_block_ids": []}, False),
        ({"remote_block_ids": None}, False),
        ({"remote_block_ids": [1, -2]}, False),
        ({"remote_block_ids": ["1"]}, False),
        ({"remote_engine_id": None}, False),
        ({"remote_engine_id": ""}, False),
        ({"remote_request_id": 5}, False),
        ({"remote_host": None}, False),
        ({"remote_host": ""}, False),
        ({"remote_port": None}, False),
        ({"remote_port": "8200"}, False),
        ({"remote_port": True}, False),
        ({"remote_port": 0}, False),
        ({"remote_port": 70000}, False),
    ],
)
def test_remote_params_need_every_field(change: dict[str, Any], valid: bool) -> None:
    ref = parse_remote_params({**GOOD, **change})
    assert (ref is not None) is valid
    if ref is not None:
        assert (ref.engine_id, ref.request_id, ref.host, ref.port) == ("e", "r", "127.0.0.1", 8200)
        assert ref.block_ids in ([1, 2], [1, 2, 3])


def test_allow_list() -> None:
    default = AllowList()
    for host in ("127.0.0.1", "127.0.0.77", "127.255.0.1", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert default.allows(host, 8200), host
    for host in ("10.0.0.1", "192.168.1.1", "0.0.0.0", "example.com", "localhost.example.com", "", "::"):
        assert not default.allows(host, 8200), host
    explicit = AllowList(["127.0.0.1:8200", "[::1]:9000", "Prefill.Local:8300"])
    assert explicit.allows("127.0.0.1", 8200) and explicit.allows("::1", 9000)
    assert explicit.allows("prefill.local", 8300)
    assert not explicit.allows("127.0.0.1", 8201)  # another port of an allowed host
    assert not explicit.allows("127.0.0.77", 8200)  # loopback, but not listed: the list replaces the default
    assert "127.0.0.1:8200" in explicit.describe() and "loopback" in default.describe()
    assert is_loopback_host("127.1.2.3") and not is_loopback_host("128.0.0.1")
    for bad in ("127.0.0.1", ":8200", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:99999", "::1:8200", "h:p"):
        with pytest.raises(ValueError):
            parse_allow_entry(bad)


def test_cli_flags() -> None:
    def config_from_args(args: Any) -> Any:
        return cli_config(args, model_from_args(args))

    args = parse_args(["--role", "decode", "--kv-allow", "127.0.0.1:8200", "--kv-allow", "[::1]:8201",
                       "--kv-pull-timeout", "3"])
    assert args.kv_allow == ["127.0.0.1:8200", "[::1]:8201"] and args.kv_pull_timeout == 3
    config = config_from_args(parse_args(["--role", "prefill", "--kv-hold-timeout", "2.5", "--kv-port", "5600"]))
    assert (config.kv_hold_timeout_s, config.kv_host, config.kv_port) == (2.5, "127.0.0.1", 5600)
    plain = config_from_args(parse_args(["--role", "prefill"]))
    assert (plain.kv_hold_timeout_s, plain.kv_host, plain.kv_port) == (480.0, None, None)
    named = config_from_args(parse_args(["--role", "prefill", "--kv-host", "prefill-0"]))
    assert (named.kv_host, named.kv_port) == ("prefill-0", None)  # advertised; the HTTP port serves it
    bounded = config_from_args(parse_args(["--role", "prefill", "--kv-hold-max-blocks", "64",
                                           "--kv-hold-max-fraction", "0.25"]))
    assert (bounded.kv_hold_max_blocks, bounded.kv_hold_max_fraction) == (64, 0.25)
    assert (plain.kv_hold_max_blocks, plain.kv_hold_max_fraction) == (0, 0.5)
    for bad in (["--kv-allow", "nowhere"], ["--kv-hold-timeout", "0"], ["--kv-host", ""],
                ["--role", "decode", "--kv-port", "5600"], ["--port", "5600", "--kv-port", "5600"],
                ["--kv-hold-max-blocks", "-1"], ["--kv-hold-max-fraction", "1.5"],
                ["--kv-hold-max-fraction", "-0.1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# ---- a successful hand-off on each route -----------------------------------------------------------


@pytest.mark.parametrize("path", list(BODIES))
async def test_decode_pulls_the_prompt_and_the_prefill_frees_it(prefill: Any, decode: Any, path: str) -> None:
    params = await prefill_params(prefill, path)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == prefill.server.port
    assert params["remote_engine_id"] == prefill.server.app[ENGINE].core.engine_id and params["tp_size"] == 1
    assert (await scrape(prefill))[("session_backend_kv_held_requests", "")] == 1

    body = {**BODIES[path], "kv_transfer_params": params}
    status, data = await post(decode, path, body)
    assert status == 200, data
    prompt = data["usage"]["prompt_tokens"]
    cached = cached_of(data["usage"])
    assert data["usage"]["completion_tokens"] == 4
    # every full block came from the prefill; only the tail (at least one token) is computed here
    assert cached == (prompt - 1) // BS * BS and prompt > 3 * BS

    d = await scrape(decode)
    assert d[("session_backend_kv_pulls_total", "")] == 1
    assert d[("session_backend_kv_pulled_tokens_total", "")] == prompt // BS * BS
    assert d[("vllm:external_prefix_cache_queries_total", "")] == prompt
    assert d[("vllm:external_prefix_cache_hits_total", "")] == prompt // BS * BS
    assert d[("vllm:prompt_tokens_by_source_total", "external_kv_transfer")] == cached
    assert d[("vllm:prompt_tokens_by_source_total", "local_compute")] == prompt - cached
    assert d[("vllm:prompt_tokens_by_source_total", "local_cache_hit")] == 0
    # as in vLLM, pulled blocks are external hits, not local prefix-cache hits
    assert d[("vllm:prefix_cache_queries_total", "")] == prompt
    assert d[("vllm:prefix_cache_hits_total", "")] == 0
    assert sum(d[("session_backend_kv_pull_failures_total", r)] for r in FAILURE_REASONS) == 0

    p = await scrape(prefill)
    assert p[("session_backend_kv_held_requests", "")] == 0
    assert p[("session_backend_kv_pulls_served_total", "")] == 1
    assert p[("vllm:kv_cache_usage_perc", "")] == 0.0  # nothing referenced any more
    # both legs were accounted under the session
    for client, generated in ((prefill, 1), (decode, 4)):
        resp = await client.get("/v1/sessions/pd-sess")
        stats = await resp.json()
        assert resp.status == 200 and stats["requests"] == 1 and stats["generated_tokens"] == generated
        assert stats["prompt_tokens"] == prompt
    assert (await (await decode.get("/v1/sessions/pd-sess")).json())["cached_tokens"] == cached
    # the same prompt again, computed on the decode alone: those blocks are its local cache now
    status, again = await post(decode, path, BODIES[path], session="pd-local")
    assert status == 200 and cached_of(again["usage"]) == cached
    d = await scrape(decode)
    assert d[("vllm:prefix_cache_hits_total", "")] == cached
    assert d[("vllm:prefix_cache_queries_total", "")] == 2 * prompt


async def test_streamed_decode_leg_reports_pulled_tokens(prefill: Any, decode: Any) -> None:
    path = "/v1/chat/completions"
    params = await prefill_params(prefill, path)
    body = {**BODIES[path], "kv_transfer_params": params, "stream": True, "stream_options": {"include_usage": True}}
    resp = await decode.post(path, json=body)
    assert resp.status == 200
    events = [e[6:] for e in (await resp.text()).split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert cached_of(usage) == (usage["prompt_tokens"] - 1) // BS * BS
    assert (await scrape(prefill))[("session_backend_kv_held_requests", "")] == 0


async def test_pulled_prompt_costs_no_prefill_time(aiohttp_client: Any) -> None:
    """At speed 1 a 2,000-token prompt takes >= 0.5 s to prefill; pulled, only its tail is computed."""
    prefill = await aiohttp_client(create_app(cfg("prefill")), server_kwargs={"host": "127.0.0.1"})
    decode = await aiohttp_client(create_app(cfg("decode", speed=1.0)), server_kwargs={"host": "127.0.0.1"})
    tokens = [4 + (i * 7) % 389 for i in range(2000)]  # in the model's vocabulary (393 ids)
    body = {"token_ids": tokens, "sampling_params": {"max_tokens": 1}}
    status, data = await post(prefill, "/inference/v1/generate", {**body, "kv_transfer_params": PLACEHOLDER})
    assert status == 200
    params = data["kv_transfer_params"]
    started = time.monotonic()
    status, pulled = await post(decode, "/inference/v1/generate", {**body, "kv_transfer_params": params})
    pulled_s = time.monotonic() - started
    assert status == 200 and cached_of(pulled["usage"]) == 1984
    started = time.monotonic()
    status, local = await post(decode, "/inference/v1/generate", {**body, "token_ids": tokens[::-1]})
    local_s = time.monotonic() - started
    assert status == 200 and cached_of(local["usage"]) == 0
    assert local_s >= 0.5 and pulled_s < local_s / 2, (pulled_s, local_s)


async def test_dedicated_side_channel_listener(aiohttp_client: Any, aiohttp_server: Any, decode: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        kv_port = s.getsockname()[1]
    app = create_app(cfg("prefill", kv_host="127.0.0.1", kv_port=kv_port), kv_side_channel_on_data_port=False)
    side = await aiohttp_server(create_side_channel_app(app), host="127.0.0.1", port=kv_port)
    prefill = await aiohttp_client(app, server_kwargs={"host": "127.0.0.1"})
    assert (await prefill.post(PULL_PATH, data=b"")).status == 404  # not on the data port
    assert (await prefill.post(RELEASE_PATH, data=b"")).status == 400  # the release is, on both
    params = await prefill_params(prefill, "/v1/completions")
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", side.port)
    status, data = await post(decode, "/v1/completions", {**BODIES["/v1/completions"], "kv_transfer_params": params})
    assert status == 200 and cached_of(data["usage"]) > 0
    assert (await scrape(decode))[("session_backend_kv_pulls_total", "")] == 1
    assert (await scrape(prefill))[("session_backend_kv_held_requests", "")] == 0


async def test_advertised_host_name_on_the_data_port(aiohttp_client: Any) -> None:
    """``--kv-host`` alone: the params name that host and the HTTP port, and an allow-list entry
    written with that name matches."""
    prefill = await aiohttp_client(create_app(cfg("prefill", kv_host="localhost")), server_kwargs={"host": "127.0.0.1"})
    decode = await aiohttp_client(create_app(cfg("decode"), kv_allow=[f"localhost:{prefill.server.port}"]),
                                  server_kwargs={"host": "127.0.0.1"})
    params = await prefill_params(prefill, "/v1/chat/completions")
    assert (params["remote_host"], params["remote_port"]) == ("localhost", prefill.server.port)
    data = await decode_with(decode, params)
    assert cached_of(data["usage"]) > 0
    assert (await scrape(decode))[("session_backend_kv_pulls_total", "")] == 1


# ---- failures: recompute, count, answer 200 -------------------------------------------------------


async def failure_counts(client: Any) -> dict[str, float]:
    m = await scrape(client)
    return {r: m[("session_backend_kv_pull_failures_total", r)] for r in FAILURE_REASONS}


async def decode_with(decode: Any, params: Any, path: str = "/v1/chat/completions") -> dict[str, Any]:
    status, data = await post(decode, path, {**BODIES[path], "kv_transfer_params": params})
    assert status == 200, data
    return data


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("reason", "spoil"),
    [
        ("invalid_params", lambda p: {**p, "remote_host": None}),
        ("invalid_params", lambda p: {**p, "remote_block_ids": []}),
        ("invalid_params", lambda p: {"do_remote_prefill": True}),
        ("mismatch", lambda p: {**p, "remote_engine_id": "another-engine"}),
        ("not_found", lambda p: {**p, "remote_request_id": "chatcmpl-nobody-00000000"}),
        ("unreachable", lambda p: {**p, "remote_port": closed_port()}),
    ],
)
async def test_bad_params_recompute_and_are_counted(prefill: Any, decode: Any, reason: str,
                                                    spoil: Callable[[dict[str, Any]], dict[str, Any]],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    params = await prefill_params(prefill, "/v1/chat/completions")
    before = await failure_counts(decode)
    with caplog.at_level("WARNING", logger="backends.kv_transfer"):
        data = await decode_with(decode, spoil(params))
    assert cached_of(data["usage"]) == 0  # recomputed here
    after = await failure_counts(decode)
    assert {r: after[r] - before[r] for r in FAILURE_REASONS} == {r: float(r == reason) for r in FAILURE_REASONS}
    assert any("recomputing the prompt locally" in rec.getMessage() and reason in rec.getMessage()
               for rec in caplog.records)
    m = await scrape(decode)
    assert m[("session_backend_kv_pulls_total", "")] == 0
    assert m[("vllm:prompt_tokens_by_source_total", "local_compute")] == data["usage"]["prompt_tokens"]
    # the prefill still holds the blocks (nobody pulled them) until its timeout
    assert (await scrape(prefill))[("session_backend_kv_held_requests", "")] == 1


async def test_a_second_pull_finds_nothing(prefill: Any, decode: Any) -> None:
    params = await prefill_params(prefill, "/v1/chat/completions")
    first = await decode_with(decode, params)
    assert cached_of(first["usage"]) > 0
    await decode_with(decode, params)
    assert (await failure_counts(decode))["not_found"] == 1


async def test_params_for_another_prompt_are_refused(prefill: Any, decode: Any) -> None:
    """Blocks can be taken (and freed) only by a request for the same prompt and cache salt."""
    params = await prefill_params(prefill, "/v1/chat/completions")
    other = {**BODIES["/v1/chat/completions"], "messages": [{"role": "user", "content": "something else " * 9}],
             "kv_transfer_params": params}
    status, _ = await post(decode, "/v1/chat/completions", other)
    assert status == 200
    salted = {**BODIES["/v1/chat/completions"], "cache_salt": "tenant-b", "kv_transfer_params": params}
    status, _ = await post(decode, "/v1/chat/completions", salted)
    assert status == 200
    assert (await failure_counts(decode))["mismatch"] == 2
    assert (await scrape(prefill))[("session_backend_kv_held_requests", "")] == 1  # still held for the right one
    await decode_with(decode, params)
    assert (await scrape(prefill))[("session_backend_kv_held_requests", "")] == 0


async def test_side_channel_refuses_bad_pulls(prefill: Any) -> None:
    params = await prefill_params(prefill, "/inference/v1/generate")
    tokens = BODIES["/inference/v1/generate"]["token_ids"]

    async def pull(**change: Any) -> int:
        req = KVPullRequest(remote_request_id=params["remote_request_id"], remote_engine_id=params["remote_engine_id"],
                            block_ids=params["remote_block_ids"], block_size=BS,
                            prompt_digest=prompt_digest(tokens, None))
        req = msgspec.structs.replace(req, **change)
        resp = await prefill.post(PULL_PATH, data=msgspec.msgpack.encode(req))
        if resp.status != 200:
            body = await resp.json()
            assert body["error"]["code"] == resp.status and body["error"]["message"]
        return resp.status

    assert (await prefill.post(PULL_PATH, data=b"not msgpack")).status == 400
    assert await pull(block_size=32) == 409
    assert await pull(remote_engine_id="x") == 409
    assert await pull(prompt_digest=prompt_digest(tokens[:-1], None)) == 409
    assert await pull(block_ids=[10_000]) == 409
    assert await pull(remote_request_id="nope") == 404
    assert (await scrape(prefill))[("session_backend_kv_held_requests", "")] == 1
    assert await pull() == 200
    assert await pull() == 404  # freed by the first pull


async def test_disallowed_host_is_never_contacted(aiohttp_client: Any, prefill: Any) -> None:
    """A decode instance with an allow-list never connects to a side channel outside it, even on
    loopback; the same listener, once allowed, does see the connection (the probe works)."""
    connections: list[str] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(str(writer.get_extra_info("peername")))
        writer.close()

    trap = await asyncio.start_server(record, "127.0.0.77", 0)
    trap_port = trap.sockets[0].getsockname()[1]
    try:
        allowed_prefill = f"127.0.0.1:{prefill.server.port}"
        strict = await aiohttp_client(create_app(cfg("decode"), kv_allow=[allowed_prefill]),
                                      server_kwargs={"host": "127.0.0.1"})
        params = await prefill_params(prefill, "/v1/chat/completions")
        aimed = {**params, "remote_host": "127.0.0.77", "remote_port": trap_port}
        for variant in (aimed, {**aimed, "remote_host": "[127.0.0.77]"}, {**params, "remote_port": trap_port}):
            await decode_with(strict, variant)
        assert (await failure_counts(strict))["not_allowed"] == 3
        assert connections == []
        # the allowed side channel still works for this instance
        await decode_with(strict, params)
        assert (await scrape(strict))[("session_backend_kv_pulls_total", "")] == 1

        # control: an instance that allows the trap does connect to it (and recomputes)
        lax = await aiohttp_client(create_app(cfg("decode"), kv_allow=[f"127.0.0.77:{trap_port}"]),
                                   server_kwargs={"host": "127.0.0.1"})
        await decode_with(lax, aimed)
        assert len(connections) == 1
        assert (await failure_counts(lax))["unreachable"] == 1
    finally:
        trap.close()
        await trap.wait_closed()


async def test_prefill_role_ignores_remote_prefill_params(prefill: Any) -> None:
    params = await prefill_params(prefill, "/v1/completions")
    status, data = await post(prefill, "/v1/completions", {**BODIES["/v1/completions"], "kv_transfer_params": params})
    assert status == 200 and data["kv_transfer_params"] is None
    assert (await scrape(prefill))[("session_backend_kv_held_requests", "")] == 1  # not pulled by itself


# ---- held blocks: timeout and abort ----------------------------------------------------------------


async def test_unpulled_blocks_are_freed_after_the_hold_timeout(aiohttp_client: Any, decode: Any) -> None:
    prefill = await aiohttp_client(create_app(cfg("prefill", kv_hold_timeout_s=0.3)),
                                   server_kwargs={"host": "127.0.0.1"})
    params = await prefill_params(prefill, "/v1/completions")
    m = await scrape(prefill)
    assert m[("session_backend_kv_held_requests", "")] == 1 and m[("vllm:kv_cache_usage_perc", "")] > 0

    async def freed() -> bool:
        m = await scrape(prefill)
        return m[("session_backend_kv_held_requests", "")] == 0 and m[("vllm:kv_cache_usage_perc", "")] == 0

    await wait_for(freed, timeout=5.0, what="held blocks to expire")
    data = await decode_with(decode, params, "/v1/completions")
    assert cached_of(data["usage"]) == 0
    assert (await failure_counts(decode))["not_found"] == 1


async def test_aborted_prefill_holds_nothing(aiohttp_client: Any) -> None:
    """A prefill leg whose client goes away mid-prefill is aborted and its blocks are freed."""
    app = create_app(cfg("prefill", speed=20.0))
    prefill = await aiohttp_client(app, server_kwargs={"host": "127.0.0.1", "handler_cancellation": True})
    engine = app[ENGINE]
    body = {"token_ids": [4 + i % 389 for i in range(1500)], "sampling_params": {"max_tokens": 1},
            "kv_transfer_params": PLACEHOLDER}
    task = asyncio.create_task(prefill.post("/inference/v1/generate", json=body))

    async def running() -> bool:
        return engine.num_running == 1

    await wait_for(running, what="the prefill to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def aborted() -> bool:
        return engine.metrics.request_success["abort"] == 1 and engine.num_running == 0

    await wait_for(aborted, what="the prefill to be aborted")
    m = await scrape(prefill)
    assert m[("session_backend_kv_held_requests", "")] == 0 and m[("vllm:kv_cache_usage_perc", "")] == 0
    assert app[FRONTEND].in_flight == 0


# ---- issue 11: release, and bounds on what a hold may take -------------------------------------------


async def test_release_frees_the_held_blocks_at_once(prefill: Any, decode: Any) -> None:
    """``POST /internal/kv/release`` with the returned params (the router's "the decode leg will not
    come"): the blocks are freed now, not after the 480 s hold timeout; a later pull finds nothing."""
    params = await prefill_params(prefill, "/v1/completions")
    m = await scrape(prefill)
    assert m[("session_backend_kv_held_requests", "")] == 1
    assert m[("session_backend_kv_held_blocks", "")] == len(params["remote_block_ids"]) > 0
    wrong_engine = await prefill.post(RELEASE_PATH, json={**params, "remote_engine_id": "another"})
    wrong_blocks = await prefill.post(RELEASE_PATH, json={**params, "remote_block_ids": [0]})
    assert wrong_engine.status == wrong_blocks.status == 409
    assert (await wrong_blocks.json())["error"]["param"] == "remote_block_ids"
    garbage = await prefill.post(RELEASE_PATH, data=b"{not json")
    assert garbage.status == 400 and "kv_transfer_params" in (await garbage.json())["error"]["message"]
    assert (await scrape(prefill))[("session_backend_kv_held_requests", "")] == 1  # none of those freed it

    resp = await prefill.post(RELEASE_PATH, json=params)
    assert resp.status == 200
    assert await resp.json() == {"released": True, "remote_request_id": params["remote_request_id"],
                                 "num_blocks": len(params["remote_block_ids"])}
    m = await scrape(prefill)
    assert m[("session_backend_kv_held_requests", "")] == 0 and m[("session_backend_kv_held_blocks", "")] == 0
    assert m[("vllm:kv_cache_usage_perc", "")] == 0
    assert m[("session_backend_kv_holds_freed_total", "released")] == 1
    assert m[("session_backend_kv_holds_freed_total", "expired")] == 0
    again = await prefill.post(RELEASE_PATH, json=params)
    assert again.status == 404
    data = await decode_with(decode, params, "/v1/completions")
    assert cached_of(data["usage"]) == 0  # recomputed
    assert (await failure_counts(decode))["not_found"] == 1


async def test_a_request_over_the_per_request_bound_is_not_held(aiohttp_client: Any) -> None:
    app = create_app(cfg("prefill", kv_hold_max_blocks=4))
    prefill = await aiohttp_client(app, server_kwargs={"host": "127.0.0.1"})
    status, data = await post(prefill, "/v1/completions", prefill_body("/v1/completions"))  # ~ 5 blocks
    assert status == 200 and data["usage"]["completion_tokens"] == 1
    assert data["usage"]["prompt_tokens"] > 4 * BS
    assert data["kv_transfer_params"] is None  # nothing to hand off: the router falls back to decode-only
    m = await scrape(prefill)
    assert m[("session_backend_kv_held_requests", "")] == 0 and m[("vllm:kv_cache_usage_perc", "")] == 0
    assert m[("session_backend_kv_holds_refused_total", "over_request_limit")] == 1
    small = {"prompt": "the sea", "max_tokens": 1, "kv_transfer_params": PLACEHOLDER}
    status, data = await post(prefill, "/v1/completions", small)
    assert status == 200 and data["kv_transfer_params"]["remote_block_ids"]  # under the bound: held
    assert app[ENGINE].core.num_held == 1


async def test_all_holds_together_stay_within_their_fraction(aiohttp_client: Any) -> None:
    """The issue's attack, straight at a ``both`` backend: eight prefill-for-remote-decode requests
    nobody pulls. Holds stay within --kv-hold-max-fraction (the oldest freed first), and the next
    normal request, one that needs most of the cache, is served at once."""
    app = create_app(cfg("both", num_blocks=64, max_model_len=1024))  # default fraction 0.5: 32 blocks
    backend = await aiohttp_client(app, server_kwargs={"host": "127.0.0.1"})
    core = app[ENGINE].core
    handed: list[dict[str, Any]] = []
    for i in range(8):
        body = {"token_ids": [4 + (i * 97 + j) % 389 for j in range(110)], "sampling_params": {"max_tokens": 1},
                "kv_transfer_params": PLACEHOLDER}
        status, data = await post(backend, "/inference/v1/generate", body, f"attacker-{i}")
        assert status == 200 and data["kv_transfer_params"] is not None
        handed.append(data["kv_transfer_params"])
        assert core.num_held_blocks <= 32
    m = await scrape(backend)
    assert m[("session_backend_kv_held_blocks", "")] == core.num_held_blocks <= 32
    assert m[("session_backend_kv_holds_freed_total", "evicted")] == 8 - core.num_held >= 4
    # the oldest went first: the newest hand-offs are the ones still held
    held = [p["remote_request_id"] for p in handed if core.get_held(p["remote_request_id"]) is not None]
    assert held == [p["remote_request_id"] for p in handed[-len(held):]]

    normal = {"token_ids": [1] + [4 + j % 389 for j in range(900)], "sampling_params": {"max_tokens": 8,
                                                                                        "ignore_eos": True}}
    resp = await asyncio.wait_for(backend.post("/inference/v1/generate", json=normal), 10)
    data = await resp.json()
    assert resp.status == 200 and len(data["choices"][0]["token_ids"]) == 8
    # ~57 blocks needed: the holds made room instead of making it wait 480 s
    assert (await scrape(backend))[("session_backend_kv_holds_freed_total", "pressure")] >= 1


async def test_a_zero_fraction_never_holds(aiohttp_client: Any) -> None:
    prefill = await aiohttp_client(create_app(cfg("prefill", kv_hold_max_fraction=0.0)),
                                   server_kwargs={"host": "127.0.0.1"})
    status, data = await post(prefill, "/v1/completions", prefill_body("/v1/completions"))
    assert status == 200 and data["kv_transfer_params"] is None
    assert (await scrape(prefill))[("session_backend_kv_holds_refused_total", "over_request_limit")] == 1
