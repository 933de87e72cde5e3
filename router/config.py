"""Router configuration: TOML decoded into msgspec Structs; CLI flags override the file.

One schema: the process's own settings and the backend lists at the top level, the rest in
sections (``[upstream]``, ``[front]``, ``[placement]``, ``[sessions]``, ``[health]``, ``[pd]``,
``[admin]``), one Struct each. Closed sets are ``Literal`` types and ranges ``msgspec.Meta``
bounds, so decoding checks them; what spans keys (the admin listener, the backend lists, the
session header) is checked in ``validate_config``. Every setting has a default here, so an
empty file is a valid configuration for one backend given with ``--backend``. Unknown keys,
wrong types and bad values stop start-up with a ``ConfigError`` that names the key as the user
gave it (the section path, the flag, or the flat key).

The flat layout of before (every key at the top level) is read for one release: ``sectioned``
moves each flat key into its section (``FLAT_KEYS``) and a warning names where it goes now.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import logging
import math
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, Literal, NoReturn, get_args, get_origin, get_type_hints

import msgspec

from contract.errors import ConfigError
from router import __version__
from router.backend_allow import literal_address, normalize_host, parse_entry
from router.membership import normalize_url
from router.upstream import HOP_BY_HOP

logger = logging.getLogger("router.config")

KiB = 1024
MiB = 1024 * 1024

#: paths never forwarded by the catch-all proxy (each with what is below it): backend internals and
#: vLLM's operator endpoints (dev mode, LoRA loading, profiling, scaling), which are not for clients
DEFAULT_PROXY_DENY = (
    "/internal",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache",
    "/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume", "/is_paused",
    "/collective_rpc", "/server_info", "/abort_requests", "/inference/v1/abort_requests",
    "/start_profile", "/stop_profile", "/scale_elastic_ep", "/is_scaling_elastic_ep",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
)


class BackendConfig(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    name: str = ""


# ---- value shapes: bounds msgspec checks while decoding; ``extra`` words the error message
#: a rule other than the one derived from the bound ("must be ...")
_RULE = "rule"
#: what the bound means, added in parentheses
_HINT = "hint"

Seconds = Annotated[float, msgspec.Meta(gt=0)]
SecondsOrZero = Annotated[float, msgspec.Meta(ge=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
UpstreamBytes = Annotated[int, msgspec.Meta(ge=1024, extra={_RULE: "must be at least 1024 bytes"})]

PolicyName = Literal["session", "round_robin", "least_loaded"]
FrontKind = Literal["raw", "aiohttp"]
StampMode = Literal["derive", "mint", "none"]
AccessLogFormat = Literal["off", "text", "json"]
SessionLabel = Literal["hash", "id", "none"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class UpstreamConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[upstream]``: calls to backends (timeouts, retries) and the bounds on their answers."""

    connect_timeout_s: Seconds = 5.0
    first_byte_timeout_s: Seconds = 30.0
    total_timeout_s: Seconds = 600.0
    retries: Annotated[int, msgspec.Meta(ge=0, extra={_HINT: "0 = no retries"})] = 2
    retry_backoff_s: SecondsOrZero = 0.05
    #: a backend response head (status line + headers) larger than this is a 502; the connection is closed
    max_head_bytes: UpstreamBytes = 64 * KiB
    #: a non-streamed backend answer (buffered whole) larger than this is a 502; streams are relayed unbuffered
    max_body_bytes: UpstreamBytes = 64 * MiB


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


class PlacementConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[placement]``: which backend takes a request."""

    policy: PolicyName = "session"
    load_factor: Annotated[float, msgspec.Meta(ge=1, extra={
        _HINT: "1 = perfectly even load; the default 1.25 allows 25% over the mean"})] = 1.25
    #: requests of room over the mean a pinned session keeps on its pin before it spills (0 = plain bound)
    sticky_headroom: Annotated[int, msgspec.Meta(ge=0, extra={
        _RULE: "must be an integer >= 0",
        _HINT: "requests a pinned session may go over the mean; 0 = plain load bound"})] = 2
    #: weight of the backends' scraped running+waiting count in the load signal (0 = own in-flight only)
    reported_load_weight: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class SessionsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[sessions]``: session ids (where they come from, how long they live) and their metrics label."""

    stamp: StampMode = "derive"
    #: the header clients send their session id in (and get it back in); upstream it is always X-Session-ID
    header: str = "X-Session-ID"
    ttl_s: Seconds = 3600.0
    max_sessions: AtLeastOne = 100_000
    #: bound on remembered Responses API ids (previous_response_id -> backend)
    max_response_ids: AtLeastOne = 100_000
    metrics_top_k: Annotated[int, msgspec.Meta(ge=0, extra={_HINT: "0 = no per-session series"})] = 100
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
    port: Annotated[int, msgspec.Meta(ge=0, le=65535, extra={_HINT: "0 = no admin listener of its own"})] = 0
    #: address of the admin listener; one that is not loopback needs a token
    host: str = "127.0.0.1"
    #: hosts, host:port and CIDR blocks POST /admin/backends may add ([] = any host); link-local and
    #: cloud metadata addresses only when listed explicitly (router.backend_allow)
    backend_allow: list[str] = []


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration: the process's own settings at the top, then one struct per section."""

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535, extra={_HINT: "0 = any free port"})] = 8000
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

    @property
    def pd_mode(self) -> bool:
        return bool(self.prefill or self.decode)


