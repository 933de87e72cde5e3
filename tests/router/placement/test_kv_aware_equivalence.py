"""The ``kv_aware`` policy's all-candidates path was rewritten for speed (one pass instead of a
stats refresh then a prediction per candidate, ``predict`` inlined): it must make exactly the same
decisions as before. ``kv_aware_reference.ReferenceKVAwarePolicy`` is the policy as it was; here
both place the same requests on thousands of random pool states (engine signals, learned constants,
KV pressure, in-flight counts, unavailable and excluded backends, KV index contents, ties) and every
placement must agree: backend, outcome, reason, cached tokens, wait and predicted TTFT (the decision
header's values, compared as exact floats), the pins written, and the errors raised."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from contract.errors import NoHealthyBackendError
from router.membership import Backend, BackendPool
from router.placement import KVAwarePolicy, KVAwareSettings, PlacementHint
from router.sessions.table import SessionEntry

from .kv_aware_reference import ReferenceKVAwarePolicy


class FakeKV:
    #: a feeder is hooked: the policy calls ``catch_up`` before its reads
    catch_up_hooked = True

    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, int]] = {}
        self.prefixes: dict[tuple[int, ...], dict[str, int]] = {}
        self.live: set[str] = set()

    def catch_up(self) -> None:
        """Nothing to apply: this fake's answers are set by the test, never late."""

    def session_tokens(self, session_id: str) -> Mapping[str, int]:
        return self.sessions.get(session_id, {})

    def has_events(self, backend_url: str) -> bool:
        return backend_url in self.live

    @property
    def any_events(self) -> bool:
        """As the index: False only while it holds nothing (then the policy does not read it)."""
        return bool(self.live) or any(self.sessions.values()) or any(self.prefixes.values())

    def prefix_tokens(self, prompt_ids: Sequence[int]) -> Mapping[str, int]:
        return self.prefixes.get(tuple(prompt_ids), {})


def randomize(rng: random.Random, backend: Backend) -> None:
    """Signals from small sets of values, so that equal predictions (ties) are common."""
    backend.healthy = rng.random() > 0.08
    backend.draining = rng.random() < 0.04
    backend.in_flight = rng.choice((0, 0, 1, 2, 3, 5, 8))
    backend.in_flight_at_scrape = rng.choice((0, 0, 1, 2, 4))
    backend.others_at_scrape = rng.choice((0.0, 0.0, 0.0, 1.0, 3.0, 7.0))
    backend.engine_waiting = rng.choice((0.0, 0.0, 1.0, 2.0, 5.0))
    backend.queued_floor = rng.choice((0.0, 1.0, backend.engine_waiting))
    backend.kv_usage = rng.choice((0.0, 0.3, 0.85, 0.92, 0.97, 1.0))
    backend.kv_capacity_tokens = rng.choice((0, 0, 4096, 65536))
    backend.output_tokens = rng.choice((-1.0, 100.0, 500.0))
    backend.reported_load = rng.choice((0.0, 1.0, 4.0))
    backend.step_s = rng.choice((-1.0, -1.0, 0.01, 0.02, 0.005))
    backend.prefill_s_per_token = rng.choice((-1.0, -1.0, 0.00025, 0.0005, 0.0001))
    backend.queued_request_s = rng.choice((-1.0, -1.0, 0.1, 0.05))
    backend.busy_s_per_request = rng.choice((-1.0, -1.0, 0.0, 0.01, 0.003))


def outcome(policy: object, pool: BackendPool, sid: str | None, entry: SessionEntry | None,
            exclude: frozenset[str], hint: PlacementHint) -> tuple[object, ...]:
    try:
        p = policy.place(pool, sid, entry, exclude, hint)  # type: ignore[attr-defined]
    except NoHealthyBackendError:
        return ("error",)
    except RecursionError:
        # the reference recursed without end on a retry whose pin was the only candidate left
        # (``_fastest`` with no bound retried itself); the current policy answers "no backend"
        assert isinstance(policy, ReferenceKVAwarePolicy)
        return ("error",)
    return (p.backend.url, p.outcome, p.reason, p.cached_tokens, p.wait_s, p.predicted_ttft_s,
            dict(entry.pins) if entry is not None else None)


