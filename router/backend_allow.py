"""Which backend URLs ``POST /admin/backends`` may add: ``admin_backend_allow`` and the addresses
that are never a backend unless named explicitly.

An entry of ``admin_backend_allow`` is one of:

- an IP address (``10.0.0.5``, ``fd00::5``) or a CIDR block (``10.0.0.0/8``, ``fd00::/8``): matches a
  URL whose host is written as an address inside it;
- a host name (``vllm-0.internal``; ``*.vllm.internal`` for any name below ``vllm.internal``):
  matches a URL whose host is written as that name (case-insensitive, a trailing dot ignored);
- either with a port (``10.0.0.5:8100``, ``[fd00::5]:8100``, ``vllm-0.internal:8100``): then the
  URL's port must be that one too (CIDR blocks take no port).

An empty list allows any host. Whatever the list, link-local addresses (169.254.0.0/16, fe80::/10)
and cloud metadata endpoints (``DENIED_NETWORKS``, ``DENIED_NAMES``) are refused unless an entry
names them explicitly: an address or block inside those ranges, or the exact host name. A broad
entry (``0.0.0.0/0``, ``*.internal``) never opens them. Host names are resolved when the backend is
added and every address they resolve to is checked against the same ranges (so ``2852039166``, the
decimal spelling of 169.254.169.254, is refused too); a name that does not resolve yet is accepted
(the health checker keeps it out of rotation until it answers). What a name resolves to later is
not checked again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: link-local ranges and the cloud metadata addresses outside them
DENIED_NETWORKS: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(n) for n in (
    "169.254.0.0/16",      # IPv4 link-local; AWS, GCP, Azure, OCI metadata at 169.254.169.254
    "fe80::/10",           # IPv6 link-local
    "fd00:ec2::254/128",   # AWS metadata over IPv6
    "100.100.100.200/32",  # Alibaba Cloud metadata
    "192.0.0.192/32",      # Oracle Cloud metadata (legacy)
))
#: host names of cloud metadata services
DENIED_NAMES = frozenset((
    "metadata", "metadata.google.internal", "metadata.goog", "instance-data", "instance-data.ec2.internal",
))
#: how long the admin API waits for a name to resolve
RESOLVE_TIMEOUT_S = 2.0

_NAME = re.compile(r"^(\*\.)?([a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$")

Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]


class BackendNotAllowed(Exception):
    """The URL's host is not allowed; the message says why and what to configure."""


@dataclass(frozen=True, slots=True)
class AllowEntry:
    text: str
    #: an address or block; None for a host name entry
    network: IPNetwork | None = None
    #: lower-case host name (without the ``*.`` of a wildcard)
    name: str = ""
    wildcard: bool = False
    port: int | None = None

    def matches(self, host: str, address: IPAddress | None, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.network is not None:
            return address is not None and address.version == self.network.version and address in self.network
        if address is not None:
            return False
        return host.endswith("." + self.name) if self.wildcard else host == self.name

    @property
    def special(self) -> bool:
        """Names a link-local or metadata address explicitly (not merely a range that holds one)."""
        if self.network is not None:
            return any(self.network.version == d.version and self.network.subnet_of(d)  # type: ignore[arg-type]
                       for d in DENIED_NETWORKS)
        return not self.wildcard


def parse_entry(text: str) -> AllowEntry:
    """Parse one ``admin_backend_allow`` entry; raises ``ValueError`` saying what is wrong."""
    entry = text.strip()
    if not entry:
        raise ValueError("an entry must not be empty")
    port: int | None = None
    host = entry
    if entry.startswith("["):  # [v6] or [v6]:port
        close = entry.find("]")
        rest = entry[close + 1:] if close > 0 else "?"
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r}: write an IPv6 address with a port as [fd00::5]:8100")
        host, port = entry[1:close], _port(text, rest[1:]) if rest else None
    elif entry.count(":") == 1:  # v4:port or name:port (a bare IPv6 address has several colons)
        host, _, port_text = entry.partition(":")
        port = _port(text, port_text)
    if "/" in host:
        if port is not None:
            raise ValueError(f"{text!r}: a CIDR block takes no port; list host:port entries instead")
        try:
            return AllowEntry(entry, network=ipaddress.ip_network(host, strict=False))
        except ValueError:
            raise ValueError(f"{text!r} is not a CIDR block (e.g. 10.0.0.0/8 or fd00::/8)") from None
    try:
        return AllowEntry(entry, network=ipaddress.ip_network(host), port=port)
    except ValueError:
        pass
    name = normalize_host(host)
    if not _NAME.match(name):
        raise ValueError(f"{text!r} is not an IP address, CIDR block or host name (optionally with :port)")
    wildcard = name.startswith("*.")
    return AllowEntry(entry, name=name[2:] if wildcard else name, wildcard=wildcard, port=port)


def _port(text: str, port_text: str) -> int:
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: the port must be 1..65535")
    return int(port_text)


def normalize_host(host: str) -> str:
    """Lower-case, without IPv6 brackets and without a trailing dot."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host[:-1] if host.endswith(".") and not host.endswith("..") else host


def literal_address(host: str) -> IPAddress | None:
    """The address a host is written as (IPv4-mapped IPv6 as its IPv4 address), or None for a name."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_special(address: IPAddress) -> bool:
    return any(address.version == d.version and address in d for d in DENIED_NETWORKS)


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to ([] when it does not resolve within ``RESOLVE_TIMEOUT_S``)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError, UnicodeError):
        return []
    found: list[IPAddress] = []
    for info in infos:
        address = literal_address(str(info[4][0]))
        if address is not None and address not in found:
            found.append(address)
    return found


class BackendAllowList:
    """``admin_backend_allow``, parsed once; ``check`` raises ``BackendNotAllowed``."""

    def __init__(self, entries: Sequence[str], resolver: Resolver = resolve) -> None:
        self.entries = [parse_entry(e) for e in entries]
        self._resolver = resolver

    async def check(self, host: str, port: int) -> None:
        host = normalize_host(host)
        address = literal_address(host)
        where = f"{host}:{port}" if address is None or address.version == 4 else f"[{host}]:{port}"
        matching = [e for e in self.entries if e.matches(host, address, port)]
        if self.entries and not matching:
            raise BackendNotAllowed(
                f"backend host {where} is not in admin_backend_allow; add it (host, host:port or CIDR block) "
                f"to the router's configuration to allow it")
        explicit = any(e.special for e in matching)
        if address is None and host in DENIED_NAMES and not explicit:
            raise BackendNotAllowed(f"backend host {host} is a cloud metadata service; refused unless "
                                    f"admin_backend_allow names it exactly")
        resolved = [address] if address is not None else await self._resolver(host, port)
        for found in resolved:
            if is_special(found) and not explicit:
                via = "" if address is not None else f" ({host} resolves to {found})"
                raise BackendNotAllowed(
                    f"backend host {where}{via} is a link-local or cloud metadata address; refused unless "
                    f"admin_backend_allow names it explicitly (the address, a block inside "
                    f"{', '.join(str(d) for d in DENIED_NETWORKS if d.version == found.version)}, or the exact host name)")
