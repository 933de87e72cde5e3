"""Prefill/decode hand-off (DESIGN.md §6, vLLM's NixlConnector proxy protocol).

The proxy places the decode leg first (session placement over the decode pool), then calls
``PDHandoff.prefill``: the prefill leg goes to the session's prefill instance (among those that
serve the request's ``model``; none is a ``no_prefill`` fallback) with the body
capped at one token, non-streaming, and the ``kv_transfer_params`` placeholder; the
``kv_transfer_params`` it returns are added to the original body for the decode leg. Both legs
carry the same ``X-Request-Id`` and ``X-Session-ID``. When the prefill leg fails (no prefill
instance, connect error, 5xx, timeout, no params) the request falls back to decode-only
(the decode instance computes the prompt itself), counted by reason, unless ``pd_fallback`` is
off, in which case the client gets a 502.

A client's own ``kv_transfer_params`` never reach either leg (the proxy strips them unless
``trust_client_kv_params``); the hand-off writes its own. When the decode leg fails after the
prefill handed off (connect error, error status, timeout, a broken stream) or the client leaves,
``release`` tells the prefill instance, in the background, to free the blocks it holds for that
decode at once (``POST /internal/kv/release`` with the returned parameters; vLLM's "notify
rejected" path) instead of after its hold timeout. Counted in
``session_router_pd_kv_releases_total{result}``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from router.attempt import Attempt
from contract.errors import (InvalidJSONError, NoHealthyBackendError, UpstreamConnectError, UpstreamError,
                             UpstreamStatusError)
from router.health import HealthChecker
from router.membership import Backend, BackendPool
from router.metrics import RouterMetrics
from router.placement.base import Policy
from router.routes import Route
from router.upstream import UpstreamPool, request_head

log = logging.getLogger(__name__)

#: routes that take the two-leg path; the others go to the decode pool directly
PD_ROUTE_KINDS = frozenset(("chat", "completion", "generate"))

#: what the prefill leg asks for (vLLM's NixlConnector placeholder)
PREFILL_REQUEST_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: the prefill instance's "the decode leg will not come" endpoint (backends/kv_transfer/side_channel.py)
RELEASE_PATH = "/internal/kv/release"
#: a release is small and off the request's path: it gets this long at most
RELEASE_TIMEOUT_S = 10.0

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


class _PrefillReply(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None


_reply_decoder = msgspec.json.Decoder(_PrefillReply)


def prefill_body(kind: str, request: dict[str, Any]) -> bytes:
    """The prefill leg's body: one token, non-streaming, asking for remote decode."""
    body = dict(request)
    body["stream"] = False
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(key, None)
    if kind == "generate":
        sampling = dict(body.get("sampling_params") or {})
        sampling["max_tokens"] = 1
        sampling.pop("min_tokens", None)
        if "output_kind" in sampling:  # one whole answer (vLLM's FINAL_ONLY), as the leg is not streamed
            sampling["output_kind"] = 2
        body["sampling_params"] = sampling
    else:
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = dict(PREFILL_REQUEST_PARAMS)
    return _encoder.encode(body)


