"""P/D faults with real processes: a decode instance dies, and requests are retried on another
decode instance before the first byte, carrying the same prefill hand-off (issue 7)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import LOOPBACK, Proc, cached_of, start_backend, start_router, wait_until
from tests.router.pd.test_pd_e2e import get_json, post, scrape, stop_all

pytestmark = pytest.mark.slow


def test_dead_decode_instance_is_retried_on_another_with_the_same_handoff(tmp_path: Any) -> None:
    log_dir = str(tmp_path)
    procs: list[Proc] = []
    try:
        prefill = start_backend(log_dir, "--role", "prefill")
        procs.append(prefill)
        allow = f"{LOOPBACK}:{prefill.port}"
        decodes = [start_backend(log_dir, "--role", "decode", "--kv-allow", allow) for _ in range(2)]
        procs += decodes
        # health checks effectively off: the dead decode is found by the failed connection itself
        router = start_router(log_dir, "--prefill", prefill.url, *[a for d in decodes for a in ("--decode", d.url)])
        procs.append(router)
        prompt = "a tale of two instances " * 10
        sessions = [f"pd-dd-{i}" for i in range(12)]
        for sid in sessions:
            status, _, data = post(router.url + "/v1/completions", {"prompt": f"{sid} {prompt}", "max_tokens": 4}, sid)
            assert status == 200, data
        pins = {sid: get_json(router.url + f"/v1/sessions/{sid}")[1]["pins"]["decode"] for sid in sessions}
        victim, survivor = decodes
        moved = [sid for sid, url in pins.items() if url == victim.url]
        assert moved and len(moved) < len(sessions)
        pulls_before = scrape(survivor.url)[("session_backend_kv_pulls_total", "")]

        victim.kill()
        for sid in sessions:
            status, headers, data = post(router.url + "/v1/completions",
                                         {"prompt": f"{sid} {prompt} again", "max_tokens": 4}, sid)
            assert status == 200, data
            assert headers["X-Session-ID"] == sid
            # the retried decode leg still carried the prefill's params: the survivor pulled the blocks
            assert cached_of(data["usage"]) > 0
        after = scrape(survivor.url)
        assert after[("session_backend_kv_pulls_total", "")] - pulls_before == len(sessions)
        assert after.get(("session_backend_kv_pull_failures_total", "not_found"), 0) == 0
        assert scrape(prefill.url)[("session_backend_kv_held_requests", "")] == 0  # nothing left held
        for sid in sessions:
            assert get_json(router.url + f"/v1/sessions/{sid}")[1]["pins"]["decode"] == survivor.url
        metrics = scrape(router.url)
        assert metrics[("session_router_retries_total", "connect")] == 1  # later ones see it marked down
        assert metrics.get(("session_router_pd_fallback_total", "connect"), 0) == 0

        # with every decode instance gone the router is unavailable, whatever the prefill does
        survivor.kill()
        status, _, data = post(router.url + "/v1/completions", {"prompt": prompt, "max_tokens": 4}, sessions[0])
        assert status in (502, 503) and data["error"]["code"] == status
        wait_until(lambda: get_json(router.url + "/health")[0] == 503, timeout=10, what="router health 503")
    finally:
        stop_all(list(reversed(procs)))
