"""The router-overhead benchmark works: its load generator counts right, its nginx is loopback-only,
its report keeps the rest of RESULTS.md, and a ``--quick`` run end to end produces a full table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from typing import Any

import msgspec
import pytest
from aiohttp import web

from bench.loadgen import LoadSpec, percentile, run_load
from bench.nginx import find_nginx, write_conf
from bench.procs import REPO, start_router
from bench.loadgen import LoadResult
from bench.router_overhead import (BEGIN, END, Cell, Target, balance, baseline_tree, bench_backend, busiest_share, checks,
                                   parse_args, process_tree, render, served, write_section)

SSE_EVENTS = 16


def _sse_app(*, status: int = 200, done: bool = True, counter: list[int] | None = None) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert request.headers["X-Session-ID"].startswith("bench-")
        if counter is not None:
            counter.append(1)
        if status != 200:
            return web.json_response({"error": {"message": "nope"}}, status=status)
        if not body["stream"]:
            return web.json_response({"choices": [{"text": "x" * body["max_tokens"]}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(SSE_EVENTS):
            await response.write(b'data: {"choices":[{"text":" t%d"}]}\n\n' % i)
        if done:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def _spec(server: Any, **kw: Any) -> LoadSpec:
    base = {"urls": [str(server.make_url("/")).rstrip("/")], "concurrency": 4, "seconds": 0.3, "warmup_s": 0.05,
            "sessions": 10, "cpu_groups": {"me": [os.getpid()]}}
    base.update(kw)
    return LoadSpec(**base)


# ---------------------------------------------------------------------- load generator
async def test_loadgen_counts_streams_and_ttft(aiohttp_server: Any) -> None:
    served: list[int] = []
    server = await aiohttp_server(_sse_app(counter=served))
    result = await run_load(_spec(server, stream=True, max_tokens=16))
    assert result.errors == 0, result.first_error
    assert result.requests > 0
    # requests in the window are a subset of what the server answered (warm-up and drain add more)
    assert result.requests <= len(served)
    assert 0 < result.ttft_p50_ms <= result.p50_ms
    assert result.p50_ms <= result.p99_ms
    assert result.rps == pytest.approx(result.requests / result.window_s)
    # server and client share this process, so its CPU per request is real and positive
    assert result.cpu_us_per_req["me"] > 0
    assert result.client_cpu_us_per_req > 0


async def test_loadgen_non_stream_has_no_ttft(aiohttp_server: Any) -> None:
    server = await aiohttp_server(_sse_app())
    result = await run_load(_spec(server))
    assert result.errors == 0 and result.requests > 0
    assert result.ttft_p50_ms == 0.0 and result.p50_ms > 0


async def test_loadgen_counts_error_statuses(aiohttp_server: Any) -> None:
    server = await aiohttp_server(_sse_app(status=503))
    result = await run_load(_spec(server))
    assert result.requests == 0
    assert result.errors > 0 and result.first_error == "status 503"


async def test_loadgen_counts_streams_without_done_as_errors(aiohttp_server: Any) -> None:
    server = await aiohttp_server(_sse_app(done=False))
    result = await run_load(_spec(server, stream=True))
    assert result.requests == 0
    assert result.errors > 0 and "[DONE]" in result.first_error


async def test_loadgen_reports_refused_connections() -> None:
    from bench.procs import free_port

    port = free_port()  # nothing listens there
    result = await run_load(LoadSpec(urls=[f"http://127.0.0.1:{port}"], concurrency=2, seconds=0.1, warmup_s=0.0))
    assert result.requests == 0 and result.errors > 0
    assert "connect" in result.first_error


def test_percentile_nearest_rank() -> None:
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 0.50) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) == 0.0


# ---------------------------------------------------------------------- nginx and the report
def test_nginx_conf_is_loopback_keepalive_unbuffered(tmp_path: Any) -> None:
    path = write_conf(str(tmp_path), 18080, ["http://127.0.0.1:8100", "http://127.0.0.1:8101"])
    with open(path, encoding="utf-8") as fh:
        conf = fh.read()
    assert "listen 127.0.0.1:18080" in conf
    assert "server 127.0.0.1:8100;" in conf and "server 127.0.0.1:8101;" in conf
    assert re.search(r"keepalive \d+;", conf)
    assert "proxy_buffering off;" in conf and "access_log off;" in conf
    assert 'proxy_set_header Connection "";' in conf and "proxy_http_version 1.1;" in conf
    assert f"error_log {tmp_path}/error.log" in conf
    with pytest.raises(ValueError, match="never 80"):
        write_conf(str(tmp_path), 80, ["http://127.0.0.1:8100"])
    with pytest.raises(ValueError, match="loopback"):
        write_conf(str(tmp_path), 18080, ["http://10.0.0.1:8100"])


def test_write_section_replaces_only_its_block(tmp_path: Any) -> None:
    out = tmp_path / "RESULTS.md"
    out.write_text("# Benchmark results\n\n## Multi-turn\nkeep me\n")
    write_section(str(out), "## Router overhead\nfirst")
    write_section(str(out), "## Router overhead\nsecond")
    text = out.read_text()
    assert "keep me" in text and "second" in text and "first" not in text
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    out.write_text(text + "\n## Soak\nalso keep me\n")
    write_section(str(out), "## Router overhead\nthird")
    text = out.read_text()
    assert "keep me" in text and "also keep me" in text and "third" in text and "second" not in text


#: the machine facts ``render`` reads, all "x" (for tests of the report's text)
_FACTS = {k: "x" for k in ("nproc", "cpu", "kernel", "loadavg", "python", "aiohttp", "uvloop", "httptools", "msgspec",
                           "nginx", "date", "command")}


def _complete(url: str, max_tokens: int) -> dict[str, Any]:
    """One non-streaming ``/v1/completions`` of ``max_tokens`` tokens from the backend at ``url``; its answer."""
    body = msgspec.json.encode({"model": "session-sim", "prompt": "hello there", "max_tokens": max_tokens})
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return dict(msgspec.json.decode(resp.read()))


def _result(cpu: float) -> LoadResult:
    """A load result whose router used ``cpu`` µs per request (for the tables' checks)."""
    return LoadResult(requests=100, errors=0, window_s=1.0, rps=100.0, p50_ms=1.0, p99_ms=2.0,
                      cpu_us_per_req={"proxy": cpu, "backends": 50.0})


def test_access_log_cells_go_to_their_own_section_with_their_cost(tmp_path: Any) -> None:
    args = parse_args(["--quick", "--access-log", "text", "json"])
    assert args.access_log == ["text", "json"] and args.section == "router_overhead_access_log"
    assert parse_args(["--quick"]).section == "router_overhead"
    out = tmp_path / "RESULTS.md"
    write_section(str(out), "## Router overhead\nmain table")
    write_section(str(out), "## Access log\ncost", args.section)
    text = out.read_text()
    assert "main table" in text and "cost" in text and text.count(BEGIN) == 1

    targets = [Target("router", []), Target("router(log=text)", []), Target("router(log=json)", [])]
    cells = {(mode, 16, name): Cell(mode, 16, name, [_result(cpu)])
             for mode in ("non-stream", "stream") for name, cpu in (("router", 80.0), ("router(log=text)", 95.0),
                                                                    ("router(log=json)", 99.0))}
    rows = checks(cells, targets, [16])
    cost = [r for r in rows if r.startswith("| access log cost, CPU/req non-stream c=16")]
    assert cost == ["| access log cost, CPU/req non-stream c=16 (over router) | — | +15 µs | +19 µs |"]


def test_policy_rows_go_to_their_own_section_with_their_cpu_over_the_session_policy() -> None:
    args = parse_args(["--quick", "--policies", "kv_aware"])
    assert args.policies == ["kv_aware"] and args.section == "router_overhead_policy"

    targets = [Target("router", []), Target("router(policy=kv_aware)", [])]
    cells = {(mode, 16, name): Cell(mode, 16, name, [_result(cpu)])
             for mode in ("non-stream", "stream") for name, cpu in (("router", 80.0), ("router(policy=kv_aware)", 88.0))}
    rows = checks(cells, targets, [16])
    assert "| CPU/req stream c=16 over router (session policy) | — | +8 µs (+10.0%) |" in rows
    assert not any(r.startswith("| access log cost") for r in rows)


def test_unsubscribed_rows_need_kv_events_and_policies_and_are_compared_with_the_session_policy() -> None:
    args = parse_args(["--quick", "--kv-events", "--policies", "kv_aware", "--unsubscribed"])
    assert args.unsubscribed
    for missing in (["--kv-events"], ["--policies", "kv_aware"]):
        with pytest.raises(SystemExit):
            parse_args(["--quick", "--unsubscribed", *missing])

    names = (("router", 80.0), ("router(policy=kv_aware)", 100.0), ("router(policy=kv_aware, unsubscribed)", 84.0))
    targets = [Target(name, []) for name, _ in names]
    cells = {(mode, 16, name): Cell(mode, 16, name, [_result(cpu)]) for mode in ("non-stream", "stream")
             for name, cpu in names}
    rows = checks(cells, targets, [16])
    assert "| CPU/req stream c=16 over router (session policy) | — | +20 µs (+25.0%) | +4 µs (+5.0%) |" in rows
    text = render(cells, targets, _FACTS, args)
    assert "the gap between the two rows is the subscription's cost" in text


def test_rows_over_a_baseline_router_with_the_median_of_rounds() -> None:
    """``--baseline REV``: every other router row gets a check row with its CPU per request over the router
    of revision REV, best of rounds and, with several rounds, the median of the per-round ratios."""
    assert parse_args(["--quick", "--baseline", "f4f1564"]).baseline == "f4f1564"
    assert parse_args(["--quick"]).baseline is None
    names = (("router", [80.0, 90.0, 70.0]), ("router(policy=kv_aware)", [88.0, 108.0, 84.0]),
             ("router@abc1234", [75.0, 80.0, 70.0]))
    targets = [Target(name, []) for name, _ in names]
    cells = {(mode, 16, name): Cell(mode, 16, name, [_result(cpu) for cpu in cpus]) for mode in ("non-stream", "stream")
             for name, cpus in names}
    rows = checks(cells, targets, [16])
    # over the session policy: best 84 over best 70; per round +10%, +20%, +20%
    assert ("| CPU/req stream c=16 over router (session policy) | — | +14 µs (+20.0%; median of rounds +20.0%) | — |"
            in rows)
    # over the baseline: router 70 vs 70 (rounds +6.7%, +12.5%, 0%), kv_aware 84 vs 70 (+17.3%, +35%, +20%)
    assert ("| CPU/req non-stream c=16 over router@abc1234 (session policy) | +0 µs (+0.0%; median of rounds +6.7%) "
            "| +14 µs (+20.0%; median of rounds +20.0%) | — |") in rows
    text = render(cells, targets, _FACTS, parse_args(["--quick", "--policies", "kv_aware", "--baseline", "abc1234"]))
    assert "**router@abc1234**: the router of commit `abc1234`" in text


def test_a_baseline_router_runs_from_its_own_tree(tmp_path: Any) -> None:
    """``baseline_tree`` extracts a revision of this repository; a router started from it runs that tree's
    code (its working directory, first on its module path) and proxies to a real backend. A revision that
    is not a commit is refused with what to give instead."""
    with pytest.raises(SystemExit, match="not a commit of this repository"):
        baseline_tree("no-such-revision-here", str(tmp_path / "none"))
    tree = str(tmp_path / "tree")
    commit = baseline_tree("HEAD", tree)
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True)
    assert commit == head.stdout.strip()
    assert os.path.isfile(os.path.join(tree, "router", "__main__.py"))
    backend = bench_backend(str(tmp_path), False)
    try:
        router = start_router(str(tmp_path), "--backend", backend.url, "--policy", "session", tree=tree)
        try:
            assert os.readlink(f"/proc/{router.pid}/cwd") == tree
            assert _complete(router.url, 2)["usage"]["completion_tokens"] == 2
        finally:
            router.stop()
    finally:
        backend.stop()


