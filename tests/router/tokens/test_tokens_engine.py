"""What the router sends an engine: the generate payload (no stop strings, the stream flag and output
kind the router reads with, usage asked for) and the engine's request id for aborts."""

from __future__ import annotations

import json

import pytest

from contract.errors import BadRequestError

from rendering.generate_request import (
    OUTPUT_DELTA,
    OUTPUT_FINAL_ONLY,
    GenerateRequest,
    SamplingParams,
    encode_generate_request,
)
from router.tokens.engine import engine_headers, engine_request_id, generate_payload


def rendered(**sampling: object) -> GenerateRequest:
    return GenerateRequest(request_id="chatcmpl-x", token_ids=[1, 2, 3], model="tiny-llama",
                           sampling_params=SamplingParams(**sampling))  # type: ignore[arg-type]


def test_stop_strings_stay_with_the_router() -> None:
    request = rendered(stop=["\n\n", "END"], output_text_buffer_length=3, max_tokens=20, output_kind=OUTPUT_FINAL_ONLY)
    sent = json.loads(generate_payload(request, stream=True))
    assert "stop" not in sent["sampling_params"] and "output_text_buffer_length" not in sent["sampling_params"]
    assert sent["sampling_params"]["max_tokens"] == 20
    assert sent["sampling_params"]["output_kind"] == OUTPUT_DELTA
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True,
                                                                 "continuous_usage_stats": False}
    # the rendered request itself is unchanged (it is the render's answer)
    assert request.sampling_params.stop == ["\n\n", "END"]


def test_non_stream_asks_for_the_final_output_only() -> None:
    request = rendered(max_tokens=5, output_kind=OUTPUT_FINAL_ONLY)
    sent = json.loads(generate_payload(request, stream=False))
    assert sent["stream"] is False and sent["stream_options"] is None
    assert sent["sampling_params"]["output_kind"] == OUTPUT_FINAL_ONLY
    # nothing else changes: the same bytes as the render's answer but for the stream fields
    expected = json.loads(encode_generate_request(request))
    assert sent == expected


def test_engine_ids_and_headers() -> None:
    assert engine_request_id("abc") == "generate-tokens-abc"
    lines = engine_headers("abc", "sess-1")
    assert "X-Request-Id: abc\r\n" in lines and "X-Session-ID: sess-1\r\n" in lines
    assert "Content-Type: application/json\r\n" in lines
    assert "X-Session-ID" not in engine_headers("abc", None)


def test_max_tokens_16_is_written_for_the_engine() -> None:
    """The render leaves max_tokens=16 out (vLLM's JSON omits the default); a generate route reads a
    missing one as the remaining context, so the payload names it (a small addition by R)."""
    request = rendered(max_tokens=16, output_kind=OUTPUT_FINAL_ONLY)
    assert "max_tokens" not in json.loads(encode_generate_request(request))["sampling_params"]
    assert json.loads(generate_payload(request, stream=False))["sampling_params"]["max_tokens"] == 16


def test_engine_headers_refuse_line_breaks() -> None:
    with pytest.raises(BadRequestError):
        engine_headers("a\r\nX-Evil: 1", None)
    with pytest.raises(BadRequestError):
        engine_headers("abc", "s\n1")
    assert engine_headers("abc", None) == "Content-Type: application/json\r\nX-Request-Id: abc\r\n"
