"""A tiny authoritative DNS server on 127.0.0.1 (UDP, an ephemeral port), built on dnspython's message and
rrset builders: A, AAAA and SRV records that a test changes while it runs, and failures on demand.

``records[name][rdtype]`` holds the record texts (``"10.0.0.1"``, ``"0 0 8000 pod-a.example."``); a name
absent from ``records`` answers NXDOMAIN, a present name without the asked type answers NOERROR with no
answer (NODATA). ``fail[(name, rdtype)]`` (or ``fail[(name, None)]`` for every type) makes it answer
``"servfail"``, or ``"drop"`` the query (no answer at all: the resolver times out).
"""

from __future__ import annotations

import asyncio

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class FakeDNS(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.records: dict[str, dict[str, list[str]]] = {}
        self.fail: dict[tuple[str, str | None], str] = {}
        self.queries: list[tuple[str, str]] = []
        self.port = 0
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: self, local_addr=("127.0.0.1", 0))
        self._transport = transport  # type: ignore[assignment]
        self.port = transport.get_extra_info("sockname")[1]

    def stop(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, rdtype: str, *values: str) -> None:
        self.records.setdefault(_key(name), {})[rdtype] = list(values)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:  # type: ignore[override]
        query = dns.message.from_wire(data)
        question = query.question[0]
        name, rdtype = _key(question.name.to_text()), dns.rdatatype.to_text(question.rdtype)
        self.queries.append((name, rdtype))
        failure = self.fail.get((name, rdtype)) or self.fail.get((name, None))
        if failure == "drop":
            return
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if failure == "servfail":
            response.set_rcode(dns.rcode.SERVFAIL)
        elif name not in self.records:
            response.set_rcode(dns.rcode.NXDOMAIN)
        else:
            values = self.records[name].get(rdtype, [])
            if values:
                response.answer.append(dns.rrset.from_text_list(name, 5, "IN", rdtype, values))
        assert self._transport is not None
        self._transport.sendto(response.to_wire(), addr)


def _key(name: str) -> str:
    return name if name.endswith(".") else name + "."
