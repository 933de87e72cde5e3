"""The bad-input corpus (``tests/contract/corpus/``) against a real router process and real backends.

Every body case goes through the router and straight to a backend; every header case is sent
raw over a socket to the router. Each must get a 4xx in OpenAI's error shape without a
traceback; after each one the router and the backends still answer a good request, and no
in-flight count or session entry is left behind (the router stamps nothing here, so its session
table must stay empty).
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import Proc, start_backend, start_router

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).resolve().parent / "corpus"
BODIES = json.loads((CORPUS / "bodies.json").read_text())
WRONG_TYPES = json.loads((CORPUS / "wrong_types.json").read_text())
HEADERS = json.loads((CORPUS / "headers.json").read_text())
ROUTES: list[str] = BODIES["routes"]
MAX_BODY = 1024 * 1024
#: the routers here serve the admin API (and the session listing) on the data port with this token
ADMIN_TOKEN = "badinput-admin-token"
GOOD = json.dumps({"model": "session-sim", "prompt": "a good request", "max_tokens": 2}).encode()


@dataclass
class Topology:
    router: Proc
    backends: list[Proc]


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    logs = tmp_path_factory.mktemp("badinput")
    backends = [start_backend(str(logs)) for _ in range(2)]
    config = logs / "router.toml"
    config.write_text(f'stamp = "none"\nmax_body_bytes = {MAX_BODY}\nlog_level = "info"\nadmin_token = "{ADMIN_TOKEN}"\n'
                      + "".join(f'[[backends]]\nurl = "{b.url}"\n' for b in backends))
    router = start_router(str(logs), "--config", str(config))
    yield Topology(router, backends)
    for proc in [router, *backends]:
        proc.stop()
    log = router.log()
    assert "Traceback" not in log, log[-3000:]


# ----------------------------------------------------------------------------- helpers


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def post(port: int, path: str, body: bytes, content_type: str = "application/json",
         headers: dict[str, str] | None = None) -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        sent = dict(headers or {})
        if content_type:
            sent["Content-Type"] = content_type
        conn.request("POST", path, body=body, headers=sent)
        resp = conn.getresponse()
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def get_json(port: int, path: str) -> Any:
    """GET an admin path (the admin API, the session listing) with the admin token."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def raw(port: int, data: bytes, timeout: float = 10.0) -> Answer:
    """Send raw bytes and parse the response: until the connection closes or, with a
    Content-Length, until that much body arrived (the server may keep draining our body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
            head, sep, body = received.partition(b"\r\n\r\n")
            if sep:
                length = [line.split(b":", 1)[1] for line in head.split(b"\r\n")[1:]
                          if line.lower().startswith(b"content-length:")]
                if length and len(body) >= int(length[0]):
                    break
    return parse_response(received)


def parse_response(data: bytes) -> Answer:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return Answer(status, headers, body)


def assert_openai_error(answer: Answer, *, status: int | None = None) -> dict[str, Any]:
    assert 400 <= answer.status < 500, (answer.status, answer.body[:300])
    if status is not None:
        assert answer.status == status, answer.body[:300]
    assert_no_traceback(answer)
    assert answer.headers.get("content-type", "").startswith("application/json"), answer.headers
    payload = json.loads(answer.body)
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == answer.status
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_no_traceback(answer: Answer) -> None:
    assert b"Traceback" not in answer.body and b'File "' not in answer.body, answer.body[:500]


def assert_still_serving_and_clean(topo: Topology) -> None:
    """The router and every backend answer a good request; nothing leaked in the router."""
    assert post(topo.router.port, "/v1/completions", GOOD).status == 200
    for backend in topo.backends:
        assert post(backend.port, "/v1/completions", GOOD).status == 200
    view = get_json(topo.router.port, "/admin/backends")["data"]
    assert [b["in_flight"] for b in view] == [0] * len(topo.backends)
    assert all(b["healthy"] for b in view)
    assert get_json(topo.router.port, "/v1/sessions")["total"] == 0


def backend_requests(topo: Topology) -> float:
    """Requests the backends finished (any reason), from their /metrics."""
    total = 0.0
    for backend in topo.backends:
        conn = http.client.HTTPConnection("127.0.0.1", backend.port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        for line in text.splitlines():
            if line.startswith("vllm:request_success_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def body_cases() -> list[Any]:
    params = []
    for case in BODIES["cases"]:
        routes = ROUTES if case["routes"] == "*" else case["routes"]
        name = Path(case["file"]).stem + (f"[{case['content_type'] or 'none'}]" if case["content_type"] != "application/json" else "")
        for route in routes:
            params.append(pytest.param(case, route, id=f"{name}-{route}"))
    return params


def read_case(case: dict[str, Any]) -> bytes:
    return (CORPUS / case["file"]).read_bytes()


# ------------------------------------------------------------------------------ bodies


@pytest.mark.parametrize("case,route", body_cases())
def test_body_corpus_through_the_router(topo: Topology, case: dict[str, Any], route: str) -> None:
    answer = post(topo.router.port, route, read_case(case), case["content_type"])
    assert_openai_error(answer)
    assert answer.headers.get("x-request-id")
    assert_still_serving_and_clean(topo)


@pytest.mark.parametrize("case,route", body_cases())
def test_body_corpus_direct_to_a_backend(topo: Topology, case: dict[str, Any], route: str) -> None:
    answer = post(topo.backends[0].port, route, read_case(case), case["content_type"])
    assert_openai_error(answer)
    assert_still_serving_and_clean(topo)


def wrong_type_variants(route: str) -> Iterator[tuple[str, bytes]]:
    spec = WRONG_TYPES["routes"][route]
    for field, values in spec["fields"].items():
        for value in values:
            body = dict(spec["base"])
            body[field] = value
            yield f"{field}={json.dumps(value)}", json.dumps(body).encode()


@pytest.mark.parametrize("route", list(WRONG_TYPES["routes"]))
@pytest.mark.parametrize("target", ["router", "backend"])
def test_wrong_types_everywhere(topo: Topology, route: str, target: str) -> None:
    port = topo.router.port if target == "router" else topo.backends[1].port
    base = json.dumps(WRONG_TYPES["routes"][route]["base"]).encode()
    assert post(port, route, base).status == 200  # the base body is valid: each variant breaks one field
    wrong = []
    for label, body in wrong_type_variants(route):
        answer = post(port, route, body)
        try:
            assert_openai_error(answer)
        except (AssertionError, ValueError) as exc:
            wrong.append(f"{label}: {answer.status} {answer.body[:120]!r} ({exc})")
    assert not wrong, "\n".join(wrong)
    assert_still_serving_and_clean(topo)


def test_oversized_bodies(topo: Topology) -> None:
    big = b'{"prompt": "' + b"a" * MAX_BODY + b'"}'
    assert_openai_error(post(topo.router.port, "/v1/completions", big), status=413)
    assert_openai_error(post(topo.router.port, "/tokenize", big), status=413)
    # chunked, so the router only learns the size while reading
    conn = http.client.HTTPConnection("127.0.0.1", topo.router.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert_openai_error(Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()), status=413)
    conn.close()
    # a declared length over the limit is refused before the body is read
    answer = raw(topo.router.port, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                                   b"Content-Length: 99999999999\r\nConnection: close\r\n\r\n{")
    assert_openai_error(answer, status=413)
    # the backend's own limit (64 MiB)
    huge = b'{"prompt": "' + b"a" * (64 * 1024 * 1024) + b'"}'
    assert_openai_error(post(topo.backends[0].port, "/v1/completions", huge), status=413)
    assert_still_serving_and_clean(topo)


def test_truncated_body_then_the_client_leaves(topo: Topology) -> None:
    """Content-Length promises more than arrives and the client goes away: nothing leaks."""
    body = GOOD[:20]
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", topo.router.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 500\r\n\r\n" + body)
    assert_still_serving_and_clean(topo)


# ----------------------------------------------------------------------------- headers


def header_request(headers: list[list[str]], body: bytes = GOOD) -> bytes:
    lines = b"".join(name.encode("latin-1") + b": " + value.encode("latin-1") + b"\r\n" for name, value in headers)
    return (b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n" + lines + b"Connection: close\r\n\r\n" + body)


HEADER_CASES = [pytest.param(c, id=c["name"]) for c in HEADERS["cases"]]


@pytest.mark.parametrize("case", HEADER_CASES)
def test_header_corpus(topo: Topology, case: dict[str, Any]) -> None:
    before = backend_requests(topo)
    answer = raw(topo.router.port, header_request(case["headers"]))
    assert answer.status == 400, answer.body[:300]
    assert_no_traceback(answer)
    if case["layer"] == "router":
        error = assert_openai_error(answer, status=400)
        assert "X-Session-ID" in error["message"] or "session id" in error["message"]
        assert answer.headers.get("x-request-id")
    assert backend_requests(topo) == before  # nothing reached a backend
    assert_still_serving_and_clean(topo)



@pytest.mark.parametrize("case", [c for c in HEADER_CASES if c.values[0]["layer"] == "http"])
def test_parser_level_rejections_in_openai_shape(topo: Topology, case: dict[str, Any]) -> None:
    # rejected by aiohttp's HTTP parser before the app runs; still OpenAI's error shape
    assert_openai_error(raw(topo.router.port, header_request(case["headers"])), status=400)
    assert_still_serving_and_clean(topo)


def test_router_logs_no_traceback_or_header_bytes_for_malformed_requests(topo: Topology) -> None:
    marker = "leaky-session-Zq81"
    for value in (marker + "\x01", marker + "\rX-Injected: 1", marker + "x" * 10240):
        answer = raw(topo.router.port, header_request([["X-Session-ID", value]]))
        assert answer.status == 400
    assert_still_serving_and_clean(topo)
    log = topo.router.log()
    assert marker not in log
    assert "Traceback" not in log
