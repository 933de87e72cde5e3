"""The prefill side of P/D: the side channel's HTTP routes and the address it advertises.

``POST /internal/kv/pull`` hands a held request's blocks over (msgpack) and frees them;
``POST /internal/kv/release`` frees them without a pull (the router's "the decode leg will not
come"). Both first find the held request on this engine (404 when nothing is held, 409 when the
caller names another engine); a pull must also match the block size and the prompt's digest.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from backends.kv_transfer.metrics import KVTransferMetrics
from backends.kv_transfer.wire import (
    MSGPACK,
    PULL_PATH,
    RELEASE_PATH,
    KVPullRequest,
    KVPullResponse,
    KVReleaseRequest,
    prompt_digest,
)
from contract.errors import BadRequestError, ClientError, NotFoundError

if TYPE_CHECKING:
    from backends.engine.client import AsyncEngine
    from backends.engine.holds import HeldBlocks

log = logging.getLogger(__name__)

_release_decoder = msgspec.json.Decoder(KVReleaseRequest)
_pull_request_decoder = msgspec.msgpack.Decoder(KVPullRequest)
_msgpack = msgspec.msgpack.Encoder()


class KVConflictError(ClientError):
    """The pull names a held request but for another engine, block size or prompt."""

    status = 409
    error_type = "ConflictError"


def advertise(params: dict[str, Any] | None, request: web.Request) -> dict[str, Any] | None:
    """Fill ``remote_host``/``remote_port`` of returned params that the engine left unset with
    the address this request reached (the side channel is then this HTTP server)."""
    if params is None or (params.get("remote_host") is not None and params.get("remote_port") is not None):
        return params
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if not sockname:
        return params
    params = dict(params)
    if params.get("remote_host") is None:
        params["remote_host"] = sockname[0]
    if params.get("remote_port") is None:
        params["remote_port"] = sockname[1]
    return params


class SideChannel:
    """The routes a prefill (or ``both``) instance serves for its held KV blocks."""

    def __init__(self, engine: "AsyncEngine", metrics: KVTransferMetrics, block_size: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.block_size = block_size

    @property
    def engine_id(self) -> str:
        return self.engine.core.engine_id

    def _held(self, request_id: str, engine_id: str, *, gone: str, other_engine: str) -> "HeldBlocks":
        """The blocks ``request_id`` holds on this engine: a 404 (ending with ``gone``) when it holds
        none, a 409 (ending with ``other_engine``) when the caller names another engine."""
        held = self.engine.get_held(request_id)
        if held is None:
            raise NotFoundError(f"request {request_id!r} holds no KV blocks here {gone}", param="remote_request_id")
        if engine_id != self.engine_id:
            raise KVConflictError(f"this is engine {self.engine_id!r}, not {engine_id!r}; {other_engine}",
                                  param="remote_engine_id")
        return held

    async def handle_pull(self, request: web.Request) -> web.Response:
        """``POST /internal/kv/pull``: hand the held blocks' content over, then free them."""
        data = await request.read()
        try:
            pull = _pull_request_decoder.decode(data)
        except msgspec.MsgspecError as exc:
            raise BadRequestError(f"not a msgpack KVPullRequest: {exc}") from None
        held = self._held(
            pull.remote_request_id, pull.remote_engine_id,
            gone="(already pulled, expired, aborted or never prefilled for remote decode); recompute the prompt",
            other_engine="the parameters are stale",
        )
        if pull.block_size != self.block_size:
            raise KVConflictError(
                f"block size {pull.block_size} differs from this engine's {self.block_size}; run P and D with the "
                "same --block-size",
                param="block_size",
            )
        if pull.prompt_digest != prompt_digest(held.token_ids, held.cache_salt):
            raise KVConflictError(
                "the held blocks are for another prompt (or cache salt) than the pulling request's",
                param="prompt_digest",
            )
        if pull.block_ids and not set(pull.block_ids) <= set(held.block_ids):
            raise KVConflictError("block_ids names blocks the request does not hold", param="block_ids")
        body = _msgpack.encode(
            KVPullResponse(
                request_id=held.request_id,
                engine_id=self.engine_id,
                block_size=self.block_size,
                token_ids=held.token_ids,
                block_hashes=held.block_hashes,
                block_ids=held.block_ids,
                cache_salt=held.cache_salt,
            )
        )
        self.engine.release_held(held.request_id)
        self.metrics.pulls_served += 1
        return web.Response(body=body, content_type=MSGPACK)

    async def handle_release(self, request: web.Request) -> web.Response:
        """``POST /internal/kv/release``: the decode leg will not come; free the held blocks now."""
        data = await request.read()
        try:
            release = _release_decoder.decode(data)
        except msgspec.MsgspecError as exc:
            raise BadRequestError(
                f"not a KV release ({exc}); send the kv_transfer_params the prefill returned, as JSON "
                "(remote_engine_id, remote_request_id, remote_block_ids)"
            ) from None
        held = self._held(
            release.remote_request_id, release.remote_engine_id,
            gone="(already pulled, released or expired); nothing to free",
            other_engine="send the release to the prefill instance that returned the parameters",
        )
        blocks = [b for item in release.remote_block_ids for b in (item if isinstance(item, list) else (item,))]
        if blocks != held.block_ids:
            raise KVConflictError("remote_block_ids differ from the blocks the request holds; send the "
                                  "kv_transfer_params as the prefill returned them", param="remote_block_ids")
        self.engine.release_held(held.request_id, "released")
        log.info("P/D: released the held KV blocks of %s (the decode leg will not come)", held.request_id)
        return web.Response(
            body=msgspec.json.encode({"released": True, "remote_request_id": held.request_id,
                                      "num_blocks": len(held.block_ids)}),
            content_type="application/json",
        )

    def add_routes(self, app: web.Application, *, pull: bool = True) -> None:
        """The side channel's routes: pull (unless ``pull`` is false: a data port whose side channel
        is on a dedicated listener) and release."""
        if pull:
            app.router.add_post(PULL_PATH, self.handle_pull)
        app.router.add_post(RELEASE_PATH, self.handle_release)
