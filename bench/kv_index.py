"""The router's KV index (``router.kv.index``) in isolation: what an event costs to apply, what a
placement costs with it, its memory per block, and what Python's cyclic GC pays for it.

The scene (issue 14 §2): 64 backends, 100,000 sessions, block size 16. A 512-token system prompt
(32 blocks) is resident on every backend; each session holds its own 8 blocks (128 tokens) after it
on its pin (session i on backend i % 64), and reported reusing the system prompt (vLLM's
``kv_cache_report_mode = "full"``), so the shared blocks carry the most recent ``MAX_TAGS``
sessions. About 800,000 blocks.

Measured, on that index (median of ``--repeats`` runs, CPU time of this one process):

- event costs: a decode step's ``BlockStored`` (1 new block, chained, tagged), a prefill's (16 new
  blocks), a reuse report (the 32 system-prompt blocks again, new session tag), a ``BlockRemoved``
  (1 block), and a ``BlockStored`` at the ``max_blocks`` bound (each new block evicts the LRU one);
- placement per request with the ``kv_aware`` policy (``router.placement.kv_aware``) over the 64
  backends reading the index: pinned sessions on idle engines (its O(1) fast path) and with every
  pin's engine queueing (all 64 candidates predicted); and the index reads alone:
  ``session_tokens``, ``prefix_tokens`` of a 640-token prompt (tokens mode: 40 blocks hashed);
- memory: bytes per block (``tracemalloc`` while 100,000 blocks are indexed, engine hashes included);
- a full GC collection (``gc.collect()``) with the whole index resident.

``python -m bench.kv_index`` writes its section of ``bench/RESULTS.md``; ``--quick`` runs a small
scene (a smoke test; nothing written).

``--compare`` measures only the placement scenarios, on the same scene, with the current policy next
to ``tests/router/placement/kv_aware_reference.py`` (the policy before its all-candidates path was
made faster) and, with ``--baseline FILE``, a ``kv_aware.py`` of another commit (``git show
COMMIT:router/placement/kv_aware.py > FILE``), interleaved (each repeat times every policy in
turn); every decision is compared (backend, outcome, reason, cached tokens, wait and predicted
TTFT). It prints a table and writes nothing.
"""

from __future__ import annotations

import argparse
import gc
from collections import deque
import hashlib
import importlib.util
import inspect
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable

from bench.router_overhead import write_section
from contract.kv_events import BlockRemoved, BlockStored
from router.kv.index import MAX_TAGS, KVIndex
from router.membership import Backend, BackendPool
from router.placement.base import Placement, PlacementHint
from router.placement.kv_aware import KVAwarePolicy
from router.sessions.table import SessionEntry

SECTION = "kv_index"
BS = 16
SYSTEM_BLOCKS = 32
OWN_BLOCKS = 8


