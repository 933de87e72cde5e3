"""``kv_aware`` through real HTTP, in process: the decision header on both fronts (streams too), the
decisions metric, and the engines' load read from a backend's ``/metrics`` by the health checker."""

from __future__ import annotations

import re
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from router.proxy import DECISION_HEADER
from tests.conftest import MakeRouter
from tests.fakes import EchoBackend
from tests.support import eventually, metric_sum

FRONTS = ("raw", "aiohttp")
DECISION = re.compile(r"^(new|sticky|spill|repin_unhealthy|repin_removed|no_session);cached=\d+;wait=\d+;reason=[a-z_]+$")


@dataclass(eq=False)
class MetricsBackend(EchoBackend):
    """An echo backend that also serves vLLM's load gauges on ``GET /metrics`` (set by the test)."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        labels = '{engine="0",model_name="m"}'
        text = "".join(
            f"# TYPE {name} gauge\n{name}{labels} {value}\n" for name, value in (
                ("vllm:num_requests_waiting", self.waiting), ("vllm:num_requests_running", self.running),
                ("vllm:kv_cache_usage_perc", self.kv_usage)))
        return web.Response(text=text, content_type="text/plain")


@pytest.mark.parametrize("front", FRONTS)
async def test_the_decision_header_on_every_answer_streams_too(make_router: MakeRouter, front: str) -> None:
    router = await make_router(front, n=2, placement={"decision_header": True})
    async with aiohttp.ClientSession() as http:
        first = await http.post(router.url + "/v1/completions", json={"prompt": "hello " * 40, "session_id": "s1"})
        assert first.status == 200
        value = first.headers[DECISION_HEADER]
        assert DECISION.match(value), value
        assert value.startswith("new;cached=0;") and value.endswith(";reason=hash")
        # the echo backend reports 10 prompt + 3 completion tokens: the pin holds 13 of them now
        second = await http.post(router.url + "/v1/completions",
                                 json={"prompt": "hello " * 40, "session_id": "s1", "stream": True})
        assert second.status == 200 and second.headers["Content-Type"].startswith("text/event-stream")
        assert second.headers[DECISION_HEADER] == "sticky;cached=13;wait=0;reason=cached"
        await second.read()
        chat = await http.post(router.url + "/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}], "session_id": "s1"})
        assert chat.headers[DECISION_HEADER].startswith("sticky;")
        metrics = await (await http.get(router.url + "/metrics")).text()
    assert metric_sum(metrics, "session_router_placement_decisions_total", policy="kv_aware", outcome="new",
                      reason="hash") == 1
    assert metric_sum(metrics, "session_router_placement_decisions_total", policy="kv_aware", outcome="sticky",
                      reason="cached") == 2


@pytest.mark.parametrize("front", FRONTS)
async def test_no_decision_header_by_default(make_router: MakeRouter, front: str) -> None:
    router = await make_router(front, n=1)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(router.url + "/v1/completions", json={"prompt": "x", "session_id": "s"})
        assert resp.status == 200 and DECISION_HEADER not in resp.headers
        stream = await http.post(router.url + "/v1/completions", json={"prompt": "x", "session_id": "s", "stream": True})
        assert DECISION_HEADER not in stream.headers
        await stream.read()


async def test_the_engines_load_comes_from_their_metrics_and_moves_sessions(make_router: MakeRouter) -> None:
    fakes = [MetricsBackend("b0"), MetricsBackend("b1")]
    router = await make_router("raw", fakes=fakes, named=True, health_interval_s=0.05,
                               placement={"decision_header": True}, admin_token="t")
    state = router.state
    by_name = {b.name: b for b in state.serving_pool.members}
    fakes[0].running, fakes[0].kv_usage = 3, 0.25
    await eventually(lambda: by_name["b0"].engine_running == 3 and by_name["b0"].kv_usage == 0.25, timeout=10.0,
                     what="b0's scraped load")
    assert by_name["b0"].load_scraped_at > 0
    async with aiohttp.ClientSession() as http:
        listing = await (await http.get(router.url + "/admin/backends", headers={"Authorization": "Bearer t"})).json()
        view = {b["name"]: b for b in listing["data"]}
        assert (view["b0"]["engine_running"], view["b0"]["kv_usage"], view["b0"]["engine_waiting"]) == (3, 0.25, 0)
        assert view["b0"]["step_s"] is None  # gauges only: nothing learned, the configured step applies
        assert view["b0"]["output_tokens"] is None
        body = {"prompt": "word " * 400, "session_id": "heavy"}
        first = await http.post(router.url + "/v1/completions", json=body)
        home = (await first.json())["backend"]
        other = "b1" if home == "b0" else "b0"
        # its engine starts queueing hard: the session leaves for the backend with headroom
        next(f for f in fakes if f.name == home).waiting = 200
        await eventually(lambda: by_name[home].engine_waiting == 200 and by_name[home].queued_scrapes >= 3,
                         timeout=10.0, what="the queue scraped three times in a row (kv_aware's hysteresis)")
        moved = await http.post(router.url + "/v1/completions", json=body)
        assert (await moved.json())["backend"] == other
        assert moved.headers[DECISION_HEADER].startswith("spill;") and moved.headers[DECISION_HEADER].endswith(
            ";reason=wait")
        stays = await http.post(router.url + "/v1/completions", json=body)
        assert (await stays.json())["backend"] == other
        assert stays.headers[DECISION_HEADER].startswith("sticky;")


async def test_the_decision_header_in_tokens_mode(make_router: MakeRouter) -> None:
    """Tokens mode answers through its own handlers: the header is there too, the prompt's size
    exact (the rendered ids), and the second turn's cached tokens the first turn's prompt + answer."""
    from rendering.model import DEFAULT_MODEL_DIR, load_model
    from tests.router.tokens.conftest import Engine, tokens_settings

    model = load_model(DEFAULT_MODEL_DIR)
    router = await make_router("raw", fakes=[Engine("e0", model), Engine("e1", model)], named=True,
                               placement={"decision_header": True}, **tokens_settings())
    messages = [{"role": "user", "content": "Count to ten."}]
    async with aiohttp.ClientSession() as http:
        first = await http.post(router.url + "/v1/chat/completions", headers={"X-Session-ID": "t"},
                                json={"model": "tiny-llama", "messages": messages, "max_tokens": 4})
        assert first.status == 200, await first.text()
        usage = (await first.json())["usage"]
        assert first.headers[DECISION_HEADER] == "new;cached=0;wait=0;reason=hash"
        stream = await http.post(router.url + "/v1/chat/completions", headers={"X-Session-ID": "t"},
                                 json={"model": "tiny-llama", "messages": messages + [
                                     {"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "more"}],
                                     "max_tokens": 4, "stream": True})
        assert stream.status == 200
        value = stream.headers[DECISION_HEADER]
        assert value == f"sticky;cached={usage['prompt_tokens'] + usage['completion_tokens']};wait=0;reason=cached"
        await stream.read()
