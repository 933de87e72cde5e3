"""The command line: the argparse flag table and ``build_config`` (the file, then flags on top).

A lower layer than ``router.cli`` and ``router.serve``: it imports neither.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, NoReturn

from contract.errors import ConfigError
from router import __version__
from router.config.load import (
    ADMIN_TOKEN_ENV,
    decode,
    read_toml,
    sectioned,
    set_value,
    validate_config,
    warn_flat_keys,
)
from router.config.schema import (
    ACCESS_LOG_FORMATS,
    DISCOVERY_POOLS,
    DISCOVERY_SOURCES,
    FRONTS,
    LOG_LEVELS,
    POLICIES,
    STAMPS,
    UPSTREAM_APIS,
    BackendConfig,
    RouterConfig,
)

def build_config(argv: list[str]) -> RouterConfig:
    """Parse command-line arguments: ``--config FILE`` first, then the other flags override it.

    ``--backend`` replaces the file's ``backends`` (and clears its ``prefill``/``decode``);
    ``--prefill``/``--decode`` replace the file's list of the same name (and clear its
    ``backends``). ``admin.token`` comes from ``--admin-token``, else from the environment variable
    ``SESSION_ROUTER_ADMIN_TOKEN`` when set and non-empty, else from the file.
    Raises ``ConfigError`` for bad flags and for every error ``load_config`` finds.
    """
    args = _parser().parse_args(argv)
    data, labels = sectioned(read_toml(args.config) if args.config is not None else {})
    flat = dict(labels)
    for dest, (path, flag) in _SCALAR_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            set_value(data, path, value)
            labels[path] = flag
    if args.admin_token is None and os.environ.get(ADMIN_TOKEN_ENV):
        set_value(data, "admin.token", os.environ[ADMIN_TOKEN_ENV])
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
    if args.render:
        set_value(data, "tokens.render", "local" if args.render == ["local"] else args.render)
        labels["tokens.render"] = "--render"
    _discovery_flags(args, data, labels)
    config = validate_config(decode(data, labels), labels=labels)
    warn_flat_keys(flat)
    return config


#: argparse destination -> (the key in [discovery.<pool>], its table or None for the pool's own, the flag)
_DISCOVERY_FLAGS = {
    "discovery": ("source", None, "--discovery"),
    "kubernetes_namespace": ("namespace", "kubernetes", "--kubernetes-namespace"),
    "kubernetes_selector": ("label_selector", "kubernetes", "--kubernetes-selector"),
    "kubernetes_port_name": ("port_name", "kubernetes", "--kubernetes-port-name"),
    "dns_name": ("name", "dns", "--dns-name"),
    "dns_port": ("port", "dns", "--dns-port"),
}


def _discovery_flags(args: argparse.Namespace, data: dict[str, Any], labels: dict[str, str]) -> None:
    """``--discovery [POOL:]SOURCE`` and the sources' flags, each ``[POOL:]VALUE`` (no pool: ``default``;
    no selector, DNS name, namespace or port name holds a colon), into ``[discovery.<pool>]``."""
    if args.kubeconfig is not None:
        set_value(data, "discovery.kubeconfig", args.kubeconfig)
        labels["discovery.kubeconfig"] = "--kubeconfig"
    for dest, (key, table, flag) in _DISCOVERY_FLAGS.items():
        for given in getattr(args, dest):
            pool, sep, text = given.partition(":")
            if not sep:
                pool, text = "default", given
            if pool not in DISCOVERY_POOLS:
                raise ConfigError(f"{flag}: {given!r} names pool {pool!r}; write [POOL:]VALUE with POOL one of "
                                  f"{', '.join(DISCOVERY_POOLS)} (no POOL: default)")
            value: str | int = text
            if key == "port":
                if not text.isdigit():
                    raise ConfigError(f"{flag}: {given!r}: the port must be a number (0 = the SRV records' ports)")
                value = int(text)
            section = data.setdefault("discovery", {})
            target = section.setdefault(pool, {}) if isinstance(section, dict) else None
            if table is not None and isinstance(target, dict):
                target = target.setdefault(table, {})
            if isinstance(target, dict):  # else not a table: the decoder says so
                target[key] = value
                labels[f"discovery.{pool}." + (f"{table}.{key}" if table else key)] = flag



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
    "decision_header": ("placement.decision_header", "--decision-header"),
    "prefill_tokens_per_s": ("placement.prefill_tokens_per_s", "--prefill-tokens-per-s"),
    "per_request_step_s": ("placement.per_request_step_s", "--per-request-step-s"),
    "admin_token": ("admin.token", "--admin-token"),
    "workers": ("workers", "--workers"),
    "front": ("front.kind", "--front"),
    "access_log": ("front.access_log", "--access-log"),
    "access_log_file": ("front.access_log_file", "--access-log-file"),
    "session_header": ("sessions.header", "--session-header"),
    "upstream_api": ("tokens.upstream_api", "--upstream-api"),
    "model_dir": ("tokens.model_dir", "--model-dir"),
    "served_model_name": ("tokens.served_model_name", "--served-model-name"),
    "max_model_len": ("tokens.max_model_len", "--max-model-len"),
    "prompt_cache_bytes": ("tokens.prompt_cache_bytes", "--prompt-cache-bytes"),
    "kv_events": ("kv_events.enabled", "--kv-events"),
    "shared_state": ("shared_state.url", "--shared-state"),
}

#: --kv-events: the word -> [kv_events] enabled
_KV_EVENTS_MODES: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}


def _kv_events_mode(word: str) -> bool | str:
    try:
        return _KV_EVENTS_MODES[word]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{word!r}: give auto, on or off") from None


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
    parser.add_argument("--policy", choices=POLICIES,
                        help="placement policy (default kv_aware; session = the policy before issue 14)")
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, help="log level (default warning)")
    parser.add_argument(
        "--stamp", choices=STAMPS, help="session id for requests without one: derive (then mint), mint or none"
    )
    parser.add_argument("--load-factor", type=float, metavar="C", help="load bound factor c >= 1 (default 1.25)")
    parser.add_argument("--decision-header", action="store_const", const=True, default=None,
                        help="answer every proxied request with X-Session-Router-Decision (placement.decision_header)")
    parser.add_argument("--prefill-tokens-per-s", type=float, metavar="N",
                        help="kv_aware: prompt tokens an engine prefills per second until learned (default 4000)")
    parser.add_argument("--per-request-step-s", type=float, metavar="S",
                        help="kv_aware: seconds of one engine step until learned (default 0.010)")
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
    parser.add_argument(
        "--kv-events", type=_kv_events_mode, metavar="auto|on|off",
        help="subscribe to the engines' KV events and index where each session's KV is (placement reads it): "
        "auto (the default: backends configured with kv_events or advertising /kv_event_sources), on (the same, "
        "warning about backends that publish none) or off",
    )
    parser.add_argument(
        "--shared-state", metavar="redis://HOST:PORT/DB",
        help="share pin moves and Responses ids with the other replicas and workers through this Redis "
        "(shared_state.url; default none: each process keeps its own)",
    )
    tokens = parser.add_argument_group(
        "tokens mode (vLLM's disaggregated serving: the router renders and derenders, engines take token ids)")
    tokens.add_argument(
        "--upstream-api", choices=UPSTREAM_APIS,
        help="what the backends speak: openai (text in/out, the default) or tokens (/inference/v1/generate, "
        "e.g. vllm serve --tokens-only)",
    )
    tokens.add_argument("--model-dir", metavar="DIR",
                        help="tokens mode: the model folder the engines serve (tokenizer.json, chat template, ...)")
    tokens.add_argument("--served-model-name", metavar="NAME",
                        help="tokens mode: the model name clients use (default: the model folder's name)")
    tokens.add_argument("--max-model-len", type=int, metavar="N",
                        help="tokens mode: context length (default: config.json's max_position_embeddings)")
    tokens.add_argument(
        "--render", action="append", metavar="URL", default=[],
        help="tokens mode: a render server (vllm launch render, or session-backend --role render) "
        "(repeatable; replaces the file's render); none (or 'local') renders in the router",
    )
    tokens.add_argument("--prompt-cache-bytes", type=int, metavar="N",
                        help="tokens mode: memory bound of the per-session incremental render cache (0 = off)")
    found = parser.add_argument_group(
        "discovery (backends found at runtime; each flag repeatable as [POOL:]VALUE, POOL one of "
        f"{', '.join(DISCOVERY_POOLS)}, no POOL: default; the config file's [discovery])")
    found.add_argument("--discovery", action="append", default=[], metavar="[POOL:]SOURCE",
                       help=f"where a pool's backends come from: {', '.join(DISCOVERY_SOURCES)} (default static: the "
                       "configured list)")
    found.add_argument("--kubernetes-selector", action="append", default=[], metavar="[POOL:]SELECTOR",
                       help="kubernetes: the backends' pods, by label selector, e.g. decode:app=vllm,role=decode")
    found.add_argument("--kubernetes-port-name", action="append", default=[], metavar="[POOL:]NAME",
                       help="kubernetes: the name of the backends' container port, e.g. http")
    found.add_argument("--kubernetes-namespace", action="append", default=[], metavar="[POOL:]NAMESPACE",
                       help="kubernetes: the pods' namespace (default: default)")
    found.add_argument("--kubeconfig", metavar="FILE",
                       help="kubernetes: a kubeconfig file (default: the pod's in-cluster service account)")
    found.add_argument("--dns-name", action="append", default=[], metavar="[POOL:]NAME",
                       help="dns: the name to resolve, e.g. a headless Service's vllm.ns.svc.cluster.local")
    found.add_argument("--dns-port", action="append", default=[], metavar="[POOL:]PORT",
                       help="dns: the backends' port (A/AAAA records); 0 (the default) = SRV records")
    return parser
