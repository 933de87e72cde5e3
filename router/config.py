"""Router configuration: TOML decoded into msgspec Structs; CLI flags override the file.

Every setting has a default here, so an empty file is a valid configuration for one backend
given with ``--backend``. Unknown keys, wrong types and bad URLs stop start-up with a
``ConfigError`` that names the key.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import msgspec

from contract.errors import ConfigError
from router import __version__
from router.backend_allow import literal_address, normalize_host, parse_entry
from router.pool import normalize_url
from router.upstream import HOP_BY_HOP

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


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "warning"
    #: session | round_robin | least_loaded
    policy: str = "session"
    #: aggregated mode: the backends
    backends: list[BackendConfig] = []
    #: P/D mode: both lists non-empty
    prefill: list[BackendConfig] = []
    decode: list[BackendConfig] = []
    #: derive | mint | none
    stamp: str = "derive"
    load_factor: float = 1.25
    #: requests of room over the mean a pinned session keeps on its pin before it spills (0 = plain bound)
    sticky_headroom: int = 2
    #: weight of the backends' scraped running+waiting count in the load signal (0 = own in-flight only)
    reported_load_weight: float = 0.0
    session_ttl_s: float = 3600.0
    max_sessions: int = 100_000
    session_metrics_top_k: int = 100
    max_body_bytes: int = 8 * MiB
    #: a request body must arrive whole within this long after its head (else 408, connection closed)
    body_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 30.0
    total_timeout_s: float = 600.0
    retries: int = 2
    retry_backoff_s: float = 0.05
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    #: passive ejection after this many consecutive failures; probed again (half-open) after eject_s
    eject_after_failures: int = 3
    eject_s: float = 5.0
    #: P/D: on prefill failure fall back to decode-only (true) or answer 502 (false)
    pd_fallback: bool = True
    #: bearer token for /admin and GET /v1/sessions (also from $SESSION_ROUTER_ADMIN_TOKEN with build_config);
    #: with admin_port = 0 the admin API is on the data port only when this is set
    admin_token: str = ""
    #: serve /admin on its own listener on admin_host (0 = no admin listener: see admin_token)
    admin_port: int = 0
    drain_timeout_s: float = 30.0
    #: SO_REUSEPORT worker processes
    workers: int = 1
    #: raw: the hot POST routes on an asyncio Protocol + httptools, the rest relayed to the aiohttp
    #: app on an internal loopback port; aiohttp: everything served by aiohttp
    front: str = "raw"
    #: bound on remembered Responses API ids (previous_response_id -> backend)
    max_response_ids: int = 100_000
    #: kv_transfer_params in client bodies: stripped before forwarding (false), or forwarded as sent
    #: (true: only for clients that run their own P/D hand-off through this router)
    trust_client_kv_params: bool = False

    # ---- admin API reach and session privacy (router.admin, router.backend_allow, router.metrics)
    #: address of the admin listener (admin_port); one that is not loopback needs admin_token
    admin_host: str = "127.0.0.1"
    #: hosts, host:port and CIDR blocks POST /admin/backends may add ([] = any host); link-local and
    #: cloud metadata addresses only when listed explicitly (router.backend_allow)
    admin_backend_allow: list[str] = []
    #: the session label of per-session /metrics series: hash (blake2b-64 of the id, hex) | id | none
    session_label: str = "hash"

    # -- routes the router does not name (issue 11, item 20) --
    #: path prefixes the catch-all proxy never forwards (the router answers 404); [] forwards all
    proxy_deny: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_PROXY_DENY))

    # -- backends' answers, the access log and the session header's name
    #: a backend response head (status line + headers) larger than this is a 502; the connection is closed
    max_upstream_head_bytes: int = 64 * KiB
    #: a non-streamed backend answer (buffered whole) larger than this is a 502; streams are relayed unbuffered
    max_upstream_body_bytes: int = 64 * MiB
    #: off | text | json: one line per proxied request on the logger "session_router.access"
    access_log: str = "off"
    #: the access log's file (appended to); empty = stderr
    access_log_file: str = ""
    #: the header clients send their session id in (and get it back in); upstream it is always X-Session-ID
    session_header: str = "X-Session-ID"

    # ---- connection bound (issue 11, item 14)
    #: open client connections per process; over it a new connection is closed as soon as it is
    #: accepted (and the open-files limit is raised to fit it, as far as the hard limit allows)
    max_connections: int = 10_000

    @property
    def pd_mode(self) -> bool:
        return bool(self.prefill or self.decode)


# --------------------------------------------------------------------------------------------
# Loading: TOML file -> RouterConfig, then CLI flags on top, then one validation pass.
# --------------------------------------------------------------------------------------------

POLICIES = ("session", "round_robin", "least_loaded")
FRONTS = ("raw", "aiohttp")
STAMPS = ("derive", "mint", "none")
ACCESS_LOG_FORMATS = ("off", "text", "json")
#: headers the router reads or sets for itself: never a session header
_NOT_SESSION_HEADERS = HOP_BY_HOP | {"host", "content-length", "content-type", "expect", "x-request-id"}
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_POOL_FIELDS = ("backends", "prefill", "decode")
_NO_BACKEND = "give at least one backend with --backend or in the config file's [[backends]]"

# "Expected `float`, got `str` - at `$.load_factor`" -> message, path
_MSGSPEC_ERROR = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`$")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<key>[^`]*)`$")


def load_config(path: str | None) -> RouterConfig:
    """Read and validate a configuration file (``None``: the defaults alone).

    Raises ``ConfigError`` naming the key for an unknown key, a wrong type, a bad value or URL,
    and when the result names no backend.
    """
    return validate_config(_decode(_read_toml(path) if path is not None else {}))


def config_from_mapping(data: Mapping[str, Any]) -> RouterConfig:
    """Decode and validate already-parsed TOML (e.g. a dict written in a test)."""
    return validate_config(_decode(data))


def build_config(argv: list[str]) -> RouterConfig:
    """Parse command-line arguments: ``--config FILE`` first, then the other flags override it.

    ``--backend`` replaces the file's ``backends`` (and clears its ``prefill``/``decode``);
    ``--prefill``/``--decode`` replace the file's list of the same name (and clear its
    ``backends``). ``admin_token`` comes from ``--admin-token``, else from the environment variable
    ``SESSION_ROUTER_ADMIN_TOKEN`` when set and non-empty, else from the file.
    Raises ``ConfigError`` for bad flags and for every error ``load_config`` finds.
    """
    args = _parser().parse_args(argv)
    config = _decode(_read_toml(args.config) if args.config is not None else {})
    overrides: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for field_name, flag in _SCALAR_FLAGS.items():
        value = getattr(args, field_name)
        if value is not None:
            overrides[field_name] = value
            labels[field_name] = flag
    if "admin_token" not in overrides and os.environ.get(ADMIN_TOKEN_ENV):
        overrides["admin_token"] = os.environ[ADMIN_TOKEN_ENV]
        labels["admin_token"] = ADMIN_TOKEN_ENV
    if args.backend and (args.prefill or args.decode):
        raise ConfigError(
            "--backend (aggregated mode) cannot be combined with --prefill/--decode (P/D mode); "
            "use one or the other"
        )
    if args.backend:
        overrides.update(backends=_backend_list(args.backend, "--backend"), prefill=[], decode=[])
        labels["backends"] = "--backend"
    if args.prefill or args.decode:
        overrides["backends"] = []
    if args.prefill:
        overrides["prefill"] = _backend_list(args.prefill, "--prefill")
        labels["prefill"] = "--prefill"
    if args.decode:
        overrides["decode"] = _backend_list(args.decode, "--decode")
        labels["decode"] = "--decode"
    if overrides:
        config = msgspec.structs.replace(config, **overrides)
    return validate_config(config, labels=labels)


def validate_config(config: RouterConfig, *, labels: Mapping[str, str] | None = None) -> RouterConfig:
    """Check every value's range and the backend lists; return a copy with normalized URLs.

    ``labels`` maps a field name to how the user gave it (e.g. ``"port": "--port"``), so that
    messages name the flag rather than the file key when a flag set the value.
    """
    names = labels or {}

    def key(field_name: str) -> str:
        return names.get(field_name, field_name)

    def check(ok: bool, field_name: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{key(field_name)}: {message}")

    for field in msgspec.structs.fields(RouterConfig):
        value = getattr(config, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key(field.name)}: must be a finite number, got {value}")

    check(bool(config.host.strip()), "host", "must not be empty; use 127.0.0.1 for loopback or 0.0.0.0 for all")
    check(0 <= config.port <= 65535, "port", f"must be 0..65535 (0 = any free port), got {config.port}")
    check(
        0 <= config.admin_port <= 65535,
        "admin_port",
        f"must be 0..65535 (0 = no admin listener of its own), got {config.admin_port}",
    )
    check(
        config.admin_port == 0 or config.admin_port != config.port,
        "admin_port",
        f"must differ from port ({config.port}); use 0 to serve /admin on the data port (with admin_token)",
    )
    _validate_admin(config, key)
    log_level = config.log_level.lower()
    check(log_level in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {config.log_level!r}")
    check(config.policy in POLICIES, "policy", f"must be one of {', '.join(POLICIES)}, got {config.policy!r}")
    check(config.stamp in STAMPS, "stamp", f"must be one of {', '.join(STAMPS)}, got {config.stamp!r}")
    check(config.front in FRONTS, "front", f"must be one of {', '.join(FRONTS)}, got {config.front!r}")
    check(
        config.load_factor >= 1,
        "load_factor",
        f"must be at least 1 (1 = perfectly even load; the default 1.25 allows 25% over the mean), "
        f"got {config.load_factor}",
    )
    check(
        config.sticky_headroom >= 0,
        "sticky_headroom",
        f"must be an integer >= 0 (requests a pinned session may go over the mean; 0 = plain load bound), "
        f"got {config.sticky_headroom}",
    )
    check(config.reported_load_weight >= 0, "reported_load_weight", f"must be >= 0, got {config.reported_load_weight}")
    for name in (
        "session_ttl_s",
        "connect_timeout_s",
        "first_byte_timeout_s",
        "total_timeout_s",
        "health_interval_s",
        "health_timeout_s",
        "body_timeout_s",
    ):
        value = getattr(config, name)
        check(value > 0, name, f"must be a positive number of seconds, got {value}")
    for name in ("retry_backoff_s", "eject_s", "drain_timeout_s"):
        value = getattr(config, name)
        check(value >= 0, name, f"must be >= 0 seconds, got {value}")
    check(config.retries >= 0, "retries", f"must be >= 0 (0 = no retries), got {config.retries}")
    for name in ("max_sessions", "max_body_bytes", "eject_after_failures", "workers", "max_response_ids",
                 "max_connections"):
        value = getattr(config, name)
        check(value >= 1, name, f"must be at least 1, got {value}")
    check(
        config.session_metrics_top_k >= 0,
        "session_metrics_top_k",
        f"must be >= 0 (0 = no per-session series), got {config.session_metrics_top_k}",
    )

    for index, path in enumerate(config.proxy_deny):
        check(path.startswith("/"), "proxy_deny", f"entry {index} ({path!r}) must be a path starting with '/'")

    for name in ("max_upstream_head_bytes", "max_upstream_body_bytes"):
        value = getattr(config, name)
        check(value >= 1024, name, f"must be at least 1024 bytes, got {value}")
    check(
        config.access_log in ACCESS_LOG_FORMATS,
        "access_log",
        f"must be one of {', '.join(ACCESS_LOG_FORMATS)}, got {config.access_log!r}",
    )
    check(
        _HEADER_NAME.fullmatch(config.session_header) is not None,
        "session_header",
        f"must be an HTTP header name (letters, digits, '-'), got {config.session_header!r}",
    )
    check(
        config.session_header.lower() not in _NOT_SESSION_HEADERS,
        "session_header",
        f"{config.session_header} is a header the router reads or sets itself; pick another name "
        "(the default is X-Session-ID)",
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
    return msgspec.structs.replace(config, log_level=log_level, **pools)


ADMIN_TOKEN_ENV = "SESSION_ROUTER_ADMIN_TOKEN"
SESSION_LABELS = ("hash", "id", "none")


def _validate_admin(config: RouterConfig, key: Callable[[str], str]) -> None:
    """The admin block: the token's characters, the allow-list's entries, the session label, and
    no admin API open to the network (an admin listener off loopback without a token)."""
    token = config.admin_token
    if token and not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise ConfigError(f"{key('admin_token')}: use visible ASCII characters only (no spaces or control "
                          f"characters: it is sent in an 'Authorization: Bearer' header)")
    check_host = config.admin_host.strip()
    if not check_host:
        raise ConfigError(f"{key('admin_host')}: must not be empty; use 127.0.0.1 (loopback, the default)")
    if config.admin_port and not token and not is_loopback_host(check_host):
        raise ConfigError(
            f"{key('admin_host')}: the admin API on {check_host}:{config.admin_port} would be open to the network "
            f"(admin_token is empty): set admin_token (or {ADMIN_TOKEN_ENV}), or keep admin_host on a "
            f"loopback address such as 127.0.0.1"
        )
    for index, entry in enumerate(config.admin_backend_allow):
        try:
            parse_entry(entry)
        except ValueError as exc:
            raise ConfigError(f"{key('admin_backend_allow')}[{index}]: {exc}") from None
    if config.session_label not in SESSION_LABELS:
        raise ConfigError(f"{key('session_label')}: must be one of {', '.join(SESSION_LABELS)}, "
                          f"got {config.session_label!r}")


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


def _decode(data: Mapping[str, Any]) -> RouterConfig:
    try:
        return msgspec.convert(data, RouterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(_translate(str(exc))) from None


def _translate(error: str) -> str:
    """Turn msgspec's ``Expected `float`, got `str` - at `$.load_factor``` into a key-first message."""
    match = _MSGSPEC_ERROR.match(error)
    assert match is not None  # the pattern matches any string
    message = match["message"]
    path = (match["path"] or "").lstrip(".")
    unknown = _UNKNOWN_FIELD.match(message)
    missing = _MISSING_FIELD.match(message)
    if unknown:
        name = unknown["key"]
        struct = BackendConfig if path else RouterConfig
        known = [f.name for f in msgspec.structs.fields(struct)]
        hint = difflib.get_close_matches(name, known, n=1)
        text = f"unknown key {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
    elif missing:
        text = f"missing required key {missing['key']!r}"
    else:
        text = message.replace("`", "")
        text = text[:1].lower() + text[1:]
        if path in _POOL_FIELDS and message.startswith("Expected `array`"):
            text += f"; write each backend as its own [[{path}]] table with a url key"
    return f"{path}: {text}" if path else text


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


#: argparse destination (= RouterConfig field) -> the flag, for flags that set one field
_SCALAR_FLAGS = {
    "host": "--host",
    "port": "--port",
    "policy": "--policy",
    "log_level": "--log-level",
    "stamp": "--stamp",
    "load_factor": "--load-factor",
    "admin_token": "--admin-token",
    "workers": "--workers",
    "front": "--front",
    "access_log": "--access-log",
    "access_log_file": "--access-log-file",
    "session_header": "--session-header",
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
