"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` (OpenAI's Responses API, text only).

The store is always on here (see ``backends.responses_store``). A ``previous_response_id``
prepends that response's conversation (its input messages and its answer) to this request's
input; ``instructions`` become a leading system message of this request only (they do not carry
over, as in OpenAI's API). Streaming follows vLLM's event sequence: ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed`` (each as ``event: <type>`` +
``data: {...}``; no ``[DONE]``, as in vLLM). The request fields, the input's conversion, the
``response`` object (vLLM's keys) and the events are ``rendering.responses_objects``', which the
router's tokens mode answers with too; the turn is rendered by ``rendering.render`` as the chat request
it is (``chat_body``), and runs on the engine as the other routes' requests do (``engine_run``).
"""

from __future__ import annotations

import secrets
import time

from aiohttp import web

from backends.engine.outputs import RequestOutput
from backends.engine_run import engine_request_for, reply_headers
from backends.frontend import FRONTEND
from backends.generation import json_response, run_to_end, stream_run
from backends.generation_run import Choice, GenerationRun
from backends.json_body import read_json_body
from backends.responses_store import StoredResponse
from backends.sse import open_stream
from contract.errors import NotFoundError
from contract.session import SESSION_HEADER, resolve_session_id
from rendering.responses_objects import (
    OutputMessage,
    ResponseObject,
    ResponsesEvents,
    ResponsesRequest,
    ResponseUsage,
    chat_body,
    chat_messages,
    encode,
    message_item,
    response_object,
    response_usage,
    responses_request_decoder,
)


def not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")


def _usage(run: GenerationRun) -> ResponseUsage:
    return response_usage(run.prompt_tokens, run.generated, run.cached_tokens)


async def create_response(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body: ResponsesRequest = await read_json_body(request, responses_request_decoder)
    session = resolve_session_id(body.session_id, request.headers.getall(SESSION_HEADER, ()), body.vllm_xargs)
    fe.check_model(body.model)
    history: list[dict[str, str]] = []
    if body.previous_response_id is not None:
        previous = fe.store.get(body.previous_response_id)
        if previous is None:
            raise not_found(body.previous_response_id)
        history = previous.conversation
    conversation = history + chat_messages(body.input, None)
    messages = [{"role": "system", "content": body.instructions}] + conversation if body.instructions else conversation
    response_id = body.request_id or f"resp_{secrets.token_hex(16)}"
    base = fe.base_request_id(request, response_id)
    # rendered as the chat turn it is (rendering.render: the model's template, vLLM's checks and defaults)
    generate = fe.renderer.render_chat(encode(chat_body(body, messages)), request_id=response_id).request
    prompt_ids = generate.token_ids
    sp = generate.sampling_params
    ecr, run = engine_request_for(fe, generate, request_id=response_id, session=session,
                                  max_tokens=sp.max_tokens if sp.max_tokens is not None else
                                  fe.config.max_model_len - len(prompt_ids),
                                  text=True, kv_transfer_params=None,
                                  engine_stream=bool(body.stream))
    headers = reply_headers(base, session)
    created = int(time.time())
    events = ResponsesEvents(f"msg_{secrets.token_hex(12)}")
    store = body.store is not False

    def response(status: str, output: list[OutputMessage], usage: ResponseUsage | None) -> ResponseObject:
        return response_object(body, fe.model, response_id=response_id, created_at=created, model_name=fe.config.model,
                               prompt_tokens=len(prompt_ids), status=status, output=output, usage=usage,
                               previous_response_id=body.previous_response_id)

    def finish() -> tuple[str, ResponseObject]:
        text = run.final_text(run.choices[0])
        status = "incomplete" if run.choices[0].finish_reason == "length" else "completed"
        final = response(status, [message_item(events.item_id, text)], _usage(run))
        if store:
            fe.store.put(response_id, StoredResponse(final, conversation + [{"role": "assistant", "content": text}]))
        return text, final

    if not body.stream:
        await run_to_end(request, fe, ecr, run)
        return json_response(finish()[1], headers)

    started = [False]

    def step(out: RequestOutput, moved: list[Choice]) -> bytes:
        frames = b""
        if not started[0]:
            started[0] = True
            frames = events.started(response("in_progress", [], None))
        for c in moved:
            text = run.stream_text(c)
            if text:
                frames += events.delta(text)
        return frames

    def tail() -> bytes:
        frames = b"" if started[0] else events.started(response("in_progress", [], None))
        text, final = finish()
        return frames + events.end(text, final)

    fe.check_engine()
    resp = await open_stream(request, headers)
    await stream_run(resp, fe, ecr, run, step, tail, done_marker=False)
    return resp


async def get_response(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    response_id = request.match_info["response_id"]
    item = fe.store.get(response_id)
    if item is None:
        raise not_found(response_id)
    return json_response(item.response, {})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)


__all__ = ["add_routes"]
