"""The derived ``conv-`` id keys on who sent the request (router.sessions.derive.sender_key)."""

from __future__ import annotations

import hashlib
import re

import msgspec

from router.sessions.derive import derive_chat_session, derive_responses_session, sender_key

MESSAGES = msgspec.Raw(b'[{"role":"system","content":"be brief"},{"role":"user","content":"hello"}]')
OTHER = msgspec.Raw(b'[{"role":"system","content":"be brief"},{"role":"user","content":"bye"}]')


def test_the_sender_is_the_credential_else_the_address() -> None:
    alice, bob = sender_key("Bearer sk-alice", None), sender_key("Bearer sk-bob", None)
    assert re.fullmatch(r"[0-9a-f]{32}", alice)
    assert alice != bob
    assert sender_key("Bearer sk-alice", "127.0.0.1") == alice  # the credential wins over the address
    assert sender_key("  Bearer sk-alice ", None) == alice
    here, there = sender_key(None, "127.0.0.1"), sender_key(None, "127.0.0.2")
    assert here != there and here == sender_key("", "127.0.0.1")
    assert sender_key(None, None) == ""
    # an address and a credential spelled the same are two senders
    assert sender_key("127.0.0.1", None) != here


def test_the_credential_is_only_a_digest() -> None:
    key = sender_key("Bearer sk-secret-123", None)
    assert "sk-secret" not in key
    assert key == hashlib.blake2b(b"Bearer sk-secret-123", digest_size=16, person=b"sr-sender-auth").hexdigest()


def test_derived_ids_differ_by_sender_and_are_stable_for_one() -> None:
    alice, bob = sender_key("Bearer a", None), sender_key("Bearer b", None)
    first = derive_chat_session(MESSAGES, alice)
    assert first is not None and re.fullmatch(r"conv-[0-9a-f]{32}", first)
    assert derive_chat_session(MESSAGES, alice) == first
    assert derive_chat_session(MESSAGES, bob) != first
    # one sender (every bench client on 127.0.0.1, no Authorization): ids still differ by conversation
    local = sender_key(None, "127.0.0.1")
    assert derive_chat_session(MESSAGES, local) != derive_chat_session(OTHER, local)
    item = msgspec.Raw(b'"hello"')
    assert derive_responses_session(item, alice) == derive_responses_session(item, alice)
    assert derive_responses_session(item, alice) != derive_responses_session(item, bob)
