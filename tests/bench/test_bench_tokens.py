"""The tokens-mode benchmarks work: sized chat bodies, the load generator sending them, the report's
arithmetic (added = tokens − bare against text, the per-token slope, TTFT added, local / server
ratios), and ``--quick`` runs of ``bench.tokens_overhead`` and ``bench.render_server`` end to end
(no timing assertions: the figures are the benchmark's, not the test's)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bench import render_server, tokens_overhead
from bench.chat_prompts import chat_bodies, chat_messages
from bench.loadgen import LoadResult, LoadSpec, build_requests
from bench.procs import REPO, start_router


def test_chat_bodies_have_the_asked_size_and_differ_per_session() -> None:
    for chars in (200, 1000, 3600):
        messages = chat_messages(3, chars)
        size = sum(len(m["content"]) for m in messages)
        assert chars - 10 <= size <= chars + 60, (chars, size)
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    bodies = chat_bodies(5, chars=500, model="tiny-llama", max_tokens=8, stream=True)
    decoded = [msgspec.json.decode(b) for b in bodies]
    assert len(set(bodies)) == 5 and chat_bodies(5, chars=500, model="tiny-llama", max_tokens=8, stream=True) == bodies
    assert all(d["model"] == "tiny-llama" and d["max_tokens"] == 8 and d["stream"] is True and d["ignore_eos"]
               for d in decoded)
    assert len({d["messages"][1]["content"] for d in decoded}) == 5


def test_loadgen_sends_the_given_bodies_one_per_session() -> None:
    bodies = ['{"a": 1}', '{"b": 22}']
    spec = LoadSpec(urls=["http://127.0.0.1:9"], path="/v1/chat/completions", sessions=3, bodies=bodies)
    requests = build_requests(spec, "127.0.0.1:9")
    assert [r.split(b"\r\n\r\n", 1)[1] for r in requests] == [b'{"a": 1}', b'{"b": 22}', b'{"a": 1}']
    assert requests[1].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"X-Session-ID: bench-1\r\n" in requests[1] and b"Content-Length: 9\r\n" in requests[1]
    default = build_requests(LoadSpec(urls=["http://127.0.0.1:9"], sessions=1), "h")[0]
    assert b'"prompt":"bench session 0' in default  # without bodies: the small completion, as before


def _result(cpu: float, ttft: float = 0.0, render: float | None = None) -> LoadResult:
    groups = {"proxy": cpu, "backends": 100.0} | ({"render": render} if render is not None else {})
    return LoadResult(requests=100, errors=0, window_s=1.0, rps=100.0, p50_ms=2.0, p99_ms=3.0, ttft_p50_ms=ttft,
                      cpu_us_per_req=groups)


def test_tokens_report_compares_added_cost_with_the_text_path_round_by_round() -> None:
    args = argparse.Namespace(sessions=10, chars=1000, concurrency=16, warmup=0.5, seconds=3.0, rounds=2)
    modes = ["non-stream", "stream 16", "stream 128"]
    targets = [tokens_overhead.Target("text", []), tokens_overhead.Target("tokens", [])]
    # text 100/110 µs; tokens 400/430 µs; bare 320/300 µs: added 80 and 130 -> round 1 ok, round 2 not
    cells = {
        ("non-stream", "text"): tokens_overhead.Cell("non-stream", "text", [_result(100), _result(110)]),
        ("non-stream", "tokens"): tokens_overhead.Cell("non-stream", "tokens", [_result(400), _result(430)]),
        ("stream 16", "text"): tokens_overhead.Cell("stream 16", "text", [_result(150, 2.0), _result(150, 2.5)]),
        ("stream 16", "tokens"): tokens_overhead.Cell("stream 16", "tokens", [_result(500, 3.0), _result(520, 3.0)]),
        ("stream 128", "text"): tokens_overhead.Cell("stream 128", "text", [_result(374, 2.0), _result(374, 2.0)]),
        ("stream 128", "tokens"): tokens_overhead.Cell("stream 128", "tokens", [_result(1620, 3), _result(1640, 3)]),
    }
    bare = {"non-stream": [320.0, 300.0], "stream 16": [330.0, 330.0], "stream 128": [442.0, 442.0]}
    facts = {"date": "d", "nproc": "2", "cpu": "c", "kernel": "k", "loadavg": "0", "python": "3.11", "aiohttp": "a",
             "uvloop": "u", "httptools": "h", "msgspec": "m", "tokenizers": "t", "command": "cmd", "prompt_tokens": "300"}
    pieces = [dict.fromkeys(tokens_overhead.PIECES, 10.0), dict.fromkeys(tokens_overhead.PIECES, 20.0)]
    text = tokens_overhead.render_report(cells, targets, modes, bare, [700.0], facts, args, pieces)
    assert "| `render_chat` | 15 [10–20] |" in text and "| sum of the pieces | 60 [40–80] |" in text
    assert "| tokens router CPU per request, measured (above) | 415 [400–430] |" in text
    row = next(line for line in text.splitlines() if line.startswith("| non-stream | 105 [100–110] | 415 [400–430]"))
    assert "| 310 [300–320] | 105 [80–130] | ⚠️ 1/2 rounds; median 105 vs 105 |" in row
    stream = next(line for line in text.splitlines() if line.startswith("| stream 16 | 150 "))
    assert "| 180 [170–190] | ❌ 0/2 rounds; median 180 vs 150 |" in stream  # 500-330, 520-330 over 150
    # per streamed token: text (374-150)/112 = 2.00; tokens (1620-500)/112 = 10.00 and (1640-520)/112 = 10.00
    per_token = {line.split("|")[1].strip(): line for line in text.splitlines() if re.match(r"\| (text|tokens) \| \d", line)}
    assert "| 2.00 [2.00–2.00] |" in per_token["text"] and "| 10.00 [10.00–10.00] |" in per_token["tokens"]
    assert "| 1.00 [1.00–1.00] |" in per_token["tokens"]  # bare DecodeStream slope (442-330)/112
    assert "| +0.75 [+0.50–+1.00] |" in per_token["tokens"]  # TTFT added: 3.0-2.0 and 3.0-2.5


def test_tokens_report_judges_the_base_tree_beside_this_one() -> None:
    """--base: the base tree's text and tokens routers get their own verdict row, from their own cells."""
    args = argparse.Namespace(sessions=10, chars=1000, concurrency=16, warmup=0.5, seconds=3.0, rounds=2)
    names = ("text", "tokens", "text(base)", "tokens(base)")
    targets = [tokens_overhead.Target(name, []) for name in names]
    cpu = {"text": (100, 110), "tokens": (400, 430), "text(base)": (120, 120), "tokens(base)": (500, 520)}
    cells = {("non-stream", name): tokens_overhead.Cell("non-stream", name, [_result(a), _result(b)])
             for name, (a, b) in cpu.items()}
    facts = {"date": "d", "nproc": "2", "cpu": "c", "kernel": "k", "loadavg": "0", "python": "3.11", "aiohttp": "a",
             "uvloop": "u", "httptools": "h", "msgspec": "m", "tokenizers": "t", "command": "cmd", "prompt_tokens": "300"}
    text = tokens_overhead.render_report(cells, targets, ["non-stream"], {"non-stream": [320.0, 300.0]}, [700.0],
                                         facts, args)
    ours = next(line for line in text.splitlines() if line.startswith("| non-stream | 105 [100–110] | 415"))
    base = next(line for line in text.splitlines() if line.startswith("| non-stream (base) | 120 [120–120] | 510"))
    assert "| 105 [80–130] | ⚠️ 1/2 rounds; median 105 vs 105 |" in ours
    assert "| 200 [180–220] | ❌ 0/2 rounds; median 200 vs 120 |" in base  # 500-320, 520-300 over 120