def decode_body(request: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The decode leg's body: the original request plus the prefill's ``kv_transfer_params``."""
    body = dict(request)
    body["kv_transfer_params"] = params
    return _encoder.encode(body)


class Handoff:
    """What the prefill leg produced: the decode leg's body and, when the prefill holds KV blocks
    for it, the returned parameters and where to release them if the decode leg fails."""

    __slots__ = ("body", "params", "backend", "headers")

    def __init__(self, body: bytes, params: dict[str, Any] | None = None, backend: Backend | None = None,
                 headers: str = "") -> None:
        self.body = body
        self.params = params
        self.backend = backend
        self.headers = headers


class PrefillFailed(Exception):
    def __init__(self, reason: str, error: UpstreamError | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


class PDHandoff:
    """The prefill leg and the release of what it holds. Its collaborators are given by the app
    factory (``router.app``)."""

    def __init__(self, prefill_pool: BackendPool, *, policy: Policy, metrics: RouterMetrics,
                 upstream: UpstreamPool, health: HealthChecker, fallback: bool) -> None:
        """``fallback``: a failed prefill leg falls back to decode-only (``pd_fallback``)."""
        self.prefill_pool = prefill_pool
        self.policy = policy
        self.metrics = metrics
        self.upstream = upstream
        self.health = health
        self.fallback = fallback
        #: releases under way (kept referenced until done)
        self._releases: set[asyncio.Task[None]] = set()

    async def prefill(self, route: Route, body: bytes, attempt: Attempt,
                      headers: str, path: str) -> Handoff:
        """Run the prefill leg; return the decode leg's body (the original one on fallback) and
        what ``release`` needs should the decode leg fail."""
        try:
            request = _decoder.decode(body)
        except msgspec.DecodeError as exc:  # routing skipped these values; the legs need them decoded
            raise InvalidJSONError(f"request body is JSON this router cannot read for a P/D hand-off: {exc}; "
                                   "send numbers within 64-bit float range") from None
        try:
            params, backend = await self._prefill_leg(route, request, attempt, headers, path)
        except PrefillFailed as failed:
            self.metrics.pd_fallbacks.labels(failed.reason).inc()
            if not self.fallback:
                raise UpstreamStatusError(
                    f"prefill failed ({failed.reason}) and pd_fallback is off; "
                    "enable pd_fallback to let decode instances compute the prompt",
                    upstream_status=502,
                ) from None
            return Handoff(body)
        return Handoff(decode_body(request, params), params, backend, headers)

    def release(self, handoff: Handoff) -> None:
        """The decode leg failed or its client left: have the prefill instance free the blocks it
        holds for it, in the background (nothing to do after a fallback)."""
        if handoff.params is None or handoff.backend is None:
            return
        task = asyncio.get_running_loop().create_task(self._release(handoff))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, handoff: Handoff) -> None:
        backend = handoff.backend
        assert backend is not None
        payload = _encoder.encode(handoff.params)
        head = request_head("POST", RELEASE_PATH, f"{backend.host}:{backend.port}", handoff.headers, len(payload))
        try:
            status = await self.upstream.control(backend.host, backend.port, head, payload,
                                                 bound_s=RELEASE_TIMEOUT_S)
        except UpstreamError as exc:
            log.warning("P/D: could not release the KV held on %s (%s); it is freed after its hold timeout",
                        backend.name, exc.reason)
            status = 0
        if status == 200:
            result = "released"
        elif status == 404:
            result = "not_held"  # already pulled (the decode failed later), released or expired
        else:
            result = "failed"
            if status:
                log.warning("P/D: releasing the KV held on %s answered %d; it is freed after its hold timeout",
                            backend.name, status)
        self.metrics.pd_kv_releases.labels(result).inc()

    async def _prefill_leg(self, route: Route, request: dict[str, Any], attempt: Attempt,
                           headers: str, path: str) -> tuple[dict[str, Any], Backend]:
        pool = self.prefill_pool.for_model(request.get("model"))  # the model's prefill instances
        if pool is None:
            raise PrefillFailed("no_prefill")
        try:
            placement = self.policy.place(pool, attempt.session_id, attempt.entry)
        except NoHealthyBackendError:
            raise PrefillFailed("no_prefill") from None
        self.metrics.placement(self.policy.name, placement.outcome.value, placement.reason)
        backend = placement.backend
        payload = prefill_body(route.kind, request)
        head = request_head("POST", path, f"{backend.host}:{backend.port}", headers, len(payload))
        backend.admit()
        upstream = None
        try:
            upstream = await self.upstream.request(backend.host, backend.port, head, payload)
            data = await upstream.read()
        except UpstreamError as exc:
            reason = exc.reason
            self.metrics.upstream_errors.labels(backend.name, reason).inc()
            self.health.record_failure(backend, connect_error=isinstance(exc, UpstreamConnectError))
            raise PrefillFailed(reason, exc) from None
        finally:
            backend.release()
            if upstream is not None:
                upstream.close()
        if upstream.status >= 500:
            self.health.record_failure(backend, connect_error=False)
            raise PrefillFailed("status_5xx")
        if upstream.status != 200:
            raise PrefillFailed("rejected")
        self.health.record_success(backend)
        try:
            params = _reply_decoder.decode(data).kv_transfer_params
        except msgspec.MsgspecError:
            params = None
        if not params:
            raise PrefillFailed("no_params")
        return params, backend

