"""P/D KV transfer between backend processes (vLLM NixlConnector semantics, simulated).

Roles: a *prefill* instance finishes a ``kv_transfer_params.do_remote_decode`` request after one
token and HOLDS its KV blocks (the engine core does that); a *decode* instance that gets
``kv_transfer_params.do_remote_prefill`` pulls those blocks over the side channel, puts them in its
prefix cache (``preload_blocks``) and decodes without computing the prompt again. Role ``both``
does either, as vLLM's ``kv_both``.

Side channel (a real transfer between the two processes)::

    decode                                              prefill (remote_host:remote_port)
      POST /internal/kv/pull   application/x-msgpack  ->  KVPullRequest
                                                    <-  200 KVPullResponse (token ids, block keys)
                                                        ... and the prefill frees the blocks
                                                    <-  404 unknown / already freed / expired
                                                    <-  409 engine id, block size or prompt differ

The endpoint is served on the prefill's HTTP server (``remote_host``/``remote_port`` then name the
address the prefill leg reached, or ``--kv-host`` and the HTTP port), or on a dedicated listener
when ``--kv-port`` is given (then the data port does not serve it). A pull must name the held
request's engine id and carry a digest of the prompt (and cache salt) it is for, so only a
request for the same prompt can take (and free) held blocks. Bodies are msgpack (``msgspec``).

Release (vLLM's "notify rejected" path: the decode leg will not come)::

    router                                              prefill (the backend the prefill leg went to)
      POST /internal/kv/release  application/json  ->  the kv_transfer_params the prefill returned
                                                        (remote_engine_id, remote_request_id,
                                                        remote_block_ids; other keys ignored)
                                                   <-  200 {"released": true, ...}: blocks freed
                                                   <-  404 nothing held (already pulled, expired)
                                                   <-  409 engine id or block ids differ

The router sends it when a decode leg fails (connect error, error status, timeout) or its client
leaves before the decode answered, so the blocks are freed at once instead of after the hold
timeout. It is served on the data port of every prefill (or ``both``) instance, and on the
dedicated side-channel listener too: only the holder of the returned parameters can name the
exact engine id, request id and block ids, and the worst a forged release can do is make one
decode instance recompute a prompt. Holds are also bounded per request, in total and under
block pressure (``backends/engine/holds.py``).

Allow-list (decode side): ``--kv-allow HOST:PORT`` (repeatable) names the only side channels a
decode instance connects to, compared with ``remote_host`` as written (no name is resolved to
decide). With none given, only loopback hosts are allowed (127.0.0.0/8, ::1 and the name
``localhost``). Parameters naming anything else are refused BEFORE any connection: a
client-supplied ``kv_transfer_params`` cannot aim a decode instance at another host.

Failures on the decode side (invalid or missing parameters, a host not allowed, an unreachable
prefill, a timeout, freed/unknown blocks, a prompt mismatch, a bad reply) never fail the request:
the prompt is recomputed locally, a WARNING is logged and ``session_backend_kv_pull_failures_total
{reason}`` counts it, as vLLM does ("Got invalid KVTransferParams" -> recompute).

Metrics (labels ``model_name``, ``engine``; counters exposed with ``_total``):

- ``session_backend_kv_pulls`` / ``session_backend_kv_pulled_tokens``: successful pulls and the
  prompt tokens they brought (full blocks); ``session_backend_kv_pull_failures{reason}``.
- ``session_backend_kv_pulls_served`` (prefill side) and the gauges
  ``session_backend_kv_held_requests`` / ``session_backend_kv_held_blocks`` (requests whose
  blocks wait for a pull, and those blocks); ``session_backend_kv_holds_freed{reason=pulled|
  released|expired|evicted|pressure|replaced}`` (how holds ended) and
  ``session_backend_kv_holds_refused{reason=over_request_limit}`` (requests not held).
- vLLM's ``vllm:external_prefix_cache_queries`` / ``vllm:external_prefix_cache_hits`` (tokens asked
  of / loaded through the connector) and ``vllm:prompt_tokens_by_source{source=local_compute|
  local_cache_hit|external_kv_transfer}`` (every finished request's prompt, by where it came from).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from yarl import URL

from backends.engine.config import EngineConfig
from backends.engine.holds import HoldTable
from backends.engine.kv_cache import hash_full_blocks, token_bytes
from contract.errors import BadRequestError, ClientError, NotFoundError

if TYPE_CHECKING:
    from backends.engine.client import AsyncEngine

log = logging.getLogger(__name__)

PULL_PATH = "/internal/kv/pull"
RELEASE_PATH = "/internal/kv/release"
MSGPACK = "application/x-msgpack"
DEFAULT_PULL_TIMEOUT_S = 10.0
#: a pull reply larger than this is refused (a prompt of max_model_len ids is far smaller)
MAX_REPLY_BYTES = 64 * 1024 * 1024

#: the closed set of pull failure reasons (metric label values)
FAILURE_REASONS = (
    "invalid_params",  # do_remote_prefill without a usable engine id / request id / host / port / block ids
    "not_allowed",  # the side channel is not on the allow-list: no connection was attempted
    "unreachable",  # connect error or connection lost
    "timeout",  # no full reply within the pull timeout
    "not_found",  # the prefill does not hold that request (freed, expired or never there)
    "mismatch",  # engine id, block size or prompt differ (the prefill's 409, or a reply for another prompt)
    "rejected",  # any other status from the side channel
    "bad_reply",  # a 200 whose body is not a KVPullResponse
)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


# ---- wire shapes ---------------------------------------------------------------------------


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


_release_decoder = msgspec.json.Decoder(KVReleaseRequest)
_pull_request_decoder = msgspec.msgpack.Decoder(KVPullRequest)
_pull_response_decoder = msgspec.msgpack.Decoder(KVPullResponse)
_msgpack = msgspec.msgpack.Encoder()


def prompt_digest(token_ids: Sequence[int], cache_salt: str | None) -> bytes:
    """A stable digest of a prompt and its cache salt (same in every process)."""
    h = hashlib.blake2b(token_bytes(token_ids), digest_size=16)
    if cache_salt is not None:
        h.update(b"\x01salt" + cache_salt.encode("utf-8", "surrogatepass"))
    return h.digest()


class KVConflictError(ClientError):
    """The pull names a held request but for another engine, block size or prompt."""

    status = 409
    error_type = "ConflictError"


# ---- parameters and the allow-list ------------------------------------------------------------


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


def _normalize_host(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or the name ``localhost`` (no name is resolved to decide)."""
    host = _normalize_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_allow_entry(entry: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:8200``) -> (normalized host, port); ValueError if malformed."""
    text = entry.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{entry!r} is not HOST:PORT (e.g. 127.0.0.1:8200 or [::1]:8200)")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"{entry!r}: write an IPv6 address in brackets, e.g. [::1]:8200")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"{entry!r}: the port must be 1..65535")
    return _normalize_host(host), port


class AllowList:
    """Which prefill side channels a decode instance may pull from."""

    __slots__ = ("entries",)

    def __init__(self, entries: Sequence[str] = ()) -> None:
        #: explicit (host, port) pairs; empty = loopback hosts only
        self.entries = frozenset(parse_allow_entry(e) for e in entries)

    def allows(self, host: str, port: int) -> bool:
        if self.entries:
            return (_normalize_host(host), port) in self.entries
        return is_loopback_host(host)

    def describe(self) -> str:
        if not self.entries:
            return "loopback hosts only (127.0.0.0/8, ::1, localhost)"
        return ", ".join(sorted(f"{h}:{p}" if ":" not in h else f"[{h}]:{p}" for h, p in self.entries))


# ---- metrics ---------------------------------------------------------------------------------


class KVTransferMetrics:
    """Plain counters on the hot path, turned into metric families at scrape time."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine_index: int) -> None:
        self.labels = [model_name, str(engine_index)]
        self.pulls = 0
        self.pulled_tokens = 0
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        self.pulls_served = 0
        self.external_queries = 0
        self.external_hits = 0
        self.by_source = dict.fromkeys(SOURCES, 0)
        self.held_requests = lambda: 0
        #: the engine's holds (bounds, counts by reason); None without an engine
        self.holds: HoldTable | None = None
        registry.register(_KVCollector(self))

    def families(self) -> Iterator[Metric]:
        labels = self.labels
        names = ["model_name", "engine"]
        counters = (
            ("session_backend_kv_pulls", "P/D decode: KV pulls from a prefill instance that succeeded.", self.pulls),
            ("session_backend_kv_pulled_tokens", "P/D decode: prompt tokens (full blocks) pulled from prefill "
             "instances.", self.pulled_tokens),
            ("session_backend_kv_pulls_served", "P/D prefill: held requests whose blocks a decode instance pulled "
             "(then freed).", self.pulls_served),
            ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance "
             "cache sharing, in terms of number of queried tokens.", self.external_queries),
            ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
             "sharing, in terms of number of cached tokens.", self.external_hits),
        )  # fmt: skip
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(labels, value)
            yield c
        failures = CounterMetricFamily(
            "session_backend_kv_pull_failures",
            "P/D decode: KV pulls that failed (the prompt was recomputed locally), by reason.",
            labels=[*names, "reason"],
        )
        for reason, value in self.failures.items():
            failures.add_metric([*labels, reason], value)
        yield failures
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", labels=[*names, "source"]
        )
        for source, value in self.by_source.items():
            by_source.add_metric([*labels, source], value)
        yield by_source
        held = GaugeMetricFamily(
            "session_backend_kv_held_requests",
            "P/D prefill: finished requests whose KV blocks are held for a decode instance to pull.",
            labels=names,
        )
        held.add_metric(labels, float(self.held_requests()))
        yield held
        holds = self.holds
        held_blocks = GaugeMetricFamily(
            "session_backend_kv_held_blocks",
            "P/D prefill: KV blocks held for decode instances to pull.",
            labels=names,
        )
        held_blocks.add_metric(labels, float(holds.num_blocks if holds is not None else 0))
        yield held_blocks
        freed = CounterMetricFamily(
            "session_backend_kv_holds_freed",
            "P/D prefill: holds of KV blocks that ended, by reason (pulled, released by the router, expired, "
            "evicted by the total bound, freed under block pressure, replaced).",
            labels=[*names, "reason"],
        )
        refused = CounterMetricFamily(
            "session_backend_kv_holds_refused",
            "P/D prefill: requests for remote decode whose blocks were not held, by reason.",
            labels=[*names, "reason"],
        )
        if holds is not None:
            for reason, value in holds.freed.items():
                freed.add_metric([*labels, reason], value)
            for reason, value in holds.refused.items():
                refused.add_metric([*labels, reason], value)
        yield freed
        yield refused


