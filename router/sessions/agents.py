"""Sessions named by agent clients' own headers, for requests no vLLM channel names a session for.

Where the router's session comes from, first match wins:

1. the vLLM channels (``contract.session``): body ``session_id`` > the session header
   (``X-Session-ID``, or the configured ``[sessions] header``) > ``vllm_xargs["session_id"]``;
2. an agent client's own session header (this module), in this order:
   ``x-claude-code-session-id`` (Claude Code), ``session-id`` then ``session_id`` (Codex),
   ``x-session-affinity`` (OpenCode);
3. ``[sessions] stamp``: the derived ``conv-…`` id, else a minted ``sess-…`` (``router.sessions.derive``).

What the clients send (read in their public sources and documentation, 2026):

- **Claude Code** sends ``X-Claude-Code-Session-Id`` on every API request: the UUID of the CLI
  session (Anthropic's "LLM gateway" documentation lists it among the request headers a gateway
  may consume for routing). Sub-agents of one CLI session send the same id (they are told apart
  by ``x-claude-code-agent-id``, which the router does not read): they are one session here.
- **Codex** (``openai/codex``, ``codex-rs/codex-api/src/requests/headers.rs``) sends ``session-id``
  (with ``thread-id``); releases before that sent ``session_id`` (an underscore, the same value).
  The value is the session's prompt-cache affinity key (``responses_session_id`` in
  ``codex-rs/core/src/client.rs``): a UUID, or the configured ``prompt_cache_key`` for a root
  agent, which ChatGPT's backend itself uses for cache affinity. ``thread-id`` and
  ``x-codex-parent-thread-id`` name threads, not sessions, and are not read.
- **OpenCode** (``sst/opencode``, ``packages/opencode/src/session/llm``) sends ``X-Session-Id`` (the
  router's own header: already the vLLM channel) and ``x-session-affinity``, both the session's id
  (``ses_…``); releases before it sent only ``x-session-affinity``. A ``task``-tool child session
  also sends ``x-parent-session-id``: its parent session's id (see ``parent_session``).

Values are used **as-is**, not namespaced: the id an agent shows its user is the id the router
pins, returns in its session header and forwards to vLLM as ``X-Session-ID``, so the backend's
KV events, the router's ``/v1/sessions`` and the client name the same session. The agents' ids
are random UUIDs (or ``ses_`` ids), so two agents do not collide; a client that also sends a vLLM
channel is named by that channel. An agent header value follows the session contract's rules for
a usable id (1..256 characters of visible ASCII); unlike a vLLM channel, whose bad value is a 400,
an empty, unusable or ambiguous (two different values) agent header is ignored, and the next
source decides: a client that does not know the router is never refused for its agent's headers.
``X-Correlation-ID``, ``X-Request-Id`` and every other header stay never a session.

The fronts capture these headers (``CAPTURED_HEADERS``) while parsing, and forward them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from contract.session import MAX_SESSION_ID_LENGTH

CLAUDE_CODE_HEADER = "x-claude-code-session-id"
CODEX_HEADER = "session-id"
CODEX_LEGACY_HEADER = "session_id"
OPENCODE_AFFINITY_HEADER = "x-session-affinity"
PARENT_HEADER = "x-parent-session-id"

#: the agent session headers, lower case, first match wins
AGENT_SESSION_HEADERS: tuple[str, ...] = (CLAUDE_CODE_HEADER, CODEX_HEADER, CODEX_LEGACY_HEADER,
                                          OPENCODE_AFFINITY_HEADER)
#: every header the fronts capture for this module, lower case
CAPTURED_HEADERS: tuple[str, ...] = (*AGENT_SESSION_HEADERS, PARENT_HEADER)

#: (lower-case name, value) pairs of the captured headers, as received
AgentHeaders = Sequence[tuple[str, str]]

_VISIBLE_ASCII = {c: None for c in range(0x21, 0x7F)}


def usable_id(value: str) -> bool:
    """Whether ``value`` may be a session id (``contract.session``'s rule: 1..256 visible ASCII)."""
    return 0 < len(value) <= MAX_SESSION_ID_LENGTH and not value.translate(_VISIBLE_ASCII)


def _named(headers: AgentHeaders, name: str) -> str | None:
    """The one usable value of header ``name``; None when absent, empty, unusable, or sent twice
    with different values."""
    found: str | None = None
    for key, value in headers:
        if key != name or not value:
            continue
        if found is not None and value != found:
            return None
        found = value
    return found if found is not None and usable_id(found) else None


def agent_session(headers: AgentHeaders) -> str | None:
    """The session an agent client's own header names (``AGENT_SESSION_HEADERS`` order), or None."""
    if not headers:
        return None
    for name in AGENT_SESSION_HEADERS:
        found = _named(headers, name)
        if found is not None:
            return found
    return None


def parent_session(headers: AgentHeaders, session_id: str) -> str | None:
    """The parent session ``x-parent-session-id`` names for ``session_id``, or None (absent,
    unusable, ambiguous, or the session itself)."""
    if not headers:
        return None
    parent = _named(headers, PARENT_HEADER)
    return parent if parent != session_id else None
