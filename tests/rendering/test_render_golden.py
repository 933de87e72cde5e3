"""Every golden render case recorded from vLLM 0.32's render server, through our ``Renderer``.

Renders must equal vLLM's answers field for field and key for key (the JSON's key order included),
except the random ``request_id``, whose form is checked instead; refusals must carry vLLM's status
and the same error body (message, type, param, code)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from contract.errors import SessionRouterError
from rendering.generate_request import decode_generate_request, encode_generate_request
from rendering.render import Renderer
from tests.rendering.conftest import golden_cases

CHAT = golden_cases("render_chat")
COMPLETIONS = golden_cases("render_completions")
CHAT_ID = re.compile(r"chatcmpl-[0-9a-f]{16}")
COMPLETION_ID = re.compile(r"cmpl-[0-9a-f]{16}")


def _ids(cases: list[dict[str, Any]]) -> list[str]:
    return [f"{i}-{'ok' if c['status'] == 200 else c['status']}" for i, c in enumerate(cases)]


def _without_id(obj: dict[str, Any]) -> str:
    """The object as ordered JSON text with its request id blanked (order matters: bytes must match)."""
    return json.dumps({k: ("<id>" if k == "request_id" else v) for k, v in obj.items()}, ensure_ascii=False)


def _answer(call: Any) -> tuple[int, Any]:
    try:
        return 200, json.loads(encode_generate_request(call()))
    except SessionRouterError as exc:
        return exc.status, json.loads(exc.body())


def test_the_golden_files_hold_every_case() -> None:
    assert len(CHAT) == 44
    assert len(COMPLETIONS) == 20
    assert sum(c["status"] != 200 for c in CHAT) == 4


@pytest.mark.parametrize("case", CHAT, ids=_ids(CHAT))
def test_render_chat_matches_vllm(renderer: Renderer, case: dict[str, Any]) -> None:
    body = json.dumps(case["request"]).encode()
    status, got = _answer(lambda: renderer.render_chat(body).request)
    assert status == case["status"], got
    expected = case["response"]
    if status != 200:
        assert got == expected
        return
    assert CHAT_ID.fullmatch(expected["request_id"])
    assert CHAT_ID.fullmatch(got["request_id"]), got["request_id"]
    assert _without_id(got) == _without_id(expected)


@pytest.mark.parametrize("case", COMPLETIONS, ids=_ids(COMPLETIONS))
def test_render_completions_matches_vllm(renderer: Renderer, case: dict[str, Any]) -> None:
    body = json.dumps(case["request"]).encode()
    status, got = _answer(lambda: renderer.render_completions(body))
    assert status == case["status"], got
    expected = case["response"]
    if status != 200:
        assert got == expected
        return
    assert len(got) == len(expected)
    several = len(expected) > 1
    base = got[0]["request_id"].rsplit("-", 1)[0] if several else got[0]["request_id"]
    for index, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        suffix = f"-{index}" if several else ""
        for rid in (mine["request_id"], theirs["request_id"]):
            assert rid.endswith(suffix)
            assert COMPLETION_ID.fullmatch(rid[: len(rid) - len(suffix)]), rid
        assert mine["request_id"] == base + suffix  # one base id for all of a body's prompts
        assert _without_id(mine) == _without_id(theirs)


@pytest.mark.parametrize("case", [c for c in CHAT if c["status"] == 200][:8], ids=lambda c: str(len(c["request"]["messages"])))
def test_a_recorded_answer_survives_decode_and_encode(case: dict[str, Any]) -> None:
    """What a render server answers decodes into ``GenerateRequest`` and encodes back to the same JSON
    (the remote-render client and the backends' generate route rely on it)."""
    raw = json.dumps(case["response"]).encode()
    again = json.loads(encode_generate_request(decode_generate_request(raw)))
    assert json.dumps(again) == json.dumps(case["response"])


def test_a_given_request_id_is_used(renderer: Renderer) -> None:
    body = json.dumps(CHAT[0]["request"]).encode()
    assert renderer.render_chat(body, request_id="chatcmpl-mine").request.request_id == "chatcmpl-mine"
    two = json.dumps({"model": "tiny-llama", "prompt": ["a", "b"]}).encode()
    assert [r.request_id for r in renderer.render_completions(two, request_id="cmpl-x")] == ["cmpl-x-0", "cmpl-x-1"]