class _KVCollector(Collector):
    def __init__(self, metrics: KVTransferMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.families()

    def describe(self) -> Iterator[Metric]:
        return self._metrics.families()


# ---- the transfer agent ---------------------------------------------------------------------


class RemoteLoad:
    """What a decode request got from a remote prefill (kept on its ``GenerationRun``)."""

    __slots__ = ("local_before", "loaded")

    def __init__(self, local_before: int = 0, loaded: int = 0) -> None:
        #: prompt tokens already in this instance's prefix cache before the pull
        self.local_before = local_before
        #: prompt tokens the pull added to the prefix cache
        self.loaded = loaded


class _PullFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class KVTransfer:
    """One backend's P/D agent: serves pulls (prefill, both) and pulls (decode, both)."""

    def __init__(
        self,
        config: EngineConfig,
        engine: "AsyncEngine",
        registry: CollectorRegistry,
        *,
        allow: AllowList | None = None,
        pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.engine = engine
        self.allow = allow if allow is not None else AllowList()
        self.pull_timeout_s = pull_timeout_s
        self.block_size = config.block_size
        self.serves_pulls = config.role in ("prefill", "both")
        self.pulls_enabled = config.role in ("decode", "both")
        self.metrics = KVTransferMetrics(registry, config.model, config.engine_index)
        self.metrics.held_requests = lambda: engine.core.num_held
        self.metrics.holds = engine.core.holds
        self._http: aiohttp.ClientSession | None = None

    @property
    def engine_id(self) -> str:
        return self.engine.core.engine_id

    # -- lifecycle ---------------------------------------------------------------------------
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

    # -- prefill side: advertise and serve ------------------------------------------------------
    def advertise(self, params: dict[str, Any] | None, request: web.Request) -> dict[str, Any] | None:
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

    async def handle_pull(self, request: web.Request) -> web.Response:
        """``POST /internal/kv/pull``: hand the held blocks' content over, then free them."""
        data = await request.read()
        try:
            pull = _pull_request_decoder.decode(data)
        except msgspec.MsgspecError as exc:
            raise BadRequestError(f"not a msgpack KVPullRequest: {exc}") from None
        engine = self.engine
        held = engine.get_held(pull.remote_request_id)
        if held is None:
            raise NotFoundError(
                f"request {pull.remote_request_id!r} holds no KV blocks here (already pulled, expired, aborted or "
                "never prefilled for remote decode); recompute the prompt",
                param="remote_request_id",
            )
        if pull.remote_engine_id != self.engine_id:
            raise KVConflictError(
                f"this is engine {self.engine_id!r}, not {pull.remote_engine_id!r}; the parameters are stale",
                param="remote_engine_id",
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
        engine.release_held(held.request_id)
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
        engine = self.engine
        held = engine.get_held(release.remote_request_id)
        if held is None:
            raise NotFoundError(
                f"request {release.remote_request_id!r} holds no KV blocks here (already pulled, released or "
                "expired); nothing to free",
                param="remote_request_id",
            )
        if release.remote_engine_id != self.engine_id:
            raise KVConflictError(
                f"this is engine {self.engine_id!r}, not {release.remote_engine_id!r}; send the release to the "
                "prefill instance that returned the parameters",
                param="remote_engine_id",
            )
        blocks = [b for item in release.remote_block_ids for b in (item if isinstance(item, list) else (item,))]
        if blocks != held.block_ids:
            raise KVConflictError("remote_block_ids differ from the blocks the request holds; send the "
                                  "kv_transfer_params as the prefill returned them", param="remote_block_ids")
        engine.release_held(held.request_id, "released")
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

    # -- decode side: pull and preload -----------------------------------------------------------
    def wants_pull(self, params: dict[str, Any] | None) -> bool:
        return self.pulls_enabled and params is not None and bool(params.get("do_remote_prefill"))

    async def load_remote(
        self, params: dict[str, Any] | None, prompt: list[int], cache_salt: str | None, request_id: str
    ) -> RemoteLoad | None:
        """For a ``do_remote_prefill`` request: pull the prompt's blocks from the prefill instance
        and put them in the prefix cache. Never raises for a failed pull (recompute instead)."""
        if not self.wants_pull(params):
            return None
        assert params is not None
        m = self.metrics
        m.external_queries += len(prompt)
        try:
            reply = await self._pull(params, prompt, cache_salt)
        except _PullFailed as failed:
            m.failures[failed.reason] += 1
            log.warning("P/D: no KV pulled for %s (%s: %s); recomputing the prompt locally",
                        request_id, failed.reason, failed.detail)
            return None
        bs = self.block_size
        keys = reply.block_hashes
        kv = self.engine.core.kv_cache
        local_before = 0
        for key in keys:
            if kv.cached_block(key) is None:
                break
            local_before += bs
        present = self.engine.preload_blocks(reply.token_ids, cache_salt)
        loaded = max(present - local_before, 0)
        m.pulls += 1
        m.pulled_tokens += len(keys) * bs
        m.external_hits += loaded
        return RemoteLoad(local_before, loaded)

    async def _pull(self, params: dict[str, Any], prompt: list[int], cache_salt: str | None) -> KVPullResponse:
        ref = parse_remote_params(params)
        if ref is None:
            raise _PullFailed(
                "invalid_params",
                "do_remote_prefill needs non-empty remote_block_ids and remote_engine_id, remote_request_id, "
                "remote_host, remote_port",
            )
        if not self.allow.allows(ref.host, ref.port):
            raise _PullFailed("not_allowed", f"{ref.host}:{ref.port} is not allowed ({self.allow.describe()})")
        host = _normalize_host(ref.host)
        url = URL.build(scheme="http", host=host, port=ref.port, path=PULL_PATH)
        payload = _msgpack.encode(
            KVPullRequest(
                remote_request_id=ref.request_id,
                remote_engine_id=ref.engine_id,
                block_ids=ref.block_ids,
                block_size=self.block_size,
                prompt_digest=prompt_digest(prompt, cache_salt),
                requester=self.engine_id,
            )
        )
        timeout = aiohttp.ClientTimeout(total=self.pull_timeout_s)
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
            raise _PullFailed("timeout", f"{where} did not answer within {self.pull_timeout_s:g}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise _PullFailed("unreachable", f"{where}: {exc.__class__.__name__}: {exc}") from None
        if status == 404:
            raise _PullFailed("not_found", f"{where} holds no blocks for {ref.request_id!r} (freed or expired)")
        if status == 409:
            raise _PullFailed("mismatch", f"{where} refused: {_error_message(data)}")
        if status != 200:
            raise _PullFailed("rejected", f"{where} answered {status}: {_error_message(data)}")
        try:
            reply = _pull_response_decoder.decode(data)
        except msgspec.MsgspecError as exc:
            raise _PullFailed("bad_reply", f"{where} sent an unreadable reply: {exc}") from None
        bs = self.block_size
        if reply.block_size != bs or reply.token_ids != prompt or reply.block_hashes != hash_full_blocks(
            reply.token_ids, bs, cache_salt
        ):
            raise _PullFailed("mismatch", f"{where} sent blocks of another prompt or block size")
        return reply

    # -- accounting ------------------------------------------------------------------------------
    def count_prompt(self, prompt_tokens: int, cached_tokens: int, remote: RemoteLoad | None) -> None:
        """One finished request's prompt tokens by source (vLLM's ``prompt_tokens_by_source``)."""
        if prompt_tokens <= 0:
            return
        cached = min(max(cached_tokens, 0), prompt_tokens)
        external = 0
        if remote is not None and remote.loaded:
            external = min(max(cached - remote.local_before, 0), remote.loaded)
        by_source = self.metrics.by_source
        by_source["local_compute"] += prompt_tokens - cached
        by_source["local_cache_hit"] += cached - external
        by_source["external_kv_transfer"] += external


def _error_message(data: bytes) -> str:
    try:
        obj = msgspec.json.decode(data)
        return str(obj["error"]["message"])[:200]
    except Exception:  # any body: only for the log line
        return data[:200].decode("utf-8", "replace")


__all__ = [
    "AllowList",
    "FAILURE_REASONS",
    "KVPullRequest",
    "KVPullResponse",
    "KVReleaseRequest",
    "KVTransfer",
    "KVTransferMetrics",
    "PULL_PATH",
    "RELEASE_PATH",
    "RemoteLoad",
    "RemotePrefill",
    "is_loopback_host",
    "parse_allow_entry",
    "parse_remote_params",
    "prompt_digest",
]
