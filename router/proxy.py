"""The data path: session -> placement -> upstream -> client, for every proxied route.

Read top to bottom: ``Proxy.handle`` resolves the session (the shared contract; else an agent
client's own session header, ``router.sessions.agents``), stamps one when none resolves, places
the request with the configured policy, sends the original body bytes to the chosen backend over
the pooled raw upstream client, retries on another candidate while nothing has reached the client
yet, then relays the response (streams chunk by chunk) and accounts it to the session.

The proxy is front-agnostic: it reads the client's request through a ``RequestView`` and
answers through a ``ResponseWriter`` (``router.exchange``, owned here); the aiohttp app and the
raw front (``router.front``) each implement those two. The route table and which paths are never
forwarded are ``router.routes``; a request's journey is an ``Attempt`` (``router.attempt``).

Models: a request whose JSON body names a ``model`` goes to the candidate set of that model in
the pool (``BackendPool.for_model``, rebuilt when membership or models change); placement runs on
that set. A model no member of the pool serves is the router's 404 (vLLM's shape and message),
answered before any session bookkeeping and without reaching a backend.

Routes the router does not name (``OTHER``: ``/v1/embeddings``, ``/v1/audio/...``, ``/version``,
any method) are forwarded by ``Proxy.forwards`` to one backend, body bytes unchanged, with the same
limits, retries and failover: session placement when a session resolves (the ``X-Session-ID``
header, or ``session_id``/``vllm_xargs`` in a JSON object body, or an agent's session header), else the policy's plain choice;
``GET``/``POST /v1/responses/{id}...`` goes to the backend that created the response when the
router saw it. Never forwarded: the router's own paths (``ROUTER_PATHS``, ``ROUTER_PREFIXES``) and
``proxy_deny``, matched on a canonical form of the path (``canonical_path``; all in ``router.routes``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from typing import Protocol, cast

from router.access_log import AccessLog
from router.attempt import Attempt
from router.bodies import (
    OpenFields,
    RoutingFields,
    decode_open_fields,
    decode_routing_fields,
    wants_stream_usage,
    without_kv_transfer_params,
)
from router.config import RouterConfig
from contract.errors import (
    BadRequestError,
    ConfigError,
    NotFoundError,
    PayloadTooLargeError,
    SessionRouterError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeoutError,
    error_body,
)
from router.exchange import REQUEST_ID_HEADER, Headers, RequestView, ResponseWriter
from router.health import HealthChecker
from router.kv.index import KVIndex
from contract.ids import IdGenerator
from router.membership import Backend, BackendPool, BackendSet
from router.metrics import RouterMetrics
from router.placement.base import Outcome, Placement, PlacementHint, Policy
from router.pd import PD_ROUTE_KINDS, Handoff, PDHandoff
from router.routes import AMBIGUOUS, NAMED_PATHS, OPEN_KINDS, ROUTER_PATHS, ROUTER_PREFIXES, Route, canonical_path, path_rules
from contract.session import SESSION_HEADER, resolve_session_id, session_from_headers
from router.sessions.agents import agent_session, parent_session
from router.sessions.derive import derive_chat_session, derive_responses_session, mint_session, sender_key
from router.sessions.responses import ResponseIndex
from router.sessions.table import SessionTable
from router.shared import Agreement, SharedState
from router.upstream import UpstreamPool, UpstreamResponse, UpstreamTimeouts, render_values, request_head
from router.usage import Usage, response_id_from_sse, usage_from_json, usage_from_sse_tail

log = logging.getLogger(__name__)

JSON_CONTENT_TYPE = "application/json"
#: with ``[placement] decision_header = true``: why the request went where it did
DECISION_HEADER = "X-Session-Router-Decision"
RETRY_STATUSES = frozenset((502, 503, 504))
_REPINS = frozenset((Outcome.REPIN_UNHEALTHY, Outcome.REPIN_REMOVED))
_RESPONSES_PREFIX = "/v1/responses/"

# Request headers never forwarded as received: router.exchange.DROP_REQUEST.
# Response headers the router (or its front) sets itself instead of relaying (and the configured
# session_header: ``response_drops``).
_DROP_RESPONSE = frozenset(
    h.lower()
    for h in (
        "Content-Length", "Connection", "Keep-Alive", "Transfer-Encoding", "Upgrade", "Trailer",
        "Date", "Server", SESSION_HEADER, REQUEST_ID_HEADER, DECISION_HEADER,
    )
)


def response_drops(session_header: str) -> frozenset[str]:
    """The backends' response headers the proxy never relays (it sets them itself), lower-case: the
    upstream pool's ``drop_headers`` (``router.app``), so that it leaves them out as it parses."""
    return _DROP_RESPONSE | {session_header.lower()}


