"""Helpers shared by the engine-core tests: wire bytes for a request, and driving a core by hand."""

from __future__ import annotations

from typing import Any

from backends.engine.core import EngineCore
from backends.engine.outputs import RequestOutput
from backends.engine.request import EngineCoreRequest, SamplingParams, encode_request


def wire(rid: str, prompt: list[int], session: str | None = None, *, salt: str | None = None, **sp: Any) -> bytes:
    """The msgpack bytes of a request (``max_tokens`` 4 unless given), as the frontend sends them."""
    params = SamplingParams(**{"max_tokens": 4, **sp})
    return encode_request(EngineCoreRequest(rid, prompt, None, params, None, 0.0, None, salt, None, session_id=session))


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step ``core`` until it has no work; every request's outputs, in order."""
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return outs
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("requests did not finish")
