"""`make demo` runs end to end (bounded), in both topologies, on ephemeral loopback ports."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("extra", [[], ["--pd"]], ids=["aggregated", "pd"])
def test_demo_runs_and_sessions_stick_with_rising_cache_hits(extra: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.demo", "--rounds", "3", "--speed", "0", "--any-ports", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 failed" in out.stdout
    # the last summary table: 6 sessions, each with 3 turns on one backend and some cached tokens
    last = out.stdout.rsplit("session ", 1)[1]
    rows = [line.split() for line in last.splitlines()[1:] if re.match(r"^(conv-|demo-session-)", line)]
    assert len(rows) == 6
    for row in rows:
        backend, turns, prompt, cached = row[1], int(row[2]), int(row[3]), int(row[4])
        assert turns == 3 and backend.startswith("http://127.0.0.1:"), row
        assert 0 < cached < prompt, row
    assert re.search(r"stopped \d+ processes", out.stdout)
