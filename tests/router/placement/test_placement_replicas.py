"""Two router processes with the same backends place every non-spilled session identically.

Each replica is a separate Python process with its own hash seed and its own order of the backend
list, so any use of the salted ``hash()`` or of list order in the ranking would show up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from router.placement import Outcome, SessionPolicy, load_bound, make_policy
from router.membership import Backend, BackendPool
from router.sessions.table import SessionTable

URLS = [f"http://127.0.0.1:{8100 + i}" for i in range(5)]
SESSIONS = [f"sess-{i:04d}" for i in range(1000)] + ["conv-" + "ab" * 16, "x", "~!@#$%^&*()_+{}|:<>?"]

# A replica: place every session once on an idle pool; print session -> backend URL.
REPLICA = """
import json, sys
from router.placement import make_policy
from router.membership import Backend, BackendPool
from router.sessions.table import SessionTable
job = json.load(sys.stdin)
pool = BackendPool("default", [Backend(u) for u in job["urls"]])
policy = make_policy("session", load_factor=1.25, reported_load_weight=0.0)
table = SessionTable(1_000_000, 3600.0)
print(json.dumps({s: policy.place(pool, s, table.touch(s)).backend.url for s in job["sessions"]}))
"""


def run_replica(urls: list[str], hash_seed: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", REPLICA],
        input=json.dumps({"urls": urls, "sessions": SESSIONS}),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    placed: dict[str, str] = json.loads(done.stdout)
    return placed


@pytest.mark.slow
def test_replicas_in_separate_processes_agree_with_each_other_and_with_this_one() -> None:
    one = run_replica(URLS, hash_seed="1")
    two = run_replica(list(reversed(URLS)), hash_seed="2")
    assert one == two
    assert set(one) == set(SESSIONS)
    assert set(one.values()) == set(URLS)  # the sessions spread over every backend

    # This process, under load: a replica that saw a different load agrees on every session
    # that was not pushed off its first choice by the bound.
    pool = BackendPool("default", [Backend(u) for u in URLS])
    policy = make_policy("session", load_factor=1.0, reported_load_weight=0.0)
    assert isinstance(policy, SessionPolicy)
    table = SessionTable(1_000_000, 3600.0)
    agreed = pushed_off = 0
    for sid in SESSIONS:
        top = policy.candidates(pool, sid)[0]
        total = sum(b.in_flight for b in pool.members)
        top_full = top.in_flight + 1 > load_bound(1.0, total, len(URLS))
        placed = policy.place(pool, sid, table.touch(sid))
        assert placed.outcome is Outcome.NEW
        placed.backend.in_flight += 1
        if top_full:
            pushed_off += 1
            assert placed.backend.url != one[sid]
        else:
            agreed += 1
            assert placed.backend.url == one[sid]
    assert agreed > 500 and pushed_off > 0  # both branches really ran
