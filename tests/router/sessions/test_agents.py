"""Agent clients' own session headers (router.sessions.agents): which header names a session,
which values count, and the parent a child session names."""

from __future__ import annotations

import pytest

from router.sessions.agents import (
    AGENT_SESSION_HEADERS,
    CAPTURED_HEADERS,
    PARENT_HEADER,
    agent_session,
    parent_session,
    usable_id,
)


def test_the_header_names_the_clients_send() -> None:
    assert AGENT_SESSION_HEADERS == ("x-claude-code-session-id", "session-id", "session_id", "x-session-affinity")
    assert CAPTURED_HEADERS == (*AGENT_SESSION_HEADERS, "x-parent-session-id")
    # never a session: the correlation and request ids, and the router's own header (a vLLM channel)
    for name in ("x-correlation-id", "x-request-id", "x-session-id", "authorization"):
        assert name not in AGENT_SESSION_HEADERS


@pytest.mark.parametrize("name", AGENT_SESSION_HEADERS)
def test_each_agent_header_names_the_session_as_is(name: str) -> None:
    assert agent_session([(name, "0b8f6a2e-1f3c-4c1e-9a7d-2b5e8c9d0f11")]) == "0b8f6a2e-1f3c-4c1e-9a7d-2b5e8c9d0f11"


def test_precedence_between_agent_headers() -> None:
    headers = [("x-session-affinity", "ses_oc"), ("session-id", "codex"), ("session_id", "codex-old"),
               ("x-claude-code-session-id", "claude")]
    assert agent_session(headers) == "claude"
    assert agent_session(headers[:3]) == "codex"
    assert agent_session([headers[0], headers[2]]) == "codex-old"
    assert agent_session(headers[:1]) == "ses_oc"


@pytest.mark.parametrize("value", ["", "a b", "x" * 257, "caf\u00e9", "tab\there"])
def test_unusable_values_are_ignored_and_the_next_header_decides(value: str) -> None:
    assert agent_session([("x-claude-code-session-id", value)]) is None
    assert agent_session([("x-claude-code-session-id", value), ("session-id", "codex-1")]) == "codex-1"


def test_two_different_values_of_one_header_are_ignored_the_same_twice_counts() -> None:
    assert agent_session([("session-id", "a"), ("session-id", "b")]) is None
    assert agent_session([("session-id", "a"), ("session-id", "b"), ("x-session-affinity", "c")]) == "c"
    assert agent_session([("session-id", "a"), ("session-id", ""), ("session-id", "a")]) == "a"


def test_the_limits_follow_the_session_contract() -> None:
    assert usable_id("x" * 256) and not usable_id("x" * 257) and not usable_id("")
    assert usable_id("~!@#$%^&*()_+{}|:<>?")


def test_no_headers_no_session() -> None:
    assert agent_session(()) is None
    assert agent_session([(PARENT_HEADER, "ses_parent")]) is None  # a parent alone names no session


def test_parent_session() -> None:
    headers = [("x-session-affinity", "ses_child"), (PARENT_HEADER, "ses_parent")]
    assert parent_session(headers, "ses_child") == "ses_parent"
    assert parent_session(headers, "ses_parent") is None  # a session is not its own parent
    assert parent_session([(PARENT_HEADER, "")], "c") is None
    assert parent_session([(PARENT_HEADER, "a b")], "c") is None
    assert parent_session([(PARENT_HEADER, "p1"), (PARENT_HEADER, "p2")], "c") is None
    assert parent_session((), "c") is None