def test_start_router_runs_the_named_trees_code(tmp_path: Path) -> None:
    """--base's routers (``start_router(tree=...)``) import the base tree's code: the tree is their working
    directory, and ``env`` reaches them."""
    tree = tmp_path / "tree"
    (tree / "router").mkdir(parents=True)
    (tree / "router" / "__init__.py").write_text("")
    (tree / "router" / "__main__.py").write_text(
        "import os, sys\nopen(os.environ['MARK'], 'w').write(__file__)\nsys.exit(3)\n")
    mark = tmp_path / "mark"
    with pytest.raises(AssertionError, match="exited with 3"):
        start_router(str(tmp_path), tree=str(tree), env={"MARK": str(mark)})
    assert mark.read_text() == str(tree / "router" / "__main__.py")


def test_tokens_glue_measures_this_tree_and_a_base_one() -> None:
    """bench.tokens_glue: every part measured, in process and in a child importing another tree."""
    from bench import tokens_glue

    here = tokens_glue.measure(tokens_glue.MODEL_DIR, repeats=1)
    assert set(here) == set(tokens_glue.PARTS) and all(v > 0 for v in here.values())
    assert here["glue"] > here["payload"]
    child = tokens_glue.measure_in(str(REPO), tokens_glue.MODEL_DIR, repeats=1)
    assert set(child) == set(tokens_glue.PARTS) and all(v > 0 for v in child.values())


