"""The engines' own load and speed, read from each backend's ``GET /metrics`` off the request path.

The health checker calls ``EngineLoad.scrape`` after every good check of a backend (so at the health
interval, in the checker's task, through its client). One scrape reads vLLM's series with
prometheus_client's text parser, summed over the label sets an engine exports (data-parallel ranks):

- gauges ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and
  ``vllm:kv_cache_usage_perc`` (the highest of the ranks) go straight onto the ``Backend``
  (``engine_waiting``, ``engine_running``, ``kv_usage``), with the scrape's time
  (``load_scraped_at``, monotonic) and the router's own in-flight count at that moment
  (``in_flight_at_scrape``): what the router sent since is ``in_flight - in_flight_at_scrape``;
  and the engine's requests beyond that in-flight count (``others_at_scrape``: running + waiting
  less ``in_flight``, at least 0), the share of other router replicas or workers, so that
  ``in_flight + others_at_scrape`` is the engine's load as every replica sees it alike;
- counters and histograms are compared with the previous scrape of the same backend, and the
  deltas teach the model's constants per backend (``learn = true``):

  * decode step (``decode_step_s``): the mean inter-token latency,
    Δ``vllm:inter_token_latency_seconds`` sum / count (one step of the batch);
  * prefill cost (``prefill_s_per_token``): the prompt tokens the engine actually computed,
    Δ``vllm:prompt_tokens_total`` − Δ``vllm:prefix_cache_hits_total``, against the time spent
    prefilling: Δ``vllm:request_prefill_time_seconds`` sum when the engine exports it (vLLM
    does), else Δ``vllm:time_to_first_token_seconds`` sum (which includes queueing, so it errs on
    the side of a dearer prefill), less one step per request. Prefills that run concurrently share
    steps, so that per-request sum counts shared time once per request; the engine cannot have
    spent more than the wall time between the two scrapes, so the time is capped there. From the
    TTFT (no prefill histogram) the sample is also capped at the configured prefill cost scaled by
    the engine's decode step over the configured step (``ratio``): TTFT counts queueing and steps
    shared with other prefills, while a GPU that runs steps k times slower prefills about k times
    slower. Only learned from intervals that computed at least ``MIN_COMPUTED_PER_REQUEST`` tokens
    per request (a mostly cached interval says little about the prefill rate); until one does, the
    configured cost scaled by ``ratio`` stands in;
  * first step (``step_s``, what a request waits before its first token besides its own prefill):
    the mean TTFT (Δ``vllm:time_to_first_token_seconds`` sum / count) less the mean computed prefill
    per request at that cost, at least one decode step. It is what a newcomer meets there: an engine
    whose steps are long, or that is stalled part of the time (starved of its GPU, stopped), shows
    it here even when its decode steps look short;
  * a queued request's cost (``queued_request_s``): the wall time between the scrapes / the
    requests that finished in it: how often a running request finishes and makes room, which is
    what a waiting request waits for (the engine queues only when it is full);
  * interference (``busy_s_per_request``): what one request in flight adds to a new request's
    first step on average: the share of a request's life spent before its first token (Δ TTFT sum
    / Δ e2e sum) times the mean computed prefill per request, in seconds;
  * tokens generated per request (``output_tokens``): Δ ITL count / Δ e2e count + 1 (one
    inter-token interval per token after the first), what the policy reserves in a KV cache for the
    running requests' growth (``router.placement.kv_aware``).

  **Robust to outliers.** Each constant is the median of its last ``WINDOW`` per-interval samples,
  and it replaces the configured value on the ``Backend`` only once ``MIN_SAMPLES`` intervals
  measured it. So one cold request (an engine's first, 1.2 s while a warm one takes 20 ms) or any
  single odd interval moves nothing: it takes a majority of the window (3 of 5 intervals) to make
  a backend look slower or faster, and an engine that really slowed down shows it within 3
  intervals that measured it. (Measured: with the mean of every sample, one cold first request made
  the router send 79 of 80 turns to the other engine.) Until then the policy uses the configured
  value; the prefill cost's stand-in is the configured cost scaled by the engine's (published)
  decode step. An interval without the requests to measure leaves the window as it was, and after
  ``FORGET_AFTER_IDLE`` idle scrapes in a row (no request began or ended there) the learned values
  and their windows are dropped. ``-1.0`` on a ``Backend`` means "not learned": the policy uses the
  configured value (always, with ``learn = false``).

A scrape that fails (no answer, not a 200, no vLLM series) clears the engine signals (waiting,
running, KV usage: unknown reads as idle) and keeps the learned constants; a counter that went
backwards (an engine restart) restarts the deltas.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.membership import Backend

METRICS_PATH = "/metrics"

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
#: an info gauge whose labels carry the cache settings (``num_gpu_blocks``, ``block_size``)
CACHE_INFO = "vllm:cache_config_info"

_SUMMED = frozenset((
    WAITING, RUNNING, PROMPT_TOKENS, PREFIX_HITS,
    *(name + suffix for name in (PREFILL_TIME, TTFT, ITL, E2E) for suffix in ("_sum", "_count")),
))
#: the lines of an exposition worth parsing: the samples read here (an engine's /metrics also holds
#: histogram buckets and per-session series, ten times the lines, which the parser would read for nothing)
_WANTED = tuple(name + end for name in (*_SUMMED, KV_USAGE, CACHE_INFO) for end in ("{", " "))

#: per-interval samples a learned constant is the median of (the most recent ones)
WINDOW = 5
#: intervals that must have measured a constant before it replaces the configured one on the Backend
MIN_SAMPLES = 3
#: an interval teaches the prefill rate only when it computed this many prompt tokens per request
MIN_COMPUTED_PER_REQUEST = 32
#: learned values are kept within these (a noisy interval must not make a backend look free or dead)
MAX_S_PER_TOKEN = 0.1
MAX_STEP_S = 10.0
#: scrapes a queue must be seen in, in a row, to count as persisting (``Backend.queued_floor``: the least
#: of their ``vllm:num_requests_waiting``): at a high request rate an engine shows a few waiting requests
#: at any instant (arrivals between two steps), two scrapes in a row often catch that, three rarely
QUEUE_SCRAPES = 3
#: scrapes in a row with no request started or finished after which a backend's learned constants are
#: dropped (the configured ones apply again): one that was slow, lost its sessions and recovered is
#: not judged by old numbers for ever; with traffic again it is learned afresh
FORGET_AFTER_IDLE = 15


@dataclass(slots=True)
class EngineSample:
    """What one scrape read: gauges, and the counters' and histograms' running totals."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    #: the KV cache's size in tokens (``num_gpu_blocks * block_size`` of ``vllm:cache_config_info``; 0: not told)
    kv_capacity_tokens: int = 0
    prompt_tokens: float = 0.0
    prefix_hits: float = 0.0
    prefill_time_sum: float = 0.0
    prefill_time_count: float = 0.0
    has_prefill_time: bool = False
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    e2e_sum: float = 0.0
    e2e_count: float = 0.0
    #: monotonic time of the scrape (set by ``EngineLoad.apply``)
    at: float = 0.0