def test_kv_events_backends_publish_where_the_routers_find_them(tmp_path: Any) -> None:
    """``--kv-events``: the benchmark's backends advertise a ZMQ PUB on an ipc:// path in the run's
    directory at ``GET /kv_event_sources`` (what the policy rows' routers subscribe to); without it, none."""
    assert parse_args(["--quick", "--kv-events"]).kv_events and not parse_args(["--quick"]).kv_events
    assert parse_args(["--quick", "--rate", "500"]).rate == 500.0 and parse_args(["--quick"]).rate == 0.0
    with pytest.raises(SystemExit):
        parse_args(["--quick", "--rate", "-1"])
    with_events, plain = bench_backend(str(tmp_path), True), bench_backend(str(tmp_path), False)
    try:
        with urllib.request.urlopen(with_events.url + "/kv_event_sources", timeout=5) as resp:
            sources = msgspec.json.decode(resp.read())
        with urllib.request.urlopen(plain.url + "/kv_event_sources", timeout=5) as resp:
            assert msgspec.json.decode(resp.read()) == {}
    finally:
        with_events.stop()
        plain.stop()
    text = msgspec.json.encode(sources).decode()
    assert f"ipc://{tmp_path}/kv-{with_events.port}.sock" in text, text


def test_backend_speed_makes_the_backends_step_like_an_engine(tmp_path: Any) -> None:
    """``--backend-speed S``: the backends run at ``--speed S`` (each step sleeps its simulated GPU time, a
    decode step 10*S ms), and the report's set-up says so; 0 (instant) is the default."""
    assert parse_args(["--quick"]).backend_speed == 0.0
    args = parse_args(["--quick", "--kv-events", "--policies", "kv_aware", "--backend-speed", "1"])
    assert args.backend_speed == 1.0
    with pytest.raises(SystemExit):
        parse_args(["--quick", "--backend-speed", "-1"])
    names = ("router", "router(policy=kv_aware)")
    cells = {("non-stream", 16, name): Cell("non-stream", 16, name, [_result(90.0)]) for name in names}
    text = render(cells, [Target(name, []) for name in names], _FACTS, args)
    assert "`python -m backends --speed 1 --model session-sim`" in text and "decode steps of 10 ms" in text
    stepping = bench_backend(str(tmp_path), True, 1.0)
    try:
        started = time.monotonic()
        answer = _complete(stepping.url, 3)
        # three tokens take three steps of at least 10 ms each (a lower bound: the steps sleep)
        assert time.monotonic() - started >= 0.03
        assert answer["usage"]["completion_tokens"] == 3
    finally:
        stepping.stop()


