"""DNS discovery: a name's records (a headless Service's), re-resolved every ``interval_s``.

- ``port`` set: the A and AAAA records of ``name``, each address one backend on that port;
- ``port = 0``: the SRV records of ``name`` (e.g. ``_http._tcp.vllm.ns.svc.cluster.local``), each target
  one backend on the record's port, the target's addresses from its own A/AAAA records.

The set reported is the union of what one resolution found. A name that exists with no such record
(NOERROR, no answer) reports an empty set. Anything else that fails (no answer from the servers, a
timeout, SERVFAIL, NXDOMAIN, one of A/AAAA failing while the other answers) keeps the set found
before, is counted, and is retried after a bounded, jittered backoff (shorter than the interval while
it lasts). Resolution uses dnspython's asyncio resolver, with the system's servers
(``/etc/resolv.conf``) or ``nameservers``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdata
import dns.rdatatype
import dns.resolver

from contract.errors import ConfigError
from router.config.load import split_host_port
from router.config.schema import DnsDiscoveryConfig
from router.discovery.backoff import Backoff
from router.discovery.metrics import DiscoveryMetrics
from router.membership import normalize_url

logger = logging.getLogger(__name__)

SOURCE = "dns"
#: one query (all its retries over the servers) is bounded by this
LIFETIME_S = 2.0


class ResolveFailed(Exception):
    """A resolution failed; ``reason`` is the metric's label (a closed set)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def make_resolver(nameservers: list[str]) -> dns.asyncresolver.Resolver:
    """dnspython's asyncio resolver asking ``nameservers`` ("ip" or "ip:port"), or the system's when empty."""
    if not nameservers:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        servers: list[dns.nameserver.Nameserver] = []
        for text in nameservers:
            host, port = split_host_port(text, 53)
            servers.append(dns.nameserver.Do53Nameserver(host, port))
        resolver.nameservers = servers
    resolver.lifetime = LIFETIME_S
    resolver.cache = None  # every round asks: the records are what changes
    return resolver


class DnsWatch:
    """Resolves one pool's ``[discovery.<pool>.dns]`` every ``interval_s`` and reports the set of
    backend URLs to ``report`` after every successful resolution (module docstring)."""

    def __init__(self, pool: str, settings: DnsDiscoveryConfig, report: Callable[[frozenset[str]], None],
                 metrics: DiscoveryMetrics, backoff: Backoff,
                 resolver: dns.asyncresolver.Resolver | None = None) -> None:
        self.pool = pool
        self.settings = settings
        self._report = report
        self.metrics = metrics
        self.backoff = backoff
        self.resolver = resolver or make_resolver(settings.nameservers)
        #: the set found by the last successful resolution (None before the first)
        self.backends: frozenset[str] | None = None
        self.resolutions = 0

    async def run(self) -> None:
        """Resolve until cancelled; never raises otherwise."""
        while True:
            try:
                found = await self.resolve()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is retried; the set found stays
                reason = exc.reason if isinstance(exc, ResolveFailed) else "error"
                self.metrics.error(self.pool, SOURCE, reason)
                delay = min(self.backoff.next_delay(), self.settings.interval_s)
                logger.warning("dns discovery for pool %s: %s; keeping its %d backends, retrying in %.1fs",
                               self.pool, exc, len(self.backends or ()), delay)
                await asyncio.sleep(delay)
                continue
            self.backoff.reset()
            self.resolutions += 1
            if found != self.backends:
                logger.info("dns discovery for pool %s: %s resolves to %s", self.pool, self.settings.name,
                            ", ".join(sorted(found)) or "nothing")
            self.backends = found
            self.metrics.synced(self.pool, SOURCE, len(found))
            self._report(found)
            await asyncio.sleep(self.settings.interval_s)

    async def resolve(self) -> frozenset[str]:
        """One resolution: the backend URLs, or ``ResolveFailed``."""
        name = self.settings.name
        if self.settings.port:
            return frozenset(_url(address, self.settings.port) for address in await self._addresses(name))
        records = [r for r in await self._query(name, "SRV") if r.port > 0]  # port 0: "no service here"
        targets = await asyncio.gather(*(self._addresses(r.target.to_text()) for r in records))
        return frozenset(_url(address, record.port) for record, addresses in zip(records, targets)
                         for address in addresses)

    async def _addresses(self, name: str) -> list[str]:
        """The A and AAAA addresses of ``name``; both asked at once, both must answer (an empty answer counts)."""
        a, aaaa = await asyncio.gather(self._query(name, "A"), self._query(name, "AAAA"))
        return [record.address for record in (*a, *aaaa)]

    async def _query(self, name: str, rdtype: str) -> list[dns.rdata.Rdata]:
        try:
            answer = await self.resolver.resolve(name, rdtype, search=False)
        except dns.resolver.NoAnswer:
            return []  # the name exists without such records
        except dns.resolver.NXDOMAIN:
            raise ResolveFailed("nxdomain", f"{name} does not exist (NXDOMAIN)") from None
        except dns.resolver.LifetimeTimeout:
            raise ResolveFailed("timeout", f"no answer for {name} {rdtype} within {LIFETIME_S:g}s") from None
        except dns.resolver.NoNameservers as exc:
            raise ResolveFailed("servfail", f"no server answered {name} {rdtype}: {exc}") from None
        except dns.exception.DNSException as exc:
            raise ResolveFailed("error", f"resolving {name} {rdtype} failed: {exc}") from None
        return list(answer)


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    try:
        return normalize_url(f"http://{host}:{port}")
    except ConfigError as exc:
        raise ResolveFailed("protocol", f"record gives no backend URL: {exc.message}") from None
