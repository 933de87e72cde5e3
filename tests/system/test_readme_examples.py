"""The README's client examples work as written: the OpenAI SDK snippet and the curl command are
taken from README.md by their markers and run against a real router and backend on loopback
(only the address 127.0.0.1:8000 is replaced by the test router's)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO, Proc, start_backend, start_router

README = Path(REPO) / "README.md"
DEMO_ADDRESS = "127.0.0.1:8000"


def example(name: str) -> str:
    """The fenced code block between ``<!-- example:NAME -->`` and ``<!-- /example:NAME -->``."""
    text = README.read_text()
    match = re.search(rf"<!-- example:{re.escape(name)} -->\n```\w*\n(.*?)```\n<!-- /example:{re.escape(name)} -->",
                      text, re.DOTALL)
    assert match, f"README.md has no example {name!r}"
    return match.group(1)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    log_dir = str(tmp_path_factory.mktemp("readme"))
    procs: list[Proc] = []
    try:
        procs += [start_backend(log_dir) for _ in range(2)]
        procs.append(start_router(log_dir, *[a for b in procs for a in ("--backend", b.url)]))
        yield procs[-1]
    finally:
        for proc in reversed(procs):
            proc.stop()


def session_view(router: Proc, session_id: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{router.url}/v1/sessions/{session_id}", timeout=5) as resp:
        return dict(json.load(resp))


def test_the_readme_points_its_examples_at_the_demo_router() -> None:
    for name in ("openai-sdk", "curl"):
        assert DEMO_ADDRESS in example(name)


def test_the_openai_sdk_example_sends_and_reads_the_session_id(router: Proc) -> None:
    pytest.importorskip("openai")
    code = example("openai-sdk").replace(DEMO_ADDRESS, f"127.0.0.1:{router.port}")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    session_id, echoed, cached, prompt = out.stdout.split()
    assert session_id == echoed and session_id.startswith("conv-")  # derived by the router, sent back, echoed
    assert 0 < int(cached) < int(prompt)  # the second turn reached the backend holding the first
    view = session_view(router, session_id)
    assert view["requests"] == 2 and len(set(dict(view["pins"]).values())) == 1  # type: ignore[arg-type]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_curl_example_sends_and_reads_the_session_id(router: Proc) -> None:
    command = example("curl").replace(DEMO_ADDRESS, f"127.0.0.1:{router.port}")
    out = subprocess.run(["bash", "-c", command], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    head, _, body = out.stdout.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200")
    assert re.search(r"^x-session-id: chat-42\r?$", head, re.IGNORECASE | re.MULTILINE), head
    assert json.loads(body)["choices"][0]["message"]["role"] == "assistant"
    assert session_view(router, "chat-42")["requests"] == 1


def test_the_readme_names_only_files_that_are_in_the_repository() -> None:
    text = README.read_text()
    named = set(re.findall(r"`([\w./-]+\.(?:md|toml|yml|yaml|py|json))`", text))
    named |= {m for m in re.findall(r"\]\(([^)]+)\)", text) if not m.startswith(("http://", "https://", "#"))}
    assert "bench/RESULTS.md" in named and "config/router.toml" in named
    missing = sorted(name for name in named if not (Path(REPO) / name).exists())
    assert not missing, f"README.md names files that are not in the repository: {missing}"
    assert "DESIGN.md" not in text and "STYLE.md" not in text


def test_the_license_is_apache_2_and_the_package_says_so() -> None:
    import tomllib

    license_text = (Path(REPO) / "LICENSE").read_text()
    assert license_text.split()[:3] == ["Apache", "License", "Version"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    with open(Path(REPO) / "pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)["project"]
    assert project["license"] == "Apache-2.0" and project["requires-python"] == ">=3.11"
    assert any(dep.startswith("openai") for dep in project["optional-dependencies"]["test"])
    assert "Python ≥ 3.11" in README.read_text().split("## Set-up", 1)[0]