def parse_metrics(text: str) -> EngineSample | None:
    """The vLLM series of one ``/metrics`` text (None when it has none of the load gauges). Only the
    sample lines read here go through prometheus_client's parser (as untyped samples)."""
    totals: dict[str, float] = {}
    kv_usage = 0.0
    capacity = 0
    seen_gauge = False
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED))
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            name = sample.name
            if name in _SUMMED:
                totals[name] = totals.get(name, 0.0) + sample.value
                if name == WAITING or name == RUNNING:
                    seen_gauge = True
            elif name == KV_USAGE:
                kv_usage = max(kv_usage, sample.value)
                seen_gauge = True
            elif name == CACHE_INFO:
                blocks, size = sample.labels.get("num_gpu_blocks", ""), sample.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit():
                    capacity += int(blocks) * int(size)  # per engine (data-parallel ranks add up)
    if not seen_gauge:
        return None
    get = totals.get
    return EngineSample(
        waiting=get(WAITING, 0.0), running=get(RUNNING, 0.0), kv_usage=min(1.0, max(0.0, kv_usage)),
        kv_capacity_tokens=capacity,
        prompt_tokens=get(PROMPT_TOKENS, 0.0), prefix_hits=get(PREFIX_HITS, 0.0),
        prefill_time_sum=get(PREFILL_TIME + "_sum", 0.0), prefill_time_count=get(PREFILL_TIME + "_count", 0.0),
        has_prefill_time=(PREFILL_TIME + "_count") in totals,
        ttft_sum=get(TTFT + "_sum", 0.0), ttft_count=get(TTFT + "_count", 0.0),
        itl_sum=get(ITL + "_sum", 0.0), itl_count=get(ITL + "_count", 0.0),
        e2e_sum=get(E2E + "_sum", 0.0), e2e_count=get(E2E + "_count", 0.0),
    )


class Estimate:
    """One learned constant: the median of its last ``WINDOW`` interval samples (``value``, -1.0 before
    any), trusted (``ready``) once ``MIN_SAMPLES`` intervals measured it."""

    __slots__ = ("recent", "count", "value")

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=WINDOW)
        #: intervals that measured it (since it was last dropped)
        self.count = 0
        self.value = -1.0

    @property
    def ready(self) -> bool:
        return self.count >= MIN_SAMPLES

    def add(self, sample: float) -> None:
        self.recent.append(sample)
        self.count += 1
        self.value = median(self.recent)


