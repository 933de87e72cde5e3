"""The P/D side channel's wire: its paths, the msgpack pull bodies and the JSON release body, the
prompt digest a pull proves itself with, and the usable part of a decode request's
``kv_transfer_params`` (``parse_remote_params``)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

from backends.engine.kv_cache import token_bytes

PULL_PATH = "/internal/kv/pull"
RELEASE_PATH = "/internal/kv/release"
MSGPACK = "application/x-msgpack"


class KVPullRequest(msgspec.Struct, forbid_unknown_fields=False):
    """Decode -> prefill: which held request, and proof that it is for the same prompt."""

    remote_request_id: str
    remote_engine_id: str
    #: blocks the decode side wants (a subset of remote_block_ids; empty = all)
    block_ids: list[int]
    block_size: int
    #: ``prompt_digest(prompt_token_ids, cache_salt)`` of the decode request
    prompt_digest: bytes
    #: the pulling engine (for the prefill's logs)
    requester: str = ""


class KVPullResponse(msgspec.Struct):
    """Prefill -> decode: what the held blocks contain."""

    request_id: str
    engine_id: str
    block_size: int
    #: the prompt whose KV the blocks hold
    token_ids: list[int]
    #: keys of the prompt's full blocks, in order (the decode side checks them)
    block_hashes: list[bytes]
    block_ids: list[int]
    cache_salt: str | None = None


class KVReleaseRequest(msgspec.Struct, forbid_unknown_fields=False):
    """Router -> prefill: the returned ``kv_transfer_params``, handed back (other keys ignored)."""

    remote_engine_id: str
    remote_request_id: str
    #: a flat list of ids or one list per KV-cache group, as returned
    remote_block_ids: list[int | list[int]]


def prompt_digest(token_ids: Sequence[int], cache_salt: str | None) -> bytes:
    """A stable digest of a prompt and its cache salt (same in every process)."""
    h = hashlib.blake2b(token_bytes(token_ids), digest_size=16)
    if cache_salt is not None:
        h.update(b"\x01salt" + cache_salt.encode("utf-8", "surrogatepass"))
    return h.digest()


class RemotePrefill(msgspec.Struct, frozen=True):
    """The usable part of a decode request's ``kv_transfer_params``."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: list[int]


def parse_remote_params(params: dict[str, Any]) -> RemotePrefill | None:
    """vLLM's rule: pull only when ``remote_block_ids`` is non-empty and ``remote_engine_id``,
    ``remote_request_id``, ``remote_host`` and ``remote_port`` are all present; else None.

    ``remote_block_ids`` may be a flat list of ids or one list per KV-cache group (flattened)."""
    engine_id = params.get("remote_engine_id")
    request_id = params.get("remote_request_id")
    host = params.get("remote_host")
    port = params.get("remote_port")
    raw_blocks = params.get("remote_block_ids")
    if not (isinstance(engine_id, str) and engine_id and isinstance(request_id, str) and request_id):
        return None
    if not (isinstance(host, str) and host and len(host) <= 255):
        return None
    if type(port) is not int or not 1 <= port <= 65535:
        return None
    if not isinstance(raw_blocks, list) or not raw_blocks:
        return None
    blocks: list[int] = []
    for item in raw_blocks:
        group = item if isinstance(item, list) else [item]
        for b in group:
            if type(b) is not int or b < 0:
                return None
            blocks.append(b)
    if not blocks:
        return None
    return RemotePrefill(engine_id=engine_id, request_id=request_id, host=host, port=port, block_ids=blocks)
