"""Tokens mode's own Python work per non-stream chat request, warm and in process, with the encode
taken out: what the router adds around tokenizing and detokenizing (issue 13, "Speed").

    python -m bench.tokens_glue [--base DIR ...] [--repeats 15] [--rounds 3]

The same 100 bodies as ``bench.tokens_overhead`` (4-message chats of ~1,000 characters, 8-token
answers). Each prompt's ids are encoded once beforehand and the renderer's encoder is replaced by a
lookup of them, so the figures hold everything of the local render but the tokenizer call:

- **glue**: ``Renderer.render_chat`` + ``generate_payload`` + ``engine_headers`` + ``ChatDerender`` and
  its ``whole`` of the engine's answer (decoded from JSON): the tokens-mode work of one request
  besides the encode and the HTTP exchanges the text path has too;
- **render**, **payload**, **derender**: its parts.

CPU µs per request (``time.process_time``), the minimum over ``--repeats`` passes over the bodies
(the machine is shared: the minimum is the least disturbed pass). ``--base DIR``: the same measured
with the code of the tree in DIR (e.g. a ``git archive`` of the base commit), in a child process with
DIR first on ``sys.path``; trees alternate for ``--rounds`` rounds and each figure is the median over
rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
MODEL_DIR = os.path.join(REPO, "models", "tiny-llama")
PARTS = ("glue", "render", "payload", "derender")


def measure(model_dir: str, repeats: int) -> dict[str, float]:
    """The figures for the code importable here (this process's ``sys.path``)."""
    import msgspec

    from bench.chat_prompts import chat_bodies
    from rendering.derender import ChatDerender
    from rendering.generate_response import decode_generate_response
    from rendering.model import load_model
    from rendering.render import Renderer
    from router.tokens.engine import engine_headers, generate_payload

    model = load_model(model_dir)
    renderer = Renderer(model)
    bodies = [b.encode() for b in chat_bodies(100, chars=1000, model=model.name, max_tokens=8, stream=False)]
    rendered = [renderer.render_chat(body, request_id="chatcmpl-bench") for body in bodies]
    answers = []
    for r in rendered:
        ids = list(r.request.token_ids[1:9])
        n = len(r.request.token_ids)
        answers.append(msgspec.json.encode({
            "request_id": r.request.request_id, "model": model.name, "created": 1,
            "usage": {"prompt_tokens": n, "total_tokens": n + len(ids), "completion_tokens": len(ids),
                      "prompt_tokens_details": {"cached_tokens": 0}},
            "prompt_token_ids": None, "kv_transfer_params": None, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": ids,
                         "logprobs": None}]}))
    encoder = renderer._prompts  # noqa: SLF001 - the benchmark swaps the tokenizer call for a lookup
    known = {r.prompt.text: encoder.ids(r.prompt.text) for r in rendered}
    encoder.ids = lambda text: list(known[text])  # a fresh list, as an encode returns

    def one(i: int) -> bytes:
        r = renderer.render_chat(bodies[i], request_id="chatcmpl-bench")
        generate_payload(r.request, stream=False)
        engine_headers("bench", "session-1")
        derender = ChatDerender(model, r.chat, request_id=r.request.request_id, created=1,
                                prompt_ids=r.request.token_ids)
        return derender.whole(decode_generate_response(answers[i]))

    def best(step: Callable[[int], object]) -> float:
        low = float("inf")
        for _ in range(repeats):
            start = time.process_time()
            for _ in range(2):
                for i in range(len(bodies)):
                    step(i)
            low = min(low, (time.process_time() - start) / (2 * len(bodies)) * 1e6)
        return low

    return {
        "glue": best(one),
        "render": best(lambda i: renderer.render_chat(bodies[i], request_id="chatcmpl-bench")),
        "payload": best(lambda i: generate_payload(rendered[i].request, stream=False)),
        "derender": best(lambda i: ChatDerender(model, rendered[i].chat, request_id="chatcmpl-bench", created=1,
                                                prompt_ids=rendered[i].request.token_ids)
                         .whole(decode_generate_response(answers[i]))),
    }


def measure_in(tree: str, model_dir: str, repeats: int) -> dict[str, float]:
    """``measure`` in a child process (this file run as a script) that imports ``tree``'s code."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", tree, "--model-dir", model_dir,
                          "--repeats", str(repeats)], cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tokens_glue", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", action="append", default=[], metavar="DIR", help="another tree to measure alongside")
    p.add_argument("--repeats", type=int, default=15, help="passes per figure; the minimum is kept (default 15)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--model-dir", default=MODEL_DIR)
    p.add_argument("--child", metavar="TREE", help=argparse.SUPPRESS)  # one measurement with TREE's code
    args = p.parse_args(argv)
    if args.child:
        sys.path.insert(0, args.child)
        print(json.dumps(measure(args.model_dir, args.repeats)))
        return 0
    trees = [REPO, *args.base]
    results: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            results[tree].append(measure_in(tree, args.model_dir, args.repeats))
    print("| tree | " + " | ".join(f"{part} µs" for part in PARTS) + " |")
    print("|---|" + "---:|" * len(PARTS))
    for tree in trees:
        rounds = results[tree]
        cells = []
        for part in PARTS:
            values = [r[part] for r in rounds]
            cells.append(f"{statistics.median(values):.1f} [{min(values):.1f}–{max(values):.1f}]")
        print(f"| {'this tree' if tree == REPO else tree} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
