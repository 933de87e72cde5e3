"""The router's upstream HTTP/1.1 client: a keep-alive connection pool on raw asyncio protocols.

The hot path of the proxy (DESIGN.md §9)::

    head = build_request_head("POST", "/v1/completions", "127.0.0.1:8100", headers, len(body))
    resp = await pool.request("127.0.0.1", 8100, head, body)
    body = await resp.read()            # non-streaming; or
    async for chunk in resp: ...        # streaming (SSE relay); resp.close() when the client goes
"""

from router.upstream.config import UpstreamLimits, UpstreamTimeouts
from router.upstream.head import HOP_BY_HOP, build_request_head, render_headers, render_values, request_head
from router.upstream.pool import UpstreamPool
from router.upstream.response import UpstreamResponse

__all__ = [
    "HOP_BY_HOP",
    "UpstreamLimits",
    "UpstreamPool",
    "UpstreamResponse",
    "UpstreamTimeouts",
    "build_request_head",
    "render_headers",
    "render_values",
    "request_head",
]
