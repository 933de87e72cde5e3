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

A client's own ``/inference/v1/generate`` is forwarded as it came (``Proxy.forward``) once its token
ids are checked against the vocabulary.

The answer's ``id`` is ``chatcmpl-{X-Request-Id}`` / ``cmpl-{X-Request-Id}`` (the router's request id:
the client's ``X-Request-Id``, else one it made), as vLLM names its answers after that header.
"""

from __future__ import annotations

import time

from rendering.derender import ChatDerender, CompletionDerender, echo_texts
from rendering.generate_request import GenerateRequest
from rendering.model import RenderModel
from rendering.requests import decode_chat_request, decode_completion_request
from rendering.vocabulary import check_generate_body
from router.attempt import Attempt
from router.bodies import OpenFields
from router.exchange import RequestView, ResponseWriter
from router.proxy import Proxy, RouteHandler
from router.routes import Route
from router.tokens.engine import EngineAborts, generate_payload
from router.tokens.answers import CompletionAnswer
from router.tokens.fanout import FanOutCall
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
        return {"chat": self.chat, "completions": self.completions, "generate": self.generate}

    async def generate(self, request: RequestView, writer: ResponseWriter, route: Route, body: bytes,
                       fields: OpenFields | None, attempt: Attempt) -> None:
        """A client's own ``/inference/v1/generate``: forwarded as it came, once its token ids are known
        to be in the vocabulary (a ``--tokens-only`` vLLM engine does not check them, and dies on one)."""
        check_generate_body(body, self.model.max_token_id)
        await self.proxy.forward(request, writer, route, body, fields, attempt)

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
        completion = decode_completion_request(body)
        prompt_ids = [generate.token_ids for generate in generates]
        attempt.prompt_ids = prompt_ids[0]
        created = int(time.time())
        texts = echo_texts(self.model, completion.prompt, prompt_ids) if completion.echo else None

        def derenderer() -> CompletionDerender:
            return CompletionDerender(self.model, completion, request_id=request_id, created=created,
                                      prompt_ids=prompt_ids, prompt_texts=texts)

        answer = CompletionAnswer(derenderer)
        if len(generates) == 1:
            await self._generate(writer, route, fields, attempt, generates[0], answer, bool(completion.stream))
            return
        stop_strings = any(g.sampling_params.stop for g in generates)
        how = self._answer(bool(completion.stream), stop_strings)
        call = FanOutCall(self.proxy, self.aborts, writer, route, fields, attempt, answer, how,
                          stop_strings=stop_strings)
        await call.run_all([generate_payload(g, stream=how != WHOLE) for g in generates])

    async def _generate(self, writer: ResponseWriter, route: Route, fields: OpenFields | None, attempt: Attempt,
                        generate: GenerateRequest, derender: Derenderer, stream: bool) -> None:
        """The engine leg: streamed from the engine when the client streams, and when stop strings may
        end it early (then collected into one answer); else one whole answer."""
        stop_strings = bool(generate.sampling_params.stop)
        answer = self._answer(stream, stop_strings)
        call = EngineCall(self.proxy, self.aborts, writer, route, fields, attempt, derender, answer,
                          stop_strings=stop_strings)
        await call.run(generate_payload(generate, stream=answer != WHOLE))

    @staticmethod
    def _answer(stream: bool, stop_strings: bool) -> str:
        if stream:
            return STREAM
        return COLLECT if stop_strings else WHOLE