def ehash(*parts: int) -> bytes:
    """A 16-byte engine block hash (as our backends send; vLLM's default is a 32-byte sha256)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], session: str | None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                       lora_id=None, medium="GPU", lora_name=None, session_id=session)


class Scene:
    """The index of the module docstring, and how to make more events for it."""

    def __init__(self, backends: int, sessions: int, max_blocks: int) -> None:
        self.urls = [f"http://10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(backends)]
        self.sessions = sessions
        self.index = KVIndex(max_blocks=max_blocks)
        self.system = list(range(1, SYSTEM_BLOCKS * BS + 1))
        self.system_hashes = [ehash(0, i) for i in range(SYSTEM_BLOCKS)]
        self.tips: dict[int, bytes] = {}
        self.serial = 0
        for url in self.urls:
            self.index.apply_events(url, [stored(self.system_hashes, None, self.system, None)])
        for s in range(sessions):
            self.index.apply_events(self.urls[s % backends], [self.own(s, OWN_BLOCKS), self.reuse(s)])

    def own(self, session: int, blocks: int) -> BlockStored:
        """``blocks`` new blocks of ``session`` after its last one (or the system prompt)."""
        parent = self.tips.get(session, self.system_hashes[-1])
        hashes = []
        for _ in range(blocks):
            self.serial += 1
            hashes.append(ehash(1, session, self.serial))
        self.tips[session] = hashes[-1]
        tokens = [100_000 + (session * 7919 + self.serial * 31 + i) % 30_000 for i in range(blocks * BS)]
        return stored(hashes, parent, tokens, f"sess-{session}")

    def reuse(self, session: int) -> BlockStored:
        return stored(self.system_hashes, None, self.system, f"sess-{session}")

    def prompt(self, session: int) -> list[int]:
        """A tokens-mode prompt of the session: the system prompt, then 8 blocks (not resident)."""
        return self.system + [50_000 + (session + i) % 1000 for i in range(OWN_BLOCKS * BS)]


def per_call(fn: Callable[[], object], calls: int) -> float:
    """Seconds of CPU per call of ``fn`` over ``calls`` calls (the process's CPU time)."""
    started = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - started) / calls


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def event_costs(scene: Scene, calls: int, repeats: int) -> dict[str, tuple[float, int]]:
    """Name -> (median microseconds per event, blocks per event)."""
    index, urls, n = scene.index, scene.urls, len(scene.urls)
    out: dict[str, tuple[float, int]] = {}
    for name, blocks, make in (
        ("BlockStored, decode step (1 new block)", 1, lambda s: scene.own(s, 1)),
        ("BlockStored, prefill (16 new blocks)", 16, lambda s: scene.own(s, 16)),
        (f"BlockStored, reuse report ({SYSTEM_BLOCKS} resident blocks, new tag)", SYSTEM_BLOCKS,
         lambda s: scene.reuse(s)),
    ):
        samples = []
        for r in range(repeats):
            sessions = [(r * calls + i) % scene.sessions for i in range(calls)]
            events = [(urls[s % n], [make(s)]) for s in sessions]
            it = iter(events)
            samples.append(per_call(lambda: index.apply_events(*next(it)), calls))
        out[name] = (median_us(samples), blocks)
    samples = []
    for r in range(repeats):
        victims = []
        for i in range(calls):
            s = (r * calls + i) % scene.sessions
            victims.append((urls[s % n], [BlockRemoved(block_hashes=[scene.tips[s]], medium="GPU")]))
            scene.tips.pop(s)  # its next block chains to the system prompt (a removed parent is unknown)
        it = iter(victims)
        samples.append(per_call(lambda: index.apply_events(*next(it)), calls))
    out["BlockRemoved (1 block)"] = (median_us(samples), 1)
    samples = []
    saved = index.max_blocks
    index.max_blocks = index.blocks
    for r in range(repeats):
        sessions = [(r * calls + i) % scene.sessions for i in range(calls)]
        events = [(urls[s % n], [scene.own(s, 1)]) for s in sessions]
        it = iter(events)
        samples.append(per_call(lambda: index.apply_events(*next(it)), calls))
    index.max_blocks = saved
    out["BlockStored at the bound (1 new block, 1 LRU eviction)"] = (median_us(samples), 1)
    return out


#: the placement scenarios: name -> how it sets the pool's engines (applied in this order, on one pool)
def _idle(pool: BackendPool) -> None:
    for backend in pool.members:
        backend.engine_waiting = 0
        backend.kv_usage = 0.0


def _queueing(pool: BackendPool) -> None:
    for backend in pool.members:  # every engine queueing: the pin's prediction no longer settles it
        backend.engine_waiting = 5
        backend.kv_usage = 0.0


def _kv_full(pool: BackendPool) -> None:
    # every engine idle with a full KV cache: each candidate's floor (its prediction without the KV-pressure
    # term) is clearly faster than the pin, so every candidate is predicted (none is: no session moves)
    for backend in pool.members:
        backend.engine_waiting = 0
        backend.kv_usage = 1.0


def _kv_known(pool: BackendPool) -> None:
    # every engine idle, its KV cache's size and answer length known (scraped and learned): each placement
    # checks the fit on its pin (the prompts placed since the scrape, the answers' growth) and records its own
    # prompt there; every turn fits (a million tokens, 30% used), so no session moves
    for backend in pool.members:
        backend.engine_waiting = 0
        backend.kv_usage = 0.3
        backend.kv_capacity_tokens = 1_000_000
        backend.output_tokens = 150.0
        backend.load_scraped_at = 1.0


#: requests in flight in the scenario with traffic: each placement sends one and the oldest finishes
TRAFFIC_IN_FLIGHT = 16


