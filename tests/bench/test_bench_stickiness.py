"""bench.stickiness: its pure parts (where requests went, the checks), the throttle that slows a
backend, and the ``--quick`` smoke run (real backends, routers and load generator)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from bench.procs import REPO, wait_until
from bench.stickiness import SlowCell, StickCell, Throttle, Window, check_targets, count_deltas, majority


def test_count_deltas_keep_the_cells_sessions_that_grew() -> None:
    before = {"stick-a-1": 3, "stick-a-2": 5, "other-1": 1}
    after = {"stick-a-1": 7, "stick-a-2": 5, "stick-a-3": 2, "other-1": 9}
    assert count_deltas(before, after, "stick-a-") == {"stick-a-1": 4, "stick-a-3": 2}


def test_majority_share_per_session() -> None:
    # s1 all on backend A; s2 3:1; s3 all on B
    a = {"s1": 10, "s2": 3}
    b = {"s2": 1, "s3": 4}
    shares, moved, off = majority([a, b])
    assert shares == [1.0, 0.75, 1.0]
    assert (moved, off) == (1, 1)
    assert majority([{}, {}]) == ([], 0, 0)


def _cell(policy: str, share: float, cpu: float, mode: str = "stream") -> StickCell:
    return StickCell(policy=policy, mode=mode, concurrency=16, sessions=64, requests=1000, majority_min=share,
                     majority_mean=share, proxy_cpu_us=cpu)


def test_checks_majority_cpu_and_the_slow_backend() -> None:
    def slow(policy: str, after_share: float, after_p99: float) -> SlowCell:
        return SlowCell(policy=policy, concurrency=16, slowdown="x", slowed_at_s=4.0, before_p99_ms=5.0,
                        after_p99_ms=after_p99, before_slow_share=0.5, after_slow_share=after_share,
                        windows=[Window(start_s=0, end_s=1, slowed=False)])

    checks = check_targets([_cell("kv_aware", 0.97, 105.0), _cell("session", 0.6, 100.0)],
                           [slow("kv_aware", 0.02, 8.0), slow("session", 0.5, 90.0)])
    assert [(c.name, c.ok) for c in checks] == [
        ("[kv_aware stream c=16] each session's majority backend serves >= 95% of its requests", True),
        ("[kv_aware stream c=16] router CPU/request within 10% of session's", True),
        ("[slow backend, kv_aware] sessions leave it (its share of requests <= 10% at the end)", True),
        ("[slow backend, kv_aware] TTFT p99 recovers (last 3 windows <= 2x before)", True),
    ]
    checks = check_targets([_cell("kv_aware", 0.9, 120.0), _cell("session", 1.0, 100.0)],
                           [slow("kv_aware", 0.3, 60.0)])
    assert not any(c.ok for c in checks)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return fh.read().rsplit(b")", 1)[1].split()[0].decode()


def test_the_throttle_stops_a_process_and_always_leaves_it_running() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        throttle = Throttle(child.pid, stop_ms=40, period_ms=50)
        throttle.start()
        wait_until(lambda: _state(child.pid) == "T", timeout=5.0, interval=0.005, what="the throttled process stopped")
        throttle.stop()
        # stop() joined the thread (no SIGSTOP can follow) and continued the process
        assert not throttle.running
        wait_until(lambda: _state(child.pid) != "T", timeout=2.0, what="the process continued")
        # running, sleeping, or in a disk wait (a child stopped during its start-up may still be reading
        # its files): anything but stopped or gone
        assert _state(child.pid) in ("S", "R", "D")
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)


@pytest.mark.slow
def test_quick_run(tmp_path: os.PathLike[str]) -> None:
    out = os.path.join(str(tmp_path), "stickiness.json")
    proc = subprocess.Popen([sys.executable, "-m", "bench.stickiness", "--quick", "--json", out], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail("bench.stickiness --quick took more than 150 s:\n" + output[-3000:])
    assert proc.returncode == 0, output[-3000:]
    with open(out, encoding="utf-8") as fh:
        result = json.load(fh)
    assert result["benchmark"] == "stickiness" and result["settings"]["kv_events"]
    cells = {(c["policy"], c["mode"]): c for c in result["cells"]}
    assert set(cells) == {(p, m) for p in ("kv_aware", "session") for m in ("non-stream", "stream")}
    for c in cells.values():
        assert c["errors"] == 0 and c["requests"] > 0, c["first_error"]
        # every session of the pool was served, and each request was found on one of the 2 backends
        assert c["sessions"] == 64 and len(c["backend_requests"]) == 2
        assert 0.5 <= c["majority_min"] <= c["majority_mean"] <= 1.0
        assert c["proxy_cpu_us"] > 0
        # 4 requests in flight over 2 idle backends: nothing for a session-aware policy to spill
        assert c["majority_mean"] >= 0.9, c
    for s in result["slow"]:
        # --slowdown speed (the default): slow from the start, compared with the all-fast stream cell
        assert [w["slowed"] for w in s["windows"]] == [True] * 5
        assert s["before_p99_ms"] == cells[(s["policy"], "stream")]["ttft_p99_ms"]
        assert all(w["errors"] == 0 and w["requests"] > 0 and 0 <= w["slow_share"] <= 1 for w in s["windows"])
        assert s["before_p99_ms"] > 0 and s["after_p99_ms"] > 0
