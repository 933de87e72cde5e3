"""bench.replicas: its pure parts (the rotation, agreement per follow-up turn, the Responses chains' tally,
the comparison with the 1-replica run, the checks) and the ``--quick`` smoke run (real backends, 3 router
replicas, redis-server when installed, a replica SIGKILLed, pods churned through the fake Kubernetes API)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from bench.multiturn import TurnRecord
from bench.procs import REPO
from bench.replicas import (
    REDIS_SERVER,
    CellReport,
    ChainRecord,
    Flip,
    Rotation,
    agreement,
    checks,
    compare,
    tally_chains,
)


def _turn(session: int, turn: int, backend: str, decision: str = "sticky;cached=0;wait=0", ok: bool = True) -> TurnRecord:
    return TurnRecord(session, turn, False, ok, 0.0, backend=backend, decision=decision)


def test_rotation_is_round_robin_per_request_over_the_replicas_left() -> None:
    rotation = Rotation(["a", "b", "c"])
    assert [rotation.pick() for _ in range(4)] == [0, 1, 2, 0]
    rotation.take_out(2)
    assert {rotation.pick() for _ in range(6)} == {0, 1}


def test_agreement_counts_follow_up_turns_where_the_session_was_moved_or_elsewhere() -> None:
    cell = CellReport(name="x", replicas=3, redis=False, records=[
        _turn(0, 0, "A", "new;cached=0;wait=0"),
        _turn(0, 1, "A"),  # where it was
        _turn(0, 2, "B", "spill;cached=0;wait=0;reason=wait"),  # moved on purpose
        _turn(0, 3, "C", "new;cached=0;wait=0"),  # a replica that did not know the session
        _turn(1, 0, "A"),
        _turn(1, 1, "B", ok=False),  # failed: neither counted nor a "previous" for the next turn
        _turn(1, 2, "B"),
        _turn(2, 0, "A"),
        _turn(2, 1, "B", "sticky;cached=0;wait=0"),  # a stale pin: elsewhere too
    ])
    agreement(cell)
    assert (cell.followup_turns, cell.followup_same, cell.followup_moved, cell.followup_disagree) == (4, 1, 1, 2)


def test_compare_matches_session_and_turn_with_the_single_router_run() -> None:
    single = CellReport(name="1 replica", replicas=1, redis=False,
                        records=[_turn(0, 0, "A"), _turn(0, 1, "A"), _turn(1, 0, "B")])
    three = CellReport(name="3 replicas", replicas=3, redis=False,
                       records=[_turn(0, 0, "A"), _turn(0, 1, "B"), _turn(1, 0, "B"), _turn(2, 0, "A")])
    compare(three, single)
    assert (three.compared, three.same_backend, three.compared_with) == (3, 2, "1 replica")


def test_chains_reach_the_storing_backend_only_when_stored_where_the_previous_answer_was() -> None:
    cell = CellReport(name="x", replicas=3, redis=True, chains=[
        ChainRecord(0, 0, 0, True, 200, "r0", stored_on=["A"]),
        ChainRecord(0, 1, 1, True, 200, "r1", "r0", stored_on=["A"], previous_on=["A"]),  # reached
        ChainRecord(0, 2, 2, False, 404, "", "r1", previous_on=["A"]),  # another backend: 404
        ChainRecord(1, 0, 0, False, 502),  # a first turn that failed
        ChainRecord(1, 1, 0, False, 0, error="ClientConnectorError"),
        ChainRecord(2, 0, 0, True, 200, "r2", stored_on=["B", "C"]),  # held twice: counted
        ChainRecord(2, 1, 1, True, 200, "r3", "r2", stored_on=["B"], previous_on=["B", "C"]),  # not proof
    ])
    tally_chains(cell)
    assert (cell.followups, cell.followups_reached, cell.followups_not_found, cell.followups_failed) == (4, 1, 1, 1)
    assert (cell.chain_first_failed, cell.stored_not_once) == (1, 1)


def _cell(name: str, replicas: int, redis: bool, **fields: object) -> CellReport:
    return CellReport(name=name, replicas=replicas, redis=redis, **fields)  # type: ignore[arg-type]


def test_checks_hold_the_cells_to_issue_15s_targets() -> None:
    cells = [
        _cell("1 replica", 1, False, hit_ratio=0.80, failed_by_replica=[0]),
        _cell("3 replicas", 3, False, hit_ratio=0.79, followup_turns=100, followup_same=90, followup_disagree=10,
              followups=10, followups_reached=6, followups_not_found=4, failed_by_replica=[2, 1, 1]),
        _cell("3 replicas, Redis", 3, True, hit_ratio=0.70, followup_turns=100, followup_same=98, followup_moved=1,
              followup_disagree=1, followups=10, followups_reached=10, failed_by_replica=[0, 0, 0]),
        _cell("3 replicas, Redis, one killed", 3, True, killed_replica=2, in_flight_on_killed=2,
              failed_by_replica=[1, 0, 2]),
        _cell("3 replicas, Redis, pod churn", 3, True, failed_by_replica=[0, 0, 0],
              flips=[Flip("vllm-0", "out", [0.01, 0.02, 0.03]), Flip("vllm-0", "in", [0.05, 2.5, 0.04])]),
    ]
    found = {c.name: c for c in checks(cells)}
    assert found["hit ratio, 3 replicas >= 98% of 1 replica's (without Redis)"].ok  # 0.79 / 0.80 = 98.75%
    # every cell compares with the 1-replica cells' mean (here the one plain cell)
    assert not found["hit ratio, 3 replicas >= 98% of 1 replica's (with Redis)"].ok
    cells.append(_cell("1 replica, Redis", 1, True, hit_ratio=0.62, failed_by_replica=[0]))
    found = {c.name: c for c in checks(cells)}
    assert found["hit ratio, 3 replicas >= 98% of 1 replica's (with Redis)"].ok  # 0.70 / mean(0.80, 0.62) = 98.6%
    assert "0.710" in found["hit ratio, 3 replicas >= 98% of 1 replica's (with Redis)"].detail
    # the reference is the 1-replica cells that ran the same workload: with Responses chains in the
    # 3-replica cells, not a repeat cell that ran none (less KV load, a higher hit ratio)
    chain = [ChainRecord(0, 0, 0, True, 200, "r0", stored_on=["A"])]
    for cell in cells:
        cell.chains = list(chain)
    cells.append(_cell("1 replica (repeat)", 1, False, hit_ratio=0.95, failed_by_replica=[0]))
    found = {c.name: c for c in checks(cells)}
    with_redis = found["hit ratio, 3 replicas >= 98% of 1 replica's (with Redis)"]
    assert with_redis.ok and "0.710" in with_redis.detail and "0.950" not in with_redis.detail
    assert found["follow-up turns placed as a single router would (without Redis): figure"].ok
    assert found["follow-up turns placed as a single router would (with Redis) >= 99%"].ok  # 99/100
    assert "90/100" in found["follow-up turns placed as a single router would (without Redis): figure"].detail
    assert found["previous_response_id follow-ups reach the storing backend (with Redis): 100%"].ok
    assert not found["[3 replicas, Redis, one killed] no request fails except those in flight on the killed "
                     "replica"].ok  # one failed on a replica that was not killed
    assert found["[3 replicas, Redis, pod churn] no request fails"].ok
    assert not found["[3 replicas, Redis, pod churn] discovery converges within 2 s on every replica"].ok


# -- the --quick smoke run ----------------------------------------------------------------------


@pytest.mark.slow
def test_quick_run(tmp_path: os.PathLike[str]) -> None:
    out = os.path.join(str(tmp_path), "replicas.json")
    # its own process group: on an overrun it and its children are stopped together
    proc = subprocess.Popen([sys.executable, "-m", "bench.replicas", "--quick", "--out", out], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=170)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail("bench.replicas --quick took more than 170 s:\n" + output[-3000:])
    # exit status 1 = a statistical target missed on a small run on a shared machine: not asserted here
    assert proc.returncode in (0, 1), output[-3000:]
    with open(out, encoding="utf-8") as fh:
        result = json.load(fh)
    cells = {c["name"]: c for c in result["cells"]}
    redis = os.path.exists(REDIS_SERVER)
    tag = ", Redis" if redis else ""
    expected = {"1 replica", "3 replicas", f"3 replicas{tag}, one killed", f"3 replicas{tag}, pod churn"}
    assert expected | ({"3 replicas, Redis"} if redis else set()) == set(cells)
    for name, c in cells.items():
        assert c["hit_ratio"] > 0 and c["followup_turns"] > 0, name
        if c["killed_replica"] >= 0:
            failed = c["failed_by_replica"]
            assert sum(failed) == failed[c["killed_replica"]] <= c["in_flight_on_killed"], c
        else:
            assert c["errors"] == 0, c["first_error"]
        assert c["stored_not_once"] == 0
    assert sum(cells["3 replicas"]["served_by_replica"]) > 0 and all(cells["3 replicas"]["served_by_replica"])
    assert cells["1 replica"]["followups_reached"] == cells["1 replica"]["followups"] > 0
    assert cells["1 replica"]["followup_disagree"] == 0  # one router always agrees with itself
    if redis:
        c = cells["3 replicas, Redis"]
        assert c["followups_reached"] == c["followups"] > 0  # a correctness property, not a statistic
    churn = cells[f"3 replicas{tag}, pod churn"]
    assert churn["flips"] and all(max(f["seconds"]) <= 2.0 for f in churn["flips"])
