"""How the tokens-mode data path renders a request: the protocol both renderers implement, and the
local one.

``RenderService`` is what the data path (``router.tokens.flow``) calls: the client's body bytes in,
``GenerateRequest``s out, ready to POST to an engine's ``/inference/v1/generate``. Two implementations,
chosen once at start-up from ``[tokens] render``:

- ``LocalRenderer`` (``render = "local"``): ``rendering.render.Renderer`` in the router process.
  Rendering is CPU-bound and short (about 1 µs per token), so it runs inline on the event loop. It
  also offers ``render_chat_state``: the render with the session's previous prompt (incremental
  render: only the new tail is tokenized) and the state to keep for the session's next turn.
- ``router.tokens.render_client.RemoteRenderer`` (a list of render server URLs): POSTs the body to
  a render server's ``/v1/chat/completions/render`` / ``/v1/completions/render``.

Errors: a request the renderer rejects raises a ``contract.errors.SessionRouterError`` whose
``status`` and ``body()`` are the client's answer (vLLM's status, shape and message; a remote render
server's own 4xx is relayed as it answered). No engine is reached.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rendering.generate_request import GenerateRequest
    from rendering.incremental import PromptState
    from rendering.render import RenderedChat, Renderer
    from router.metrics import RenderMetrics


#: the answers' id prefixes (vLLM's): ``chatcmpl-<X-Request-Id>``, ``cmpl-<X-Request-Id>``
CHAT_PREFIX = "chatcmpl-"
COMPLETION_PREFIX = "cmpl-"


class RenderService(Protocol):
    """Renders client bodies to generate requests (local or remote; same answers, same errors)."""

    async def render_chat(self, body: bytes, *, request_id: str) -> GenerateRequest:
        """A ``/v1/chat/completions`` body -> its one ``GenerateRequest``, whose ``request_id`` is
        ``request_id`` (``chatcmpl-<X-Request-Id>``: the answer's id)."""
        ...

    async def render_completions(self, body: bytes, *, request_id: str) -> list[GenerateRequest]:
        """A ``/v1/completions`` body -> one ``GenerateRequest`` per prompt, with ``request_id``
        (``cmpl-<X-Request-Id>``), numbered ``{request_id}-{i}`` when there are several."""
        ...


class LocalRenderer:
    """``RenderService`` in the router process, over one ``rendering.render.Renderer`` (built once at
    start-up from the model folder, shared read-only). Each render's time goes to ``metrics``
    (``session_router_render_local_duration_seconds``) when given."""

    __slots__ = ("renderer", "metrics")

    def __init__(self, renderer: Renderer, metrics: RenderMetrics | None = None) -> None:
        self.renderer = renderer
        self.metrics = metrics

    async def render_chat(self, body: bytes, *, request_id: str) -> GenerateRequest:
        return self.render_chat_state(body, request_id=request_id).request

    async def render_completions(self, body: bytes, *, request_id: str) -> list[GenerateRequest]:
        started = time.perf_counter()
        try:
            return self.renderer.render_completions(body, request_id=request_id)
        finally:
            if self.metrics is not None:
                self.metrics.local_done(time.perf_counter() - started)

    def render_chat_state(self, body: bytes, *, request_id: str, previous: PromptState | None = None) -> RenderedChat:
        """The whole local render: the request (with ``request_id``), the client's decoded fields and the
        prompt state for the session's next turn (``previous``: this session's state from the turn
        before, or None)."""
        started = time.perf_counter()
        try:
            return self.renderer.render_chat(body, request_id=request_id, previous=previous)
        finally:
            if self.metrics is not None:
                self.metrics.local_done(time.perf_counter() - started)