#: section name -> its struct
SECTIONS: dict[str, type[msgspec.Struct]] = {
    "upstream": UpstreamConfig,
    "front": FrontConfig,
    "placement": PlacementConfig,
    "sessions": SessionsConfig,
    "health": HealthConfig,
    "pd": PDConfig,
    "admin": AdminConfig,
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
_FLAT_NAMES = {f"{section}.{key}": flat for flat, (section, key) in FLAT_KEYS.items()}


# --------------------------------------------------------------------------------------------
# Loading: TOML file -> RouterConfig, then CLI flags on top, then one validation pass.
# --------------------------------------------------------------------------------------------

POLICIES: tuple[str, ...] = get_args(PolicyName)
FRONTS: tuple[str, ...] = get_args(FrontKind)
STAMPS: tuple[str, ...] = get_args(StampMode)
ACCESS_LOG_FORMATS: tuple[str, ...] = get_args(AccessLogFormat)
SESSION_LABELS: tuple[str, ...] = get_args(SessionLabel)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
#: headers the router reads or sets for itself: never a session header
_NOT_SESSION_HEADERS = HOP_BY_HOP | {"host", "content-length", "content-type", "expect", "x-request-id"}
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_POOL_FIELDS = ("backends", "prefill", "decode")
_NO_BACKEND = "give at least one backend with --backend or in the config file's [[backends]]"
ADMIN_TOKEN_ENV = "SESSION_ROUTER_ADMIN_TOKEN"

# "Expected `float`, got `str` - at `$.placement.load_factor`" -> message, path
_MSGSPEC_ERROR = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`$")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<key>[^`]*)`$")
_BOUND = re.compile(r"^Expected `\w+` [<>]=? ")
_ENUM = re.compile(r"^Invalid enum value ")

#: how the user gave a setting, by its dotted path (``placement.load_factor``): a flag, an
#: environment variable or a flat key; messages name that rather than the path
Labels = dict[str, str]


def load_config(path: str | None) -> RouterConfig:
    """Read and validate a configuration file (``None``: the defaults alone).

    Raises ``ConfigError`` naming the key for an unknown key, a wrong type, a bad value or URL,
    and when the result names no backend. Flat (pre-section) keys are read, each with a
    deprecation warning on the logger ``router.config``.
    """
    data, labels = sectioned(_read_toml(path) if path is not None else {})
    config = validate_config(_decode(data, labels), labels=labels)
    warn_flat_keys(labels)
    return config


def config_from_mapping(data: Mapping[str, Any]) -> RouterConfig:
    """Decode and validate already-parsed TOML (e.g. a dict written in a test)."""
    nested, labels = sectioned(data)
    config = validate_config(_decode(nested, labels), labels=labels)
    warn_flat_keys(labels)
    return config


def build_config(argv: list[str]) -> RouterConfig:
    """Parse command-line arguments: ``--config FILE`` first, then the other flags override it.

    ``--backend`` replaces the file's ``backends`` (and clears its ``prefill``/``decode``);
    ``--prefill``/``--decode`` replace the file's list of the same name (and clear its
    ``backends``). ``admin.token`` comes from ``--admin-token``, else from the environment variable
    ``SESSION_ROUTER_ADMIN_TOKEN`` when set and non-empty, else from the file.
    Raises ``ConfigError`` for bad flags and for every error ``load_config`` finds.
    """
    args = _parser().parse_args(argv)
    data, labels = sectioned(_read_toml(args.config) if args.config is not None else {})
    flat = dict(labels)
    for dest, (path, flag) in _SCALAR_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            _set(data, path, value)
            labels[path] = flag
    if args.admin_token is None and os.environ.get(ADMIN_TOKEN_ENV):
        _set(data, "admin.token", os.environ[ADMIN_TOKEN_ENV])
        labels["admin.token"] = ADMIN_TOKEN_ENV
    if args.backend and (args.prefill or args.decode):
        raise ConfigError(
            "--backend (aggregated mode) cannot be combined with --prefill/--decode (P/D mode); "
            "use one or the other"
        )
    if args.backend:
        data.update(backends=_backend_list(args.backend, "--backend"), prefill=[], decode=[])
        labels["backends"] = "--backend"
    if args.prefill or args.decode:
        data["backends"] = []
    if args.prefill:
        data["prefill"] = _backend_list(args.prefill, "--prefill")
        labels["prefill"] = "--prefill"
    if args.decode:
        data["decode"] = _backend_list(args.decode, "--decode")
        labels["decode"] = "--decode"
    config = validate_config(_decode(data, labels), labels=labels)
    warn_flat_keys(flat)
    return config


def sectioned(data: Mapping[str, Any]) -> tuple[dict[str, Any], Labels]:
    """Move the flat layout's keys into their sections: the result to decode, and for each moved
    key its section path -> the flat key (so that messages name the key as the file wrote it).

    Raises ``ConfigError`` when a file sets a key both ways (flat and in its section).
    """
    nested = {key: (dict(value) if key in SECTIONS and isinstance(value, Mapping) else value)
              for key, value in data.items()}
    moved: Labels = {}
    for flat, (section, key) in FLAT_KEYS.items():
        if flat not in data or (flat in SECTIONS and isinstance(data[flat], Mapping)):
            continue
        value = nested.pop(flat)
        table = nested.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{section}: expected a [{section}] table, got {type(table).__name__}")
        if key in table:
            raise ConfigError(
                f"{flat} and [{section}] {key} are both set; keep only [{section}] {key} "
                f"({flat} at top level is its deprecated spelling)"
            )
        table[key] = value
        moved[f"{section}.{key}"] = flat
    return nested, moved


def warn_flat_keys(flat_keys: Mapping[str, str]) -> None:
    """Log, once per key, that a flat key is deprecated and where it goes now (after the
    configuration proved valid, so that an error is the only thing a failed start prints)."""
    for path, flat in flat_keys.items():
        section, _, key = path.partition(".")
        if FLAT_KEYS.get(flat) == (section, key):
            logger.warning("%s is deprecated at top level; write it as [%s] %s (flat keys are read until the "
                           "next release)", flat, section, key)


def validate_config(config: RouterConfig, *, labels: Mapping[str, str] | None = None) -> RouterConfig:
    """Check every value's range (the schema's bounds) and what spans keys: the admin listener,
    the session header, the deny list and the backend lists; return a copy with normalized URLs.

    ``labels`` maps a setting's path to how the user gave it (e.g. ``"port": "--port"``), so that
    messages name the flag rather than the file key when a flag set the value.
    """
    names = labels or {}
    # a file in the flat layout gets the flat names in messages about keys it did not set either
    flat_file = any(FLAT_KEYS.get(name) == tuple(path.split(".", 1)) for path, name in names.items())

    def key(path: str) -> str:
        return names.get(path) or (_FLAT_NAMES.get(path, path) if flat_file else path)

    def check(ok: bool, path: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{key(path)}: {message}")

    config = _decode(msgspec.to_builtins(config), names)  # the bounds, for a config built in code
    check(bool(config.host.strip()), "host", "must not be empty; use 127.0.0.1 for loopback or 0.0.0.0 for all")
    check(
        config.admin.port == 0 or config.admin.port != config.port,
        "admin.port",
        f"must differ from port ({config.port}); use 0 to serve /admin on the data port "
        f"(with {key('admin.token')})",
    )
    _validate_admin(config.admin, key)
    for index, path in enumerate(config.front.proxy_deny):
        check(path.startswith("/"), "front.proxy_deny", f"entry {index} ({path!r}) must be a path starting with '/'")
    header = config.sessions.header
    check(
        _HEADER_NAME.fullmatch(header) is not None,
        "sessions.header",
        f"must be an HTTP header name (letters, digits, '-'), got {header!r}",
    )
    check(
        header.lower() not in _NOT_SESSION_HEADERS,
        "sessions.header",
        f"{header} is a header the router reads or sets itself; pick another name (the default is X-Session-ID)",
    )

    if config.backends and (config.prefill or config.decode):
        raise ConfigError(
            f"{key('backends')}: give either backends (aggregated mode) or prefill/decode (P/D mode), not both"
        )
    if config.prefill and not config.decode:
        raise ConfigError(f"{key('decode')}: P/D mode needs at least one decode backend")
    if not (config.backends or config.decode):
        raise ConfigError(_NO_BACKEND)
    pools = {name: _validate_pool(getattr(config, name), name, names.get(name)) for name in _POOL_FIELDS}
    return msgspec.structs.replace(config, **pools)


def _validate_admin(admin: AdminConfig, key: Callable[[str], str]) -> None:
    """The admin section: the token's characters, the allow-list's entries, and no admin API open
    to the network (an admin listener off loopback without a token)."""
    token = admin.token
    if token and not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise ConfigError(f"{key('admin.token')}: use visible ASCII characters only (no spaces or control "
                          f"characters: it is sent in an 'Authorization: Bearer' header)")
    check_host = admin.host.strip()
    if not check_host:
        raise ConfigError(f"{key('admin.host')}: must not be empty; use 127.0.0.1 (loopback, the default)")
    if admin.port and not token and not is_loopback_host(check_host):
        raise ConfigError(
            f"{key('admin.host')}: the admin API on {check_host}:{admin.port} would be open to the network "
            f"({key('admin.token')} is empty): set {key('admin.token')} (or {ADMIN_TOKEN_ENV}), or keep "
            f"{key('admin.host')} on a loopback address such as 127.0.0.1"
        )
    for index, entry in enumerate(admin.backend_allow):
        try:
            parse_entry(entry)
        except ValueError as exc:
            raise ConfigError(f"{key('admin.backend_allow')}[{index}]: {exc}") from None


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1, IPv4-mapped 127.x); names are not resolved."""
    host = normalize_host(host)
    if host == "localhost":
        return True
    address = literal_address(host)
    return address is not None and address.is_loopback


def _validate_pool(entries: list[BackendConfig], field_name: str, flag: str | None) -> list[BackendConfig]:
    seen_urls: dict[str, int] = {}
    seen_names: dict[str, int] = {}
    result: list[BackendConfig] = []
    for index, entry in enumerate(entries):
        where = flag if flag is not None else f"{field_name}[{index}].url"
        try:
            url = normalize_url(entry.url)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc.message}") from None
        if url in seen_urls:
            raise ConfigError(
                f"{where}: {url} is listed twice in {field_name} (also entry {seen_urls[url]}); list each backend once"
            )
        seen_urls[url] = index
        name = entry.name or url
        if name in seen_names:
            name_where = flag if flag is not None else f"{field_name}[{index}].name"
            raise ConfigError(
                f"{name_where}: backend name {name!r} is used twice in {field_name} "
                f"(also entry {seen_names[name]}); names must be unique within a pool"
            )
        seen_names[name] = index
        result.append(BackendConfig(url=url, name=entry.name))
    return result


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc.strerror or exc}") from None


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    """Set ``section.key`` (or a top-level key) in decoded-TOML ``data``; a section that is not a
    table is left for the decoder to reject."""
    section, _, key = path.rpartition(".")
    if not section:
        data[key] = value
        return
    table = data.setdefault(section, {})
    if isinstance(table, dict):
        table[key] = value


def _lookup(data: Mapping[str, Any], path: str) -> Any:
    value: Any = data
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _decode(data: Mapping[str, Any], labels: Mapping[str, str]) -> RouterConfig:
    """Decode a (sectioned) mapping into ``RouterConfig``: types, closed sets and bounds."""
    data = dict(data)
    if isinstance(data.get("log_level"), str):
        data["log_level"] = data["log_level"].lower()
    for path, value in _scalars(data):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{labels.get(path, path)}: must be a finite number, got {value}")
    try:
        return msgspec.convert(data, RouterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(_translate(str(exc), data, labels)) from None


def _scalars(data: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of the top-level values and of each section's values."""
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, Mapping):
            for inner, item in value.items():
                yield f"{key}.{inner}", item
        else:
            yield str(key), value


@functools.cache
def _hints(struct: type[msgspec.Struct]) -> dict[str, Any]:
    return get_type_hints(struct, include_extras=True)


def _field_type(path: str) -> tuple[str, Any]:
    """The field's name and annotated type at a settings path (``None`` when it is not one)."""
    section, _, name = path.rpartition(".")
    struct = SECTIONS.get(section) if section else RouterConfig
    if struct is None:
        return name, None
    return name, _hints(struct).get(name)


def _bound_message(name: str, annotation: Any, value: Any) -> str | None:
    """"must be at least 1 (hint), got 0" from a field's ``msgspec.Meta``."""
    metas = [m for m in get_args(annotation)[1:] if isinstance(m, msgspec.Meta)]
    if get_origin(annotation) is not Annotated or not metas:
        return None
    meta = metas[0]
    extra = meta.extra or {}
    seconds = name.endswith("_s")
    rule = extra.get(_RULE)
    if rule is None:
        if meta.ge is not None and meta.le is not None:
            rule = f"must be {meta.ge}..{meta.le}"
        elif meta.gt == 0:
            rule = "must be a positive number of seconds" if seconds else "must be a positive number"
        elif meta.ge == 0:
            rule = "must be >= 0 seconds" if seconds else "must be >= 0"
        elif meta.ge is not None:
            rule = f"must be at least {meta.ge:g}"
        else:
            return None
    hint = f" ({extra[_HINT]})" if _HINT in extra else ""
    return f"{rule}{hint}, got {value}"


def _translate(error: str, data: Mapping[str, Any], labels: Mapping[str, str]) -> str:
    """Turn msgspec's ``Expected `float`, got `str` - at `$.placement.load_factor``` into a key-first
    message naming the key as the user gave it (flag, flat key or section path)."""
    match = _MSGSPEC_ERROR.match(error)
    assert match is not None  # the pattern matches any string
    message = match["message"]
    path = (match["path"] or "").lstrip(".")
    where = labels.get(path, path)
    unknown = _UNKNOWN_FIELD.match(message)
    missing = _MISSING_FIELD.match(message)
    name, annotation = _field_type(path)
    if unknown:
        # characters of msgspec's path syntax, escaped so that no message looks like one
        key = unknown["key"].replace("$", "\\u0024").replace("`", "\\u0060")
        if not path:
            known = [f.name for f in msgspec.structs.fields(RouterConfig)] + list(FLAT_KEYS)
        elif path in SECTIONS:
            known = [f.name for f in msgspec.structs.fields(SECTIONS[path])]
        else:
            known = [f.name for f in msgspec.structs.fields(BackendConfig)]
        hint = difflib.get_close_matches(key, known, n=1)
        text = f"unknown key {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
    elif missing:
        text = f"missing required key {missing['key']!r}"
    elif _ENUM.match(message) and get_origin(annotation) is Literal:
        choices = ", ".join(get_args(annotation))
        text = f"must be one of {choices}, got {_lookup(data, path)!r}"
    elif _BOUND.match(message) and (bound := _bound_message(name, annotation, _lookup(data, path))):
        text = bound
    else:
        text = message.replace("`", "")
        text = text[:1].lower() + text[1:]
        if path in _POOL_FIELDS and message.startswith("Expected `array`"):
            text += f"; write each backend as its own [[{path}]] table with a url key"
        elif path in SECTIONS and message.startswith("Expected `object`"):
            text += f"; write it as a [{path}] table"
    return f"{where}: {text}" if where else text


