"""The scale-out roles as real ``session-backend`` processes: ``--role render`` (a render server with no
engine), ``--tokens-only`` and ``--enable-scale-out`` engines, and the model flags (``--model-dir``,
``--served-model-name``, ``--max-model-len``)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rendering.model import DEFAULT_MODEL_DIR
from tests.backends.test_backend_process import REPO, Backend

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).resolve().parents[1] / "rendering" / "data"


def post(b: Backend, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(b.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def procs() -> Iterator[list[Backend]]:
    started: list[Backend] = []
    yield started
    for b in started:
        b.stop(signal.SIGKILL)


def test_role_render_process_renders_as_vllm_and_has_no_engine(procs: list[Backend]) -> None:
    b = Backend("--role", "render")
    procs.append(b)
    assert "role=render" in b.first_line and "model=tiny-llama" in b.first_line
    assert b.get("/health") == (200, b"")
    status, models = b.get("/v1/models")
    assert status == 200 and json.loads(models)["data"][0]["id"] == "tiny-llama"
    case = json.loads((GOLDEN / "render_chat.jsonl").open(encoding="utf-8").readline())
    status, got = post(b, "/v1/chat/completions/render", case["request"])
    assert status == 200
    assert {**got, "request_id": None} == {**case["response"], "request_id": None}
    status, err = post(b, "/inference/v1/generate", got)
    assert status == 404 and err["error"]["code"] == 404
    status, tok = post(b, "/tokenize", {"prompt": "hello world"})
    assert status == 200 and tok["count"] == len(tok["tokens"])
    assert b.get("/load")[0] == 200 and b.get("/version")[0] == 200
    assert b"session_backend_render_requests_total" in b.get("/metrics")[1]
    assert b.stop(signal.SIGTERM) == 0
    assert "Traceback" not in "".join(b.stderr)


def test_tokens_only_process(procs: list[Backend]) -> None:
    b = Backend("--tokens-only", "--speed", "0")
    procs.append(b)
    assert "tokens-only" in b.first_line
    body = {"token_ids": [1, 300, 301], "sampling_params": {"max_tokens": 4, "ignore_eos": True}}
    status, data = post(b, "/inference/v1/generate", body, {"X-Session-ID": "proc-s", "X-Request-Id": "r1"})
    assert status == 200 and data["request_id"] == "generate-tokens-r1" and len(data["choices"][0]["token_ids"]) == 4
    status, err = post(b, "/inference/v1/generate", {**body, "sampling_params": {"stop": ["x"]}})
    assert status == 400 and err["error"]["message"].startswith("stop strings are not supported on a --tokens-only")
    assert post(b, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})[0] == 404
    assert post(b, "/inference/v1/abort_requests", {"request_ids": ["generate-tokens-r1"]}) == (200, None)
    assert b.metric("vllm:num_requests_running") == 0
    status, stats = b.get("/v1/sessions/proc-s")
    assert status == 200 and json.loads(stats)["requests"] == 1
    assert b.stop() == 0


def test_model_flags(procs: list[Backend], tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    b = Backend("--model-dir", str(folder), "--max-model-len", "512", "--enable-scale-out")
    procs.append(b)
    assert "model=my-model" in b.first_line and "scale-out" in b.first_line
    status, models = b.get("/v1/models")
    card = json.loads(models)["data"][0]
    assert (card["id"], card["max_model_len"]) == ("my-model", 512)
    status, rendered = post(b, "/v1/chat/completions/render", {"model": "my-model",
                                                               "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and rendered["sampling_params"]["max_tokens"] == 512 - len(rendered["token_ids"])
    named = Backend("--served-model-name", "other", "--speed", "0")
    procs.append(named)
    assert json.loads(named.get("/v1/models")[1])["data"][0]["id"] == "other"


@pytest.mark.parametrize(("args", "fragment"), [
    (["--model-dir", "/nonexistent/model"], "does not exist"),
    (["--role", "render", "--tokens-only"], "no engine"),
    (["--max-model-len", "0"], "--max-model-len"),
])
def test_bad_model_flags_fail_fast(args: list[str], fragment: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "backends", "--port", "0", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr
