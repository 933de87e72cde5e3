"""The configuration's schema: msgspec Structs, one per section, with their defaults and bounds.

One schema: the process's own settings and the backend lists at the top level, the rest in
sections (``[upstream]``, ``[front]``, ``[placement]``, ``[sessions]``, ``[health]``, ``[pd]``,
``[admin]``, ``[tokens]``, ``[discovery]``), one Struct each. Closed sets are ``Literal`` types and ranges ``msgspec.Meta``
bounds, so decoding checks them; what spans keys is checked in ``router.config.load``. Every
setting has a default here, so an empty file is a valid configuration for one backend given
with ``--backend``. ``FLAT_KEYS`` maps the flat layout of before (every key at the top level),
still read for one release, to the sections.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec

KiB = 1024
MiB = 1024 * 1024

#: paths never forwarded by the catch-all proxy (each with what is below it): backend internals and
#: vLLM's operator endpoints (dev mode, LoRA loading, profiling, scaling), which are not for clients
DEFAULT_PROXY_DENY = (
    "/internal",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache",
    "/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume", "/is_paused",
    "/collective_rpc", "/server_info", "/abort_requests", "/inference/v1/abort_requests",
    "/kv_event_sources",  # the engine's KV-event socket addresses
    "/start_profile", "/stop_profile", "/scale_elastic_ep", "/is_scaling_elastic_ep",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
)


class BackendConfig(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    name: str = ""
    #: where its engine publishes KV events (its --kv-events-config endpoint; "" = ask its
    #: GET /kv_event_sources); a concrete host there means the engine connects and the router binds it
    kv_events: str = ""
    #: its engine's replay endpoint ("" = none: a gap then resets its index entries)
    kv_replay: str = ""
    #: its engine's topic (engines publishing to one address the router binds need one each)
    kv_topic: str = ""


# ---- value shapes: bounds msgspec checks while decoding; ``extra`` words the error message
#: a rule other than the one derived from the bound ("must be ...")
RULE = "rule"
#: what the bound means, added in parentheses
HINT = "hint"

Seconds = Annotated[float, msgspec.Meta(gt=0)]
SecondsOrZero = Annotated[float, msgspec.Meta(ge=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
UpstreamBytes = Annotated[int, msgspec.Meta(ge=1024, extra={RULE: "must be at least 1024 bytes"})]

PolicyName = Literal["kv_aware", "session", "round_robin", "least_loaded"]
FrontKind = Literal["raw", "aiohttp"]
StampMode = Literal["derive", "mint", "none"]
AccessLogFormat = Literal["off", "text", "json"]
SessionLabel = Literal["hash", "id", "none"]
UpstreamApi = Literal["openai", "tokens"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
DiscoverySource = Literal["static", "kubernetes", "dns"]
#: the pools a [discovery.<pool>] table may name
DISCOVERY_POOLS = ("default", "prefill", "decode", "render")


class UpstreamConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[upstream]``: calls to backends (timeouts, retries) and the bounds on their answers."""

    connect_timeout_s: Seconds = 5.0
    first_byte_timeout_s: Seconds = 30.0
    total_timeout_s: Seconds = 600.0
    retries: Annotated[int, msgspec.Meta(ge=0, extra={HINT: "0 = no retries"})] = 2
    retry_backoff_s: SecondsOrZero = 0.05
    #: a backend response head (status line + headers) larger than this is a 502; the connection is closed
    max_head_bytes: UpstreamBytes = 64 * KiB
    #: a non-streamed backend answer (buffered whole) larger than this is a 502; streams are relayed unbuffered
    max_body_bytes: UpstreamBytes = 64 * MiB
    #: keep-alive connections kept open per backend when idle; a request finding none opens one, and one
    #: released while this many are idle is closed. Below a backend's usual concurrency, connections are
    #: opened and closed all the time (a TCP handshake per request on both sides).
    max_idle_per_host: Annotated[int, msgspec.Meta(ge=0, extra={HINT: "0 = no keep-alive"})] = 256


class FrontConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[front]``: the client side: the HTTP front, request bounds, what is forwarded, the access log."""

    #: raw: the hot POST routes on an asyncio Protocol + httptools, the rest relayed to the aiohttp
    #: app on an internal loopback port; aiohttp: everything served by aiohttp
    kind: FrontKind = "raw"
    max_body_bytes: AtLeastOne = 8 * MiB
    #: a request body must arrive whole within this long after its head (else 408, connection closed)
    body_timeout_s: Seconds = 60.0
    #: open client connections per process; over it a new connection is closed as soon as it is
    #: accepted (and the open-files limit is raised to fit it, as far as the hard limit allows)
    max_connections: AtLeastOne = 10_000
    #: path prefixes the catch-all proxy never forwards (the router answers 404); [] forwards all
    proxy_deny: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_PROXY_DENY))
    #: one line per proxied request on the logger "session_router.access"
    access_log: AccessLogFormat = "off"
    #: the access log's file (appended to); empty = stderr
    access_log_file: str = ""
    #: an idle keep-alive client connection is closed after this long (both fronts)
    keepalive_timeout_s: Seconds = 75.0
    #: a request head (request line, headers, blank line) larger than this gets a 400 and the
    #: connection closes (the raw front; aiohttp's front bounds each line instead)
    max_head_bytes: Annotated[int, msgspec.Meta(ge=1024, extra={RULE: "must be at least 1024 bytes"})] = 256 * KiB
    #: the listening sockets' accept backlog: bursts of new connections must not overflow it
    listen_backlog: AtLeastOne = 1024


class PlacementConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[placement]``: which backend takes a request."""

    #: kv_aware: the lowest predicted time to first token, sessions staying where their KV is;
    #: session: rendezvous hash with bounded loads (the policy before issue 14)
    policy: PolicyName = "kv_aware"
    load_factor: Annotated[float, msgspec.Meta(ge=1, extra={
        HINT: "1 = perfectly even load; the default 1.25 allows 25% over the mean"})] = 1.25
    #: requests of room over the mean a pinned session keeps on its pin before it spills (0 = plain bound)
    sticky_headroom: Annotated[int, msgspec.Meta(ge=0, extra={
        RULE: "must be an integer >= 0",
        HINT: "requests a pinned session may go over the mean; 0 = plain load bound"})] = 2
    #: weight of the backends' scraped running+waiting count in the load signal (0 = own in-flight only)
    reported_load_weight: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: kv_aware: a new session skips a hash choice holding more than this x the mean pinned sessions (0 = off)
    session_balance: Annotated[float, msgspec.Meta(ge=0, extra={
        HINT: "0 = off (the default); else at least 1 (1.05 lets a backend hold 5% more sessions than the mean)"})] = 0.0
    # -- kv_aware (router.placement.kv_aware): the TTFT model's constants, configured or learned
    #: prompt tokens an engine prefills per second (learned per backend when learn = true)
    prefill_tokens_per_s: Annotated[float, msgspec.Meta(gt=0)] = 4000.0
    #: seconds before a first token besides the prompt's prefill: an engine step at least (learned: mean
    #: TTFT less the prefill, at least the mean inter-token latency)
    per_request_step_s: SecondsOrZero = 0.010
    #: seconds each request an engine has waiting adds to a newcomer's wait (learned: e2e / running)
    queued_request_s: SecondsOrZero = 0.1
    #: learn the constants above per backend from its /metrics (false: the configured values only)
    learn: bool = True
    #: a session moves only to a backend predicted clearly faster: ttft(pin) > move_factor * ttft(it) + move_margin_s
    move_factor: Annotated[float, msgspec.Meta(ge=1)] = 1.5
    move_margin_s: SecondsOrZero = 0.005
    #: KV cache usage (0..1) from which a backend is charged for eviction / preemption risk (full at 1)
    kv_pressure_from: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.9
    #: safety net: no backend takes a session's request over max(max_load_factor x mean, mean + sticky_headroom)
    max_load_factor: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    #: text mode: request body bytes per prompt token, to estimate a prompt's size before it is tokenized
    bytes_per_token: Annotated[float, msgspec.Meta(gt=0)] = 4.0
    #: answer every proxied request with X-Session-Router-Decision: <outcome>;cached=<tokens>;wait=<ms>;reason=<why>
    decision_header: bool = False


class SessionsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[sessions]``: session ids (where they come from, how long they live) and their metrics label."""

    stamp: StampMode = "derive"
    #: the header clients send their session id in (and get it back in); upstream it is always X-Session-ID
    header: str = "X-Session-ID"
    ttl_s: Seconds = 3600.0
    max_sessions: AtLeastOne = 100_000
    #: bound on remembered Responses API ids (previous_response_id -> backend)
    max_response_ids: AtLeastOne = 100_000
    metrics_top_k: Annotated[int, msgspec.Meta(ge=0, extra={HINT: "0 = no per-session series"})] = 100
    #: the session label of per-session /metrics series: hash (blake2b-64 of the id, hex) | id | none
    label: SessionLabel = "hash"


class HealthConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[health]``: active checks and passive ejection."""

    interval_s: Seconds = 2.0
    timeout_s: Seconds = 1.0
    #: passive ejection after this many consecutive failures; probed again (half-open) after eject_s
    eject_after_failures: AtLeastOne = 3
    eject_s: SecondsOrZero = 5.0


class PDConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[pd]``: prefill/decode disaggregation."""

    #: on prefill failure fall back to decode-only (true) or answer 502 (false)
    fallback: bool = True
    #: kv_transfer_params in client bodies: stripped before forwarding (false), or forwarded as sent
    #: (true: only for clients that run their own P/D hand-off through this router)
    trust_client_kv_params: bool = False


class AdminConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[admin]``: where the admin API is served and what it may do."""

    #: bearer token for /admin and GET /v1/sessions (also from $SESSION_ROUTER_ADMIN_TOKEN with build_config);
    #: with port = 0 the admin API is on the data port only when this is set
    token: str = ""
    #: serve /admin on its own listener on host (0 = no admin listener: see token)
    port: Annotated[int, msgspec.Meta(ge=0, le=65535, extra={HINT: "0 = no admin listener of its own"})] = 0
    #: address of the admin listener; one that is not loopback needs a token
    host: str = "127.0.0.1"
    #: hosts, host:port and CIDR blocks POST /admin/backends may add ([] = any host); link-local and
    #: cloud metadata addresses only when listed explicitly (router.backend_allow)
    backend_allow: list[str] = []


class TokensConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[tokens]``: which API the backends speak, and for ``"tokens"`` the model the router renders
    and derenders with (DESIGN.md §10: vLLM's "disaggregated everything" coordinator)."""

    #: openai: text in, text out (OpenAI routes forwarded as sent); tokens: the router renders requests
    #: to token ids, the engines take them on /inference/v1/generate, the router derenders the answers
    upstream_api: UpstreamApi = "openai"
    #: the model folder (tokenizer.json, tokenizer_config.json, chat template, generation_config.json,
    #: config.json); required with upstream_api = "tokens"
    model_dir: str = ""
    #: the model name clients send and answers carry; "" = the folder's name (as vLLM's default)
    served_model_name: str = ""
    #: the context length; 0 = config.json's max_position_embeddings (vLLM's --max-model-len)
    max_model_len: Annotated[int, msgspec.Meta(ge=0, extra={HINT: "0 = the model's config.json"})] = 0
    #: "local": rendered in the router process; a list of render server URLs (vLLM's
    #: `vllm launch render`, or `session-backend --role render`): rendered there
    render: str | list[str] = "local"
    #: bound on the per-session incremental-render cache (rendered prompts kept per session)
    prompt_cache_bytes: Annotated[int, msgspec.Meta(ge=0, extra={HINT: "0 = no incremental render"})] = 256 * MiB

    @property
    def enabled(self) -> bool:
        return self.upstream_api == "tokens"

    @property
    def render_urls(self) -> list[str]:
        """The render servers ([] = render locally)."""
        return [] if isinstance(self.render, str) else list(self.render)


class KubernetesDiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[discovery.<pool>.kubernetes]``: the pods a pool's backends are (watched through the API server)."""

    namespace: str = "default"
    #: which pods: a Kubernetes label selector, e.g. "app=vllm,role=decode" (required)
    label_selector: str = ""
    #: the container port's name in the pod spec, e.g. "http" (required)
    port_name: str = ""


class DnsDiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[discovery.<pool>.dns]``: a headless Service's records, re-resolved every ``interval_s``."""

    #: the name to resolve: A/AAAA records with ``port`` set, SRV records with port = 0 (required)
    name: str = ""
    #: the backends' port; 0 = take each backend's port (and host) from the SRV records of ``name``
    port: Annotated[int, msgspec.Meta(ge=0, le=65535, extra={HINT: "0 = the ports of SRV records"})] = 0
    interval_s: Seconds = 5.0
    #: the DNS servers to ask, "host" or "host:port" ([] = the system's, /etc/resolv.conf)
    nameservers: list[str] = []


class PoolDiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[discovery.<pool>]``: where one pool's backends come from."""

    #: static: the configured list (and the admin API) only; kubernetes: the ready pods of a label
    #: selector; dns: the records of a name. Discovered backends join the configured ones.
    source: DiscoverySource = "static"
    kubernetes: KubernetesDiscoveryConfig | None = None
    dns: DnsDiscoveryConfig | None = None


class DiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[discovery]``: backends discovered at runtime, per pool: ``default`` (aggregated mode),
    ``prefill`` and ``decode`` (P/D mode), ``render`` (tokens mode's render servers)."""

    #: the Kubernetes API's credentials: "" = in-cluster (the pod's service account token and CA),
    #: else a kubeconfig file
    kubeconfig: str = ""
    #: the kubeconfig's context ("" = its current-context)
    kubernetes_context: str = ""
    #: waits between retries after an API or DNS error: from backoff_initial_s doubling up to
    #: backoff_max_s, with jitter; what was discovered stays meanwhile
    backoff_initial_s: Seconds = 0.5
    backoff_max_s: Seconds = 30.0
    default: PoolDiscoveryConfig = msgspec.field(default_factory=PoolDiscoveryConfig)
    prefill: PoolDiscoveryConfig = msgspec.field(default_factory=PoolDiscoveryConfig)
    decode: PoolDiscoveryConfig = msgspec.field(default_factory=PoolDiscoveryConfig)
    render: PoolDiscoveryConfig = msgspec.field(default_factory=PoolDiscoveryConfig)

    def pools(self) -> dict[str, PoolDiscoveryConfig]:
        """Pool name -> its discovery, for the pools whose source is not static."""
        return {name: pool for name in DISCOVERY_POOLS
                if (pool := getattr(self, name)).source != "static"}


KVEventsMode = bool | Literal["auto"]


class KVEventsSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[kv_events]``: the router subscribes to the engines' KV events and indexes where each
    session's KV is resident (``router.kv``; placement reads it)."""

    #: "auto": subscribe to backends configured with kv_events or whose GET /kv_event_sources lists a
    #: publisher; true: the same, and a warning for each backend that publishes none; false: no index
    enabled: KVEventsMode = "auto"
    #: bound on indexed blocks over all backends (least recently stored or reused go first); budget
    #: 420 bytes each (router.kv.index.BYTES_PER_BLOCK; 410 measured)
    max_blocks: AtLeastOne = 1_000_000
    #: tokens per KV block prompts are cut into until the engines' first event says (tokens mode)
    block_size: AtLeastOne = 16
    #: how long a replay of missed batches may take before the backend's entries are reset instead
    replay_timeout_s: Seconds = 2.0
    #: placement drains the KV-event sockets before it reads the index, unless they were drained less
    #: than this long ago: a placement sees every batch that arrived this long before it; 0 = at every
    #: placement (nothing wakes the router for a batch: router.kv.service)
    min_read_interval_s: SecondsOrZero = 0.005
    #: while no placement drains them, the sockets are drained this often (replays, resets, /v1/sessions)
    idle_read_interval_s: Seconds = 0.1
    #: how often each backend's GET /kv_event_sources is read again (a changed endpoint re-subscribes)
    sources_refresh_s: Seconds = 30.0


class SharedStateConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[shared_state]`` (or top-level ``shared_state = "redis://…"``, its ``url``): router replicas and
    workers share pin moves and the Responses id -> backend map through one Redis (``router.shared``)."""

    #: redis://[user:password@]host:port/db, rediss://… or unix:///path; "" = no shared state
    url: str = ""
    #: every key and the pub/sub channel start with this (several routers on one Redis: one each)
    key_prefix: str = "session-router:"
    #: a read (a session's pins on first sight, an unknown Responses id) waits at most this long
    read_timeout_s: Seconds = 0.05
    #: one pipelined batch of writes, and a reconnect's PING, may take this long
    write_timeout_s: Seconds = 1.0
    #: writes waiting for the background writer; past it they are dropped (and counted)
    queue_size: AtLeastOne = 10_000
    #: reconnect backoff: from the first, doubling up to the second
    backoff_min_s: Seconds = 0.1
    backoff_max_s: Seconds = 5.0


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration: the process's own settings at the top, then one struct per section."""

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535, extra={HINT: "0 = any free port"})] = 8000
    log_level: LogLevel = "warning"
    #: SO_REUSEPORT worker processes
    workers: AtLeastOne = 1
    drain_timeout_s: SecondsOrZero = 30.0
    #: aggregated mode: the backends
    backends: list[BackendConfig] = []
    #: P/D mode: both lists non-empty
    prefill: list[BackendConfig] = []
    decode: list[BackendConfig] = []
    upstream: UpstreamConfig = msgspec.field(default_factory=UpstreamConfig)
    front: FrontConfig = msgspec.field(default_factory=FrontConfig)
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)
    sessions: SessionsConfig = msgspec.field(default_factory=SessionsConfig)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    pd: PDConfig = msgspec.field(default_factory=PDConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    tokens: TokensConfig = msgspec.field(default_factory=TokensConfig)
    discovery: DiscoveryConfig = msgspec.field(default_factory=DiscoveryConfig)
    kv_events: KVEventsSettings = msgspec.field(default_factory=KVEventsSettings)
    shared_state: SharedStateConfig = msgspec.field(default_factory=SharedStateConfig)

    @property
    def pd_mode(self) -> bool:
        return bool(self.prefill or self.decode or self.discovery.prefill.source != "static"
                    or self.discovery.decode.source != "static")


#: section name -> its struct
SECTIONS: dict[str, type[msgspec.Struct]] = {
    "upstream": UpstreamConfig,
    "front": FrontConfig,
    "placement": PlacementConfig,
    "sessions": SessionsConfig,
    "health": HealthConfig,
    "pd": PDConfig,
    "admin": AdminConfig,
    "tokens": TokensConfig,
    "discovery": DiscoveryConfig,
    "kv_events": KVEventsSettings,
    "shared_state": SharedStateConfig,
}

#: the keys of the flat layout (before sections), still read for one release: flat key -> (section, key)
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "connect_timeout_s": ("upstream", "connect_timeout_s"),
    "first_byte_timeout_s": ("upstream", "first_byte_timeout_s"),
    "total_timeout_s": ("upstream", "total_timeout_s"),
    "retries": ("upstream", "retries"),
    "retry_backoff_s": ("upstream", "retry_backoff_s"),
    "max_upstream_head_bytes": ("upstream", "max_head_bytes"),
    "max_upstream_body_bytes": ("upstream", "max_body_bytes"),
    "front": ("front", "kind"),
    "max_body_bytes": ("front", "max_body_bytes"),
    "body_timeout_s": ("front", "body_timeout_s"),
    "max_connections": ("front", "max_connections"),
    "proxy_deny": ("front", "proxy_deny"),
    "access_log": ("front", "access_log"),
    "access_log_file": ("front", "access_log_file"),
    "policy": ("placement", "policy"),
    "load_factor": ("placement", "load_factor"),
    "sticky_headroom": ("placement", "sticky_headroom"),
    "reported_load_weight": ("placement", "reported_load_weight"),
    "stamp": ("sessions", "stamp"),
    "session_header": ("sessions", "header"),
    "session_ttl_s": ("sessions", "ttl_s"),
    "max_sessions": ("sessions", "max_sessions"),
    "max_response_ids": ("sessions", "max_response_ids"),
    "session_metrics_top_k": ("sessions", "metrics_top_k"),
    "session_label": ("sessions", "label"),
    "health_interval_s": ("health", "interval_s"),
    "health_timeout_s": ("health", "timeout_s"),
    "eject_after_failures": ("health", "eject_after_failures"),
    "eject_s": ("health", "eject_s"),
    "pd_fallback": ("pd", "fallback"),
    "trust_client_kv_params": ("pd", "trust_client_kv_params"),
    "admin_token": ("admin", "token"),
    "admin_port": ("admin", "port"),
    "admin_host": ("admin", "host"),
    "admin_backend_allow": ("admin", "backend_allow"),
}
#: section path -> its flat key
FLAT_NAMES = {f"{section}.{key}": flat for flat, (section, key) in FLAT_KEYS.items()}

POLICIES: tuple[str, ...] = get_args(PolicyName)
FRONTS: tuple[str, ...] = get_args(FrontKind)
STAMPS: tuple[str, ...] = get_args(StampMode)
ACCESS_LOG_FORMATS: tuple[str, ...] = get_args(AccessLogFormat)
SESSION_LABELS: tuple[str, ...] = get_args(SessionLabel)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
UPSTREAM_APIS: tuple[str, ...] = get_args(UpstreamApi)
DISCOVERY_SOURCES: tuple[str, ...] = get_args(DiscoverySource)