class Learned:
    """What ``learn`` has measured of one backend, published onto its ``Backend`` by ``publish``."""

    __slots__ = ("decode_step", "prefill_per_token", "first_step", "queued", "busy", "output")

    def __init__(self) -> None:
        self.decode_step = Estimate()
        self.prefill_per_token = Estimate()
        self.first_step = Estimate()
        self.queued = Estimate()
        self.busy = Estimate()
        self.output = Estimate()

    def publish(self, backend: Backend, *, ratio: float = 0.0) -> None:
        """Set ``backend``'s learned fields: each trusted estimate, else -1.0 (the configured value);
        an untrusted prefill cost stands in as ``ratio`` times a trusted decode step (``learn``)."""
        decode = self.decode_step.value if self.decode_step.ready else -1.0
        backend.decode_step_s = decode
        if self.prefill_per_token.ready:
            backend.prefill_s_per_token = self.prefill_per_token.value
        elif ratio > 0 and decode >= 0:
            backend.prefill_s_per_token = min(MAX_S_PER_TOKEN, ratio * decode)
        else:
            backend.prefill_s_per_token = -1.0
        backend.step_s = self.first_step.value if self.first_step.ready else -1.0
        backend.queued_request_s = self.queued.value if self.queued.ready else -1.0
        backend.busy_s_per_request = self.busy.value if self.busy.ready else -1.0
        backend.output_tokens = self.output.value if self.output.ready else -1.0


def learn(learned: Learned, before: EngineSample, now: EngineSample, *, ratio: float = 0.0) -> None:
    """Add the samples the interval between two scrapes measured to ``learned`` (module docstring).
    The derived samples (first step, interference) use the estimates so far, trusted or not.

    ``ratio``: configured seconds per prompt token / configured step seconds (0: no such cap)."""
    elapsed = now.at - before.at
    d_itl_count = now.itl_count - before.itl_count
    if d_itl_count > 0:
        decode = (now.itl_sum - before.itl_sum) / d_itl_count
        learned.decode_step.add(min(MAX_STEP_S, max(0.0, decode)))
    decode = learned.decode_step.value
    step = decode if decode > 0 else 0.0
    computed = (now.prompt_tokens - before.prompt_tokens) - (now.prefix_hits - before.prefix_hits)
    from_ttft = not (now.has_prefill_time and before.has_prefill_time)
    if from_ttft:
        requests = now.ttft_count - before.ttft_count
        spent = now.ttft_sum - before.ttft_sum
    else:
        requests = now.prefill_time_count - before.prefill_time_count
        spent = now.prefill_time_sum - before.prefill_time_sum
    if requests > 0 and computed >= MIN_COMPUTED_PER_REQUEST * requests:
        spent -= requests * step
        if elapsed > 0 and spent > elapsed:
            spent = elapsed  # concurrent prefills shared that time (module docstring)
        per_token = max(0.0, spent) / computed
        if from_ttft and ratio > 0 and decode >= 0:
            per_token = min(per_token, ratio * decode)
        learned.prefill_per_token.add(min(MAX_S_PER_TOKEN, per_token))
    per_token = learned.prefill_per_token.value
    if per_token < 0 and ratio > 0 and decode >= 0:
        # nothing to measure the prefill by yet: the configured cost at this engine's speed
        per_token = min(MAX_S_PER_TOKEN, ratio * decode)
    d_ttft_count = now.ttft_count - before.ttft_count
    d_ttft_sum = now.ttft_sum - before.ttft_sum
    if d_ttft_count > 0:
        # what came before the first token besides the request's own prefill: at least a step
        own = (computed / d_ttft_count) * per_token if computed > 0 and per_token > 0 else 0.0
        first = max(step, d_ttft_sum / d_ttft_count - own)
        learned.first_step.add(min(MAX_STEP_S, first))
    elif d_itl_count > 0:
        learned.first_step.add(step)
    d_e2e_count = now.e2e_count - before.e2e_count
    d_e2e_sum = now.e2e_sum - before.e2e_sum
    if d_e2e_count > 0:
        if d_itl_count >= 0:
            # tokens generated per finished request: one inter-token interval per token after the first
            learned.output.add(d_itl_count / d_e2e_count + 1.0)
        if elapsed > 0:
            learned.queued.add(min(MAX_STEP_S, elapsed / d_e2e_count))
        if d_e2e_sum > 0 and d_ttft_count > 0 and computed >= 0 and per_token >= 0:
            before_first = min(1.0, max(0.0, d_ttft_sum / d_e2e_sum))
            learned.busy.add(min(MAX_STEP_S, before_first * (computed / d_ttft_count) * per_token))