class RouteHandler(Protocol):
    """Serves a route in place of forwarding it (tokens mode): called by ``Proxy.handle`` after the
    body was read, the session resolved and stamped and the model's candidate set found. It answers
    through ``writer``; a ``SessionRouterError`` it raises is answered by the proxy (before a stream
    started), and it records the answer's status on ``attempt``."""

    async def __call__(self, request: RequestView, writer: ResponseWriter, route: Route, body: bytes,
                       fields: OpenFields | None, attempt: Attempt) -> None: ...


class Proxy:
    """The data path. Its collaborators are given by the app factory (``router.app``)."""

    def __init__(self, config: RouterConfig, *, pool: BackendPool, policy: Policy, sessions: SessionTable,
                 responses: ResponseIndex, metrics: RouterMetrics, upstream: UpstreamPool,
                 health: HealthChecker, request_ids: IdGenerator, access_log: AccessLog | None = None,
                 pd: PDHandoff | None = None) -> None:
        """``pool``: where requests go (the decode pool in P/D mode: prefill legs are ``pd``'s
        business); ``pd``: the P/D hand-off (None: aggregated serving); ``access_log``: None when
        ``access_log = "off"``. Tokens mode sets ``tokens`` after construction (``router.app``)."""
        self.config = config
        self.pool = pool
        self.policy = policy
        self.sessions = sessions
        self.responses = responses
        self.metrics = metrics
        self.upstream = upstream
        self.health = health
        #: request ids for requests that come without one (the fronts use it for their own answers)
        self.request_ids = request_ids
        self.access_log = access_log
        self.pd = pd
        self._deny = path_rules(config.front.proxy_deny)
        #: the client-side session header (read and echoed under this name; upstream it is always
        #: SESSION_HEADER, the name vLLM reads)
        self.session_header = config.sessions.header
        # the headers it sets itself are left out of every answer by the pool, as it parses the head
        if not response_drops(self.session_header) <= upstream.drop_headers:
            raise ConfigError(
                "the proxy's upstream pool relays the headers the proxy sets itself: build it with "
                "UpstreamPool(..., drop_headers=router.proxy.response_drops(session_header))"
            )
        #: the policy predicts from a hint (prompt size, parent session): built per placement only then
        self._hinted = policy.name == "kv_aware"
        self._bytes_per_token = config.placement.bytes_per_token
        #: ``[placement] decision_header``: every proxied answer says why it went where it did
        self.decision_header = config.placement.decision_header
        #: tokens mode (``[tokens] upstream_api = "tokens"``): route name -> the handler that serves it
        #: instead of forwarding (``router.tokens``); None in text mode, the only test on its path
        self.tokens: dict[str, RouteHandler] | None = None
        #: the off-first-choice metric and pin writes (``router.shared``; set by the app factory)
        self.agreement: Agreement | None = None
        #: the shared state (Redis) of replicas and workers: None without ``shared_state``
        self.shared: SharedState | None = None
        #: the KV index (``router.kv``; set by the app factory): answers' cached tokens correct it; None when off
        self.kv: KVIndex | None = None

    def forwards(self, target: str) -> bool:
        """Whether a request for ``target`` that no route of the router matched goes to a backend
        (``OTHER``), rather than being answered by the router (404/405): not one of the router's
        own paths, not a named route's path (another method), not under ``proxy_deny``, and not a
        path that could be read as another (empty or dot segments, encoded slashes)."""
        if AMBIGUOUS.search(target.partition("?")[0]) is not None:
            return False
        path = canonical_path(target)
        if path in ROUTER_PATHS or path.startswith(ROUTER_PREFIXES) or path in NAMED_PATHS:
            return False
        exact, prefixes = self._deny
        return path not in exact and not path.startswith(prefixes)

    # ------------------------------------------------------------------ entry point
    async def handle(self, request: RequestView, writer: ResponseWriter, route: Route) -> None:
        """Answer one request of ``route`` through ``writer``. Raises only ``CancelledError`` (the
        client went away, or the front gave up draining), or what the writer raises when a
        failure after a stream started leaves no way to answer but cutting the connection."""
        loop = asyncio.get_running_loop()
        attempt = Attempt(route, request.request_id or self.request_ids.next(), loop.time())
        try:
            if request.raw_path[:1] != "/":
                raise BadRequestError(
                    "absolute-form request target: this router is a reverse proxy, not a forward proxy; "
                    f"send {request.method} {route.path or '/path'} with the router's address in the Host header"
                )
            body = await self._read_body(request)
            shared = self.shared
            if shared is not None:  # a Responses id another replica stored (router.shared)
                await shared.recall_response(route.kind, body, request.path_qs)
            fields = self._resolve(request, route, body, attempt)
            if shared is not None and attempt.entry is not None and attempt.entry.requests == 1:
                await shared.recall_pins(attempt.entry)  # first sight here: its pins as others left them
            if not self.config.pd.trust_client_kv_params:
                stripped = without_kv_transfer_params(body, fields)
                if stripped is not None:  # a client's own P/D parameters reach no backend
                    body = stripped
                    self.metrics.kv_params_stripped.labels(route.name).inc()
            tokens = self.tokens
            if tokens is not None and route.name in tokens:
                await tokens[route.name](request, writer, route, body, fields, attempt)
            else:
                await self.forward(request, writer, route, body, fields, attempt)
        except SessionRouterError as exc:
            self._error(writer, exc.status, exc.body(), attempt)
        except asyncio.CancelledError:
            # client went away: the upstream connection was closed in _relay/forward
            attempt.status = 499
            self._finish(attempt, loop.time(), request.method)
            raise
        except Exception:  # never a traceback to the client; keep serving
            log.exception("unexpected error on %s", route.path)
            self._error(writer, 500, error_body(500, "internal router error; see the router's log"), attempt)
        self._finish(attempt, loop.time(), request.method)

    # ------------------------------------------------------------------ session
    async def _read_body(self, request: RequestView) -> bytes:
        length = request.content_length
        if length is not None and length > self.config.front.max_body_bytes:
            raise PayloadTooLargeError(
                f"request body is {length} bytes; the limit is {self.config.front.max_body_bytes} (max_body_bytes)"
            )
        return await request.read_body()

    def _resolve(self, request: RequestView, route: Route, body: bytes, attempt: Attempt) -> OpenFields | None:
        kind = route.kind
        fields: OpenFields | None
        if kind in OPEN_KINDS:
            fields = decode_open_fields(body)
        else:
            fields = decode_routing_fields(body)
        if fields is not None:
            candidates = self.pool.for_model(fields.model)
            if candidates is None:  # vLLM's answer, from the router: no backend of the pool serves it
                if self.tokens is None:
                    raise NotFoundError(f"The model `{fields.model}` does not exist.", param="model")
                # tokens mode: the renderer judges the name (render's own 404), the engines take ids
                candidates = self.pool
            attempt.pool = candidates
        if kind == "plain":
            return fields
        headers = request.session_headers
        if kind == "generate" or fields is None:
            # tokens-in: the header is the only channel, as in vLLM
            session_id = session_from_headers(headers, self.session_header)
        else:
            session_id = resolve_session_id(fields.session_id, headers, fields.vllm_xargs, self.session_header)
        agents = None  # agent clients' own headers (router.sessions.agents), read only when needed
        if session_id is None:
            agents = request.agent_headers
            if agents:
                session_id = agent_session(agents)
        if kind == "other":
            attempt.home = self._stored_response(request.path_qs)
        elif session_id is None:
            session_id = self._stamp(request, route, cast(RoutingFields, fields))
        attempt.session_id = session_id
        if session_id is not None:
            entry = self.sessions.touch(session_id)
            if not entry.requests:  # created by this request: the parent its agent names, if any
                if agents is None:
                    agents = request.agent_headers
                if agents:
                    entry.parent = parent_session(agents, session_id)
            entry.requests += 1
            attempt.entry = entry
        return fields

    def _stamp(self, request: RequestView, route: Route, fields: RoutingFields) -> str | None:
        mode = self.config.sessions.stamp
        if mode == "none":
            return None
        if mode == "derive":
            derived: str | None = None
            if route.kind == "chat":
                if fields.messages:
                    derived = derive_chat_session(fields.messages, sender_key(request.authorization, request.peer))
            elif route.kind == "responses":
                known = self._previous_response(fields)
                if known is not None and known[1] is not None:
                    derived = known[1]
                elif fields.input:
                    derived = derive_responses_session(fields.input, sender_key(request.authorization, request.peer))
            if derived is not None:
                return derived
        return mint_session()

    def _previous_response(self, fields: OpenFields | None) -> tuple[str, str | None] | None:
        previous = getattr(fields, "previous_response_id", None)
        if not isinstance(previous, str):
            return None
        return self.responses.lookup(previous)

    def _stored_response(self, target: str) -> str | None:
        """The backend URL that created the response of ``/v1/responses/{id}...`` (None: not such a
        path, or an id the router did not see)."""
        responses = self.responses
        if not len(responses) or not target.startswith(_RESPONSES_PREFIX):
            return None
        response_id = target[len(_RESPONSES_PREFIX):].partition("?")[0].partition("/")[0]
        known = responses.lookup(response_id) if response_id else None
        return known[0] if known is not None else None

    # ------------------------------------------------------------------ placement + upstream
    def place(self, pool: BackendSet, attempt: Attempt, fields: OpenFields | None,
               exclude: frozenset[str], body_len: int = 0) -> Placement:
        """Place one attempt of the request on ``pool`` (``body_len``: the body's size, for the
        policy's prompt estimate in text mode)."""
        if not exclude:
            home = attempt.home
            if home is None and attempt.route.kind == "responses":
                known = self._previous_response(fields)
                home = known[0] if known is not None else None
            if home is not None:
                backend = pool.get(home)
                if backend is not None and backend.available:
                    attempt.placement = placement = Placement(backend, Outcome.STICKY, "cached")
                    if self.agreement is not None and attempt.entry is not None and attempt.session_id is not None:
                        pin = attempt.entry.pins.get(pool.name)
                        self.agreement.placed(pool, attempt.session_id, attempt.entry, pin, placement, attempt.started)
                    return placement
        if self._hinted:
            hint: PlacementHint | None = self._hint(pool, attempt, body_len)
        else:  # other policies read only a new child session's parent (router.sessions.agents)
            entry = attempt.entry
            hint = None
            if entry is not None and entry.parent is not None and pool.name not in entry.pins:
                hint = PlacementHint(parent_session=entry.parent, parent_entry=self.sessions.get(entry.parent))
        entry = attempt.entry
        agreement = self.agreement
        before = entry.pins.get(pool.name) if agreement is not None and entry is not None else None
        placement = self.policy.place(pool, attempt.session_id, entry, exclude, hint)
        attempt.placement = placement
        # ``Agreement.placed`` has nothing to do for a request placed on its unchanged pin, when the pin is
        # its session's first choice and no shared state is kept (most requests): not called then
        if agreement is not None and entry is not None and attempt.session_id is not None and (
                placement.backend.url != before or entry.off_first or agreement.shared is not None
                or entry.pins.get(pool.name) != before):
            agreement.placed(pool, attempt.session_id, entry, before, placement, attempt.started)
        # A retry's placement is counted only when it re-pinned the session (a pin found dead by a
        # failed connection is a repin_unhealthy, like one found by a health check); a retry that
        # merely goes elsewhere is counted in retries_total, not as a spill.
        if (attempt.route.session_aware or attempt.entry is not None) and (
                not exclude or placement.outcome in _REPINS):
            self.metrics.placement(self.policy.name, placement.outcome.value, placement.reason)
        return placement

    def _hint(self, pool: BackendSet, attempt: Attempt, body_len: int) -> PlacementHint:
        """What the kv_aware policy predicts from: the prompt's size (exact in tokens mode, else
        from the body's length, at least what the session's last request left cached), the
        session's last prompt + answer, and a new child session's parent."""
        entry = attempt.entry
        last = entry.last_tokens if entry is not None else 0
        prompt_ids = attempt.prompt_ids
        if prompt_ids is not None:
            estimate = len(prompt_ids)
        else:
            estimate = int(body_len / self._bytes_per_token)
            if estimate < last:
                estimate = last
        hint = PlacementHint(estimate, prompt_ids, None, None, last)
        if entry is not None:
            parent = entry.parent
            if parent is not None and pool.name not in entry.pins:
                hint.parent_session = parent
                hint.parent_entry = self.sessions.get(parent)
        return hint

    async def forward(self, request: RequestView, writer: ResponseWriter, route: Route, body: bytes,
                      fields: OpenFields | None, attempt: Attempt) -> None:
        """Send ``body`` as it is to a backend of the attempt's pool and relay the answer (text mode's
        data path, P/D hand-off included; tokens mode's for the routes it only checks)."""
        pool = attempt.pool or self.pool
        headers = self.forward_headers(request, attempt)
        first: Placement | None = None
        handoff: Handoff | None = None
        if self.pd is not None and route.kind in PD_ROUTE_KINDS:
            first = self.place(pool, attempt, fields, frozenset(), len(body))  # decode first, then prefill
            handoff = await self.pd.prefill(route, body, attempt, headers, request.path_qs)
            body = handoff.body
        method = request.method
        if method == "HEAD":  # the upstream client frames answers by their head alone; the front drops the body
            method = "GET"
        completed = False
        try:
            upstream, backend = await self.send(pool, route, method, request.path_qs, headers, body, fields,
                                                attempt, first)
            try:
                await self._relay(writer, route, fields, upstream, backend, attempt)
            finally:
                upstream.close()
                backend.release()
            completed = 200 <= attempt.status < 300
        finally:
            if handoff is not None and not completed and self.pd is not None:
                # the decode leg failed or the client left: the prefill need not hold its blocks
                self.pd.release(handoff)

    def forward_headers(self, request: RequestView, attempt: Attempt) -> str:
        """The header lines every upstream leg of this request carries, rendered once."""
        own = [(REQUEST_ID_HEADER, attempt.request_id)]
        if attempt.session_id is not None:
            own.append((SESSION_HEADER, attempt.session_id))
        return request.forward_headers() + render_values(own)

    async def send(self, pool: BackendSet, route: Route, method: str, path: str, headers: str,
                   body: bytes, fields: OpenFields | None, attempt: Attempt,
                   first: Placement | None = None) -> tuple[UpstreamResponse, Backend]:
        """Send to a placed backend, retrying on the next candidate before any byte reached the client.

        Returns with the backend's ``in_flight`` incremented (``admit``); the caller ``release``s it when done.
        """
        loop = asyncio.get_running_loop()
        exclude: set[str] = set()
        retries_left = self.config.upstream.retries
        # total_timeout_s bounds the whole request, retries included: later attempts get what is left
        deadline = attempt.started + self.config.upstream.total_timeout_s
        timeouts: UpstreamTimeouts | None = None  # the pool's own on the first attempt
        while True:
            placement = first if first is not None else self.place(pool, attempt, fields, frozenset(exclude),
                                                                   len(body))
            first = None
            backend = placement.backend
            attempt.backend = backend
            attempt.outcome = placement.outcome
            if attempt.entry is not None:
                attempt.entry.last_backend = backend.name
            head = request_head(method, path, f"{backend.host}:{backend.port}", headers, len(body))
            backend.admit()
            try:
                upstream = await self.upstream.request(backend.host, backend.port, head, body, timeouts=timeouts)
            except UpstreamError as exc:
                backend.release()
                reason = exc.reason
                self.record_failure(backend, reason, connect_error=isinstance(exc, UpstreamConnectError))
                if retries_left <= 0 or not exc.retryable or loop.time() >= deadline:
                    raise
            except BaseException:  # cancelled (client gone): the pool closed the connection
                backend.release()
                raise
            else:
                if upstream.status not in RETRY_STATUSES or retries_left <= 0 or loop.time() >= deadline:
                    if upstream.status < 500:
                        self.health.record_success(backend)
                    ttfb = attempt.ttfb = loop.time() - attempt.started
                    self.metrics.first_byte(route.name, ttfb)
                    return upstream, backend
                upstream.close()
                backend.release()
                reason = f"status_{upstream.status}"
                self.record_failure(backend, reason, connect_error=False)
            retries_left -= 1
            exclude.add(backend.url)
            self.metrics.retries.labels(reason).inc()
            if len(exclude) >= len(pool):
                exclude.clear()  # every backend tried once: allow another round on the healthy ones
            await asyncio.sleep(min(self.config.upstream.retry_backoff_s * (0.5 + random.random()),
                                    max(0.0, deadline - loop.time())))
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise UpstreamTimeoutError(
                    f"no backend answered within total_timeout_s ({self.config.upstream.total_timeout_s:g} s), "
                    "retries included"
                )
            timeouts = self.upstream.timeouts.capped(remaining)

    def record_failure(self, backend: Backend, reason: str, *, connect_error: bool) -> None:
        self.metrics.upstream_errors.labels(backend.name, reason).inc()
        self.health.record_failure(backend, connect_error=connect_error)

    # ------------------------------------------------------------------ relay
    async def _relay(self, writer: ResponseWriter, route: Route, fields: OpenFields | None,
                     upstream: UpstreamResponse, backend: Backend, attempt: Attempt) -> None:
        attempt.status = upstream.status
        headers = self._response_headers(upstream, attempt)
        if not upstream.content_type.startswith("text/event-stream"):
            data = await upstream.read()
            if upstream.status == 200 and (route.session_aware or attempt.entry is not None):
                usage, response_id = usage_from_json(data)
                self.account(attempt, usage)
                if route.kind == "responses" and response_id is not None:
                    self.responses.remember(response_id, backend.url, attempt.session_id)
            elif upstream.status >= 400:
                self.account_error(attempt)
            writer.respond(upstream.status, headers, data)
            return
        await self._relay_stream(writer, route, fields, upstream, backend, attempt, headers)

    async def _relay_stream(self, writer: ResponseWriter, route: Route, fields: OpenFields | None,
                            upstream: UpstreamResponse, backend: Backend, attempt: Attempt,
                            headers: Headers) -> None:
        await writer.start(upstream.status, headers)
        track_usage = route.session_aware and fields is not None and (
            route.kind == "responses" or wants_stream_usage(cast(RoutingFields, fields))
        )
        want_id = route.kind == "responses"
        last: deque[bytes] = deque(maxlen=3)
        tail = b"\n\n"  # the last chunk relayed: where the relayed bytes end
        final = b""  # the body's last piece when it came with the body's end: sent with the stream's end
        try:
            async for chunk in upstream:
                tail = chunk
                if track_usage:
                    last.append(chunk)
                if want_id:
                    response_id = response_id_from_sse(chunk)
                    if response_id is not None:
                        self.responses.remember(response_id, backend.url, attempt.session_id)
                        want_id = False
                if upstream.complete:  # this piece took everything buffered: it is the body's last
                    final = chunk  # one send for the last piece and the end, not two
                    break
                await writer.write(chunk)
        except UpstreamError as exc:
            # bytes already reached the client: end the stream with an error event, never hang; the
            # event starts on an event boundary even when the backend broke off mid-event
            self.record_failure(backend, exc.reason, connect_error=False)
            attempt.status = exc.status
            self.account_error(attempt)
            if (upstream.header("content-encoding") or "identity").lower() != "identity":
                # an encoded (e.g. gzip) stream: plain text appended would be garbage to the decoder;
                # the stream ends unfinished, which the client's decoder reports
                await writer.end()
                return
            await writer.write(event_boundary(tail) + b"data: " + exc.body() + b"\n\ndata: [DONE]\n\n")
            await writer.end()
            return
        if track_usage:
            self.account(attempt, usage_from_sse_tail(b"".join(last)))
        else:
            self.account(attempt, None)
        await writer.end(final)

    def _response_headers(self, upstream: UpstreamResponse, attempt: Attempt) -> list[tuple[str, str]]:
        headers = upstream.headers + [(REQUEST_ID_HEADER, attempt.request_id)]  # the pool left out response_drops
        if attempt.session_id is not None:
            headers.append((self.session_header, attempt.session_id))
        if self.decision_header and attempt.placement is not None:
            headers.append((DECISION_HEADER, decision_value(attempt.placement)))
        return headers

    # ------------------------------------------------------------------ accounting
    def account(self, attempt: Attempt, usage: Usage | None) -> None:
        entry = attempt.entry
        prompt = completion = cached = 0
        if usage is not None:
            attempt.usage = usage
            prompt, completion, cached = usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
            self.metrics.usage(prompt, completion, cached)
            kv = self.kv  # an index no backend's events reach holds nothing to correct (``any_events``)
            if kv is not None and kv.any_events and attempt.session_id is not None and attempt.backend is not None:
                kv.observe_hit(attempt.session_id, attempt.backend.url, cached, prompt)
        if entry is not None:
            entry.record_usage(prompt, completion, cached)

    def account_error(self, attempt: Attempt) -> None:
        if attempt.entry is not None:
            attempt.entry.errors += 1

    def _error(self, writer: ResponseWriter, status: int, body: bytes, attempt: Attempt) -> None:
        attempt.status = status
        headers = [("Content-Type", JSON_CONTENT_TYPE), (REQUEST_ID_HEADER, attempt.request_id)]
        if attempt.session_id is not None:
            headers.append((self.session_header, attempt.session_id))
        if status >= 500 or attempt.backend is not None:
            self.account_error(attempt)
        writer.respond(status, headers, body)

    def _finish(self, attempt: Attempt, now: float, method: str) -> None:
        backend = attempt.backend.name if attempt.backend is not None else "none"
        self.metrics.request_done(attempt.route.name, backend, attempt.status, now - attempt.started)
        access_log = self.access_log
        if access_log is not None:
            outcome = attempt.outcome
            access_log.write(method, attempt.route.path, attempt.status, now - attempt.started, attempt.ttfb,
                             attempt.backend.name if attempt.backend is not None else None, attempt.session_id,
                             outcome.value if outcome is not None else None, attempt.usage, attempt.request_id)


def decision_value(placement: Placement) -> str:
    """The decision header's value: ``<outcome>;cached=<tokens>;wait=<ms>;reason=<why>``."""
    value = f"{placement.outcome.value};cached={placement.cached_tokens};wait={round(placement.wait_s * 1000)}"
    return f"{value};reason={placement.reason}" if placement.reason else value


def event_boundary(tail: bytes) -> bytes:
    """The line breaks that end an SSE event whose bytes so far end with ``tail`` (the last relayed
    chunk; nothing relayed: pass ``b"\\n\\n"``). Extra blank lines are harmless (an empty event is
    never dispatched); missing ones would glue the next event onto a half-written one."""
    if tail.endswith(b"\n\n"):
        return b""
    if tail.endswith(b"\n"):  # a line ended (LF or CRLF): one blank line ends the event
        return b"\n"
    return b"\n\n"  # mid-line (or a lone CR): end the line, then the event