def test_the_report_shows_how_evenly_each_target_spread_the_requests(tmp_path: Any) -> None:
    """The backends' own success counters, read around a cell, give the busiest backend's share; the
    report lists it per target and cell (median over rounds)."""
    assert busiest_share([10, 5], [40, 15]) == 0.75 and busiest_share([3, 3], [3, 3]) == 0.0
    backend = bench_backend(str(tmp_path), False)
    try:
        before = served([backend.url])
        for _ in range(3):
            _complete(backend.url, 2)
        assert [b - a for a, b in zip(before, served([backend.url]))] == [3.0]
    finally:
        backend.stop()
    targets = [Target("direct", [], is_proxy=False), Target("router(policy=kv_aware)", [])]
    cells = {("non-stream", 16, t.name): Cell("non-stream", 16, t.name, [_result(1.0)] * 3, shares)
             for t, shares in zip(targets, ([0.5, 0.52, 0.51], [0.8, 0.79, 0.81]))}
    rows = balance(cells, targets, [16])
    assert "| router(policy=kv_aware) | 0.80 | — |" in rows and "| direct | 0.51 | — |" in rows


def test_process_tree_includes_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        tree = process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)


# ---------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_quick_benchmark_run_writes_a_full_table(tmp_path: Any) -> None:
    out = tmp_path / "RESULTS.md"
    out.write_text("# Benchmark results\n\nother results stay\n")
    jsonl = tmp_path / "runs.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.router_overhead", "--quick", "--out", str(out), "--jsonl", str(jsonl)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "other results stay" in text and BEGIN in text and END in text
    assert "python -m bench.router_overhead --quick" in text
    expected = {"direct", "router", "router×2"} | ({"nginx"} if find_nginx() else set())
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| (non-stream|stream) \| \d+ \|", line)]
    seen = {(cols[0].strip(), cols[2].strip()) for cols in rows}
    assert seen == {(mode, t) for mode in ("non-stream", "stream") for t in expected}
    for cols in rows:
        mode, target = cols[0].strip(), cols[2].strip()
        assert float(cols[3].split()[0]) > 0, cols  # req/s
        assert cols[-1].strip() == "0", cols  # errors
        if target != "direct":
            assert float(cols[9].split()[0]) > 0, cols  # proxy CPU us/req
        if mode == "stream":
            assert float(cols[7]) > 0, cols  # TTFT
    assert "CPU/req non-stream" in text
    record = msgspec.json.decode(jsonl.read_text().splitlines()[-1])
    assert all(r["requests"] > 0 and r["errors"] == 0 for cell in record["cells"] for r in cell["rounds"])