def _backend_list(urls: list[str], flag: str) -> list[BackendConfig]:
    """The URLs of a repeatable flag; a comma-joined value gets the flags to write instead."""
    for url in urls:
        parts = [part.strip() for part in url.split(",") if part.strip()]
        if len(parts) > 1:
            instead = " ".join(f"{flag} {part}" for part in parts)
            raise ConfigError(
                f"{flag}: {url!r} names {len(parts)} backends; give each backend its own {flag} flag: {instead}"
            )
    return [BackendConfig(url=url) for url in urls]


#: argparse destination -> (the setting's path, the flag), for flags that set one setting
_SCALAR_FLAGS = {
    "host": ("host", "--host"),
    "port": ("port", "--port"),
    "policy": ("placement.policy", "--policy"),
    "log_level": ("log_level", "--log-level"),
    "stamp": ("sessions.stamp", "--stamp"),
    "load_factor": ("placement.load_factor", "--load-factor"),
    "admin_token": ("admin.token", "--admin-token"),
    "workers": ("workers", "--workers"),
    "front": ("front.kind", "--front"),
    "access_log": ("front.access_log", "--access-log"),
    "access_log_file": ("front.access_log_file", "--access-log-file"),
    "session_header": ("sessions.header", "--session-header"),
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises ``ConfigError`` instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see --help)")