@pytest.mark.parametrize("seed", range(4))
def test_same_decisions_as_the_reference_on_random_pool_states(seed: int) -> None:
    rng = random.Random(seed)
    compared = moved = evicted = 0
    errors = 0
    for trial in range(750):
        size = rng.choice((1, 2, 3, 5, 8, 9, 16, 64))
        pool = BackendPool("default", [Backend(f"http://10.0.{i // 250}.{i % 250 + 1}:8000") for i in range(size)])
        urls = [b.url for b in pool.members]
        settings = KVAwareSettings(
            move_factor=rng.choice((1.0, 1.5, 2.0)), move_margin_s=rng.choice((0.0, 0.005)),
            kv_pressure_from=rng.choice((0.8, 0.9)), max_load_factor=rng.choice((1.0, 2.0)),
            sticky_headroom=rng.choice((0, 2)), reported_load_weight=rng.choice((0.0, 0.0, 0.5)))
        kv = FakeKV() if rng.random() < 0.8 else None
        now = [0.0]  # one clock for both (``ahead``: the prefill work each sent a backend)
        reference = ReferenceKVAwarePolicy(settings, kv=kv, clock=lambda now=now: now[0])
        current = KVAwarePolicy(settings, kv=kv, clock=lambda now=now: now[0])
        entries: dict[str, tuple[SessionEntry, SessionEntry]] = {}
        for s in range(6):
            sid = f"s{s}"
            pair = (SessionEntry(sid, 0.0, 0.0, 0.0), SessionEntry(sid, 0.0, 0.0, 0.0))
            if rng.random() < 0.8:
                pin = rng.choice(urls) if rng.random() < 0.95 else "http://10.9.9.9:8000"  # a removed pin
                pair[0].pins["default"] = pair[1].pins["default"] = pin
            entries[sid] = pair
        for _ in range(8):  # a sequence: the policies' stats caches, cursors and the pins evolve
            for backend in pool.members:
                if rng.random() < 0.5:
                    randomize(rng, backend)
            sid = rng.choice(list(entries) + [None])
            prompt = rng.choice((0, 16, 640, 768, 2000))
            if kv is not None:
                kv.sessions.clear()
                for other in entries:
                    holders = rng.sample(urls, min(len(urls), rng.choice((0, 1, 1, 2, 3))))
                    kv.sessions[other] = {u: rng.choice((0, 128, 640, 768, 4000)) for u in holders}
                kv.live = set(rng.sample(urls, rng.randint(0, len(urls))))
            ids = (1, 2, 3) if rng.random() < 0.2 else None
            if kv is not None and ids is not None:
                kv.prefixes[ids] = {u: rng.choice((16, 640)) for u in rng.sample(urls, min(len(urls), 2))}
            parent = rng.choice((None, None, "s0", "s1"))
            exclude = frozenset(rng.sample(urls, rng.choice((0, 0, 0, 1, 2)) if size > 2 else 0))
            if sid is not None and rng.random() < 0.15:  # a retry: the pin already failed
                pin = entries[sid][0].pins.get("default")
                if pin is not None:
                    exclude |= {pin}
            last = rng.choice((0, prompt // 2, prompt // 2, prompt, 1000))  # the session's last turn
            now[0] += rng.choice((0.0, 0.0, 0.001, 0.05, 0.3, 5.0))
            results = []
            for policy, which in ((reference, 0), (current, 1)):
                entry = entries[sid][which] if sid is not None else None
                parent_entry = entries[parent][which] if parent is not None else None
                hint = PlacementHint(prompt, prompt_ids=ids, parent_session=parent, parent_entry=parent_entry,
                                     last_tokens=last)
                results.append(outcome(policy, pool, sid, entry, exclude, hint))
            assert results[0] == results[1], (seed, trial, sid, results)
            compared += 1
            errors += results[0][0] == "error"
            moved += results[0][0] != "error" and results[0][1].name == "SPILL"
            evicted += results[0][0] != "error" and results[0][2] == "evicted"
    assert compared == 750 * 8
    assert moved > 100  # the states exercise the all-candidates path, not only the sticky fast path
    assert evicted > 20  # and the pin that lost the session's KV


def queueing_alike(rng: random.Random, backend: Backend, waiting: float, odd: float) -> None:
    """A scrape that found ``backend``'s engine queueing about as much as the others (the state where
    the policy settles a pinned placement without a pass, ``KVAwarePolicy._settled``); with
    probability ``odd`` one that does not queue, or a fractional load (no exact sums)."""
    now = rng.choice((waiting, waiting, waiting + 1.0, 0.0 if rng.random() < odd else waiting))
    backend.queued_floor = min(now, backend.engine_waiting)  # what persisted over two scrapes (hysteresis)
    backend.engine_waiting = now
    backend.in_flight_at_scrape = backend.in_flight
    backend.others_at_scrape = rng.choice((0.0, 0.0, 1.0, 3.0, 2.5 if rng.random() < odd else 0.0))
    backend.kv_usage = rng.choice((0.0, 0.3, 0.3, 0.3, 0.92, 1.0))
    backend.kv_capacity_tokens = rng.choice((0, 0, 8192, 65536))
    backend.output_tokens = rng.choice((-1.0, 150.0))
    backend.load_scraped_at += 1.0  # a new scrape: the prompts placed since the last are in its usage


def learned(rng: random.Random, backend: Backend, alike: bool, only: str | None = None) -> None:
    """Learned constants (alike: mostly the configured ones); ``only``: change that one alone."""
    choices = {
        "step_s": (-1.0,) if alike else (-1.0, 0.01, 0.005),
        "prefill_s_per_token": (-1.0,) if alike else (-1.0, 0.00025, 0.0001),
        "queued_request_s": (-1.0, 0.1) if alike else (-1.0, 0.1, 0.05),
        "busy_s_per_request": (-1.0, 0.002) if alike else (-1.0, 0.0, 0.01, 0.003),
    }
    for name, values in choices.items():
        if only is None or name == only:
            setattr(backend, name, rng.choice(values if only is None else (*values, 0.0005)))


def one_change(rng: random.Random, backend: Backend) -> None:
    """One field of ``backend`` changed alone, as a scrape, a health check, a drain or learning may:
    mostly one that makes it faster (a candidate the last pass did not see as a rival may be one now)."""
    name, value = rng.choice((
        ("engine_waiting", 0.0), ("engine_waiting", 1.0), ("in_flight_at_scrape", backend.in_flight + 7),
        ("others_at_scrape", 0.0), ("step_s", 0.001), ("prefill_s_per_token", 0.00001),
        ("queued_request_s", 0.0), ("busy_s_per_request", -1.0), ("healthy", True), ("draining", False),
        ("engine_waiting", 9.0), ("others_at_scrape", 5.0), ("step_s", 0.05),
    ))
    setattr(backend, name, value)


@pytest.mark.parametrize("seed", range(4))
def test_same_decisions_with_and_without_a_pass_as_in_flight_counts_move(seed: int) -> None:
    """Sequences of placements on pools where every engine queues about alike, with what happens
    between them in a router: requests sent and finished (in-flight counts rising and falling, the
    proxy's writes), scrapes of one engine, health and drain changes, learned constants, members
    leaving and joining, fractional loads. The policy settles most pinned placements without a pass
    (``_settled``): its bound must hold after in-flight counts fell (the drops since the pass) and
    every other change must be seen; the reference passes over every candidate each time."""
    rng = random.Random(1000 + seed)
    compared = settled = passes = after_drops = moved = 0
    for trial in range(80):
        size = rng.choice((3, 9, 16, 64, 64))
        pool = BackendPool("default", [Backend(f"http://10.1.{i // 250}.{i % 250 + 1}:8000") for i in range(size)])
        settings = KVAwareSettings(
            move_factor=rng.choice((1.0, 1.5)), move_margin_s=rng.choice((0.0, 0.005)),
            max_load_factor=rng.choice((1.0, 2.0)), sticky_headroom=rng.choice((0, 2)))
        kv = FakeKV() if rng.random() < 0.7 else None
        now = [0.0]  # one clock for both (``ahead``: the prefill work each sent a backend)
        reference = ReferenceKVAwarePolicy(settings, kv=kv, clock=lambda now=now: now[0])
        current = KVAwarePolicy(settings, kv=kv, clock=lambda now=now: now[0])
        real_settled = current._settled
        counts = [0, 0, 0]  # settled, a pass needed, settled after in-flight counts fell since the pass

        def counting_settled(*args: object, real=real_settled, counts=counts, current=current,  # type: ignore[no-untyped-def]
                             pool=pool) -> object:
            found = real(*args)  # type: ignore[arg-type]
            counts[found is None] += 1
            if found is not None and pool.ledger.drops > current._settles[pool.key].drops:
                counts[2] += 1
            return found

        current._settled = counting_settled  # type: ignore[method-assign]
        waiting = rng.choice((1.0, 3.0, 6.0, 6.0))
        alike = rng.random() < 0.7
        odd = rng.choice((0.0, 0.0, 0.01, 0.1))
        for backend in pool.members:
            backend.in_flight = rng.choice((0, 1, 2, 4))
            queueing_alike(rng, backend, waiting, odd)
            queueing_alike(rng, backend, waiting, odd)
            learned(rng, backend, alike)
        urls = [b.url for b in pool.members]
        entries: dict[str, tuple[SessionEntry, SessionEntry]] = {}
        for s in range(12):
            pair = (SessionEntry(f"s{s}", 0.0, 0.0, 0.0), SessionEntry(f"s{s}", 0.0, 0.0, 0.0))
            pair[0].pins["default"] = pair[1].pins["default"] = rng.choice(urls)
            entries[f"s{s}"] = pair
        if kv is not None:  # mostly on its pin (the index and the pins agree), sometimes a little elsewhere too
            for sid, pair in entries.items():
                held = kv.sessions[sid] = {u: 128 for u in rng.sample(urls, rng.choice((0, 0, 0, 1, 2)))}
                if rng.random() < 0.8:
                    held[pair[0].pins["default"]] = rng.choice((640, 2000))
            kv.live = set(rng.sample(urls, rng.randint(0, len(urls))))
        for _ in range(60):
            members = pool.members
            for _ in range(rng.choice((0, 1, 1, 2, 3, 6))):  # requests finished and sent since
                backend = rng.choice(members)
                if rng.random() < 0.55 and backend.in_flight > 0:
                    backend.in_flight -= 1
                else:
                    backend.in_flight += 1
            event = rng.random()
            if event < 0.08:
                queueing_alike(rng, rng.choice(members), waiting, odd)
            elif event < 0.10:
                backend = rng.choice(members)
                backend.healthy = not backend.healthy
            elif event < 0.12:
                backend = rng.choice(members)
                backend.draining = not backend.draining
            elif event < 0.14:
                learned(rng, rng.choice(members), alike,
                        rng.choice(("step_s", "prefill_s_per_token", "queued_request_s", "busy_s_per_request")))
            elif event < 0.15 and len(members) > 2:
                gone = pool.remove(rng.choice(members).url)
                assert gone is not None
                back = Backend(gone.url)  # a member leaving and joining again, with a fresh state
                back.in_flight = rng.choice((0, 3))
                queueing_alike(rng, back, waiting, odd)
                pool.add(back)
            elif event < 0.20:
                one_change(rng, rng.choice(members))
            sid = rng.choice(list(entries) + [None] if rng.random() < 0.1 else list(entries))
            prompt = rng.choice((16, 640, 2000))
            now[0] += rng.choice((0.0, 0.0, 0.001, 0.05, 0.3, 5.0))
            exclude = frozenset(rng.sample(urls, 1)) if rng.random() < 0.05 else frozenset()
            results = []
            for policy, which in ((reference, 0), (current, 1)):
                entry = entries[sid][which] if sid is not None else None
                results.append(outcome(policy, pool, sid, entry, exclude, PlacementHint(prompt, last_tokens=prompt // 2)))
            assert results[0] == results[1], (seed, trial, sid, results)
            compared += 1
            moved += results[0][0] != "error" and results[0][1].name == "SPILL"
        settled += counts[0]
        passes += counts[1]
        after_drops += counts[2]
    assert compared == 80 * 60
    # the no-pass answer was used often, also after in-flight counts fell; and some sessions moved
    assert settled > 250 and after_drops > 60 and moved > 100, (settled, passes, after_drops, moved)


@pytest.mark.parametrize("seed", range(4))
def test_same_decisions_without_a_pass_when_every_backend_has_work_ahead(seed: int) -> None:
    """Bursts of turns whose prompts are not all cached, on engines that queue alike (so the hysteresis
    alone does not settle the pin): every backend has prefill work ahead (``ahead``), so the pin's
    prediction is above the sticky fast path's floor, and the policy settles the placement without a
    pass from the earliest end of work ahead the last pass saw, while no member's in-flight count can
    have reached 0 since (``_settled``). The reference predicts every candidate each time: the
    decisions must be the same, also as counts fall, the clock moves on and one backend changes."""
    rng = random.Random(2000 + seed)
    compared = with_ahead = passes = moved = 0
    for trial in range(60):
        size = rng.choice((2, 2, 3, 4, 9))
        waiting = rng.choice((1.0, 2.0))
        pool = BackendPool("default", [Backend(f"http://10.2.0.{i + 1}:8000") for i in range(size)])
        settings = KVAwareSettings(move_factor=rng.choice((1.0, 1.5)), move_margin_s=rng.choice((0.0, 0.005)))
        now = [0.0]
        reference = ReferenceKVAwarePolicy(settings, clock=lambda now=now: now[0])
        current = KVAwarePolicy(settings, clock=lambda now=now: now[0])
        real_settled = current._settled
        counts = [0, 0]  # settled with the ``ahead`` term in its bound, a pass needed

        def counting_settled(*args: object, real=real_settled, counts=counts, current=current,  # type: ignore[no-untyped-def]
                             pool=pool, now=now) -> object:
            found = real(*args)  # type: ignore[arg-type]
            settle = current._settles.get(pool.key)
            if found is None:
                counts[1] += 1
            elif settle is not None and settle.in_flight > pool.ledger.drops - settle.drops and settle.done > now[0]:
                counts[0] += 1
            return found

        current._settled = counting_settled  # type: ignore[method-assign]
        for backend in pool.members:
            backend.in_flight = rng.choice((24, 32, 64))
            backend.in_flight_at_scrape = backend.in_flight
            learned(rng, backend, rng.random() < 0.9)
            queueing_alike(rng, backend, waiting, 0.0)  # a queue that persisted: the hysteresis alone does not settle
            queueing_alike(rng, backend, waiting, 0.0)
        urls = [b.url for b in pool.members]
        entries: dict[str, tuple[SessionEntry, SessionEntry]] = {}
        for s in range(4 * size):  # every backend pins some, so every backend gets work ahead
            pair = (SessionEntry(f"s{s}", 0.0, 0.0, 0.0), SessionEntry(f"s{s}", 0.0, 0.0, 0.0))
            pair[0].pins["default"] = pair[1].pins["default"] = rng.choice(urls)
            entries[f"s{s}"] = pair
        for _ in range(80):
            members = pool.members
            for _ in range(rng.choice((0, 1, 1, 2, 3))):  # requests finished since (and one sent per placement)
                backend = rng.choice(members)
                if backend.in_flight > 0:
                    backend.in_flight -= 1
            if rng.random() < 0.05:
                one_change(rng, rng.choice(members))
            sid = rng.choice(list(entries))
            prompt = rng.choice((200, 240, 240, 640))
            last = rng.choice((prompt, prompt - 8, prompt - 40))
            now[0] += rng.choice((0.0, 0.0001, 0.0005, 0.002))  # faster than the work sent: it piles up
            results = [outcome(policy, pool, sid, entries[sid][which], frozenset(), PlacementHint(prompt, last_tokens=last))
                       for policy, which in ((reference, 0), (current, 1))]
            assert results[0] == results[1], (seed, trial, sid, results)
            compared += 1
            moved += results[0][1].name == "SPILL"
            pool.get(str(results[0][0])).in_flight += 1  # the proxy sends it there  # type: ignore[union-attr]
        with_ahead += counts[0]
        passes += counts[1]
    assert compared == 60 * 80
    # the bound with work ahead answered often (the burst this term is for), passes still ran, sessions moved
    assert with_ahead > 30 and passes > 500 and moved > 50, (with_ahead, passes, moved)
