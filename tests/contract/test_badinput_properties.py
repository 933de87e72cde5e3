"""Property-based bad input (hypothesis) against a real router process and a real backend.

Properties: arbitrary bytes and arbitrary JSON objects on every proxied route never get a 5xx,
every 4xx is in OpenAI's error shape, and nothing stays in flight; every proper prefix of a
valid body is a 4xx; an ``X-Session-ID`` value is accepted exactly when the session contract
says so, and only accepted values make session entries.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import Proc, start_backend, start_router
from tests.contract.test_badinput_corpus import (
    ADMIN_TOKEN,
    GOOD,
    ROUTES,
    Answer,
    assert_no_traceback,
    assert_openai_error,
    get_json,
    header_request,
    post,
    raw,
)

pytestmark = pytest.mark.slow

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
#: fields the router or the backends read, so that generated objects hit typed fields
FIELDS = ["model", "prompt", "messages", "input", "max_tokens", "max_completion_tokens", "max_output_tokens", "n",
          "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "stream",
          "stream_options", "session_id", "vllm_xargs", "previous_response_id", "store", "token_ids",
          "sampling_params", "tokens", "output_mode", "echo", "role", "content", "include_usage"]

small_ints = st.integers(min_value=-3, max_value=8)  # large valid values would only make long answers
scalars = st.none() | st.booleans() | small_ints | st.floats(allow_nan=False, allow_infinity=False, width=32) | \
    st.text(max_size=12)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=6)


class Topology:
    def __init__(self, router: Proc, backend: Proc) -> None:
        self.router = router
        self.backend = backend


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    logs = tmp_path_factory.mktemp("badinput-props")
    backend = start_backend(str(logs))
    config = logs / "router.toml"
    config.write_text(f'stamp = "none"\nmax_body_bytes = 65536\nadmin_token = "{ADMIN_TOKEN}"\n'
                      f'[[backends]]\nurl = "{backend.url}"\n')
    router = start_router(str(logs), "--config", str(config))
    yield Topology(router, backend)
    router.stop()
    backend.stop()
    assert "Traceback" not in router.log(), router.log()[-3000:]


def check(answer: Answer) -> None:
    assert answer.status < 500, (answer.status, answer.body[:300])
    assert_no_traceback(answer)
    if answer.status >= 400:
        assert_openai_error(answer)


def assert_clean(topo: Topology) -> None:
    assert post(topo.router.port, "/v1/completions", GOOD).status == 200
    assert post(topo.backend.port, "/v1/completions", GOOD).status == 200
    view = get_json(topo.router.port, "/admin/backends")["data"]
    assert [b["in_flight"] for b in view] == [0]
    assert view[0]["healthy"]


def test_arbitrary_bytes_never_get_a_5xx(topo: Topology) -> None:
    @SETTINGS
    @given(body=st.binary(max_size=512) | st.binary(max_size=64).map(lambda b: b"{" + b), route=st.sampled_from(ROUTES))
    def prop(body: bytes, route: str) -> None:
        check(post(topo.router.port, route, body))
        check(post(topo.backend.port, route, body))

    prop()
    assert_clean(topo)


def test_arbitrary_json_objects_never_get_a_5xx(topo: Topology) -> None:
    @SETTINGS
    @given(obj=json_objects, route=st.sampled_from(ROUTES))
    def prop(obj: dict[str, Any], route: str) -> None:
        body = json.dumps(obj).encode()
        check(post(topo.router.port, route, body))
        check(post(topo.backend.port, route, body))

    prop()
    assert_clean(topo)


VALID_BODIES = {
    "/v1/completions": {"model": "session-sim", "prompt": "hello there", "max_tokens": 2, "session_id": "prefix-s"},
    "/v1/chat/completions": {"model": "session-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"model": "session-sim", "input": "hi", "max_output_tokens": 2},
    "/inference/v1/generate": {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}},
    "/tokenize": {"model": "session-sim", "prompt": "hi"},
    "/detokenize": {"model": "session-sim", "tokens": [1, 2, 3]},
}


def test_every_proper_prefix_of_a_valid_body_is_a_4xx(topo: Topology) -> None:
    bodies = {route: json.dumps(body, separators=(",", ":")).encode() for route, body in VALID_BODIES.items()}
    for route, body in bodies.items():
        assert post(topo.router.port, route, body).status == 200, route

    @SETTINGS
    @given(data=st.data(), route=st.sampled_from(ROUTES))
    def prop(data: st.DataObject, route: str) -> None:
        body = bodies[route]
        cut = data.draw(st.integers(min_value=0, max_value=len(body) - 1))
        for port in (topo.router.port, topo.backend.port):
            assert_openai_error(post(port, route, body[:cut]))

    prop()
    assert_clean(topo)


def contract_accepts(value: str) -> bool:
    """The session contract, as it applies to a header value once HTTP has trimmed its edges."""
    stripped = value.strip(" \t")
    return stripped == "" or (len(stripped) <= 256 and all(0x21 <= ord(c) <= 0x7E for c in stripped))


def test_session_header_accepted_exactly_when_the_contract_allows(topo: Topology) -> None:
    listing = get_json(topo.router.port, "/v1/sessions?limit=10000")
    known = {e["session_id"] for e in listing["data"]}
    accepted: set[str] = set()
    # any byte but CR and LF (those split the head: the corpus covers them), short and long values
    chars = st.characters(min_codepoint=0, max_codepoint=0xFF, blacklist_characters="\r\n")
    values = st.text(chars, max_size=20) | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E),
                                                    min_size=250, max_size=262)

    @SETTINGS
    @given(value=values)
    def prop(value: str) -> None:
        answer = raw(topo.router.port, header_request([["X-Session-ID", value]]))
        expected_ok = contract_accepts(value)
        assert (answer.status == 200) == expected_ok, (value, answer.status, answer.body[:200])
        if not expected_ok:
            assert answer.status == 400
            assert_no_traceback(answer)
        elif value.strip(" \t"):
            assert answer.headers["x-session-id"] == value.strip(" \t")
            accepted.add(value.strip(" \t"))

    prop()
    assert_clean(topo)
    listing = get_json(topo.router.port, "/v1/sessions?limit=10000")
    now = {e["session_id"] for e in listing["data"]}
    assert now - known - {"prefix-s"} == accepted - known  # entries only for accepted values
