"""What tokens mode costs the router per request, next to the text path and next to the bare
tokenizer work of the same request (issue 13, "Speed").

    python -m bench.tokens_overhead [--quick] [--rounds 5] [--seconds 3] [--out bench/RESULTS.md]

One run starts two ``session-backend --speed 0 --model-dir models/tiny-llama --enable-scale-out``
on 127.0.0.1 (they serve both ``/v1/chat/completions`` and ``/inference/v1/generate``, so every
router talks to the same engines) and, in front of the same two:

- **text**: ``python -m router --backend A --backend B`` (``upstream_api = "openai"``: forwarded as sent);
- **tokens**: the same with ``--upstream-api tokens --model-dir models/tiny-llama --prompt-cache-bytes 0``
  (local render, no per-session incremental render: every request is a full render + encode);
- **tokens(remote)** (unless ``--no-remote-render``): tokens mode with ``--render URL`` of a
  ``session-backend --role render`` (the render server's CPU is its own column).

A load generator process (``bench.loadgen``) drives each in turn, closed loop at concurrency c (16),
with the same ``/v1/chat/completions`` bodies: one per session from a pool of 100 (``X-Session-ID``),
each a 4-message conversation of about ``--chars`` (1,000) characters, ``ignore_eos`` so every
answer has exactly ``max_tokens`` tokens. Modes: non-stream (8 tokens) and streams of
``--stream-tokens`` lengths (32 and 128). "direct" sends the text requests to the backends.

The **bare** cost is measured in this process, between the cells, on the same prompts: Hugging Face
``Tokenizer.encode`` of each rendered prompt text plus a ``DecodeStream`` stepped over as many
output ids as the mode's answer has. What tokens mode **adds** beyond tokenizing and detokenizing
is its router CPU per request minus that; the issue's target is added ≤ the text path's whole CPU
per request. Per streamed token: the slope of router CPU per request between the two stream
lengths. TTFT added: tokens' TTFT p50 minus text's at c=16.

**Matched rates** (``--rates 300 600``): CPU per request of an asyncio server falls as its rate
rises (one loop iteration serves several events), and closed loop the text router runs at about
twice tokens mode's rate; so with ``--rates`` every cell is open loop instead (``LoadSpec.rate``:
requests start at fixed intervals over up to c connections), each router at the same request rate,
non-stream only, and the verdict is per rate. The floor is given twice: with ``Tokenizer.encode``
(the issue's words, "the bare ``encode`` + ``DecodeStream`` cost") and with
``Tokenizer.encode_batch_fast`` (what the renderer calls: the same ids without character offsets).

Rounds are interleaved (target order rotates) because the machine is shared and noisy; figures
are medians over rounds with ``[lo–hi]``; ratios and differences are taken within each round
(side by side) and then summarised the same way. CPU per request = utime+stime of the process
tree from /proc over the measured window, per completed request.

**A/B** (``--base DIR``): a frozen copy of another tree (e.g. ``git archive`` of the base commit into
DIR) is run beside this one: its own text and tokens routers (``text(base)``, ``tokens(base)``, started
with DIR as their working directory, so they import DIR's code) in front of the same engines, in the
same interleaved rounds; the verdict table then has a row per tree. ``--no-stream``: non-stream only.

Output: a markdown section ``tokens_overhead`` in ``--out`` and one JSON line per run in
``bench/out/tokens_overhead.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from bench.chat_prompts import chat_bodies
from bench.loadgen import LoadResult, LoadSpec
from bench.procs import LOOPBACK, Proc, free_port, start_process, start_router
from bench.router_overhead import LoadGen, exit_status, machine_facts, process_tree, publish

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
DEFAULT_OUT = os.path.join(BENCH_DIR, "RESULTS.md")
JSONL = os.path.join(BENCH_DIR, "out", "tokens_overhead.jsonl")
SECTION = "tokens_overhead"
MODEL_DIR = os.path.join(REPO, "models", "tiny-llama")
CHAT_PATH = "/v1/chat/completions"
NON_STREAM_TOKENS = 8


# ---------------------------------------------------------------------- the processes
def start_engine(log_dir: str, model_dir: str, *extra: str) -> Proc:
    """A session-backend at --speed 0 serving ``model_dir`` (``extra``: --enable-scale-out, --tokens-only, --role render)."""
    port = free_port()
    return start_process("backends", ["--host", LOOPBACK, "--port", str(port), "--speed", "0",
                                      "--model-dir", model_dir, *extra], port, log_dir, timeout=60)


def tokens_router_args(model_dir: str, *, render: Sequence[str] = (), prompt_cache_bytes: int | None = 0) -> list[str]:
    args = ["--upstream-api", "tokens", "--model-dir", model_dir]
    for url in render:
        args += ["--render", url]
    if prompt_cache_bytes is not None:
        args += ["--prompt-cache-bytes", str(prompt_cache_bytes)]
    return args


#: (text target, tokens target) pairs the verdict compares: this tree's, and the base tree's (--base)
PAIRS = (("text", "tokens"), ("text(base)", "tokens(base)"))


@dataclass
class Target:
    name: str
    urls: list[str]
    groups: Callable[[], dict[str, list[int]]] = field(default=dict)
    is_proxy: bool = True


# ---------------------------------------------------------------------- the bare tokenizer work
@dataclass
class Prompt:
    text: str
    token_ids: list[int]


def rendered_prompts(model_dir: str, bodies: Sequence[str], *, completions: bool = False) -> list[Prompt]:
    """Each body's prompt as the router renders it (text and ids), with the project's own renderer
    (``completions``: the bodies are ``/v1/completions`` ones with one text prompt)."""
    from rendering.model import load_model
    from rendering.render import Renderer

    renderer = Renderer(load_model(model_dir))
    out = []
    for body in bodies:
        if completions:
            [generate] = renderer.render_completions(body.encode())
            out.append(Prompt(msgspec.json.decode(body)["prompt"], list(generate.token_ids)))
        else:
            rendered = renderer.render_chat(body.encode())
            out.append(Prompt(rendered.prompt.text, list(rendered.request.token_ids)))
    return out


def bare_cost_us(model_dir: str, prompts: Sequence[Prompt], output_tokens: int, *, min_seconds: float = 0.3,
                 fast: bool = False, rate: float = 0.0) -> float:
    """CPU µs of ``encode`` of a prompt + a ``DecodeStream`` over ``output_tokens`` ids, per request,
    averaged over the prompts (repeated until ``min_seconds`` of CPU). ``fast``: the encode is
    ``encode_batch_fast([text])`` (no character offsets), as the renderer calls it. ``rate`` > 0:
    paced, one request every 1/``rate`` s (sleeping between them, as a router idles between requests
    at that rate: caches go cold), until ``min_seconds`` of wall time."""
    import tokenizers
    from tokenizers.decoders import DecodeStream

    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    # output ids: ordinary text ids (the prompt's own, past the BOS), as an engine would generate
    outputs = [(p.token_ids[1:] * (1 + output_tokens // max(1, len(p.token_ids) - 1)))[:output_tokens]
               for p in prompts]
    done = 0
    start = time.process_time()
    wall = due = time.perf_counter()
    while True:
        for prompt, out in zip(prompts, outputs, strict=True):
            if rate > 0:
                due += 1.0 / rate
                pause = due - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
            if fast:
                tokenizer.encode_batch_fast([prompt.text], add_special_tokens=False)
            else:
                tokenizer.encode(prompt.text, add_special_tokens=False)
            stream = DecodeStream(skip_special_tokens=True)
            for token in out:
                stream.step(tokenizer, token)
        done += len(prompts)
        spent = time.process_time() - start
        if (time.perf_counter() - wall if rate > 0 else spent) >= min_seconds:
            return spent / done * 1e6


def render_cost_us(model_dir: str, bodies: Sequence[str], *, min_seconds: float = 0.3,
                   completions: bool = False) -> float:
    """CPU µs of ``Renderer.render_chat`` per request (template + validation + encode), for reference;
    ``completions``: of ``Renderer.render_completions`` (validation + encode)."""
    from rendering.model import load_model
    from rendering.render import Renderer

    renderer = Renderer(load_model(model_dir))
    render = renderer.render_completions if completions else renderer.render_chat
    raw = [b.encode() for b in bodies]
    done = 0
    start = time.process_time()
    while True:
        for body in raw:
            render(body)
        done += len(raw)
        spent = time.process_time() - start
        if spent >= min_seconds:
            return spent / done * 1e6


PIECES = ("render_chat", "encode GenerateRequest", "decode GenerateResponse", "ChatDerender.whole")


def pieces_us(model_dir: str, bodies: Sequence[str], output_tokens: int, *, min_seconds: float = 0.2) -> dict[str, float]:
    """CPU µs per request of each in-process piece of a non-stream tokens-mode chat request, with the
    project's own code: render, the generate body's encoding, the engine answer's decoding (a
    ``output_tokens``-token answer) and the derender to a ``chat.completion``. The HTTP work (client
    and engine legs), placement and metrics are the rest of the router's CPU per request."""
    import msgspec as _msgspec

    from rendering.derender import ChatDerender
    from rendering.generate_request import encode_generate_request
    from rendering.generate_response import decode_generate_response
    from rendering.model import load_model
    from rendering.render import Renderer

    model = load_model(model_dir)
    renderer = Renderer(model)
    raw = [b.encode() for b in bodies]
    rendered = [renderer.render_chat(b) for b in raw]
    answers = []
    for r in rendered:
        ids = list(r.request.token_ids[1:1 + output_tokens])
        answers.append(_msgspec.json.encode({
            "request_id": r.request.request_id, "model": model.name, "created": 1,
            "usage": {"prompt_tokens": len(r.request.token_ids), "total_tokens": len(r.request.token_ids) + len(ids),
                      "completion_tokens": len(ids), "prompt_tokens_details": {"cached_tokens": 0}},
            "prompt_token_ids": None, "kv_transfer_params": None, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": ids,
                         "logprobs": None}]}))
    decoded = [decode_generate_response(a) for a in answers]

    def timed(step: Callable[[int], object]) -> float:
        done = 0
        start = time.process_time()
        while True:
            for i in range(len(raw)):
                step(i)
            done += len(raw)
            spent = time.process_time() - start
            if spent >= min_seconds:
                return spent / done * 1e6

    return {
        "render_chat": timed(lambda i: renderer.render_chat(raw[i])),
        "encode GenerateRequest": timed(lambda i: encode_generate_request(rendered[i].request)),
        "decode GenerateResponse": timed(lambda i: decode_generate_response(answers[i])),
        "ChatDerender.whole": timed(lambda i: ChatDerender(
            model, rendered[i].chat, request_id=rendered[i].request.request_id,
            prompt_ids=rendered[i].request.token_ids).whole(decoded[i])),
    }


