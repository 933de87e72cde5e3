"""Loading the configuration: TOML read, flat keys moved into their sections, decoded, validated.

Unknown keys, wrong types and bad values stop start-up with a ``ConfigError`` that names the key
as the user gave it (the section path, the flag, or the flat key). The flat layout of before is
read for one release: ``sectioned`` moves each flat key into its section (``FLAT_KEYS``) and a
warning names where it goes now.
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import msgspec

from contract.errors import ConfigError
from router.backend_allow import literal_address, normalize_host, parse_entry
from router.config.schema import (
    FLAT_KEYS,
    FLAT_NAMES,
    HINT,
    RULE,
    SECTIONS,
    DISCOVERY_POOLS,
    AdminConfig,
    BackendConfig,
    DnsDiscoveryConfig,
    KubernetesDiscoveryConfig,
    RouterConfig,
    TokensConfig,
)
from router.membership import normalize_url
from router.upstream import HOP_BY_HOP

logger = logging.getLogger("router.config")

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
    data, labels = sectioned(read_toml(path) if path is not None else {})
    config = validate_config(decode(data, labels), labels=labels)
    warn_flat_keys(labels)
    return config


def config_from_mapping(data: Mapping[str, Any]) -> RouterConfig:
    """Decode and validate already-parsed TOML (e.g. a dict written in a test)."""
    nested, labels = sectioned(data)
    config = validate_config(decode(nested, labels), labels=labels)
    warn_flat_keys(labels)
    return config



def sectioned(data: Mapping[str, Any]) -> tuple[dict[str, Any], Labels]:
    """Move the flat layout's keys into their sections: the result to decode, and for each moved
    key its section path -> the flat key (so that messages name the key as the file wrote it).

    Raises ``ConfigError`` when a file sets a key both ways (flat and in its section).
    """
    nested = {key: (dict(value) if key in SECTIONS and isinstance(value, Mapping) else value)
              for key, value in data.items()}
    moved: Labels = {}
    if isinstance(nested.get("shared_state"), str):  # shared_state = "redis://…": the section's url
        nested["shared_state"] = {"url": nested["shared_state"]}
        moved["shared_state.url"] = "shared_state"
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
        return names.get(path) or (FLAT_NAMES.get(path, path) if flat_file else path)

    def check(ok: bool, path: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{key(path)}: {message}")

    config = decode(msgspec.to_builtins(config), names)  # the bounds, for a config built in code
    check(bool(config.host.strip()), "host", "must not be empty; use 127.0.0.1 for loopback or 0.0.0.0 for all")
    check(
        config.admin.port == 0 or config.admin.port != config.port,
        "admin.port",
        f"must differ from port ({config.port}); use 0 to serve /admin on the data port "
        f"(with {key('admin.token')})",
    )
    _validate_admin(config.admin, key)
    balance = config.placement.session_balance
    check(balance == 0 or balance >= 1, "placement.session_balance",
          f"must be 0 (off) or at least 1 (1 = no backend over the mean pinned sessions), got {balance:g}")
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
    discovered = _validate_discovery(config, key)
    if (config.prefill or "prefill" in discovered) and not (config.decode or "decode" in discovered):
        raise ConfigError(f"{key('decode')}: P/D mode needs at least one decode backend")
    if not (config.backends or config.decode or {"default", "decode"} & discovered):
        raise ConfigError(_NO_BACKEND)
    pools = {name: _validate_pool(getattr(config, name), name, names.get(name)) for name in _POOL_FIELDS}
    tokens = _validate_tokens(config.tokens, key)
    _validate_shared_state(config, key)
    return msgspec.structs.replace(config, tokens=tokens, **pools)


def _validate_shared_state(config: RouterConfig, key: Callable[[str], str]) -> None:
    """``shared_state``: a Redis URL the ``redis`` client takes, and a backoff that grows."""
    shared = config.shared_state
    if shared.url and not shared.url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"{key('shared_state.url')}: {shared.url!r} is not a Redis URL; write "
                          "redis://host:6379/0 (rediss:// for TLS, unix:///path for a socket), or leave it out")
    if shared.backoff_max_s < shared.backoff_min_s:
        raise ConfigError(f"{key('shared_state.backoff_max_s')}: must be at least backoff_min_s "
                          f"({shared.backoff_min_s:g})")


def _validate_tokens(tokens: TokensConfig, key: Callable[[str], str]) -> TokensConfig:
    """The ``[tokens]`` section: a model folder that exists when (and only when) the backends take
    tokens, and render server URLs; returns a copy with the URLs normalized.

    There is no default model folder: the router's token ids must be the engines' own, and a
    shipped toy tokenizer would silently produce the wrong ones (vLLM, too, requires its model)."""
    settings = ("model_dir", "served_model_name", "max_model_len", "render")
    if not tokens.enabled:
        given = [name for name in settings if getattr(tokens, name) != getattr(_TOKENS_DEFAULTS, name)]
        if given:
            raise ConfigError(
                f"{key('tokens.' + given[0])}: only used in tokens mode (the backends take token ids): set "
                f"{key('tokens.upstream_api')} to tokens, or remove {key('tokens.' + given[0])}"
            )
        return tokens
    if not tokens.model_dir.strip():
        raise ConfigError(
            f"{key('tokens.model_dir')}: tokens mode ({key('tokens.upstream_api')} tokens) needs the model folder the "
            "engines serve (tokenizer.json, tokenizer_config.json, config.json, ...), e.g. "
            "--model-dir models/tiny-llama; the router renders and derenders with its tokenizer"
        )
    if not os.path.isdir(tokens.model_dir):
        raise ConfigError(f"{key('tokens.model_dir')}: {_shown(tokens.model_dir)} is not a directory; give the model "
                          "folder (with tokenizer.json)")
    if tokens.served_model_name != tokens.served_model_name.strip():
        raise ConfigError(f"{key('tokens.served_model_name')}: no leading or trailing spaces, got "
                          f"{_shown(tokens.served_model_name)}")
    render = tokens.render
    if isinstance(render, str):
        if render != "local":
            raise ConfigError(f"{key('tokens.render')}: \"local\" or a list of render server URLs, got {_shown(render)}")
        return tokens
    if not render:
        raise ConfigError(f"{key('tokens.render')}: an empty list names no render server; write \"local\" to "
                          "render in the router, or list at least one URL")
    urls: list[str] = []
    for index, url in enumerate(render):
        try:
            normalized = normalize_url(url)
        except ConfigError as exc:
            raise ConfigError(f"{key('tokens.render')}[{index}]: {exc.message}") from None
        if normalized in urls:
            raise ConfigError(f"{key('tokens.render')}[{index}]: {normalized} is listed twice; list each render "
                              "server once")
        urls.append(normalized)
    return msgspec.structs.replace(tokens, render=urls)


_TOKENS_DEFAULTS = TokensConfig()

#: one requirement of a Kubernetes label selector: key, key=v, key==v, key!=v, !key, key in (..), key notin (..)
_LABEL_KEY = r"(?:[a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_LABEL_VALUE = r"(?:[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SELECTOR_REQUIREMENT = re.compile(
    rf"\s*(?:!\s*{_LABEL_KEY}|{_LABEL_KEY}\s*(?:(?:==?|!=)\s*{_LABEL_VALUE}"
    rf"|\s(?:in|notin)\s*\(\s*{_LABEL_VALUE}(?:\s*,\s*{_LABEL_VALUE})*\s*\))?)\s*")
_SELECTOR_SPLIT = re.compile(r",(?![^(]*\))")
#: a DNS name (a trailing dot allowed) and a Kubernetes port name (IANA_SVC_NAME)
_DNS_NAME = re.compile(r"(?=.{1,253}\.?$)([A-Za-z0-9_]([-A-Za-z0-9_]{0,61}[A-Za-z0-9])?\.)*"
                       r"[A-Za-z0-9_]([-A-Za-z0-9_]{0,61}[A-Za-z0-9])?\.?")
_PORT_NAME = re.compile(r"(?=.{1,15}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _validate_discovery(config: RouterConfig, key: Callable[[str], str]) -> set[str]:
    """The ``[discovery]`` section: each pool's source has its table (and only that one) with what
    it needs, and names a pool of this mode. Returns the pools with a source other than static."""
    discovery = config.discovery
    if discovery.backoff_max_s < discovery.backoff_initial_s:
        raise ConfigError(f"{key('discovery.backoff_max_s')}: must be at least "
                          f"{key('discovery.backoff_initial_s')} ({discovery.backoff_initial_s:g})")
    for name, pool in ((n, getattr(discovery, n)) for n in DISCOVERY_POOLS):
        where = f"discovery.{name}"
        for kind in ("kubernetes", "dns"):
            if getattr(pool, kind) is not None and pool.source != kind:
                raise ConfigError(f"{key(where + '.source')}: is {pool.source!r} but [{where}.{kind}] is set: "
                                  f"set source = \"{kind}\" (--discovery {name}:{kind}) or remove [{where}.{kind}]")
        if pool.source == "kubernetes":
            _validate_kubernetes_source(pool.kubernetes, f"{where}.kubernetes", key)
        elif pool.source == "dns":
            _validate_dns_source(pool.dns, f"{where}.dns", key)
    discovered = set(discovery.pools())
    pd_pools = discovered & {"prefill", "decode"}
    if "default" in discovered and (pd_pools or config.prefill or config.decode):
        raise ConfigError(f"{key('discovery.default.source')}: the default pool is aggregated mode's; in P/D mode "
                          "discover [discovery.prefill] and [discovery.decode] instead")
    if pd_pools and config.backends:
        raise ConfigError(f"{key('discovery.' + sorted(pd_pools)[0] + '.source')}: discovering a P/D pool makes this "
                          f"P/D mode, but {key('backends')} lists aggregated backends; give prefill/decode instead")
    if "render" in discovered and not config.tokens.enabled:
        raise ConfigError(f"{key('discovery.render.source')}: the render pool is tokens mode's render servers: set "
                          f"{key('tokens.upstream_api')} to tokens, or leave [discovery.render] static")
    if discovery.kubeconfig and not os.path.isfile(discovery.kubeconfig):
        raise ConfigError(f"{key('discovery.kubeconfig')}: {_shown(discovery.kubeconfig)} is not a file; give a "
                          "kubeconfig file, or \"\" for the pod's in-cluster service account")
    return discovered


def _validate_kubernetes_source(source: KubernetesDiscoveryConfig | None, where: str,
                                key: Callable[[str], str]) -> None:
    if source is None or not source.label_selector.strip():
        raise ConfigError(f"{key(where + '.label_selector')}: Kubernetes discovery needs the pods' label selector, "
                          "e.g. label_selector = \"app=vllm\" (--kubernetes-selector), and port_name, the container port's name")
    parts = _SELECTOR_SPLIT.split(source.label_selector)
    for part in parts:
        if not _SELECTOR_REQUIREMENT.fullmatch(part):
            raise ConfigError(f"{key(where + '.label_selector')}: {_shown(part.strip())} is not a label selector "
                              "requirement (key=value, key!=value, key, !key, key in (a,b), key notin (a,b); "
                              "joined with commas)")
    if not _PORT_NAME.fullmatch(source.port_name):
        raise ConfigError(f"{key(where + '.port_name')}: the name of the backends' container port (1-15 lower-case "
                          f"letters, digits, '-'), e.g. port_name = \"http\" (--kubernetes-port-name), got "
                              f"{_shown(source.port_name)}")
    if not _DNS_NAME.fullmatch(source.namespace) or "." in source.namespace:
        raise ConfigError(f"{key(where + '.namespace')}: must be a namespace name, got {_shown(source.namespace)}")


def _validate_dns_source(source: DnsDiscoveryConfig | None, where: str, key: Callable[[str], str]) -> None:
    if source is None or not _DNS_NAME.fullmatch(source.name):
        got = "" if source is None else f", got {_shown(source.name)}"
        raise ConfigError(f"{key(where + '.name')}: DNS discovery needs the name to resolve, e.g. the headless "
                          f"Service's name = \"vllm.inference.svc.cluster.local\" (--dns-name){got}")
    for index, server in enumerate(source.nameservers):
        host, port = split_host_port(server, 53)
        if literal_address(host) is None or not 0 < port < 65536:
            raise ConfigError(f"{key(where + '.nameservers')}[{index}]: an IP address, optionally with a port "
                              f"(\"10.0.0.10\", \"127.0.0.1:5353\", \"[::1]:53\"), got {_shown(server)}")


def split_host_port(text: str, default_port: int) -> tuple[str, int]:
    """``"host"``, ``"host:port"``, ``"[v6]"`` or ``"[v6]:port"`` -> (host, port); a bad port is -1."""
    host, port = text.strip(), str(default_port)
    if host.startswith("["):
        inside, _, rest = host[1:].partition("]")
        host, port = inside, (rest[1:] if rest.startswith(":") else (port if not rest else "x"))
    elif host.count(":") == 1:
        host, port = host.split(":")
    return host, int(port) if port.isdigit() else -1


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
        _validate_kv_source(entry, flag if flag is not None else f"{field_name}[{index}]")
        result.append(msgspec.structs.replace(entry, url=url))
    return result


def _validate_kv_source(entry: BackendConfig, where: str) -> None:
    """A backend's ``kv_events``/``kv_replay``: ZMQ endpoints the router can reach (tcp:// or ipc://),
    a replay socket only beside an event endpoint."""
    for key in ("kv_events", "kv_replay"):
        value = getattr(entry, key)
        if value and not value.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"{where}.{key}: {value!r} is not a ZMQ endpoint the router can reach; give "
                              "tcp://host:port or ipc:///path, as in the engine's --kv-events-config")
    if entry.kv_replay and not entry.kv_events:
        raise ConfigError(f"{where}.kv_replay: set only with kv_events (the endpoint the engine publishes on)")
    if entry.kv_topic and not entry.kv_events:
        raise ConfigError(f"{where}.kv_topic: set only with kv_events (the endpoint the engine publishes on)")


def read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc.strerror or exc}") from None


def set_value(data: dict[str, Any], path: str, value: Any) -> None:
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


def decode(data: Mapping[str, Any], labels: Mapping[str, str]) -> RouterConfig:
    """Decode a (sectioned) mapping into ``RouterConfig``: types, closed sets and bounds."""
    data = dict(data)
    if isinstance(data.get("log_level"), str):
        data["log_level"] = data["log_level"].lower()
    for path, value in _scalars(data):
        # a key that names no setting is msgspec's to refuse (unknown key), whatever its value
        if isinstance(value, float) and not math.isfinite(value) and _field_type(path)[1] is not None:
            raise ConfigError(f"{labels.get(path, path)}: must be a finite number, got {value}")
    try:
        return msgspec.convert(data, RouterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(_translate(str(exc), data, labels)) from None


def _scalars(data: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of the top-level values and of each section's values."""
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, Mapping):
            yield from _nested_scalars(key, value)
        else:
            yield str(key), value