def test_render_report_ratio_and_target() -> None:
    args = argparse.Namespace(sessions=5, chars=5500, concurrency=[1, 4], warmup=0.5, seconds=3.0, rounds=2,
                              route="chat")
    facts = {"date": "d", "nproc": "2", "cpu": "c", "kernel": "k", "loadavg": "0", "python": "3.11", "tokenizers": "t",
             "jinja2": "j", "vllm": "0.32.0", "command": "cmd", "prompt_tokens": "1000"}
    server = lambda cpu: LoadResult(requests=10, errors=0, window_s=1.0, rps=10.0, p50_ms=3.0, p99_ms=4.0,  # noqa: E731
                                    cpu_us_per_req={"server": cpu})
    cells = {"ours c=4": render_server.Cell("ours", 4, [server(1000.0), server(1200.0)]),
             "vllm c=4": render_server.Cell("vllm", 4, [server(3000.0), server(3300.0)])}
    text = render_server.render_report([900.0, 1000.0], cells, {"ours": True, "vllm": True}, facts, args, "",
                                       [800.0, 850.0])
    assert "| its floor: `Tokenizer.encode` of the rendered text alone | — | 825 [800–850] |" in text
    ours = next(line for line in text.splitlines() if line.startswith("| ours | 4 | 1100 [1000–1200] |"))
    vllm = next(line for line in text.splitlines() if line.startswith("| vllm | 4 | 3150 [3000–3300] |"))
    assert "| 0.87 [0.83–0.90] | ❌ 0/2 |" in ours
    assert "| 0.30 [0.30–0.30] | ✅ 2/2 |" in vllm
    assert "ours yes, vllm yes" in text
    assert text.startswith("## Local render vs a render server") and "`POST /v1/chat/completions/render` bodies" in text
    args.route = "completions"
    text = render_server.render_report([900.0, 1000.0], cells, {"ours": True, "vllm": True}, facts, args, "",
                                       [800.0, 850.0])
    assert text.startswith("## Local completions render vs a render server")
    assert "`POST /v1/completions/render` bodies (the `/v1/completions` body)" in text
    assert "| local (`Renderer.render_completions`) | — | 950 [900–1000] |" in text
    assert "| its floor: `Tokenizer.encode` of the prompt text alone | — | 825 [800–850] |" in text


def test_render_server_routes_write_their_own_sections() -> None:
    assert render_server.parse_args([]).section == "render_server"
    assert render_server.parse_args(["--route", "completions"]).section == "render_server_completions"
    assert render_server.parse_args(["--route", "completions", "--section", "x"]).section == "x"


