"""Safe defaults of the admin API and the session views (issue 11, items 1, 2 and 16).

- Where the admin API (and ``GET /v1/sessions``, the listing of every session) is served: not on
  the data port by default; there with ``admin_token``; only on ``admin_host:admin_port`` when that
  is set; a non-loopback admin listener without a token stops start-up. Checked in-process on both
  fronts (the raw front relays non-hot routes to the aiohttp app) and with real ``python -m router``
  processes (``--front raw``/``aiohttp``, ``--workers 2``).
- ``GET``/``DELETE /v1/sessions/{id}`` stay open (the id is the capability).
- ``admin_backend_allow`` and the refusal of link-local and cloud metadata addresses.
- ``POST /admin/backends`` input: duplicate names and URLs, long or odd names, port 0.
- ``session_label = "hash" | "id" | "none"`` on ``/metrics``.

In-process routers serve ``router.app.create_app`` on 127.0.0.1 ephemeral ports in front of
``tests.fakes.EchoBackend`` servers; "elsewhere" probes use 127.0.0.9 where nothing listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.backend_allow import BackendAllowList, BackendNotAllowed, parse_entry
from router.config import build_config, config_from_mapping
from contract.errors import ConfigError
from contract.ids import session_hash
from tests.conftest import MakeRouter, RouterUnderTest
from tests.fakes import EchoBackend
from bench.procs import free_ports
from tests.support import REPO, http_status, start_router, wait_until

TOKEN = "defaults-admin-Token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FRONTS = ["raw", "aiohttp"]
ELSEWHERE = "127.0.0.9"


# ----------------------------------------------------------------------------- in-process routers


Factory = Callable[..., Awaitable[RouterUnderTest]]


@pytest.fixture
def serve(make_router: MakeRouter) -> Factory:
    """``serve(front, n=1, **settings)``: the router on the given front, and its admin app on its
    own listener when ``admin_port`` is set (the number only selects the mode here)."""

    async def make(front: str, *, n: int = 1, **overrides: Any) -> RouterUnderTest:
        return await make_router(front, n=n, admin=True, **overrides)

    return make


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def call(http: aiohttp.ClientSession, method: str, url: str, *, json_body: Any = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with http.request(method, url, json=json_body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def assert_error(status: int, payload: Any, want: int) -> dict[str, Any]:
    assert status == want, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"} and payload["error"]["code"] == want
    return payload["error"]


async def make_session(http: aiohttp.ClientSession, router: RouterUnderTest, session_id: str) -> None:
    status, _ = await call(http, "POST", router.url + "/v1/completions", json_body={"prompt": "x", "session_id": session_id})
    assert status == 200


def members(router: RouterUnderTest) -> list[str]:
    return [b.url for pool in router.state.pools.values() for b in pool.members]


# --------------------------------------------------------------------- item 1: where admin lives


@pytest.mark.parametrize("front", FRONTS)
async def test_default_config_serves_no_admin_api_on_the_data_port(serve: Factory, http: aiohttp.ClientSession,
                                                                   front: str) -> None:
    router = await serve(front)
    before = members(router)
    extra = f"http://{ELSEWHERE}:9"
    for headers in ({}, AUTH, {"Authorization": "Bearer "}):
        for method, path, body in (("GET", "/admin/backends", None), ("POST", "/admin/backends", {"url": extra}),
                                   ("DELETE", f"/admin/backends/{before[0]}", None), ("GET", "/admin", None)):
            status, payload = await call(http, method, router.url + path, json_body=body, headers=headers)
            error = assert_error(status, payload, 404)
            assert "admin_token" in error["message"] and "admin_port" in error["message"], error
    assert members(router) == before
    assert not any(b.draining for pool in router.state.pools.values() for b in pool.members)


@pytest.mark.parametrize("front", FRONTS)
async def test_session_listing_is_an_admin_action_but_one_session_stays_open(serve: Factory,
                                                                            http: aiohttp.ClientSession,
                                                                            front: str) -> None:
    router = await serve(front)
    await make_session(http, router, "mine-1")
    status, payload = await call(http, "GET", router.url + "/v1/sessions")
    error = assert_error(status, payload, 404)
    assert "admin action" in error["message"] and "mine-1" not in error["message"]
    # the id is the capability: read and forget it without any token
    status, view = await call(http, "GET", router.url + "/v1/sessions/mine-1")
    assert status == 200 and view["session_id"] == "mine-1" and view["session_hash"] == session_hash("mine-1")
    status, _ = await call(http, "DELETE", router.url + "/v1/sessions/mine-1")
    assert status == 200
    assert_error(*await call(http, "GET", router.url + "/v1/sessions/mine-1"), 404)


@pytest.mark.parametrize("front", FRONTS)
async def test_admin_token_serves_admin_and_listing_on_the_data_port(serve: Factory, http: aiohttp.ClientSession,
                                                                     front: str) -> None:
    router = await serve(front, admin_token=TOKEN)
    await make_session(http, router, "tok-1")
    for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}x"}):
        assert_error(*await call(http, "GET", router.url + "/admin/backends", headers=bad), 401)
        error = assert_error(*await call(http, "GET", router.url + "/v1/sessions", headers=bad), 401)
        assert TOKEN not in error["message"]
    status, listing = await call(http, "GET", router.url + "/admin/backends", headers=AUTH)
    assert status == 200 and [b["url"] for b in listing["data"]] == members(router)
    status, sessions = await call(http, "GET", router.url + "/v1/sessions", headers=AUTH)
    assert status == 200 and [s["session_id"] for s in sessions["data"]] == ["tok-1"]
    # one session by its id needs no token, even with the admin API on this port
    assert (await call(http, "GET", router.url + "/v1/sessions/tok-1"))[0] == 200
    assert (await call(http, "DELETE", router.url + "/v1/sessions/tok-1"))[0] == 200


@pytest.mark.parametrize("front", FRONTS)
async def test_admin_port_serves_admin_and_listing_only_on_its_listener(serve: Factory, http: aiohttp.ClientSession,
                                                                        front: str) -> None:
    router = await serve(front, admin_port=1)  # no token: the listener is loopback-only (admin_host)
    await make_session(http, router, "adm-1")
    assert router.admin_url is not None
    error = assert_error(*await call(http, "GET", router.url + "/admin/backends", headers=AUTH), 404)
    assert "own listener" in error["message"]
    assert_error(*await call(http, "GET", router.url + "/v1/sessions", headers=AUTH), 404)
    status, listing = await call(http, "GET", router.admin_url + "/admin/backends")
    assert status == 200 and [b["url"] for b in listing["data"]] == members(router)
    status, sessions = await call(http, "GET", router.admin_url + "/v1/sessions")
    assert status == 200 and [s["session_id"] for s in sessions["data"]] == ["adm-1"]


# ---------------------------------------------------------------- item 1: start-up checks (config)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "router.example", "fd00::1"])
def test_admin_listener_off_loopback_without_token_is_refused(host: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"admin_port": 9000, "admin_host": host, "backends": [{"url": "http://127.0.0.1:8100"}]})
    message = info.value.message
    assert message.startswith("admin_host:") and "admin_token" in message and "open to the network" in message
    # with a token it is allowed
    config = config_from_mapping({"admin_port": 9000, "admin_host": host, "admin_token": TOKEN,
                                  "backends": [{"url": "http://127.0.0.1:8100"}]})
    assert config.admin.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "LOCALHOST.", "::ffff:127.0.0.1"])
def test_admin_listener_on_loopback_may_be_open(host: str) -> None:
    config = config_from_mapping({"admin_port": 9000, "admin_host": host, "backends": [{"url": "http://127.0.0.1:8100"}]})
    assert config.admin.token == ""


def test_a_public_data_port_without_token_starts_with_the_admin_api_off() -> None:
    config = config_from_mapping({"host": "0.0.0.0", "backends": [{"url": "http://127.0.0.1:8100"}]})
    assert (config.admin.port, config.admin.token, config.admin.host) == (0, "", "127.0.0.1")


@pytest.mark.parametrize(("settings", "message"), [
    ({"admin_token": "has space"}, "admin_token: use visible ASCII"),
    ({"admin_token": "tab\t"}, "admin_token: use visible ASCII"),
    ({"admin_host": " "}, "admin_host: must not be empty"),
    ({"admin_backend_allow": ["10.0.0.0/8:80"]}, "admin_backend_allow[0]: '10.0.0.0/8:80': a CIDR block takes no port"),
    ({"admin_backend_allow": ["10.0.0.1", "10.0.0.300/8"]}, "admin_backend_allow[1]: '10.0.0.300/8' is not a CIDR"),
    ({"admin_backend_allow": ["host:0"]}, "admin_backend_allow[0]: 'host:0': the port must be 1..65535"),
    ({"admin_backend_allow": ["bad host"]}, "admin_backend_allow[0]: 'bad host' is not an IP address"),
    ({"admin_backend_allow": [""]}, "admin_backend_allow[0]: an entry must not be empty"),
    ({"admin_backend_allow": "10.0.0.0/8"}, "admin_backend_allow: expected array"),
    ({"session_label": "raw"}, "session_label: must be one of hash, id, none, got 'raw'"),
])
def test_bad_admin_settings_name_the_key(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping({**settings, "backends": [{"url": "http://127.0.0.1:8100"}]})
    assert info.value.message.startswith(message), info.value.message


def test_admin_token_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_file = tmp_path / "r.toml"
    config_file.write_text('admin_token = "from-file"\n[[backends]]\nurl = "http://127.0.0.1:8100"\n')
    monkeypatch.delenv("SESSION_ROUTER_ADMIN_TOKEN", raising=False)
    assert build_config(["--config", str(config_file)]).admin.token == "from-file"
    monkeypatch.setenv("SESSION_ROUTER_ADMIN_TOKEN", "")  # empty: as if unset (compose's ${VAR:-})
    assert build_config(["--config", str(config_file)]).admin.token == "from-file"
    monkeypatch.setenv("SESSION_ROUTER_ADMIN_TOKEN", "from-env")
    assert build_config(["--config", str(config_file)]).admin.token == "from-env"
    assert build_config(["--config", str(config_file), "--admin-token", "from-flag"]).admin.token == "from-flag"
    monkeypatch.setenv("SESSION_ROUTER_ADMIN_TOKEN", "bad token")
    with pytest.raises(ConfigError, match="^SESSION_ROUTER_ADMIN_TOKEN: use visible ASCII"):
        build_config(["--config", str(config_file)])


# ------------------------------------------------------------------ item 1: real router processes


def refuse_to_start(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "router", *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("workers", ["1", "2"])
def test_router_with_an_open_admin_api_off_loopback_refuses_to_start(tmp_path: Path, workers: str) -> None:
    admin_port, port = free_ports(2)
    config = tmp_path / "open.toml"
    config.write_text(f'host = "0.0.0.0"\nadmin_port = {admin_port}\nadmin_host = "0.0.0.0"\n'
                      f'[[backends]]\nurl = "http://127.0.0.1:9"\n')
    result = refuse_to_start(["--config", str(config), "--port", str(port), "--workers", workers],
                             env={"SESSION_ROUTER_ADMIN_TOKEN": ""})
    assert result.returncode == 2, result
    assert result.stderr.startswith("session-router: admin_host: the admin API on 0.0.0.0:"), result.stderr
    assert "admin_token" in result.stderr and "listening" not in result.stdout
    assert http_status(f"http://127.0.0.1:{port}/health") == 0  # nothing ever listened
    assert http_status(f"http://127.0.0.1:{admin_port}/admin/backends") == 0


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the LISTEN sockets on ``port`` (from /proc/net/tcp and tcp6)."""
    found: set[str] = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with contextlib.suppress(OSError), open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                local, state = fields[1], fields[3]
                address, _, port_hex = local.partition(":")
                if state != "0A" or int(port_hex, 16) != port:
                    continue
                raw = bytes.fromhex(address)
                if width == 4:
                    found.add(str(ipaddress.IPv4Address(raw[::-1])))
                else:  # four little-endian 32-bit words
                    found.add(str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raw", "aiohttp", "workers"])
def test_real_router_default_token_and_admin_listener(tmp_path: Path, mode: str) -> None:
    """A real router process: no admin API on the data port by default; with a token it is there
    (401 without it); with admin_port it is on 127.0.0.1:admin_port only, open there."""
    front = ["--front", "aiohttp"] if mode == "aiohttp" else ["--front", "raw"]
    front += ["--workers", "2"] if mode == "workers" else []
    backend = "http://127.0.0.1:9"  # nothing needs to answer: only the router's own routes are used
    procs = []
    try:
        plain = start_router(str(tmp_path), "--backend", backend, *front)
        procs.append(plain)
        for path in ("/admin/backends", "/v1/sessions"):
            assert http_status(plain.url + path) == 404, path
        assert http_status(plain.url + "/v1/sessions/nobody") == 404

        (admin_port,) = free_ports(1)
        config = tmp_path / "admin.toml"
        config.write_text(f"admin_port = {admin_port}\n")
        listener = start_router(str(tmp_path), "--config", str(config), "--backend", backend, *front)
        procs.append(listener)
        assert http_status(listener.url + "/admin/backends") == 404
        assert http_status(listener.url + "/v1/sessions") == 404
        admin = f"http://127.0.0.1:{admin_port}"
        wait_until(lambda: http_status(admin + "/admin/backends") == 200, timeout=20, what="the admin listener")
        assert http_status(admin + "/v1/sessions") == 200
        assert listening_addresses(admin_port) == {"127.0.0.1"}
    finally:
        for proc in procs:
            proc.stop()

    token_env = {"SESSION_ROUTER_ADMIN_TOKEN": TOKEN}
    port = free_ports(1)[0]
    child = subprocess.Popen([sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(port),
                              "--backend", backend, *front], cwd=REPO, env={**os.environ, **token_env},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_status(url + "/health") in (200, 503), timeout=20, what="the router with a token")
        assert http_status(url + "/admin/backends") == 401
        assert http_status(url + "/v1/sessions") == 401

        async def with_token() -> tuple[int, int]:
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/admin/backends", headers=AUTH) as a, \
                        session.get(url + "/v1/sessions", headers=AUTH) as s:
                    return a.status, s.status

        assert asyncio.run(with_token()) == (200, 200)
    finally:
        child.terminate()
        child.wait(20)


# ------------------------------------------------------- item 1: allow-list and metadata refusal


def test_allow_entries_parse() -> None:
    assert parse_entry("10.0.0.0/8").network == ipaddress.ip_network("10.0.0.0/8")
    assert parse_entry("10.0.0.5:8100").port == 8100
    assert parse_entry("[fd00::5]:8100").network == ipaddress.ip_network("fd00::5/128")
    assert parse_entry("fd00::5").port is None
    star = parse_entry("*.VLLM.internal")
    assert (star.name, star.wildcard) == ("vllm.internal", True)
    assert parse_entry("vllm-0.internal:8000").name == "vllm-0.internal"


async def check(entries: list[str], host: str, port: int = 80, resolved: list[str] | None = None) -> str | None:
    """None when allowed, else the refusal message; ``resolved``: what a name resolves to."""
    async def resolver(name: str, _port: int) -> list[Any]:
        return [ipaddress.ip_address(a) for a in (resolved or [])]

    try:
        await BackendAllowList(entries, resolver=resolver).check(host, port)
    except BackendNotAllowed as exc:
        return str(exc)
    return None


async def test_empty_allow_list_allows_any_host_but_link_local_and_metadata() -> None:
    assert await check([], "10.0.0.5") is None
    assert await check([], "vllm-0.internal", resolved=["10.0.0.5"]) is None
    assert await check([], "unresolvable.invalid", resolved=[]) is None
    for host in ("169.254.169.254", "169.254.1.1", "fe80::1", "fd00:ec2::254", "::ffff:169.254.169.254",
                 "100.100.100.200"):
        message = await check([], host)
        assert message is not None and "link-local or cloud metadata" in message, host
    for name in ("metadata.google.internal", "METADATA.google.internal.", "metadata", "instance-data"):
        message = await check([], name)
        assert message is not None and "metadata service" in message, name
    # a name (or a numeric spelling) that resolves to one
    message = await check([], "sneaky.example", resolved=["169.254.169.254"])
    assert message is not None and "resolves to 169.254.169.254" in message


async def test_the_real_resolver_sees_numeric_spellings_of_the_metadata_address() -> None:
    for host in ("2852039166", "0xa9.0xfe.0xa9.0xfe"):
        with pytest.raises(BackendNotAllowed, match="169.254.169.254"):
            await BackendAllowList([]).check(host, 80)


async def test_allow_list_entries_match_hosts_ports_and_blocks() -> None:
    entries = ["10.0.0.0/8", "192.168.1.5:8100", "vllm-0.internal", "*.pool.internal:8000", "[fd00::5]:9000"]
    allowed = [("10.9.9.9", 1), ("192.168.1.5", 8100), ("vllm-0.internal", 5), ("VLLM-0.internal.", 5),
               ("a.pool.internal", 8000), ("b.a.pool.internal", 8000), ("fd00::5", 9000)]
    refused = [("11.0.0.1", 80), ("192.168.1.5", 8101), ("vllm-1.internal", 5), ("pool.internal", 8000),
               ("a.pool.internal", 8001), ("fd00::5", 9001), ("fd00::6", 9000), ("127.0.0.1", 80),
               ("x.vllm-0.internal", 5)]
    for host, port in allowed:
        assert await check(entries, host, port, resolved=["10.0.0.7"]) is None, (host, port)
    for host, port in refused:
        message = await check(entries, host, port, resolved=["10.0.0.7"])
        assert message is not None and "not in admin_backend_allow" in message, (host, port)


async def test_link_local_and_metadata_need_an_explicit_entry() -> None:
    # broad entries never open them
    for broad in (["0.0.0.0/0"], ["169.0.0.0/8"], ["::/0"], ["*.google.internal"]):
        assert await check(broad, "169.254.169.254") is not None, broad
        assert await check(broad, "metadata.google.internal") is not None, broad
    assert await check(["::/0"], "fe80::1") is not None
    # explicit ones do
    assert await check(["169.254.169.254"], "169.254.169.254") is None
    assert await check(["169.254.169.254:80"], "169.254.169.254", 80) is None
    assert await check(["169.254.0.0/16"], "169.254.3.4") is None
    assert await check(["fe80::/64"], "fe80::1") is None
    assert await check(["metadata.google.internal"], "metadata.google.internal", resolved=["169.254.169.254"]) is None
    assert await check(["sneaky.example"], "sneaky.example", resolved=["169.254.169.254"]) is None
    # an explicit address entry does not cover a name that resolves to it
    assert await check(["169.254.169.254"], "sneaky.example", resolved=["169.254.169.254"]) is not None


@pytest.mark.parametrize("front", FRONTS)
async def test_admin_refuses_metadata_and_unlisted_hosts_without_connecting(serve: Factory,
                                                                            http: aiohttp.ClientSession,
                                                                            front: str, aiohttp_server: Any) -> None:
    extra = await aiohttp_server(EchoBackend("extra").app(), host="127.0.0.1")
    router = await serve(front, admin_token=TOKEN, admin_backend_allow=[f"127.0.0.1:{extra.port}"])
    before = members(router)
    for url in ("http://169.254.169.254", "http://metadata.google.internal", "http://[fe80::1]:8000",
                "http://[fd00:ec2::254]", f"http://{ELSEWHERE}:{extra.port}", "http://127.0.0.1:9"):
        status, payload = await call(http, "POST", router.url + "/admin/backends", json_body={"url": url},
                                     headers=AUTH)
        error = assert_error(status, payload, 403)
        assert error["param"] == "url" and "admin_backend_allow" in error["message"], error
    assert members(router) == before
    status, added = await call(http, "POST", router.url + "/admin/backends",
                               json_body={"url": f"http://127.0.0.1:{extra.port}", "name": "extra"}, headers=AUTH)
    assert status == 201 and added["healthy"], added
    assert members(router) == before + [f"http://127.0.0.1:{extra.port}"]


# --------------------------------------------------------------------------- item 16: admin input


@pytest.mark.parametrize("front", FRONTS)
async def test_admin_rejects_duplicates_long_names_and_port_0(serve: Factory, http: aiohttp.ClientSession,
                                                              front: str, aiohttp_server: Any) -> None:
    extra = await aiohttp_server(EchoBackend("extra").app(), host="127.0.0.1")
    router = await serve(front, n=2, admin_token=TOKEN)
    first = router.state.pools["default"].members[0]
    first.name = "first"
    new_url = f"http://127.0.0.1:{extra.port}"
    cases = [
        ({"url": first.url}, "url", "already in pool 'default'"),
        ({"url": first.url + "/"}, "url", "already in pool 'default'"),  # the same backend, written otherwise
        ({"url": new_url, "name": "first"}, "name", "already used by"),
        ({"url": new_url, "name": first.url}, "name", "already used by"),  # a name that is another's URL
        ({"url": new_url, "name": "n" * 129}, "name", "1..128"),
        ({"url": new_url, "name": "has space"}, "name", "visible ASCII"),
        ({"url": new_url, "name": "tab\there"}, "name", "visible ASCII"),
        ({"url": new_url, "name": "caf\u00e9"}, "name", "visible ASCII"),
        ({"url": "http://127.0.0.1:0"}, "url", "port 0"),
        ({"url": "http://127.0.0.1:70000"}, "url", "invalid port"),
        ({"url": "http://" + "a" * 600 + ":80"}, "url", "at most 512 characters"),
    ]
    before = members(router)
    for body, param, text in cases:
        status, payload = await call(http, "POST", router.url + "/admin/backends", json_body=body, headers=AUTH)
        error = assert_error(status, payload, 400)
        assert error["param"] == param and text in error["message"], (body, error)
        assert len(error["message"]) < 400, error  # a huge name is not echoed whole
    assert members(router) == before
    # a name of exactly 128 visible characters is fine
    status, added = await call(http, "POST", router.url + "/admin/backends",
                               json_body={"url": new_url, "name": "n" * 128}, headers=AUTH)
    assert status == 201 and added["name"] == "n" * 128
    # and it can be removed by that name
    status, removed = await call(http, "DELETE", router.url + "/admin/backends/" + "n" * 128, headers=AUTH)
    assert status == 200 and removed["removed"]
    assert members(router) == before


# ------------------------------------------------------------------ item 2: /metrics session labels


async def session_samples(http: aiohttp.ClientSession, router: RouterUnderTest) -> tuple[str, set[str]]:
    async with http.get(router.url + "/metrics") as resp:
        text = await resp.text()
    labels = set()
    for line in text.splitlines():
        if line.startswith("session_router_session_") and 'session="' in line:
            labels.add(line.split('session="', 1)[1].split('"', 1)[0])
    return text, labels


@pytest.mark.parametrize("front", FRONTS)
async def test_session_labels_are_hashes_by_default(serve: Factory, http: aiohttp.ClientSession, front: str) -> None:
    router = await serve(front)
    ids = ["alice-secret-session", "bob-7"]
    for sid in ids:
        await make_session(http, router, sid)
    text, labels = await session_samples(http, router)
    assert labels == {session_hash(sid) for sid in ids}
    assert all(len(label) == 16 and int(label, 16) >= 0 for label in labels)
    assert not any(sid in text for sid in ids)
    # the operator's way to find a session's series: its view, or the hash computed from the id
    status, view = await call(http, "GET", router.url + "/v1/sessions/bob-7")
    assert status == 200 and view["session_hash"] in labels


@pytest.mark.parametrize(("mode", "expected"), [("id", "ids"), ("none", "nothing")])
async def test_session_label_id_and_none(serve: Factory, http: aiohttp.ClientSession, mode: str,
                                         expected: str) -> None:
    router = await serve("raw", session_label=mode)
    ids = ["s-1", "s-2"]
    for sid in ids:
        await make_session(http, router, sid)
    text, labels = await session_samples(http, router)
    assert labels == (set(ids) if expected == "ids" else set())
    if mode == "none":
        assert "session_router_session_requests_total" not in text
        assert "session_router_sessions_active 2.0" in text  # the aggregate stays
        assert router.state.metrics.exported_sessions() == []


def test_session_hash_is_blake2b_64() -> None:
    import hashlib

    assert session_hash("abc") == hashlib.blake2b(b"abc", digest_size=8).hexdigest() == "d8bb14d833d59559"
    assert json.dumps(session_hash("sess-\u00e9"))  # any id hashes