# ---------------------------------------------------------------------- aggregation
class Cell(msgspec.Struct):
    mode: str
    target: str
    rounds: list[LoadResult] = []


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def fmt(values: Sequence[float], digits: int = 0, signed: bool = False) -> str:
    """median [lo–hi] of ``values`` (just the value when there is one)."""
    if not values:
        return "—"
    spec = f"{'+' if signed else ''}.{digits}f"
    mid = format(median(values), spec)
    if len(values) < 2:
        return mid
    return f"{mid} [{format(min(values), spec)}–{format(max(values), spec)}]"


def cpu(r: LoadResult, group: str = "proxy") -> float:
    return r.cpu_us_per_req.get(group, 0.0)


def per_round(a: Cell | None, b: Cell | None, f: Callable[[LoadResult, LoadResult], float]) -> list[float]:
    """``f`` of the two cells' results round by round (side by side in time)."""
    if a is None or b is None:
        return []
    return [f(x, y) for x, y in zip(a.rounds, b.rounds)]


def mode_tokens(mode: str) -> int:
    """Answer tokens of a mode label: ``non-stream``, ``stream N``, either with `` @R/s`` (open loop)."""
    base = mode.split(" @")[0]
    return NON_STREAM_TOKENS if base == "non-stream" else int(base.split()[1])