def _parser() -> _Parser:
    parser = _Parser(
        prog="session-router",
        description="Session-aware router for vLLM-compatible inference backends. "
        "Settings come from --config FILE (TOML; see config/router.toml); flags override it.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000; 0 = any free port)")
    parser.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        default=[],
        help="backend base URL, e.g. http://127.0.0.1:8100 (repeatable; replaces the file's backends)",
    )
    parser.add_argument(
        "--prefill", action="append", metavar="URL", default=[], help="P/D mode: prefill backend URL (repeatable)"
    )
    parser.add_argument(
        "--decode", action="append", metavar="URL", default=[], help="P/D mode: decode backend URL (repeatable)"
    )
    parser.add_argument("--policy", choices=POLICIES, help="placement policy (default session)")
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, help="log level (default warning)")
    parser.add_argument(
        "--stamp", choices=STAMPS, help="session id for requests without one: derive (then mint), mint or none"
    )
    parser.add_argument("--load-factor", type=float, metavar="C", help="load bound factor c >= 1 (default 1.25)")
    parser.add_argument("--admin-token", metavar="TOKEN",
                        help=f"bearer token required by /admin and GET /v1/sessions (default ${ADMIN_TOKEN_ENV})")
    parser.add_argument(
        "--workers", type=int, metavar="N", help="SO_REUSEPORT worker processes sharing the port (default 1)"
    )
    parser.add_argument(
        "--front", choices=FRONTS,
        help="HTTP front: raw (the proxied POST routes on asyncio + httptools, the rest relayed to "
        "aiohttp; the default) or aiohttp (everything on aiohttp)",
    )
    parser.add_argument(
        "--access-log", choices=ACCESS_LOG_FORMATS,
        help="one line per proxied request on the logger session_router.access: off (the default), text or json",
    )
    parser.add_argument("--access-log-file", metavar="FILE", help="append the access log to FILE (default stderr)")
    parser.add_argument(
        "--session-header", metavar="NAME",
        help="header clients send their session id in (default X-Session-ID); it is echoed under that name and "
        "forwarded to backends as X-Session-ID",
    )
    return parser
