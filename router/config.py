"""Router configuration: TOML decoded into msgspec Structs; CLI flags override the file.

Every setting has a default here, so an empty file is a valid configuration for one backend
given with ``--backend``. Unknown keys, wrong types and bad URLs stop start-up with a
``ConfigError`` that names the key.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import tomllib
from collections.abc import Mapping
from typing import Any, NoReturn

import msgspec

from router import __version__
from router.errors import ConfigError
from router.pool import normalize_url

MiB = 1024 * 1024


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
    #: bearer token for /admin; empty = admin API open (bind loopback only then)
    admin_token: str = ""
    #: serve /admin on a separate port (0 = on the data port)
    admin_port: int = 0
    drain_timeout_s: float = 30.0
    #: SO_REUSEPORT worker processes
    workers: int = 1
    #: raw: the hot POST routes on an asyncio Protocol + httptools, the rest relayed to the aiohttp
    #: app on an internal loopback port; aiohttp: everything served by aiohttp
    front: str = "raw"
    #: bound on remembered Responses API ids (previous_response_id -> backend)
    max_response_ids: int = 100_000
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
    ``backends``). Raises ``ConfigError`` for bad flags and for every error ``load_config`` finds.
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
    if args.backend and (args.prefill or args.decode):
        raise ConfigError(
            "--backend (aggregated mode) cannot be combined with --prefill/--decode (P/D mode); "
            "use one or the other"
        )
    if args.backend:
        overrides.update(backends=_backend_list(args.backend), prefill=[], decode=[])
        labels["backends"] = "--backend"
    if args.prefill or args.decode:
        overrides["backends"] = []
    if args.prefill:
        overrides["prefill"] = _backend_list(args.prefill)
        labels["prefill"] = "--prefill"
    if args.decode:
        overrides["decode"] = _backend_list(args.decode)
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
        f"must be 0..65535 (0 = serve /admin on the data port), got {config.admin_port}",
    )
    check(
        config.admin_port == 0 or config.admin_port != config.port,
        "admin_port",
        f"must differ from port ({config.port}); use 0 to serve /admin on the data port",
    )
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


def _backend_list(urls: list[str]) -> list[BackendConfig]:
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
    parser.add_argument("--admin-token", metavar="TOKEN", help="bearer token required by /admin")
    parser.add_argument(
        "--workers", type=int, metavar="N", help="SO_REUSEPORT worker processes sharing the port (default 1)"
    )
    parser.add_argument(
        "--front", choices=FRONTS,
        help="HTTP front: raw (the proxied POST routes on asyncio + httptools, the rest relayed to "
        "aiohttp; the default) or aiohttp (everything on aiohttp)",
    )
    return parser
