"""Tokens mode's routes beside chat and completions, answered without an engine or through the chat
path: ``/tokenize``, ``/detokenize`` (here) and ``/v1/responses`` (``router.tokens.responses_route``);
``side_handlers`` gives the proxy their handlers.

``/tokenize`` and ``/detokenize`` are the renderer's: the router's own (``rendering.render.Renderer``,
vLLM's answers) with ``render = "local"``, a render server's with remote render (its answer, or its
error, relayed as it came). No engine is asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rendering.model import RenderModel
from router.attempt import Attempt
from router.bodies import OpenFields
from router.exchange import REQUEST_ID_HEADER, RequestView, ResponseWriter
from router.proxy import RouteHandler
from router.routes import Route
from router.tokens.render_client import RemoteRenderer
from router.tokens.responses_route import ResponsesHandler

if TYPE_CHECKING:
    from rendering.render import Renderer


class TokenizeHandler:
    """The proxy's ``RouteHandler`` for ``/tokenize`` or ``/detokenize`` in tokens mode: the answer of
    ``TokenizeRoutes`` with the proxy's own headers (``X-Request-Id``, the session when one resolved)."""

    __slots__ = ("answer", "session_header")

    def __init__(self, routes: "TokenizeRoutes", name: str, session_header: str) -> None:
        self.answer = routes.tokenize if name == "tokenize" else routes.detokenize
        self.session_header = session_header

    async def __call__(self, request: RequestView, writer: ResponseWriter, route: Route, body: bytes,
                       fields: OpenFields | None, attempt: Attempt) -> None:
        answer = await self.answer(body, request_id=attempt.request_id)
        attempt.status = 200
        headers = [("Content-Type", "application/json"), (REQUEST_ID_HEADER, attempt.request_id)]
        if attempt.session_id is not None:
            headers.append((self.session_header, attempt.session_id))
        writer.respond(200, headers, answer)


class TokenizeRoutes:
    """``/tokenize`` and ``/detokenize``: the local renderer's answers, or a render server's."""

    def __init__(self, renderer: Renderer | None, remote: RemoteRenderer | None = None) -> None:
        """``remote``: the render servers (they answer); else ``renderer``, the router's own."""
        if renderer is None and remote is None:
            raise ValueError("TokenizeRoutes needs the local renderer or the remote one")
        self.renderer = renderer
        self.remote = remote

    async def tokenize(self, body: bytes, *, request_id: str) -> bytes:
        """The 200 answer's body (vLLM's ``/tokenize`` shape); errors are raised (vLLM's status and body)."""
        if self.remote is not None:
            return await self.remote.tokenize(body, request_id=request_id)
        assert self.renderer is not None
        return self.renderer.tokenize(body)

    async def detokenize(self, body: bytes, *, request_id: str) -> bytes:
        """The 200 answer's body (vLLM's ``/detokenize`` shape); errors are raised."""
        if self.remote is not None:
            return await self.remote.detokenize(body, request_id=request_id)
        assert self.renderer is not None
        return self.renderer.detokenize(body)


def side_handlers(chat: RouteHandler, model: RenderModel, renderer: Renderer | None, remote: RemoteRenderer | None,
                  session_header: str) -> dict[str, RouteHandler]:
    """The handlers of this module by route name, for ``Proxy.tokens`` (beside the chat and
    completions handlers of ``router.tokens.flow``; ``chat`` is the chat route's). ``remote``: the
    render servers when they render (they answer /tokenize and /detokenize too), else ``renderer``."""
    tokenize = TokenizeRoutes(renderer, remote)
    return {
        "responses": ResponsesHandler(chat, model),
        "tokenize": TokenizeHandler(tokenize, "tokenize", session_header),
        "detokenize": TokenizeHandler(tokenize, "detokenize", session_header),
    }