def scenarios(backends: int) -> list[tuple[str, Callable[[BackendPool], None], bool]]:
    """(name, how it sets the engines, whether requests are sent and finish between placements)."""
    return [
        ("kv_aware place(), pinned, engines idle (fast path)", _idle, False),
        ("kv_aware place(), pinned, every engine queueing alike (no candidate's floor beats the pin)", _queueing,
         False),
        ("kv_aware place(), pinned, every engine queueing alike, a request sent and one finished per placement "
         f"({TRAFFIC_IN_FLIGHT} in flight; the in-flight writes included)", _queueing, True),
        (f"kv_aware place(), pinned, every KV cache full (all {backends - 1} others predicted)", _kv_full, False),
        ("kv_aware place(), pinned, engines idle with their KV capacity known (the fit check on the pin), a "
         f"request sent and one finished per placement ({TRAFFIC_IN_FLIGHT} in flight)", _kv_known, True),
    ]


class Traffic:
    """Requests sent and finished around placements: each placed backend's in-flight count goes up
    (as the proxy's does) and the oldest request in flight finishes (its backend's goes down), so
    ``TRAFFIC_IN_FLIGHT`` stay in flight; ``close`` finishes them."""

    def __init__(self, pool: BackendPool) -> None:
        self.ring: deque[Backend] = deque()
        for backend in pool.members[:TRAFFIC_IN_FLIGHT]:
            backend.in_flight += 1
            self.ring.append(backend)

    def after(self, backend: Backend) -> None:
        backend.in_flight += 1
        self.ring.append(backend)
        self.ring.popleft().in_flight -= 1

    def wrap(self, place: Callable[[int], Placement]) -> Callable[[int], Placement]:
        def one(i: int) -> Placement:
            placement = place(i)
            self.after(placement.backend)
            return placement

        return one

    def close(self) -> None:
        while self.ring:
            self.ring.popleft().in_flight -= 1


def _pinned_entries(scene: Scene) -> list[SessionEntry]:
    entries = []
    for s in range(scene.sessions):
        entry = SessionEntry(f"sess-{s}", created=0.0, last_active=0.0, last_seen=0.0)
        entry.pins["default"] = scene.urls[s % len(scene.urls)]
        entries.append(entry)
    return entries


PLACE_HINT = PlacementHint(prompt_tokens_estimate=(SYSTEM_BLOCKS + OWN_BLOCKS + 8) * BS, last_tokens=640)


def _cycle(sessions: int, fn: Callable[[int], object]) -> Callable[[], object]:
    """``fn`` of the next session, stepping through them by a prime (not in pin order)."""
    state = [0]

    def one() -> object:
        i = state[0] = (state[0] + 7919) % sessions
        return fn(i)

    return one


