"""Tokens mode's data path for ``/v1/chat/completions`` and ``/v1/completions``.

``Proxy.handle`` has read the body, resolved and stamped the session and found the model's candidate
set, as in text mode; then, instead of forwarding the body, it calls the route's handler here:

1. render the body to ``GenerateRequest``s (``RenderService``: local or on render servers); a request
   the renderer rejects is answered with vLLM's status and error shape, no engine reached. Local chat
   renders read and update the session's prompt state (``PromptCache``): a new turn of a known
   session tokenizes only what it adds;
2. the prompt's token ids go on the ``Attempt`` (placement can read them), then the engine leg
   (``router.tokens.generate.EngineCall``): placement, ``/inference/v1/generate`` with ``X-Session-ID``
   and ``X-Request-Id``, derender (``rendering.derender``), stop strings and aborts, usage.

The answer's ``id`` is ``chatcmpl-{X-Request-Id}`` / ``cmpl-{X-Request-Id}`` (the router's request id:
the client's ``X-Request-Id``, else one it made), as vLLM names its answers after that header.
"""

from __future__ import annotations

import time

from contract.errors import BadRequestError
from rendering.derender import ChatDerender, CompletionDerender
from rendering.generate_request import GenerateRequest
from rendering.model import RenderModel
from rendering.requests import decode_chat_request, decode_completion_request
from router.attempt import Attempt
from router.bodies import OpenFields
from router.exchange import RequestView, ResponseWriter
from router.proxy import Proxy, RouteHandler
from router.routes import Route
from router.tokens.engine import EngineAborts, generate_payload
from router.tokens.answers import CompletionAnswer
from router.tokens.generate import COLLECT, STREAM, WHOLE, Derenderer, EngineCall
from router.tokens.prompt_cache import PromptCache
from router.tokens.renderers import CHAT_PREFIX, COMPLETION_PREFIX, LocalRenderer, RenderService



class TokensRoutes:
    """The handlers of the two generating routes in tokens mode; built once by the app factory."""

    def __init__(self, proxy: Proxy, *, model: RenderModel, renderer: RenderService,
                 local: LocalRenderer | None, prompts: PromptCache | None, aborts: EngineAborts) -> None:
        """``renderer``: local or remote; ``local``: the same renderer when it is the local one (the
        incremental chat render), else None; ``prompts``: the per-session prompt states (None: off)."""
        self.proxy = proxy
        self.model = model
        self.renderer = renderer
        self.local = local
        self.prompts = prompts if local is not None else None
        self.aborts = aborts

    def handlers(self) -> dict[str, RouteHandler]:
        """Route name -> handler, for ``Proxy.tokens``."""
        return {"chat": self.chat, "completions": self.completions}

    async def chat(self, request: RequestView, writer: ResponseWriter, route: Route, body: bytes,
                   fields: OpenFields | None, attempt: Attempt) -> None:
        request_id = CHAT_PREFIX + attempt.request_id
        local = self.local
        if local is not None:
            prompts = self.prompts
            session_id = attempt.session_id
            previous = prompts.get(session_id) if prompts is not None and session_id is not None else None
            rendered = local.render_chat_state(body, request_id=request_id, previous=previous)
            generate, chat = rendered.request, rendered.chat
            if prompts is not None and session_id is not None:
                prompts.put(session_id, rendered.prompt)
        else:
            generate = await self.renderer.render_chat(body, request_id=request_id)
            chat = decode_chat_request(body)
        attempt.prompt_ids = generate.token_ids
        derender = ChatDerender(self.model, chat, request_id=generate.request_id, created=int(time.time()),
                                prompt_ids=generate.token_ids)
        await self._generate(writer, route, fields, attempt, generate, derender, bool(chat.stream))

    async def completions(self, request: RequestView, writer: ResponseWriter, route: Route, body: bytes,
                          fields: OpenFields | None, attempt: Attempt) -> None:
        request_id = COMPLETION_PREFIX + attempt.request_id
        generates = await self.renderer.render_completions(body, request_id=request_id)
        if len(generates) != 1:
            raise BadRequestError(
                f"this router in tokens mode serves one prompt per /v1/completions request, got {len(generates)}; "
                "send each prompt in its own request", param="prompt")
        generate = generates[0]
        completion = decode_completion_request(body)
        attempt.prompt_ids = generate.token_ids
        created = int(time.time())
        prompt = completion.prompt
        texts = [prompt] if isinstance(prompt, str) else None

        def derenderer() -> CompletionDerender:
            return CompletionDerender(self.model, completion, request_id=generate.request_id, created=created,
                                      prompt_ids=[generate.token_ids], prompt_texts=texts)

        await self._generate(writer, route, fields, attempt, generate, CompletionAnswer(derenderer),
                             bool(completion.stream))

    async def _generate(self, writer: ResponseWriter, route: Route, fields: OpenFields | None, attempt: Attempt,
                        generate: GenerateRequest, derender: Derenderer, stream: bool) -> None:
        """The engine leg: streamed from the engine when the client streams, and when stop strings may
        end it early (then collected into one answer); else one whole answer."""
        if stream:
            answer = STREAM
        elif generate.sampling_params.stop:
            answer = COLLECT
        else:
            answer = WHOLE
        call = EngineCall(self.proxy, self.aborts, writer, route, fields, attempt, derender, answer)
        await call.run(generate_payload(generate, stream=answer != WHOLE))
