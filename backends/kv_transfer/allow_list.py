"""Which prefill side channels a decode instance may pull from: ``--kv-allow HOST:PORT`` entries,
compared with ``remote_host`` as written (no name is resolved to decide); none given: loopback
hosts only."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence


def normalize_host(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or the name ``localhost`` (no name is resolved to decide)."""
    host = normalize_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_allow_entry(entry: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:8200``) -> (normalized host, port); ValueError if malformed."""
    text = entry.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{entry!r} is not HOST:PORT (e.g. 127.0.0.1:8200 or [::1]:8200)")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"{entry!r}: write an IPv6 address in brackets, e.g. [::1]:8200")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"{entry!r}: the port must be 1..65535")
    return normalize_host(host), port


class AllowList:
    """Which prefill side channels a decode instance may pull from."""

    __slots__ = ("entries",)

    def __init__(self, entries: Sequence[str] = ()) -> None:
        #: explicit (host, port) pairs; empty = loopback hosts only
        self.entries = frozenset(parse_allow_entry(e) for e in entries)

    def allows(self, host: str, port: int) -> bool:
        if self.entries:
            return (normalize_host(host), port) in self.entries
        return is_loopback_host(host)

    def describe(self) -> str:
        if not self.entries:
            return "loopback hosts only (127.0.0.0/8, ::1, localhost)"
        return ", ".join(sorted(f"{h}:{p}" if ":" not in h else f"[{h}]:{p}" for h, p in self.entries))