def _nested_scalars(prefix: str, table: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """A section's values, and those of the tables inside it (``discovery.decode.dns.interval_s``)."""
    for inner, item in table.items():
        if isinstance(item, Mapping):
            yield from _nested_scalars(f"{prefix}.{inner}", item)
        else:
            yield f"{prefix}.{inner}", item


@functools.cache
def _hints(struct: type[msgspec.Struct]) -> dict[str, Any]:
    return get_type_hints(struct, include_extras=True)


def _field_type(path: str) -> tuple[str, Any]:
    """The field's name and annotated type at a settings path (``None`` when it is not one)."""
    section, _, name = path.rpartition(".")
    struct = _struct_at(section)
    if struct is None:
        return name, None
    return name, _hints(struct).get(name)


def _struct_at(path: str) -> type[msgspec.Struct] | None:
    """The Struct a table path decodes into: ``""`` the whole config, ``"placement"`` a section,
    ``"discovery.decode.dns"`` a table inside one (None when the path names no table)."""
    struct: type[msgspec.Struct] = RouterConfig
    for part in path.split(".") if path else ():
        hint = _hints(struct).get(part)
        found = [arg for arg in (get_args(hint) or (hint,))
                 if isinstance(arg, type) and issubclass(arg, msgspec.Struct)]
        if not found:
            return None
        struct = found[0]
    return struct


def _bound_message(name: str, annotation: Any, value: Any) -> str | None:
    """"must be at least 1 (hint), got 0" from a field's ``msgspec.Meta``."""
    metas = [m for m in get_args(annotation)[1:] if isinstance(m, msgspec.Meta)]
    if get_origin(annotation) is not Annotated or not metas:
        return None
    meta = metas[0]
    extra = meta.extra or {}
    seconds = name.endswith("_s")
    rule = extra.get(RULE)
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
    hint = f" ({extra[HINT]})" if HINT in extra else ""
    return f"{rule}{hint}, got {value}"


def _escaped(text: str) -> str:
    """``text`` with the characters of msgspec's path syntax escaped, so that no message looks like one."""
    return text.replace("$", "\\u0024").replace("`", "\\u0060")


def _shown(value: Any) -> str:
    """A user's value as a message quotes it (``repr``, path characters escaped)."""
    return _escaped(repr(value))


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
        key = _escaped(unknown["key"])
        if not path:
            known = [f.name for f in msgspec.structs.fields(RouterConfig)] + list(FLAT_KEYS)
        else:
            table = _struct_at(path) if path.split(".")[0] in SECTIONS else None
            known = [f.name for f in msgspec.structs.fields(table or BackendConfig)]
        hint = difflib.get_close_matches(key, known, n=1)
        text = f"unknown key {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
    elif missing:
        text = f"missing required key {missing['key']!r}"
    elif _ENUM.match(message) and get_origin(annotation) is Literal:
        choices = ", ".join(get_args(annotation))
        text = f"must be one of {choices}, got {_shown(_lookup(data, path))}"
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


