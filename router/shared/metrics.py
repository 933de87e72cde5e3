"""``session_router_shared_state_*`` and ``session_router_off_first_choice_total``, exported at scrape time.

Plain ints and dicts bumped by ``router.shared`` (no prometheus-client lock on the request path),
turned into families when ``/metrics`` is read. The shared-state families are exported only when
``shared_state`` is configured; the agreement counter always.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.metrics import labelled

PREFIX = "session_router_"


class SharedMetrics(Collector):
    """Register once on the router's registry. ``agreement``: the ``Agreement.counts`` dict."""

    def __init__(self, agreement: dict[str, int], *, shared: bool) -> None:
        self.agreement = agreement
        self.shared = shared
        self.up = 0
        self.errors: dict[str, int] = {}
        self.dropped_writes = 0
        self.read_timeouts = 0
        #: (kind: pins | response, result: hit | miss | skipped) -> reads
        self.reads: dict[tuple[str, str], int] = {}
        #: kind (pin | resp | forget) -> writes sent
        self.writes: dict[str, int] = {}
        #: pin moves by other processes applied here
        self.pushes = 0

    def error(self, op: str) -> None:
        self.errors[op] = self.errors.get(op, 0) + 1

    def collect(self) -> Iterator[Metric]:
        yield labelled(CounterMetricFamily, PREFIX + "off_first_choice",
                       "Requests of sessions placed off their first-choice (rendezvous) backend, by reason",
                       ["reason"], sorted(self.agreement.items()))
        if not self.shared:
            return
        yield GaugeMetricFamily(PREFIX + "shared_state_up",
                                "1 while the shared state (Redis) is reachable; 0: deciding from local state",
                                value=self.up)
        yield labelled(CounterMetricFamily, PREFIX + "shared_state_errors",
                       "Failures talking to the shared state, by operation", ["op"], sorted(self.errors.items()))
        yield CounterMetricFamily(PREFIX + "shared_state_dropped_writes",
                                  "Writes to the shared state dropped (queue full, or lost with a failed batch)",
                                  value=self.dropped_writes)
        yield CounterMetricFamily(PREFIX + "shared_state_read_timeouts",
                                  "Reads of the shared state that took longer than read_timeout_s",
                                  value=self.read_timeouts)
        yield labelled(CounterMetricFamily, PREFIX + "shared_state_reads",
                       "Reads of the shared state on first sight, by kind and result", ["kind", "result"],
                       sorted(self.reads.items()))
        yield labelled(CounterMetricFamily, PREFIX + "shared_state_writes", "Writes sent to the shared state, by kind",
                       ["kind"], sorted(self.writes.items()))
        yield CounterMetricFamily(PREFIX + "shared_state_pushes",
                                  "Pin moves made by other processes applied to this one's sessions",
                                  value=self.pushes)