# ---------------------------------------------------------------------- end to end (--quick)
def _run(module: str, tmp_path: Path, *extra: str) -> tuple[str, str]:
    out = tmp_path / "RESULTS.md"
    out.write_text("# Benchmark results\n\nother results stay\n")
    proc = subprocess.run([sys.executable, "-m", module, "--quick", "--out", str(out), "--jsonl",
                           str(tmp_path / "runs.jsonl"), *extra], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "other results stay" in text
    return text, (tmp_path / "runs.jsonl").read_text()


@pytest.mark.slow
def test_tokens_overhead_quick_run(tmp_path: Path) -> None:
    text, jsonl = _run("bench.tokens_overhead", tmp_path)
    assert "<!-- tokens_overhead:begin -->" in text and "python -m bench.tokens_overhead --quick" in text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| (non-stream|stream \d+) \| [a-z]", line)]  # target rows
    seen = {(c[0].strip(), c[1].strip()) for c in rows if len(c) == 9}
    modes = ("non-stream", "stream 4", "stream 12")
    assert seen == {(m, t) for m in modes for t in ("direct", "text", "tokens", "tokens(remote)")}
    for cols in rows:
        if len(cols) == 9:
            assert float(cols[2].split()[0]) > 0 and cols[-1].strip() == "0", cols  # req/s, errors
    assert re.search(r"^\| non-stream \| \d+ \| \d+ \| \d+ \| -?\d+ \|", text, re.M)  # the added-cost row
    assert re.search(r"^\| tokens \| -?\d+\.\d+ \| -?\d+\.\d+ \| \d+\.\d+ \| [+-]\d+\.\d+ \|$", text, re.M)
    record: dict[str, Any] = msgspec.json.decode(jsonl.splitlines()[-1])
    assert all(r["requests"] > 0 and r["errors"] == 0 for cell in record["cells"] for r in cell["rounds"])
    assert all(v and v[0] > 0 for v in record["bare_us"].values())
    assert set(record["pieces_us"][0]) == set(tokens_overhead.PIECES) and all(record["pieces_us"][0].values())


@pytest.mark.slow
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_render_server_quick_run(tmp_path: Path, route: str) -> None:
    text, jsonl = _run("bench.render_server", tmp_path, "--vllm-python", "", "--route", route)
    section, call = (("render_server", "render_chat") if route == "chat"
                     else ("render_server_completions", "render_completions"))
    assert f"<!-- {section}:begin -->" in text
    assert "ours (`--role render`) yes" in text  # the same token ids as the local render
    assert "The vllm row was not run" in text
    assert re.search(rf"^\| local \(`Renderer.{call}`\) \| — \| \d+ \|", text, re.M)
    for c in (1, 4):
        assert re.search(rf"^\| ours \(`--role render`\) \| {c} \| \d+ \| \d+ \| \d+\.\d+ \| \d+\.\d+ \| .* \| 0 \|$",
                         text, re.M), text
    record: dict[str, Any] = msgspec.json.decode(jsonl.splitlines()[-1])
    assert record["same_ids"] == {"ours (`--role render`)": True} and record["local_us"][0] > 0
    assert record["bare_encode_us"][0] > 0


def test_tokens_report_at_matched_rates_judges_both_floors() -> None:
    args = argparse.Namespace(sessions=10, chars=1000, concurrency=16, warmup=0.5, seconds=3.0, rounds=2)
    assert tokens_overhead.mode_label("non-stream", 300.0) == "non-stream @300/s"
    assert tokens_overhead.mode_rate("non-stream @300/s") == 300.0 and tokens_overhead.mode_rate("stream 32") == 0.0
    assert tokens_overhead.mode_tokens("non-stream @300/s") == tokens_overhead.NON_STREAM_TOKENS
    assert tokens_overhead.mode_tokens("stream 32 @600/s") == 32
    modes = ["non-stream @300/s", "non-stream @600/s"]
    targets = [tokens_overhead.Target("text", []), tokens_overhead.Target("tokens", [])]
    late = LoadResult(requests=100, errors=0, window_s=1.0, rps=99.0, p50_ms=2.0, p99_ms=3.0, late=3,
                      cpu_us_per_req={"proxy": 400.0, "backends": 100.0})
    cells = {
        (modes[0], "text"): tokens_overhead.Cell(modes[0], "text", [_result(200), _result(220)]),
        (modes[0], "tokens"): tokens_overhead.Cell(modes[0], "tokens", [late, _result(440)]),
        (modes[1], "text"): tokens_overhead.Cell(modes[1], "text", [_result(150), _result(150)]),
        (modes[1], "tokens"): tokens_overhead.Cell(modes[1], "tokens", [_result(350), _result(360)]),
    }
    bare = {modes[0]: [250.0, 250.0], modes[1]: [250.0, 250.0]}
    fast = {modes[0]: [180.0, 180.0], modes[1]: [180.0, 180.0]}
    facts = {"date": "d", "nproc": "2", "cpu": "c", "kernel": "k", "loadavg": "0", "python": "3.11", "aiohttp": "a",
             "uvloop": "u", "httptools": "h", "msgspec": "m", "tokenizers": "t", "command": "cmd", "prompt_tokens": "300"}
    text = tokens_overhead.render_report(cells, targets, modes, bare, [250.0], facts, args, bare_fast=fast)
    assert "open loop at 300, 600 req/s" in text and "3 requests in all found every connection busy" in text
    assert "**direct**" not in text and "streams" not in text
    # 300/s: added (encode) 150, 190 vs text 200, 220 -> met; added (fast) 220, 260 -> not met
    row = next(line for line in text.splitlines() if line.startswith("| non-stream @300/s | 210 [200–220] |"))
    assert "| 170 [150–190] | ✅ 2/2 rounds; median 170 vs 210 | 180 [180–180] | 240 [220–260] | ❌ 0/2 rounds; " \
           "median 240 vs 210 |" in row
    # 600/s: added (encode) 100, 110 vs 150 -> met; added (fast) 170, 180 -> not met
    row = next(line for line in text.splitlines() if line.startswith("| non-stream @600/s | 150 [150–150] |"))
    assert "| ✅ 2/2 rounds; median 105 vs 150 |" in row and "| ❌ 0/2 rounds; median 175 vs 150 |" in row
    assert "Streaming:" not in text  # no per-token slope across rates
    paced = {"encode, paced": {modes[0]: [300.0, 300.0], modes[1]: [260.0, 260.0]}}
    text = tokens_overhead.render_report(cells, targets, modes, bare, [250.0], facts, args, bare_fast=fast, paced=paced)
    # 300/s: 400-300, 440-300 = 100, 140 vs 200, 220; 600/s: 350-260, 360-260 = 90, 100 vs 150
    assert "| non-stream @300/s | encode, paced | 300 [300–300] | 120 [100–140] | ✅ 2/2 rounds; median 120 vs 210 |" in text
    assert "| non-stream @600/s | encode, paced | 260 [260–260] | 95 [90–100] | ✅ 2/2 rounds; median 95 vs 150 |" in text


def test_a_paced_floor_sleeps_between_requests_and_counts_cpu_only() -> None:
    prompts = tokens_overhead.rendered_prompts(tokens_overhead.MODEL_DIR, chat_bodies(
        4, chars=300, model="tiny-llama", max_tokens=8, stream=False))
    started, cpu0 = time.perf_counter(), time.process_time()
    cost = tokens_overhead.bare_cost_us(tokens_overhead.MODEL_DIR, prompts, 8, min_seconds=0.2, rate=50.0)
    # ~10-12 requests over 0.2 s of wall time (not 0.2 s of CPU, as many as fit, as unpaced)
    assert time.perf_counter() - started >= 0.2 and time.process_time() - cpu0 < 0.1 and cost > 0


@pytest.mark.slow
def test_tokens_overhead_quick_run_at_matched_rates(tmp_path: Path) -> None:
    text, jsonl = _run("bench.tokens_overhead", tmp_path, "--rates", "40", "--no-remote-render", "--no-direct")
    assert "open loop at 40 req/s" in text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| non-stream @40/s \| [a-z]", line)]
    assert {c[1].strip() for c in rows if len(c) == 9} == {"text", "tokens"}
    assert all(0 < float(c[2].split()[0]) <= 45 for c in rows if len(c) == 9), rows  # req/s held to the rate
    assert re.search(r"^\| non-stream @40/s \| \d+ \| \d+ \| \d+ \| -?\d+ \| .* \| \d+ \| -?\d+ \| .* \|$", text, re.M)
    record: dict[str, Any] = msgspec.json.decode(jsonl.splitlines()[-1])
    assert all(v and v[0] > 0 for v in record["bare_fast_us"].values())
    assert all(v and v[0] > 0 for floor in record["bare_paced_us"].values() for v in floor.values())
    assert re.search(r"^\| non-stream @40/s \| encode \+ DecodeStream, paced \| \d+ \| -?\d+ \| ", text, re.M)
    assert all(r["requests"] > 0 and r["errors"] == 0 for cell in record["cells"] for r in cell["rounds"])
