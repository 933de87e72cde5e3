"""``session-backend`` / ``python -m backends``: run one simulated vLLM-compatible backend.

    session-backend --host 127.0.0.1 --port 8100 --role both --speed 1 [--model-dir models/tiny-llama]

The model folder (``--model-dir``, default the shipped ``models/tiny-llama``) gives the tokenizer, the
chat template, the context length (``--max-model-len`` overrides it) and the served name (the folder's
name unless ``--served-model-name``); the engine generates ids of that vocabulary.

vLLM 0.32's scale-out surface::

    session-backend --enable-scale-out      # + render, derender, abort routes
    session-backend --tokens-only           # only generate, abort, health, metrics, load, models
    session-backend --role render           # a render server: no engine

Prints one line when listening (``session-backend listening on http://HOST:PORT ...``; with
``--port 0`` it names the port the OS chose). SIGTERM / SIGINT stop it gracefully: no new
connections, in-flight requests get ``--shutdown-timeout`` seconds, then the engine stops.

P/D (see ``backends/kv_transfer/``)::

    session-backend --port 8200 --role prefill --kv-hold-timeout 480 --kv-hold-max-fraction 0.5
    session-backend --port 8201 --role decode --kv-allow 127.0.0.1:8200

A prefill instance serves the KV side channel on its HTTP port, or on ``--kv-host``/``--kv-port``
when ``--kv-port`` is given (then only there); ``--kv-host`` alone names the host it advertises as
``remote_host`` (default: the address the prefill request reached). A decode instance pulls only
from the side channels given with ``--kv-allow HOST:PORT`` (repeatable; compared with the
advertised ``remote_host`` as written); with none, from loopback hosts only. Held blocks are
bounded per request (``--kv-hold-max-blocks``), in total (``--kv-hold-max-fraction`` of the cache)
and in time (``--kv-hold-timeout``); the router frees them early with ``POST /internal/kv/release``.

KV-cache events (vLLM's ``--kv-events-config``; ``backends/kv_events``)::

    session-backend --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "ipc:///tmp/b0/kv.sock", "replay_endpoint": "ipc:///tmp/b0/kv-replay.sock"}'

Bad JSON or a bad field stops start-up with exit status 2; a socket that cannot be bound exits 1.
Block hashes go out as vLLM's default ints; ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` sends bytes.
``GET /kv_event_sources`` says where the events are (``{}`` without the flag).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from backends import __version__
from backends.app import create_app, create_side_channel_app
from backends.render_routes import create_render_app
from backends.engine.config import EngineConfig
from backends.kv_events.publisher import PublisherError
from backends.kv_events.recorder import int_block_hashes
from backends.kv_transfer.allow_list import parse_allow_entry
from backends.kv_transfer.pull_client import DEFAULT_PULL_TIMEOUT_S
from contract.aiohttp_json_errors import JsonErrorAppRunner
from contract.errors import ConfigError
from contract.kv_events import parse_kv_events_config
from rendering.model import DEFAULT_MODEL_DIR, RenderModel, load_model

log = logging.getLogger("backends")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default; flags whose help already says it are left alone."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower():
            return text
        return super()._get_help_string(action)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    p = argparse.ArgumentParser(prog="session-backend", description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8100, help="port to bind; 0 = any free port")
    p.add_argument("--role", choices=("both", "prefill", "decode", "render"), default=d.role,
                   help="both: a whole request; prefill/decode: one side of a P/D hand-off; render: a render "
                        "server with no engine (vllm launch render)")
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR), metavar="DIR",
                   help="model folder: tokenizer.json, tokenizer_config.json, chat template, config.json "
                        "(default: the shipped models/tiny-llama)")
    p.add_argument("--served-model-name", "--model", dest="served_model_name", default=None, metavar="NAME",
                   help="served model name (default: the model folder's name)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens: longer prompts (+ max_tokens) get a 400 (default: the "
                        "model's, config.json max_position_embeddings)")
    p.add_argument("--enable-scale-out", action="store_true",
                   help="also serve vLLM's scale-out routes: /v1/chat/completions/render, /v1/completions/render, "
                        "the derender routes, /inference/v1/abort_requests")
    p.add_argument("--tokens-only", action="store_true",
                   help="serve only /inference/v1/generate, abort, /health, /metrics, /load, /v1/models "
                        "(vllm serve --tokens-only: no detokenization, stop strings refused)")
    p.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=True,
                   help="report usage.prompt_tokens_details.cached_tokens on /v1/chat/completions and /v1/completions "
                        "when the prefix cache served part of the prompt (vLLM's flag, on by default here: the "
                        "router's session accounting reads it)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV-cache capacity in blocks")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="requests the scheduler runs at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens the scheduler processes per step")
    p.add_argument("--speed", type=float, default=d.speed,
                   help="latency-model scale: 1 = a small model on one GPU, 0 = no sleeping")
    p.add_argument("--max-tracked-sessions", type=int, default=d.max_tracked_sessions,
                   help="sessions the engine keeps accounting for (least recently active dropped)")
    p.add_argument("--session-metrics-top-k", type=int, default=d.session_metrics_top_k,
                   help="most recently active sessions with per-session metric series")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="log level (any case)")
    pd = p.add_argument_group("P/D disaggregation (kv_transfer_params, vLLM NixlConnector semantics)")
    pd.add_argument("--kv-hold-timeout", type=float, default=d.kv_hold_timeout_s, metavar="SECONDS",
                    help="prefill: free held KV blocks no decode instance pulled after this long")
    pd.add_argument("--kv-hold-max-blocks", type=int, default=d.kv_hold_max_blocks, metavar="N",
                    help="prefill: a request whose KV is more than N blocks is not held for remote decode (no "
                         "kv_transfer_params returned; the router falls back to decode-only); 0 = only the "
                         "--kv-hold-max-fraction bound")
    pd.add_argument("--kv-hold-max-fraction", type=float, default=d.kv_hold_max_fraction, metavar="F",
                    help="prefill: all held KV blocks together stay within this fraction of --num-blocks; a new "
                         "hold frees the oldest ones past it (0 = never hold)")
    pd.add_argument("--kv-allow", action="append", default=[], metavar="HOST:PORT",
                    help="decode: a prefill side channel this instance may pull KV from (repeatable); "
                         "default: loopback hosts only")
    pd.add_argument("--kv-pull-timeout", type=float, default=DEFAULT_PULL_TIMEOUT_S, metavar="SECONDS",
                    help="decode: give up a pull (and recompute) after this long")
    pd.add_argument("--kv-port", type=int, default=None, metavar="PORT",
                    help="prefill: serve the side channel on this dedicated port instead of the HTTP port "
                         "(default: on the HTTP port)")
    pd.add_argument("--kv-host", default=None, metavar="HOST",
                    help="prefill: the host advertised as remote_host (e.g. a name decode instances resolve and "
                         "allow); default: the address the prefill request reached. With --kv-port, also the "
                         "address that listener binds (default --host)")
    pd.add_argument("--kv-engine-id", default="", metavar="ID",
                    help="engine id advertised as remote_engine_id (default: unique per process)")
    ev = p.add_argument_group("KV-cache events (vLLM's, see backends/kv_events)")
    ev.add_argument("--kv-events-config", default=None, metavar="JSON",
                    help="vLLM's KVEventsConfig as JSON, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": "
                         "\"zmq\", \"endpoint\": \"ipc:///tmp/kv.sock\", \"replay_endpoint\": \"ipc:///tmp/kv-replay.sock\"}': "
                         "publish the prefix cache's BlockStored/BlockRemoved/AllBlocksCleared events on ZMQ "
                         "(a concrete-host tcp endpoint is connected to, *, ::, ipc:// and inproc:// are bound); "
                         "GET /kv_event_sources reports it (default: off)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                 "max_tracked_sessions", "session_metrics_top_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 1:
        p.error("--max-model-len must be at least 1")
    if args.role == "render" and args.tokens_only:
        p.error("--tokens-only is an engine's surface; a --role render server has no engine")
    if args.speed < 0:
        p.error("--speed must be >= 0")
    if not 0 <= args.port <= 65535:
        p.error("--port must be in 0..65535")
    if args.kv_hold_timeout <= 0:
        p.error("--kv-hold-timeout must be > 0 seconds")
    if args.kv_hold_max_blocks < 0:
        p.error("--kv-hold-max-blocks must be >= 0 (0 = only the --kv-hold-max-fraction bound)")
    if not 0 <= args.kv_hold_max_fraction <= 1:
        p.error("--kv-hold-max-fraction must be in 0..1 (a fraction of --num-blocks)")
    if args.kv_pull_timeout <= 0:
        p.error("--kv-pull-timeout must be > 0 seconds")
    for entry in args.kv_allow:
        try:
            parse_allow_entry(entry)
        except ValueError as exc:
            p.error(f"--kv-allow: {exc}")
    if args.kv_port is not None:
        if not 1 <= args.kv_port <= 65535:
            p.error("--kv-port must be in 1..65535")
        if args.kv_port == args.port:
            p.error("--kv-port must differ from --port (leave it out to serve the side channel on --port)")
        if args.role == "decode":
            p.error("--kv-port is for prefill (or both) instances: a decode instance serves no side channel")
    if args.kv_host is not None and not args.kv_host.strip():
        p.error("--kv-host must not be empty")
    if args.kv_events_config is not None:
        if args.role == "render":
            p.error("--kv-events-config needs an engine; a --role render server has none")
        try:
            args.kv_events_config = parse_kv_events_config(args.kv_events_config)
            args.kv_events_int_hashes = int_block_hashes(os.environ)
        except (ConfigError, ValueError) as exc:
            p.error(str(exc))
    else:
        args.kv_events_int_hashes = True
    return args


def model_from_args(args: argparse.Namespace) -> RenderModel:
    """The model folder named by the flags (``ConfigError`` naming what is wrong)."""
    return load_model(args.model_dir, served_model_name=args.served_model_name, max_model_len=args.max_model_len)


def config_from_args(args: argparse.Namespace, model: RenderModel) -> EngineConfig:
    return EngineConfig(
        model=model.name,
        role=args.role,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=model.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speed=args.speed,
        max_tracked_sessions=args.max_tracked_sessions,
        session_metrics_top_k=args.session_metrics_top_k,
        kv_hold_timeout_s=args.kv_hold_timeout,
        kv_hold_max_blocks=args.kv_hold_max_blocks,
        kv_hold_max_fraction=args.kv_hold_max_fraction,
        kv_engine_id=args.kv_engine_id,
        # unset host/port: the side channel is the HTTP server, named by the address a request reached
        kv_host=_kv_host(args) if args.kv_port is not None or args.kv_host is not None else None,
        kv_port=args.kv_port,
    )


_WILDCARDS = ("", "0.0.0.0", "::")


def _kv_host(args: argparse.Namespace) -> str:
    host = args.kv_host if args.kv_host is not None else args.host
    if host in _WILDCARDS:
        log.warning("the KV side channel listens on every interface; advertising 127.0.0.1 as remote_host "
                    "(give --kv-host to name an address decode instances can reach)")
        return "127.0.0.1"
    return host


async def serve(args: argparse.Namespace, model: RenderModel) -> None:
    dedicated = args.kv_port is not None and args.role != "render"
    if args.role == "render":
        app = create_render_app(model)
    else:
        app = create_app(config_from_args(args, model), model=model, scale_out=args.enable_scale_out,
                         tokens_only=args.tokens_only, prompt_tokens_details=args.enable_prompt_tokens_details,
                         kv_allow=args.kv_allow, kv_pull_timeout_s=args.kv_pull_timeout,
                         kv_side_channel_on_data_port=not dedicated, kv_events=args.kv_events_config,
                         kv_events_host=args.host, kv_events_int_hashes=args.kv_events_int_hashes)
    runner = JsonErrorAppRunner(app, access_log=None, handler_cancellation=True,
                           shutdown_timeout=args.shutdown_timeout)
    await runner.setup()
    kv_runner: web.AppRunner | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        host, port = _bound(runner, args.host, args.port)
        kv_note = ""
        if dedicated and args.role != "decode":
            kv_runner = JsonErrorAppRunner(create_side_channel_app(app), access_log=None, handler_cancellation=True)
            await kv_runner.setup()
            kv_listen = args.kv_host if args.kv_host is not None else args.host
            await web.TCPSite(kv_runner, kv_listen, args.kv_port).start()
            kv_note = f", kv side channel on {kv_listen}:{args.kv_port}"
        surface = ", tokens-only" if args.tokens_only else ", scale-out" if args.enable_scale_out else ""
        print(f"session-backend listening on http://{host}:{port} (model={model.name}, role={args.role}{surface}, "
              f"speed={args.speed:g}{kv_note})", flush=True)
        await stop.wait()
        log.info("stopping: draining in-flight requests for up to %gs", args.shutdown_timeout)
    finally:
        if kv_runner is not None:
            await kv_runner.cleanup()
        await runner.cleanup()


def _bound(runner: web.AppRunner, host: str, port: int) -> tuple[str, int]:
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return str(addr[0]), int(addr[1])
    return host, port


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        model = model_from_args(args)
    except ConfigError as exc:
        print(f"session-backend: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:  # optional dependency
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(serve(args, model))
    except OSError as exc:  # e.g. the port is taken
        print(f"session-backend: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except PublisherError as exc:  # a KV-event socket could not be bound or connected
        print(f"session-backend: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
