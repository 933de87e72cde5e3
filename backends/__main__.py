"""``session-backend`` / ``python -m backends``: run one simulated vLLM-compatible backend.

    session-backend --host 127.0.0.1 --port 8100 --role both --model session-sim --speed 1

Prints one line when listening (``session-backend listening on http://HOST:PORT ...``; with
``--port 0`` it names the port the OS chose). SIGTERM / SIGINT stop it gracefully: no new
connections, in-flight requests get ``--shutdown-timeout`` seconds, then the engine stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from backends.engine.outputs import EngineConfig
from backends.server import create_app

log = logging.getLogger("backends")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    d = EngineConfig()
    p = argparse.ArgumentParser(prog="session-backend", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port to bind; 0 = any free port (default 8100)")
    p.add_argument("--role", choices=("both", "prefill", "decode"), default=d.role)
    p.add_argument("--model", default=d.model, help="served model name")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV-cache capacity in blocks")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--speed", type=float, default=d.speed,
                   help="latency-model scale: 1 = a small model on one GPU, 0 = no sleeping")
    p.add_argument("--max-tracked-sessions", type=int, default=d.max_tracked_sessions)
    p.add_argument("--session-metrics-top-k", type=int, default=d.session_metrics_top_k)
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds in-flight requests get on SIGTERM (default 5)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    args = p.parse_args(argv)
    for name in ("block_size", "num_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "max_tracked_sessions", "session_metrics_top_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.speed < 0:
        p.error("--speed must be >= 0")
    if not 0 <= args.port <= 65535:
        p.error("--port must be in 0..65535")
    return args


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        role=args.role,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speed=args.speed,
        max_tracked_sessions=args.max_tracked_sessions,
        session_metrics_top_k=args.session_metrics_top_k,
    )


async def serve(args: argparse.Namespace) -> None:
    app = create_app(config_from_args(args))
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                           shutdown_timeout=args.shutdown_timeout)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        host, port = _bound(runner, args.host, args.port)
        print(f"session-backend listening on http://{host}:{port} (model={args.model}, role={args.role}, "
              f"speed={args.speed:g})", flush=True)
        await stop.wait()
        log.info("stopping: draining in-flight requests for up to %gs", args.shutdown_timeout)
    finally:
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
        import uvloop
    except ImportError:  # optional dependency
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(serve(args))
    except OSError as exc:  # e.g. the port is taken
        print(f"session-backend: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
