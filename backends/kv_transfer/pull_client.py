"""The decode side's HTTP client of a prefill's side channel: one ``POST /internal/kv/pull``.

Every way a pull can fail raises ``PullFailed`` with a reason of ``FAILURE_REASONS`` (the
parameters are unusable, the side channel is not allowed, unreachable, slow, holds nothing, holds
another prompt, refuses, or answers something unreadable); the caller recomputes the prompt.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
from yarl import URL

from backends.engine.kv_cache import hash_full_blocks
from backends.kv_transfer.allow_list import AllowList, normalize_host
from backends.kv_transfer.wire import (
    MSGPACK,
    PULL_PATH,
    KVPullRequest,
    KVPullResponse,
    parse_remote_params,
    prompt_digest,
)

DEFAULT_PULL_TIMEOUT_S = 10.0
#: a pull reply larger than this is refused (a prompt of max_model_len ids is far smaller)
MAX_REPLY_BYTES = 64 * 1024 * 1024

_pull_response_decoder = msgspec.msgpack.Decoder(KVPullResponse)
_msgpack = msgspec.msgpack.Encoder()


class PullFailed(Exception):
    """A pull that brought nothing; ``reason`` is one of ``FAILURE_REASONS`` (a metric label)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class PullClient:
    """Pulls held blocks from the side channels ``allow`` permits (one connection pool, made on
    first use; no proxies from the environment, no redirects, no decompression)."""

    def __init__(self, allow: AllowList, block_size: int, requester: str,
                 timeout_s: float = DEFAULT_PULL_TIMEOUT_S) -> None:
        self.allow = allow
        self.block_size = block_size
        #: this engine's id (named in the pull, for the prefill's logs)
        self.requester = requester
        self.timeout_s = timeout_s
        self._http: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            # no proxies from the environment, no redirects followed (see pull), no decompression
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64), auto_decompress=False, trust_env=False
            )
        return self._http

    async def pull(self, params: dict[str, Any], prompt: list[int], cache_salt: str | None) -> KVPullResponse:
        """The held blocks ``params`` name, checked to be ``prompt``'s; ``PullFailed`` otherwise."""
        ref = parse_remote_params(params)
        if ref is None:
            raise PullFailed(
                "invalid_params",
                "do_remote_prefill needs non-empty remote_block_ids and remote_engine_id, remote_request_id, "
                "remote_host, remote_port",
            )
        if not self.allow.allows(ref.host, ref.port):
            raise PullFailed("not_allowed", f"{ref.host}:{ref.port} is not allowed ({self.allow.describe()})")
        host = normalize_host(ref.host)
        url = URL.build(scheme="http", host=host, port=ref.port, path=PULL_PATH)
        payload = _msgpack.encode(
            KVPullRequest(
                remote_request_id=ref.request_id,
                remote_engine_id=ref.engine_id,
                block_ids=ref.block_ids,
                block_size=self.block_size,
                prompt_digest=prompt_digest(prompt, cache_salt),
                requester=self.requester,
            )
        )
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        where = f"{ref.host}:{ref.port}"
        try:
            async with self._session().post(
                url, data=payload, headers={"Content-Type": MSGPACK}, timeout=timeout, allow_redirects=False
            ) as resp:
                status = resp.status
                # only a reply of a declared, bounded size is read (ours always declare it)
                size = resp.content_length
                data = await resp.read() if size is not None and size <= MAX_REPLY_BYTES else b""
        except asyncio.TimeoutError:
            raise PullFailed("timeout", f"{where} did not answer within {self.timeout_s:g}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise PullFailed("unreachable", f"{where}: {exc.__class__.__name__}: {exc}") from None
        if status == 404:
            raise PullFailed("not_found", f"{where} holds no blocks for {ref.request_id!r} (freed or expired)")
        if status == 409:
            raise PullFailed("mismatch", f"{where} refused: {_error_message(data)}")
        if status != 200:
            raise PullFailed("rejected", f"{where} answered {status}: {_error_message(data)}")
        try:
            reply = _pull_response_decoder.decode(data)
        except msgspec.MsgspecError as exc:
            raise PullFailed("bad_reply", f"{where} sent an unreadable reply: {exc}") from None
        bs = self.block_size
        if reply.block_size != bs or reply.token_ids != prompt or reply.block_hashes != hash_full_blocks(
            reply.token_ids, bs, cache_salt
        ):
            raise PullFailed("mismatch", f"{where} sent blocks of another prompt or block size")
        return reply


def _error_message(data: bytes) -> str:
    try:
        obj = msgspec.json.decode(data)
        return str(obj["error"]["message"])[:200]
    except Exception:  # any body: only for the log line
        return data[:200].decode("utf-8", "replace")