def mode_label(mode: str, rate: float) -> str:
    return f"{mode} @{rate:g}/s" if rate > 0 else mode


def mode_rate(mode: str) -> float:
    return float(mode.split(" @")[1].removesuffix("/s")) if " @" in mode else 0.0


def render_report(cells: dict[tuple[str, str], Cell], targets: Sequence[Target], modes: Sequence[str],
                  bare: dict[str, list[float]], render_us: list[float], facts: dict[str, str],
                  args: argparse.Namespace, pieces: Sequence[dict[str, float]] = (),
                  bare_fast: dict[str, list[float]] | None = None,
                  paced: dict[str, dict[str, list[float]]] | None = None) -> str:
    names = [t.name for t in targets]
    stream_modes = [m for m in modes if not m.startswith("non-stream")]
    rates = sorted({mode_rate(m) for m in modes if mode_rate(m) > 0})
    if rates:
        late = sum(r.late for cell in cells.values() for r in cell.rounds)
        load = (f"open loop at {', '.join(f'{r:g}' for r in rates)} req/s (every target at the same rate; requests "
                f"start at fixed intervals over up to c={args.concurrency} keep-alive connections; {late} requests "
                f"in all found every connection busy and waited)")
    else:
        load = f"closed loop at c={args.concurrency}, keep-alive"
    lines = [
        f"## Tokens mode: router CPU per request, streaming derender, TTFT (issue 13) — {facts['date']}",
        "",
        f"- Machine: {facts['nproc']} CPUs ({facts['cpu']}), {facts['kernel']}; load average at start "
        f"{facts['loadavg']} (shared machine, other work running).",
        f"- Versions: Python {facts['python']}, aiohttp {facts['aiohttp']}, uvloop {facts['uvloop']}, "
        f"httptools {facts['httptools']}, msgspec {facts['msgspec']}, tokenizers {facts['tokenizers']}.",
        f"- Command: `{facts['command']}`",
        "- Setup: 2 × `python -m backends --speed 0 --model-dir models/tiny-llama --enable-scale-out` on "
        "127.0.0.1 (the same engines behind every router). **text**: `python -m router --backend A --backend B` "
        "(openai mode). **tokens**: the same with `--upstream-api tokens --model-dir models/tiny-llama "
        "--prompt-cache-bytes 0` (local render, a full render per request). "
        + ("**tokens(remote)**: tokens mode with `--render URL` of a `python -m backends --role render` (its CPU "
           "in the render column). " if "tokens(remote)" in names else "")
        + ("**direct**: the text requests straight to the backends. " if "direct" in names else "")
        + f"Clients: `POST {CHAT_PATH}`, one body per "
        f"session from a pool of {args.sessions} (`X-Session-ID`), a 4-message chat of ~{args.chars} characters "
        f"(~{facts['prompt_tokens']} prompt tokens), `ignore_eos` so answers are exactly `max_tokens` long; "
        f"non-stream {NON_STREAM_TOKENS} tokens"
        + (", streams " + ", ".join(m.split()[1] for m in stream_modes) + " tokens." if stream_modes else "."),
        f"- Method: {load}; per cell {args.warmup:g} s warm-up, "
        f"{args.seconds:g} s measured; {args.rounds} rounds interleaved (target order rotates). Figures: median "
        "over rounds `[lo–hi]`; differences and ratios are taken within a round, then summarised. Router CPU = "
        "utime+stime of the router's process tree from /proc over the window, per completed request. **bare** = "
        "`Tokenizer.encode` of the rendered prompt + a `DecodeStream` stepped over the answer's ids, measured in "
        "the benchmark process on the same prompts (once per round, between cells)"
        + ("; **bare (fast)** the same with `Tokenizer.encode_batch_fast([text])`, the offset-free encode the "
           "renderer calls" if bare_fast else "") + ". Full local render "
        f"(`Renderer.render_chat`, template + checks + encode) of the same bodies: {fmt(render_us)} µs.",
        "- **Target**: what tokens mode adds beyond tokenizing and detokenizing (tokens − bare) ≤ the text "
        "path's whole router CPU per request.",
        "",
        "| mode | target | req/s | p50 ms | TTFT p50 ms | router CPU µs/req | render server CPU µs/req "
        "| backends CPU µs/req | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in modes:
        for name in names:
            cell = cells.get((mode, name))
            if cell is None or not cell.rounds:
                continue
            rs = cell.rounds
            stream = not mode.startswith("non-stream")
            target = next(t for t in targets if t.name == name)
            lines.append(
                f"| {mode} | {name} | {fmt([r.rps for r in rs])} | {fmt([r.p50_ms for r in rs], 2)} | "
                f"{fmt([r.ttft_p50_ms for r in rs], 2) if stream else '—'} | "
                f"{fmt([cpu(r) for r in rs]) if target.is_proxy else '—'} | "
                f"{fmt([cpu(r, 'render') for r in rs]) if 'render' in rs[0].cpu_us_per_req else '—'} | "
                f"{fmt([cpu(r, 'backends') for r in rs])} | {sum(r.errors for r in rs)} |")
    fast_head = (" bare encode_batch_fast + DecodeStream µs | tokens − bare (fast) µs | ≤ text? (per round) |"
                 if bare_fast else "")
    lines += [
        "",
        "| mode | text router CPU µs/req | tokens router CPU µs/req | bare encode + DecodeStream µs | tokens − bare "
        "(added) µs | added ≤ text? (per round) |" + fast_head,
        "|---|---:|---:|---:|---:|---|" + ("---:|---:|---|" if bare_fast else ""),
    ]

    def judged(added: list[float], text: Cell) -> str:
        ok = sum(1 for i, a in enumerate(added) if i < len(text.rounds) and a <= cpu(text.rounds[i]))
        verdict = "✅" if ok == len(added) else ("❌" if ok == 0 else "⚠️")
        return (f"{verdict} {ok}/{len(added)} rounds; median {median(added):.0f} vs "
                f"{median([cpu(r) for r in text.rounds]):.0f}")

    for mode, (text_name, tokens_name) in ((m, pair) for m in modes for pair in PAIRS):
        text, tokens = cells.get((mode, text_name)), cells.get((mode, tokens_name))
        if text is None or tokens is None:
            continue
        b = bare.get(mode, [])
        added = [cpu(t) - b[i] for i, t in enumerate(tokens.rounds) if i < len(b)]
        label = mode + (" (base)" if text_name.endswith("(base)") else "")
        row = (f"| {label} | {fmt([cpu(r) for r in text.rounds])} | {fmt([cpu(r) for r in tokens.rounds])} | "
               f"{fmt(b)} | {fmt(added)} | {judged(added, text)} |")
        if bare_fast:
            f = bare_fast.get(mode, [])
            added_fast = [cpu(t) - f[i] for i, t in enumerate(tokens.rounds) if i < len(f)]
            row += f" {fmt(f)} | {fmt(added_fast)} | {judged(added_fast, text)} |"
        lines.append(row)
    if paced:
        lines += [
            "",
            "The same verdict against floors **paced at the cell's rate** (the bare work done once every 1/rate s "
            "in this process, sleeping in between, as the router idles between requests: cold caches cost the bare "
            "tokenizer work too):",
            "",
            "| mode | floor | floor µs | tokens − floor µs | ≤ text? (per round) |",
            "|---|---|---:|---:|---|",
        ]
        for mode, (text_name, tokens_name) in ((m, pair) for m in modes for pair in PAIRS):
            text, tokens = cells.get((mode, text_name)), cells.get((mode, tokens_name))
            if text is None or tokens is None:
                continue
            label = mode + (" (base)" if text_name.endswith("(base)") else "")
            for floor, values in paced.items():
                f = values.get(mode, [])
                added = [cpu(t) - f[i] for i, t in enumerate(tokens.rounds) if i < len(f)]
                lines.append(f"| {label} | {floor} | {fmt(f)} | {fmt(added)} | {judged(added, text)} |")
    if pieces:
        first = next(m for m in modes if m.startswith("non-stream"))
        text_cpu = [cpu(r) for r in cells[(first, "text")].rounds] if (first, "text") in cells else []
        tokens_cpu = [cpu(r) for r in cells[(first, "tokens")].rounds] if (first, "tokens") in cells else []
        total = [sum(p.values()) for p in pieces]
        lines += [
            "",
            f"Where a non-stream tokens request's router CPU goes: the in-process pieces (this process, the same "
            f"bodies, {NON_STREAM_TOKENS}-token answers, once per round), next to the measured totals.",
            "",
            "| piece | CPU µs per request |",
            "|---|---:|",
            *(f"| `{name}` | {fmt([p[name] for p in pieces])} |" for name in PIECES),
            f"| sum of the pieces | {fmt(total)} |",
            f"| tokens router CPU per request, measured (above{', ' + first if first != 'non-stream' else ''}) "
            f"| {fmt(tokens_cpu)} |",
            f"| text router CPU per request, measured (above{', ' + first if first != 'non-stream' else ''}): its "
            f"HTTP, placement, metrics | {fmt(text_cpu)} |",
        ]
    if len(stream_modes) >= 2:
        short, long_ = stream_modes[0], stream_modes[-1]
        span = mode_tokens(long_) - mode_tokens(short)
        lines += [
            "",
            f"Streaming: router CPU per streamed token = (CPU/req at {mode_tokens(long_)} tokens − at "
            f"{mode_tokens(short)}) / {span}, per round; TTFT at c={args.concurrency}, {short} tokens.",
            "",
            "| target | router CPU µs per streamed token | bare DecodeStream µs per token | TTFT p50 ms | "
            "TTFT added vs text ms |",
            "|---|---:|---:|---:|---:|",
        ]
        bare_slope = [(lb - sb) / span for sb, lb in zip(bare.get(short, []), bare.get(long_, []))]
        for name in names:
            a, z = cells.get((short, name)), cells.get((long_, name))
            if a is None or z is None:
                continue
            target = next(t for t in targets if t.name == name)
            slope = per_round(a, z, lambda x, y: (cpu(y) - cpu(x)) / span) if target.is_proxy else []
            ttft = [r.ttft_p50_ms for r in a.rounds]
            added = per_round(a, cells.get((short, "text")), lambda x, y: x.ttft_p50_ms - y.ttft_p50_ms)
            lines.append(f"| {name} | {fmt(slope, 2) if slope else '—'} | "
                         f"{fmt(bare_slope, 2) if name.startswith('tokens') else '—'} | {fmt(ttft, 2)} | "
                         f"{fmt(added, 2, signed=True) if name.startswith('tokens') else '—'} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tokens_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 round, 0.4 s cells, c=4, streams of 4 and 12 tokens, 20 sessions")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; quick 1)")
    p.add_argument("--seconds", type=float, default=None, help="measured seconds per cell (default 3; quick 0.4)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per cell (default 0.5; quick 0.2)")
    p.add_argument("--concurrency", type=int, default=None, help="default 16; quick 4")
    p.add_argument("--sessions", type=int, default=None, help="X-Session-ID pool (one body each; default 100)")
    p.add_argument("--chars", type=int, default=1000, help="characters of message content per chat (default 1000)")
    p.add_argument("--stream-tokens", type=int, nargs="+", default=None,
                   help="stream lengths in tokens (default 32 128; quick 4 12; not 16: vLLM's SamplingParams default, which a render leaves out and an engine reads as the rest of the context)")
    p.add_argument("--no-remote-render", action="store_true", help="skip the tokens(remote) row")
    p.add_argument("--no-direct", action="store_true", help="skip the direct (no router) row")
    p.add_argument("--no-stream", action="store_true", help="non-stream requests only (no stream cells)")
    p.add_argument("--base", default=None, metavar="DIR",
                   help="A/B: also run text and tokens routers from the tree in DIR (e.g. a `git archive` of the "
                        "base commit), interleaved with this tree's, as text(base) and tokens(base)")
    p.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the --base routers only (repeatable; e.g. LD_PRELOAD=...)")
    p.add_argument("--rates", type=float, nargs="+", default=None, metavar="REQ_PER_S",
                   help="open loop: every target at each of these request rates, non-stream only (default: "
                        "closed loop at --concurrency, non-stream and streams)")
    p.add_argument("--model-dir", default=MODEL_DIR, help="the model folder (default models/tiny-llama)")
    p.add_argument("--section", default=SECTION, help=f"marked section of --out to write (default {SECTION})")
    p.add_argument("--out", default=DEFAULT_OUT, help="markdown file to write the report into")
    p.add_argument("--jsonl", default=JSONL, help="raw results, one JSON line per run appended")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.seconds = args.seconds or (0.4 if args.quick else 3.0)
    args.warmup = args.warmup if args.warmup is not None else (0.2 if args.quick else 0.5)
    args.concurrency = args.concurrency or (4 if args.quick else 16)
    args.sessions = args.sessions or (20 if args.quick else 100)
    args.stream_tokens = sorted(args.stream_tokens or ([4, 12] if args.quick else [32, 128]))
    if min(args.rounds, args.concurrency, args.sessions, args.chars, *args.stream_tokens) < 1 or args.seconds <= 0:
        p.error("--rounds, --seconds, --concurrency, --sessions, --chars and --stream-tokens must be positive")
    if args.rates is not None and min(args.rates) <= 0:
        p.error("--rates must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    import tokenizers

    facts = machine_facts(None, raw_argv, "bench.tokens_overhead")
    facts["tokenizers"] = tokenizers.__version__
    from rendering.model import load_model

    model = load_model(args.model_dir)
    if args.rates:
        modes = [mode_label("non-stream", rate) for rate in args.rates]
    else:
        modes = ["non-stream", *(() if args.no_stream else (f"stream {n}" for n in args.stream_tokens))]
    bodies = {m: chat_bodies(args.sessions, chars=args.chars, model=model.name, max_tokens=mode_tokens(m),
                             stream=not m.startswith("non-stream")) for m in modes}
    non_stream = modes[0]
    prompts = rendered_prompts(args.model_dir, bodies[modes[0]])
    facts["prompt_tokens"] = f"{median([len(p.token_ids) for p in prompts]):.0f}"
    bare: dict[str, list[float]] = {m: [] for m in modes}
    bare_fast: dict[str, list[float]] = {m: [] for m in modes}
    paced: dict[str, dict[str, list[float]]] = {
        "encode + DecodeStream, paced": {m: [] for m in modes},
        "encode_batch_fast + DecodeStream, paced": {m: [] for m in modes}} if args.rates else {}
    render_us: list[float] = []
    pieces: list[dict[str, float]] = []
    cells: dict[tuple[str, str], Cell] = {}
    started: list[Proc] = []
    loadgen: LoadGen | None = None
    with tempfile.TemporaryDirectory(prefix="bench-tokens-overhead-") as tmp:
        try:
            engines = [start_engine(tmp, args.model_dir, "--enable-scale-out") for _ in range(2)]
            started += engines
            engine_pids = [e.pid for e in engines]
            route = [a for e in engines for a in ("--backend", e.url)]
            text = start_router(tmp, *route, "--policy", "session")
            tokens = start_router(tmp, *route, "--policy", "session", *tokens_router_args(args.model_dir))
            started += [text, tokens]

            def groups(router: Proc, render: Proc | None = None) -> Callable[[], dict[str, list[int]]]:
                def make() -> dict[str, list[int]]:
                    out = {"proxy": process_tree(router.pid), "backends": engine_pids}
                    if render is not None:
                        out["render"] = [render.pid]
                    return out
                return make

            targets = [] if args.no_direct else [
                Target("direct", [e.url for e in engines], lambda: {"backends": engine_pids}, is_proxy=False)]
            targets += [Target("text", [text.url], groups(text)), Target("tokens", [tokens.url], groups(tokens))]
            if args.base:
                base_env = dict(item.split("=", 1) for item in args.base_env)
                text_base = start_router(tmp, *route, "--policy", "session", tree=args.base, env=base_env)
                tokens_base = start_router(tmp, *route, "--policy", "session", *tokens_router_args(args.model_dir),
                                           tree=args.base, env=base_env)
                started += [text_base, tokens_base]
                targets += [Target("text(base)", [text_base.url], groups(text_base)),
                            Target("tokens(base)", [tokens_base.url], groups(tokens_base))]
            if not args.no_remote_render:
                render = start_engine(tmp, args.model_dir, "--role", "render")
                remote = start_router(tmp, *route, "--policy", "session",
                                      *tokens_router_args(args.model_dir, render=[render.url]))
                started += [render, remote]
                targets.append(Target("tokens(remote)", [remote.url], groups(remote, render)))

            loadgen = LoadGen()
            total = args.rounds * len(modes) * len(targets)
            done = 0
            for rnd in range(args.rounds):
                render_us.append(render_cost_us(args.model_dir, bodies[non_stream],
                                                min_seconds=0.05 if args.quick else 0.3))
                pieces.append(pieces_us(args.model_dir, bodies[non_stream], NON_STREAM_TOKENS,
                                        min_seconds=0.03 if args.quick else 0.2))
                for index, mode in enumerate(modes):
                    bare[mode].append(bare_cost_us(args.model_dir, prompts, mode_tokens(mode),
                                                   min_seconds=0.05 if args.quick else 0.3))
                    bare_fast[mode].append(bare_cost_us(args.model_dir, prompts, mode_tokens(mode),
                                                        min_seconds=0.05 if args.quick else 0.3, fast=True))
                    for floor, values in paced.items():
                        values[mode].append(bare_cost_us(args.model_dir, prompts, mode_tokens(mode),
                                                         min_seconds=0.2 if args.quick else 1.5,
                                                         fast="batch_fast" in floor, rate=mode_rate(mode)))
                    shift = (rnd + index) % len(targets)
                    for target in targets[shift:] + targets[:shift]:
                        spec = LoadSpec(urls=target.urls, path=CHAT_PATH, model=model.name,
                                        stream=not mode.startswith("non-stream"), max_tokens=mode_tokens(mode),
                                        rate=mode_rate(mode),
                                        concurrency=args.concurrency, seconds=args.seconds, warmup_s=args.warmup,
                                        sessions=args.sessions, bodies=bodies[mode], cpu_groups=target.groups())
                        result = loadgen.run(spec)
                        cells.setdefault((mode, target.name), Cell(mode, target.name)).rounds.append(result)
                        done += 1
                        print(f"[{done}/{total}] round {rnd + 1} {mode:<11} {target.name:<15} {result.rps:7.0f} req/s "
                              f"p50 {result.p50_ms:7.2f} ms  ttft {result.ttft_p50_ms:6.2f} ms  router "
                              f"{cpu(result):6.0f} us/req  errors {result.errors}  late {result.late}"
                              + (f" ({result.first_error})" if result.first_error else ""), file=sys.stderr, flush=True)
            dead = [p for p in started if not p.alive()]
            if dead:
                raise RuntimeError(f"a process died during the benchmark: {[p.args for p in dead]}")
        finally:
            if loadgen is not None:
                loadgen.stop()
            for proc in reversed(started):
                proc.stop()

    publish(render_report(cells, targets, modes, bare, render_us, facts, args, pieces, bare_fast, paced),
            args.out, args.section, args.jsonl,
            {"facts": facts, "bare_us": bare, "bare_fast_us": bare_fast, "bare_paced_us": paced,
             "render_us": render_us, "pieces_us": pieces, "cells": list(cells.values())})
    return exit_status(cells)


if __name__ == "__main__":
    sys.exit(main())
