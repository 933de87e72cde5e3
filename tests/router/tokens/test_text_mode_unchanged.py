"""Text mode (``upstream_api = "openai"``, the default) is untouched by tokens mode: no tokens
handlers, no model loaded, no rendering module imported by the app, and chat/completions bodies
forwarded byte for byte to the backends' own OpenAI routes."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from router.app import PROXY, TOKENS
from tests.fakes import EchoBackend
from tests.support import REPO

BODY = b'{"model": "m",  "messages": [{"role": "user", "content": "hi"}], "stop": ["x"], "max_tokens": 3}'


@pytest.mark.parametrize("front", ["raw", "aiohttp"])
async def test_text_mode_forwards_the_body_as_sent(make_router: Any, front: str) -> None:
    backend = EchoBackend("b0")
    router = await make_router(front, fakes=[backend])
    assert router.app[PROXY].tokens is None and TOKENS not in router.app
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/chat/completions", "/v1/completions"):
            async with http.post(router.url + path, data=BODY, headers={"Content-Type": "application/json",
                                                                         "X-Session-ID": "s"}) as response:
                assert response.status == 200
                assert json.loads(await response.read())["backend"] == "b0"
    assert [(seen.path, seen.body) for seen in backend.seen] == [("/v1/chat/completions", BODY),
                                                                 ("/v1/completions", BODY)]


def test_text_mode_never_imports_the_tokens_data_path() -> None:
    code = ("import sys; from router.app import create_app; from tests.support import router_config; "
            "from router.config import BackendConfig; "
            "create_app(router_config(backends=[BackendConfig('http://127.0.0.1:9')])); "
            "print(sorted(m for m in sys.modules if m.startswith(('rendering.render', 'rendering.derender', "
            "'router.tokens.flow', 'router.tokens.mode', 'tokenizers', 'jinja2'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]"
