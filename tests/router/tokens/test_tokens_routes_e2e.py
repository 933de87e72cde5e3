"""Tokens mode's side routes end to end, real processes: a render server (``session-backend --role
render``), a ``--tokens-only`` engine and routers in tokens mode, one rendering locally and one on the
render servers (a dead one listed first: 127.0.0.9, where nothing listens). ``/tokenize`` and
``/detokenize`` answer what the local renderer answers; render errors come back as the render server
sent them; ``/v1/responses`` works with the OpenAI SDK, stream or not; with every render server down the router
answers 503."""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from rendering.model import DEFAULT_MODEL_DIR, load_model
from rendering.render import Renderer
from tests.support import Proc, free_port, kill_alive, metric_sum, start_process

pytestmark = pytest.mark.slow

MODEL_DIR = str(DEFAULT_MODEL_DIR)
RENDERER = Renderer(load_model(DEFAULT_MODEL_DIR))


def dead_url() -> str:
    return f"http://127.0.0.9:{free_port()}"


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def start_render_server(log_dir: str) -> Proc:
    port = free_port()
    return start_process("backends", ["--host", "127.0.0.1", "--port", str(port), "--role", "render",
                                      "--model-dir", MODEL_DIR], port, log_dir)


def start_engine(log_dir: str) -> Proc:
    port = free_port()
    return start_process("backends", ["--host", "127.0.0.1", "--port", str(port), "--tokens-only",
                                      "--model-dir", MODEL_DIR, "--speed", "0"], port, log_dir)


def start_tokens_router(log_dir: str, engine: Proc, render: list[str]) -> Proc:
    port = free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--upstream-api", "tokens", "--model-dir", MODEL_DIR,
            "--backend", engine.url]
    for url in render:
        args += ["--render", url]
    return start_process("router", args, port, log_dir)


@dataclass
class Cluster:
    render: Proc
    engine: Proc
    local: Proc   # renders in the router
    remote: Proc  # renders on [dead, render]
    dead: str


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            render = start_render_server(log_dir)
            procs.append(render)
            engine = start_engine(log_dir)
            procs.append(engine)
            local = start_tokens_router(log_dir, engine, [])
            procs.append(local)
            dead = dead_url()
            remote = start_tokens_router(log_dir, engine, [dead, render.url])
            procs.append(remote)
            yield Cluster(render, engine, local, remote, dead)
        finally:
            kill_alive(*procs)