def _went_backwards(before: EngineSample, now: EngineSample) -> bool:
    return (now.prompt_tokens < before.prompt_tokens or now.ttft_count < before.ttft_count
            or now.e2e_count < before.e2e_count or now.itl_count < before.itl_count)


class EngineLoad:
    """Scrapes the engines' ``/metrics`` for the health checker; see the module docstring.

    ``learn``: learn the constants from the engines' counters (False: the configured ones only).
    Keeps the previous sample of each backend (by URL) for the deltas; ``forget`` drops one.
    """

    def __init__(self, *, learn: bool = True, prefill_tokens_per_s: float = 4000.0, per_request_step_s: float = 0.010,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``prefill_tokens_per_s``, ``per_request_step_s``: the configured constants (their ratio
        caps a prefill cost learned from TTFT; see the module docstring)."""
        self.learn = learn
        self._ratio = 1.0 / prefill_tokens_per_s / per_request_step_s if per_request_step_s > 0 else 0.0
        self._clock = clock
        self._previous: dict[str, EngineSample] = {}
        #: backend URL -> what was learned of it (published onto its Backend after each scrape)
        self._learned: dict[str, Learned] = {}
        #: backend URL -> ``vllm:num_requests_waiting`` of its last QUEUE_SCRAPES - 1 scrapes (``queued_floor``)
        self._waiting: dict[str, deque[float]] = {}
        #: backend URL -> idle scrapes in a row (see FORGET_AFTER_IDLE)
        self._idle: dict[str, int] = {}
        #: completed scrapes (tests and the admin view read it)
        self.scrapes = 0

    async def scrape(self, backend: Backend, client: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout) -> bool:
        """Read ``backend``'s ``/metrics`` now and apply it; whether it held the engine's load."""
        sample: EngineSample | None = None
        try:
            async with client.get(backend.url + METRICS_PATH, timeout=timeout) as resp:
                body = await resp.read()
                if resp.status == 200:
                    sample = parse_metrics(body.decode("utf-8", "replace"))
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError):
            sample = None
        if sample is None:
            self.clear(backend)
            return False
        self.apply(backend, sample)
        return True

    def apply(self, backend: Backend, sample: EngineSample) -> None:
        """Record one scrape's ``sample`` of ``backend`` (the gauges, and what the deltas teach)."""
        recent = self._waiting.get(backend.url)
        if recent is None:
            recent = self._waiting[backend.url] = deque(maxlen=QUEUE_SCRAPES - 1)
        backend.queued_floor = min(sample.waiting, *recent) if len(recent) == QUEUE_SCRAPES - 1 else 0.0
        recent.append(sample.waiting)
        backend.engine_waiting = sample.waiting
        backend.queued_scrapes = backend.queued_scrapes + 1 if sample.waiting > 0 else 0
        backend.engine_running = sample.running
        backend.kv_usage = sample.kv_usage
        backend.kv_capacity_tokens = sample.kv_capacity_tokens
        backend.load_scraped_at = sample.at = self._clock()
        backend.in_flight_at_scrape = backend.in_flight
        others = sample.running + sample.waiting - backend.in_flight
        backend.others_at_scrape = others if others > 0 else 0.0
        before = self._previous.get(backend.url)
        self._previous[backend.url] = sample
        if self.learn and before is not None and not _went_backwards(before, sample):
            learned = self._learned.get(backend.url)
            if learned is None:
                learned = self._learned[backend.url] = Learned()
            learn(learned, before, sample, ratio=self._ratio)
            if sample.ttft_count == before.ttft_count and sample.e2e_count == before.e2e_count:
                idle = self._idle[backend.url] = self._idle.get(backend.url, 0) + 1
                if idle >= FORGET_AFTER_IDLE:
                    learned = self._learned[backend.url] = Learned()
                    self._idle[backend.url] = 0
            else:
                self._idle[backend.url] = 0
            learned.publish(backend, ratio=self._ratio)
        self.scrapes += 1

    def clear(self, backend: Backend) -> None:
        """No engine signals from ``backend`` now: unknown load reads as none (the learned constants stay)."""
        backend.engine_waiting = 0.0
        backend.queued_floor = 0.0
        backend.queued_scrapes = 0
        self._waiting.pop(backend.url, None)
        backend.engine_running = 0.0
        backend.kv_usage = 0.0
        backend.in_flight_at_scrape = backend.in_flight
        backend.others_at_scrape = 0.0
        self._previous.pop(backend.url, None)

    def forget(self, url: str) -> None:
        self._previous.pop(url, None)
        self._waiting.pop(url, None)
        self._idle.pop(url, None)
        self._learned.pop(url, None)
