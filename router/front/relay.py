"""Everything the raw front does not serve natively goes to the aiohttp app.

The app listens on an internal loopback port; the relay forwards the method, the target, the
headers (hop-by-hop ones dropped) and the body over a keep-alive pool of the raw upstream
client (``router.upstream``), and relays the answer back, streams included. ``HEAD`` is sent
as ``GET`` (the upstream client frames bodies by the response alone) and the front drops the
body. Such requests are rare (health checks, metrics scrapes, admin calls), so one local hop
is fine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from contract.errors import SessionRouterError, UpstreamError
from contract.ids import IdGenerator
from contract.session import SESSION_HEADER
from router.exchange import REQUEST_ID_HEADER
from router.front.wire import error_headers
from router.upstream import UpstreamLimits, UpstreamPool, UpstreamTimeouts, render_headers, request_head

if TYPE_CHECKING:
    from router.front.raw_exchange import Exchange

#: the app bounds its own work (proxy timeouts, /v1/models fan-out); these only catch a stuck hop
RELAY_TIMEOUTS = UpstreamTimeouts(connect_s=5.0, first_byte_s=3600.0, total_s=86400.0)
#: response headers the front sets itself
_DROP_RESPONSE = frozenset(("date", "server"))
_REQUEST_ID_LOWER = REQUEST_ID_HEADER.lower()


class Relay:
    """Forwards requests to the aiohttp app on ``host:port``."""

    def __init__(self, host: str, port: int, ids: IdGenerator, session_header: str = SESSION_HEADER) -> None:
        self.host = host
        self.port = port
        self.ids = ids
        #: the app reads the client's session header under this name (its ``session_header``)
        self.session_header = session_header
        self._host_header = f"{host}:{port}"
        self.pool = UpstreamPool(RELAY_TIMEOUTS, UpstreamLimits(max_idle_per_host=8), drop_headers=_DROP_RESPONSE)

    async def forward(self, ex: "Exchange") -> None:
        request_id = ex.request_id or self.ids.next()
        try:
            body = await ex.read_body()
            own = [(REQUEST_ID_HEADER, request_id)] + [(self.session_header, v) for v in ex.session_headers]
            method = "GET" if ex.head_only else ex.method
            head = request_head(method, ex.path_qs, self._host_header, ex.forward_headers() + render_headers(own),
                                len(body))
            upstream = await self.pool.request(self.host, self.port, head, body)
        except SessionRouterError as exc:
            ex.respond(exc.status, error_headers(request_id), exc.body())
            return
        try:
            headers = list(upstream.headers)  # without _DROP_RESPONSE (the pool's drop_headers)
            if not any(name.lower() == _REQUEST_ID_LOWER for name, _ in headers):
                headers.append((REQUEST_ID_HEADER, request_id))
            if upstream.content_length is not None or upstream.complete:  # 204s too
                ex.respond(upstream.status, headers, await upstream.read())
                return
            await ex.start(upstream.status, headers)
            async for data in upstream:
                await ex.write(data)
            await ex.end()
        except UpstreamError as exc:
            if ex.started:
                ex.conn.abort()  # the app broke off mid-stream: so does the client's answer
            else:
                ex.respond(exc.status, error_headers(request_id), exc.body())
        finally:
            upstream.close()

    async def close(self) -> None:
        await self.pool.close()
