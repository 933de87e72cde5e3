"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` (OpenAI's Responses API, text only).

The store is always on here (see ``backends.responses_store``). A ``previous_response_id``
prepends that response's conversation (its input messages and its answer) to this request's
input; ``instructions`` become a leading system message of this request only (they do not carry
over, as in OpenAI's API). Streaming follows vLLM's event sequence: ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed`` (each as ``event: <type>`` +
``data: {...}``; no ``[DONE]``, as in vLLM).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec
from aiohttp import web

from backends.engine.outputs import RequestOutput
from backends.frontend import FRONTEND
from backends.generation import json_response, run_to_end, stream_run
from backends.generation_run import Choice, GenerationRun
from backends.json_body import read_json_body
from backends.openai_routes import message_text, reply_headers
from backends.protocol import (
    ChatMessage,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    PromptTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from backends.responses_store import StoredResponse
from backends.sse import event_frame, open_stream
from backends.validation import engine_request, resolve_max_tokens, sampling_params
from contract.errors import BadRequestError, NotFoundError
from contract.session import SESSION_HEADER, resolve_session_id

_decoder = msgspec.json.Decoder(ResponsesRequest)
_enc = msgspec.json.Encoder()


def not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")


def input_messages(value: str | list[Any] | None) -> list[tuple[str, str]]:
    """The ``input`` of a request as (role, text) messages."""
    if value is None:
        raise BadRequestError("Field required: input (a string or a list of message items).", param="input")
    if isinstance(value, str):
        return [("user", value)]
    if not value:
        raise BadRequestError("input must not be an empty list.", param="input")
    out: list[tuple[str, str]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise BadRequestError(
                f"input[{i}]: only message items ({{\"role\": ..., \"content\": ...}}) are supported by "
                f"this backend, got {kind!r}.",
                param="input",
            )
        try:
            msg = msgspec.convert(item, ChatMessage)
        except msgspec.ValidationError as exc:
            raise BadRequestError(f"input[{i}]: {exc}", param="input") from None
        out.append((msg.role, message_text(msg, i, "input")))
    return out


def _usage(run: GenerationRun) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=run.prompt_tokens,
        output_tokens=run.generated,
        total_tokens=run.prompt_tokens + run.generated,
        input_tokens_details=InputTokensDetails(cached_tokens=run.cached_tokens),
        prompt_tokens_details=PromptTokensDetails(cached_tokens=run.cached_tokens),
    )


async def create_response(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND]
    body: ResponsesRequest = await read_json_body(request, _decoder)
    session = resolve_session_id(body.session_id, request.headers.getall(SESSION_HEADER, ()), body.vllm_xargs)
    fe.check_model(body.model)
    history: list[tuple[str, str]] = []
    if body.previous_response_id is not None:
        previous = fe.store.get(body.previous_response_id)
        if previous is None:
            raise not_found(body.previous_response_id)
        history = previous.conversation
    new_input = input_messages(body.input)
    conversation = history + new_input
    messages = [("system", body.instructions)] + conversation if body.instructions else conversation
    try:
        prompt_ids = fe.tokenizer.apply_chat_template(messages)
    except ValueError as exc:
        raise BadRequestError(f"input: {exc}.", param="input") from None
    max_tokens = resolve_max_tokens(fe.config, len(prompt_ids), body.max_output_tokens, "max_output_tokens")
    params = sampling_params(fe.config, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                             max_tokens=max_tokens, final_only=not body.stream)
    response_id = body.request_id or f"resp_{secrets.token_hex(16)}"
    base = fe.base_request_id(request, response_id)
    ecr = engine_request(fe, external_id=response_id, prompt_ids=prompt_ids, params=params,
                         session_id=session, cache_salt=body.cache_salt, priority=body.priority)
    run = GenerationRun(fe.tokenizer, 1, None)
    headers = reply_headers(base, session)
    created = int(time.time())
    item_id = f"msg_{secrets.token_hex(12)}"
    store = body.store is not False

    def response(status: str, text: str | None, usage: ResponseUsage | None) -> ResponseObject:
        output = [] if text is None else [OutputMessage(id=item_id, content=[OutputText(text=text)])]
        incomplete = None
        choice = run.choices[0]
        if status == "completed" and choice.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return ResponseObject(
            id=response_id, created_at=created, model=fe.config.model, output=output, status=status,
            usage=usage, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id, temperature=body.temperature,
            top_p=body.top_p, metadata=body.metadata, incomplete_details=incomplete, store=store,
            user=body.user,
        )

    def finish() -> ResponseObject:
        text = run.final_text(run.choices[0])
        final = response("completed", text, _usage(run))
        if store:
            fe.store.put(response_id, StoredResponse(final, conversation + [("assistant", text)]))
        return final

    if not body.stream:
        await run_to_end(request, fe, ecr, run)
        return json_response(finish(), headers)

    seq = [0]

    def event(kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": seq[0], **fields}
        seq[0] += 1
        return event_frame(kind, _enc.encode(payload))

    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    started = [False]

    def opening() -> bytes:
        started_resp = response("in_progress", None, None)
        return (
            event("response.created", response=started_resp)
            + event("response.in_progress", response=started_resp)
            + event("response.output_item.added", output_index=0,
                    item={"id": item_id, "type": "message", "role": "assistant", "status": "in_progress",
                          "content": []})
            + event("response.content_part.added", part=part, **where)
        )

    def step(out: RequestOutput, moved: list[Choice]) -> bytes:
        frames = b""
        if not started[0]:
            started[0] = True
            frames = opening()
        for c in moved:
            text = run.stream_text(c)
            if text:
                frames += event("response.output_text.delta", delta=text, logprobs=[], **where)
        return frames

    def tail() -> bytes:
        frames = b"" if started[0] else opening()
        final = finish()
        text = final.output[0].content[0].text
        done_part = {**part, "text": text}
        return frames + (
            event("response.output_text.done", text=text, logprobs=[], **where)
            + event("response.content_part.done", part=done_part, **where)
            + event("response.output_item.done", output_index=0, item=final.output[0])
            + event("response.completed", response=final)
        )

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


__all__ = ["add_routes", "input_messages"]