def placement_costs(scene: Scene, calls: int, repeats: int) -> dict[str, float]:
    """Name -> median microseconds per call."""
    index = scene.index
    pool = BackendPool("default", [Backend(url) for url in scene.urls])
    policy = KVAwarePolicy(kv=index)
    entries = _pinned_entries(scene)
    out: dict[str, float] = {}

    def place(i: int) -> Placement:
        entry = entries[i]
        return policy.place(pool, entry.session_id, entry, hint=PLACE_HINT)

    for name, setup, traffic in scenarios(len(pool.members)):
        setup(pool)
        samples = []
        for _ in range(repeats):
            moving = Traffic(pool) if traffic else None
            samples.append(per_call(_cycle(scene.sessions, moving.wrap(place) if moving else place), calls))
            if moving:
                moving.close()
        out[name] = median_us(samples)
    out["KVIndex.session_tokens()"] = median_us(
        [per_call(_cycle(scene.sessions, lambda i: index.session_tokens(f"sess-{i}")), calls) for _ in range(repeats)])
    prompts = [scene.prompt(s) for s in range(0, scene.sessions, max(1, scene.sessions // 512))]
    out[f"KVIndex.prefix_tokens(), {len(prompts[0])}-token prompt ({len(prompts[0]) // BS} blocks)"] = median_us(
        [per_call(_cycle(scene.sessions, lambda i: index.prefix_tokens(prompts[i % len(prompts)])), calls // 10)
         for _ in range(repeats)])
    return out


def load_policy_class(path: str, module: str, cls: str) -> type:
    """The class ``cls`` of the Python file ``path`` (another commit's policy, or the test's reference)."""
    spec = importlib.util.spec_from_file_location(module, path)
    assert spec is not None and spec.loader is not None, path
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded  # dataclasses look their module up
    spec.loader.exec_module(loaded)
    return getattr(loaded, cls)  # type: ignore[no-any-return]


#: placements per scenario whose decisions ``compare_placement`` compares
DECISIONS = 2000


def _fresh(cls: type, scene: Scene) -> object:
    """A policy of ``cls`` on a clock that stands still, when it takes one (``kv_aware``'s prefill work
    sent to a backend, ``ahead``, then depends on the placements alone, alike for every copy)."""
    if "clock" in inspect.signature(cls).parameters:
        return cls(kv=scene.index, clock=lambda: 0.0)
    return cls(kv=scene.index)


def compare_placement(scene: Scene, calls: int, repeats: int, baseline: str | None
                      ) -> tuple[list[str], dict[str, dict[str, float]], dict[str, str]]:
    """(policy labels, scenario -> label -> median µs per call, scenario -> what the decisions were).
    Every policy places the same sessions on the same pool; the decisions of ``verify`` calls per
    scenario are compared (an ``AssertionError`` names the first that differs)."""
    reference = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "tests", "router", "placement", "kv_aware_reference.py")
    classes: dict[str, type] = {
        "reference": load_policy_class(reference, "_kv_aware_reference", "ReferenceKVAwarePolicy")}
    if baseline is not None:
        classes["baseline"] = load_policy_class(baseline, "_kv_aware_baseline", "KVAwarePolicy")
    classes["current"] = KVAwarePolicy
    policies = {label: cls(kv=scene.index) for label, cls in classes.items()}
    pool = BackendPool("default", [Backend(url) for url in scene.urls])
    entries = {label: _pinned_entries(scene) for label in policies}
    timings: dict[str, dict[str, float]] = {}
    decisions: dict[str, str] = {}
    for name, setup, traffic in scenarios(len(pool.members)):
        setup(pool)
        samples: dict[str, list[float]] = {label: [] for label in policies}
        for _ in range(repeats):
            for label, policy in policies.items():
                own = entries[label]
                place = policy.place  # type: ignore[attr-defined]

                def one(i: int, own: list[SessionEntry] = own, place: Callable[..., Placement] = place) -> Placement:
                    return place(pool, own[i].session_id, own[i], hint=PLACE_HINT)

                moving = Traffic(pool) if traffic else None
                samples[label].append(per_call(_cycle(scene.sessions, moving.wrap(one) if moving else one), calls))
                if moving:
                    moving.close()
        timings[name] = {label: median_us(values) for label, values in samples.items()}
        # the decisions: fresh policies (the same history: their caches start alike) and fresh pins
        # place the same sessions in turn on the same pool state, the traffic applied once per step
        fresh = {label: _fresh(cls, scene) for label, cls in classes.items()}
        pins = {label: _pinned_entries(scene) for label in fresh}
        seen: set[tuple[object, ...]] = set()
        moving = Traffic(pool) if traffic else None
        for i in range(0, scene.sessions, max(1, scene.sessions // DECISIONS)):
            answers = []
            for label, policy in fresh.items():
                entry = pins[label][i]
                p = policy.place(pool, entry.session_id, entry, hint=PLACE_HINT)  # type: ignore[attr-defined]
                answers.append((p.backend.url, p.outcome, p.reason, p.cached_tokens, p.wait_s, p.predicted_ttft_s,
                                dict(entry.pins)))
            assert all(a == answers[0] for a in answers), (name, i, dict(zip(fresh, answers)))
            seen.add((answers[0][1].name, answers[0][2]))
            if moving is not None:
                moving.after(pool.get(answers[0][0]))  # type: ignore[arg-type]
        if moving is not None:
            moving.close()
        decisions[name] = "identical " + ", ".join(f"{o}/{r}" for o, r in sorted(seen))
    return list(policies), timings, decisions


def bytes_per_block(blocks: int) -> float:
    """tracemalloc's count of what ``blocks`` indexed blocks hold (engine hashes, tags included)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    scene = Scene(backends=64, sessions=blocks // OWN_BLOCKS, max_blocks=10 * blocks)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    # the scene's own bookkeeping (tips) is not the index's: subtract it
    tips = sys.getsizeof(scene.tips) + sum(sys.getsizeof(v) for v in scene.tips.values())
    return (held - tips) / scene.index.blocks


def gc_pause_ms() -> float:
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1000


def report(scene: Scene, built: int, build_s: float, events: dict[str, tuple[float, int]],
           placement: dict[str, float], per_block: float, measured_blocks: int, gc_ms: float) -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        f"## KV index micro-benchmark (issue 14 §2) — {time.strftime('%Y-%m-%d %H:%M %Z')}",
        "",
        "`python -m bench.kv_index"
        + "".join(f" {a}" for a in sys.argv[1:]) + f"`, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs (load average {load}: the machine was shared; CPU time of this process).",
        f"Scene: {len(scene.urls)} backends, {scene.sessions:,} sessions, {built:,} blocks indexed "
        f"(block size {BS}; a {SYSTEM_BLOCKS}-block system prompt on every backend, {OWN_BLOCKS} own blocks per "
        f"session on its pin, the system prompt's blocks tagged by the latest {MAX_TAGS} sessions), built in "
        f"{build_s:.1f} s.",
        "",
        "| event | µs per event | µs per block |",
        "|---|---:|---:|",
    ]
    for name, (us, blocks) in events.items():
        lines.append(f"| {name} | {us:.1f} | {us / blocks:.2f} |")
    lines += ["", "| placement / read | µs per call |", "|---|---:|"]
    for name, us in placement.items():
        lines.append(f"| {name} | {us:.1f} |")
    lines += [
        "",
        f"Memory: {per_block:.0f} bytes per indexed block (tracemalloc, {measured_blocks:,} blocks, 16-byte engine "
        "hashes and "
        f"session tags included; `router.kv.index.BYTES_PER_BLOCK` documents it). A full `gc.collect()` with the "
        f"{built:,}-block index resident: {gc_ms:.0f} ms (blocks are ids into arrays, not objects).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_index", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--max-blocks", type=int, default=1_000_000)
    parser.add_argument("--calls", type=int, default=20_000, help="calls per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a small scene, nothing written (smoke test)")
    parser.add_argument("--compare", action="store_true",
                        help="placement only: the current policy next to the reference (and --baseline), "
                             "decisions compared; nothing written")
    parser.add_argument("--baseline", default=None, metavar="FILE",
                        help="with --compare: another commit's router/placement/kv_aware.py")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    args = parser.parse_args(argv)
    if args.quick:
        args.backends, args.sessions, args.calls, args.repeats = 8, 500, 200, 1
    started = time.perf_counter()
    scene = Scene(args.backends, args.sessions, args.max_blocks)
    build_s = time.perf_counter() - started
    if args.compare:
        labels, timings, decisions = compare_placement(scene, args.calls, args.repeats, args.baseline)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        lines = [f"`python -m bench.kv_index {' '.join(sys.argv[1:] if argv is None else argv)}` "
                 f"({time.strftime('%Y-%m-%d %H:%M %Z')}, load average {load}; {len(scene.urls)} backends, "
                 f"{scene.sessions:,} sessions; µs per call, median of {args.repeats} × {args.calls:,} calls, "
                 "interleaved)", "",
                 "| scenario | " + " | ".join(labels) + " | decisions |",
                 "|---|" + "---:|" * len(labels) + "---|"]
        for name, by_label in timings.items():
            lines.append(f"| {name.removeprefix('kv_aware place(), ')} | "
                         + " | ".join(f"{by_label[label]:.1f}" for label in labels) + f" | {decisions[name]} |")
        print("\n".join(lines))
        return 0
    built = scene.index.blocks
    gc_ms = gc_pause_ms()
    events = event_costs(scene, args.calls, args.repeats)
    placement = placement_costs(scene, args.calls, args.repeats)
    measured = 1_000 if args.quick else 100_000
    per_block = bytes_per_block(measured)
    text = report(scene, built, build_s, events, placement, per_block, measured, gc_ms)
    print(text)
    if not args.quick:
        write_section(args.out, text, SECTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
