"""DNS discovery (``router.discovery.dns.DnsWatch``) against a real UDP DNS server on 127.0.0.1: A/AAAA
with the configured port, SRV for the ports, records changing between rounds, and failures (SERVFAIL,
timeouts, NXDOMAIN, one of A/AAAA failing) keeping the set found before."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from router.config.schema import DnsDiscoveryConfig
from router.discovery.backoff import Backoff
from router.discovery.dns import DnsWatch, make_resolver
from router.discovery.metrics import DiscoveryMetrics
from tests.router.discovery.fake_dns import FakeDNS
from tests.support import eventually

NAME = "vllm.inference.svc.cluster.local"
BOUND_S = 10.0


@dataclass
class Resolved:
    watch: DnsWatch
    metrics: DiscoveryMetrics
    reports: list[frozenset[str]] = field(default_factory=list)

    @property
    def current(self) -> frozenset[str] | None:
        return self.reports[-1] if self.reports else None

    async def converge(self, expected: set[str], what: str) -> None:
        await eventually(lambda: self.current == frozenset(expected), timeout=BOUND_S, what=what)

    def errors(self, reason: str) -> int:
        return sum(n for (_, _, r), n in self.metrics.errors.items() if r == reason)


@pytest.fixture
async def server() -> AsyncIterator[FakeDNS]:
    fake = FakeDNS()
    await fake.start()
    try:
        yield fake
    finally:
        fake.stop()


@contextlib.asynccontextmanager
async def resolving(server: FakeDNS, *, name: str = NAME, port: int = 8000) -> AsyncIterator[Resolved]:
    settings = DnsDiscoveryConfig(name=name, port=port, interval_s=0.05, nameservers=[server.nameserver])
    resolver = make_resolver(settings.nameservers)
    resolver.lifetime = 0.3  # a dropped query times out quickly here
    metrics = DiscoveryMetrics()
    reports: list[frozenset[str]] = []
    watch = DnsWatch("decode", settings, reports.append, metrics, Backoff(0.02, 0.1), resolver=resolver)
    task = asyncio.create_task(watch.run())
    try:
        yield Resolved(watch, metrics, reports)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_and_aaaa_records_on_the_configured_port_follow_changes(server: FakeDNS) -> None:
    server.set(NAME, "A", "10.0.0.1", "10.0.0.2")
    server.set(NAME, "AAAA", "fd00::3")
    async with resolving(server) as r:
        await r.converge({"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://[fd00::3]:8000"}, "first round")
        server.set(NAME, "A", "10.0.0.2", "10.0.0.4")
        server.set(NAME, "AAAA")
        started = time.monotonic()
        await r.converge({"http://10.0.0.2:8000", "http://10.0.0.4:8000"}, "the changed records")
        assert time.monotonic() - started < BOUND_S
        assert r.metrics.backends[("decode", "dns")] == 2
        assert {(NAME + ".", "A"), (NAME + ".", "AAAA")} <= set(server.queries)


async def test_srv_records_give_each_target_its_port(server: FakeDNS) -> None:
    srv = "_http._tcp." + NAME
    server.set(srv, "SRV", "0 0 8001 pod-a.example.", "0 0 8002 pod-b.example.", "0 0 0 unused.example.")
    server.set("pod-a.example", "A", "10.0.0.1")
    server.set("pod-b.example", "A", "10.0.0.2")
    server.set("pod-b.example", "AAAA", "fd00::2")
    async with resolving(server, name=srv, port=0) as r:
        await r.converge({"http://10.0.0.1:8001", "http://10.0.0.2:8002", "http://[fd00::2]:8002"}, "SRV")
        server.set(srv, "SRV", "0 0 8002 pod-b.example.")
        await r.converge({"http://10.0.0.2:8002", "http://[fd00::2]:8002"}, "a target gone")
        assert ("unused.example.", "A") not in server.queries  # port 0: no service there


async def test_a_name_without_addresses_is_an_empty_set(server: FakeDNS) -> None:
    server.set(NAME, "A", "10.0.0.1")
    async with resolving(server) as r:
        await r.converge({"http://10.0.0.1:8000"}, "first round")
        server.set(NAME, "A")  # NOERROR, no record: the Service has no ready endpoints
        await r.converge(set(), "no addresses")


@pytest.mark.parametrize("failure", ["servfail", "drop", "nxdomain", "aaaa-only"])
async def test_a_failed_resolution_keeps_what_it_has(server: FakeDNS, failure: str) -> None:
    server.set(NAME, "A", "10.0.0.1")
    reason = {"servfail": "servfail", "drop": "timeout", "nxdomain": "nxdomain", "aaaa-only": "servfail"}[failure]
    async with resolving(server) as r:
        await r.converge({"http://10.0.0.1:8000"}, "first round")
        if failure == "nxdomain":
            records = server.records.pop(NAME + ".")
        elif failure == "aaaa-only":
            server.fail[(NAME + ".", "AAAA")] = "servfail"  # A still answers: the round failed all the same
        else:
            server.fail[(NAME + ".", None)] = failure
        rounds = len(r.reports)
        await eventually(lambda: r.errors(reason) >= 2, timeout=BOUND_S, what=f"{failure} counted")
        assert len(r.reports) == rounds and r.current == frozenset({"http://10.0.0.1:8000"})
        server.fail.clear()
        if failure == "nxdomain":
            server.records[NAME + "."] = records
        server.set(NAME, "A", "10.0.0.5")
        await r.converge({"http://10.0.0.5:8000"}, "resolving again")
        assert r.watch.backoff.failures == 0