TOKENIZE_BODIES = [
    {"model": "tiny-llama", "prompt": "hello world, café 東京 😀"},
    {"model": "tiny-llama", "prompt": "hello", "add_special_tokens": False, "return_token_strs": True},
    {"model": "tiny-llama", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
]


@pytest.mark.parametrize("which", ["local", "remote"])
def test_tokenize_and_detokenize_answer_what_the_local_renderer_answers(cluster: Cluster, which: str) -> None:
    router: Proc = getattr(cluster, which)
    for body in TOKENIZE_BODIES:
        raw = json.dumps(body).encode()
        status, answer = post(router.url + "/tokenize", raw)
        assert status == 200, answer
        assert json.loads(answer) == json.loads(RENDERER.tokenize(raw)), body
        tokens = json.loads(answer)["tokens"]
        detok = json.dumps({"model": "tiny-llama", "tokens": tokens}).encode()
        status, text = post(router.url + "/detokenize", detok)
        assert status == 200 and json.loads(text) == json.loads(RENDERER.detokenize(detok))


@pytest.mark.parametrize("which", ["local", "remote"])
def test_tokenize_errors_are_vllms(cluster: Cluster, which: str) -> None:
    router: Proc = getattr(cluster, which)
    body = json.dumps({"model": "no-such-model", "prompt": "x"}).encode()
    status, answer = post(router.url + "/tokenize", body)
    direct_status, direct = post(cluster.render.url + "/tokenize", body)
    assert (status, json.loads(answer)) == (direct_status, json.loads(direct))
    assert status == 404 and json.loads(answer)["error"]["type"] == "NotFoundError"


def test_a_render_servers_4xx_reaches_the_client_unchanged(cluster: Cluster) -> None:
    for body in ({"model": "tiny-llama", "messages": []},
                 {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
                 {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}):
        raw = json.dumps(body).encode()
        direct = post(cluster.render.url + "/v1/chat/completions/render", raw)
        assert direct[0] in (400, 404)
        assert post(cluster.remote.url + "/v1/chat/completions", raw) == direct
        status, local = post(cluster.local.url + "/v1/chat/completions", raw)  # the same answer, rendered here
        assert (status, json.loads(local)) == (direct[0], json.loads(direct[1]))


def test_the_dead_render_server_is_skipped_and_shown_down(cluster: Cluster) -> None:
    for i in range(3):
        status, answer = post(cluster.remote.url + "/v1/chat/completions",
                              json.dumps({"model": "tiny-llama", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": f"hi {i}"}]}).encode())
        assert status == 200, answer
        assert json.loads(answer)["object"] == "chat.completion"
    metrics = get(cluster.remote.url + "/metrics")[1].decode()
    assert metric_sum(metrics, "session_router_backend_healthy", pool="render", backend=cluster.dead) == 0
    assert metric_sum(metrics, "session_router_backend_healthy", pool="render", backend=cluster.render.url) == 1
    assert metric_sum(metrics, "session_router_render_requests_total", render_server=cluster.render.url,
                      status_class="2xx") >= 3
    health = json.loads(get(cluster.remote.url + "/health")[1])
    assert health["status"] == "ok" and health["pools"]["render"] == {"healthy": 1, "total": 2}
    local_metrics = get(cluster.local.url + "/metrics")[1].decode()
    assert metric_sum(local_metrics, "session_router_render_requests_total") == 0


@pytest.mark.parametrize("which", ["local", "remote"])
def test_models_lists_the_rendered_model(cluster: Cluster, which: str) -> None:
    status, answer = get(getattr(cluster, which).url + "/v1/models")
    assert status == 200
    assert [card["id"] for card in json.loads(answer)["data"]] == ["tiny-llama"]


@pytest.mark.parametrize("which", ["local", "remote"])
def test_responses_non_stream_with_the_openai_sdk(cluster: Cluster, which: str) -> None:
    router: Proc = getattr(cluster, which)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    response = client.responses.create(model="tiny-llama", input="Say hello to the router",
                                       instructions="Answer briefly.", max_output_tokens=8, store=False,
                                       extra_headers={"X-Session-ID": f"resp-{which}"})
    assert response.object == "response" and response.model == "tiny-llama"
    assert response.id.startswith("resp_") and response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.output_text  # the engine's ids, detokenized by the router
    chat = json.dumps({"model": "tiny-llama", "messages": [{"role": "system", "content": "Answer briefly."},
                                                           {"role": "user", "content": "Say hello to the router"}]})
    prompt_len = len(RENDERER.render_chat(chat.encode()).request.token_ids)
    assert response.usage is not None
    assert response.usage.input_tokens == prompt_len
    assert 1 <= response.usage.output_tokens <= 8
    assert response.usage.total_tokens == prompt_len + response.usage.output_tokens
    assert response.max_output_tokens == 8
    # the session the turn ran under reached the engine as on chat
    sessions = get(cluster.engine.url + "/v1/sessions")[1].decode()
    assert f"resp-{which}" in sessions


@pytest.mark.parametrize("which", ["local", "remote"])
def test_responses_stream_with_the_openai_sdk(cluster: Cluster, which: str) -> None:
    router: Proc = getattr(cluster, which)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    events = list(client.responses.create(model="tiny-llama", input="Say hello to the router", stream=True,
                                          max_output_tokens=6, extra_headers={"X-Session-ID": f"rs-{which}"}))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert deltas and [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "".join(deltas) and final.status in ("completed", "incomplete")
    assert final.usage is not None and 1 <= final.usage.output_tokens <= 6
    prompt = json.dumps({"model": "tiny-llama", "messages": [{"role": "user", "content": "Say hello to the router"}]})
    assert final.usage.input_tokens == len(RENDERER.render_chat(prompt.encode()).request.token_ids)
    assert f"rs-{which}" in get(cluster.engine.url + "/v1/sessions")[1].decode()


def test_responses_store_is_a_clear_400(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.local.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny-llama", input="hi", store=True)
    assert "store is not supported" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny-llama", input="hi", previous_response_id="resp_1")
    assert "previous_response_id is not supported" in str(caught.value)


def test_every_render_server_down_is_a_503() -> None:
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            render = start_render_server(log_dir)
            procs.append(render)
            engine = start_engine(log_dir)
            procs.append(engine)
            router = start_tokens_router(log_dir, engine, [dead_url(), render.url])
            procs.append(router)
            body = json.dumps({"model": "tiny-llama", "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}]}).encode()
            assert post(router.url + "/v1/chat/completions", body)[0] == 200
            render.stop()
            status, answer = post(router.url + "/v1/chat/completions", body)
            error: dict[str, Any] = json.loads(answer)["error"]
            assert status == 503 and error["code"] == 503 and error["type"] == "ServiceUnavailableError"
            assert "render" in error["message"] and "render = \"local\"" in error["message"]
            assert post(router.url + "/tokenize", json.dumps({"prompt": "x"}).encode())[0] == 503
            assert get(router.url + "/health")[0] == 503
        finally:
            kill_alive(*procs)
