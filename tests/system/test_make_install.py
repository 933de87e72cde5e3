"""`make`'s install step: a failed install leaves no half-made .venv; an old Python is refused.

`make install` runs for real in a scratch copy of the Makefile and pyproject.toml, with a stand-in
``python`` (no packages are downloaded): its ``-m venv`` makes a venv whose pip fails or succeeds
as the test says.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

FAKE_PYTHON = """#!/bin/bash
# a stand-in python3: `-c` answers the version check, `-m venv DIR` makes a venv whose python is fake too
case "$1" in
  -c) exit "${FAKE_OLD_PYTHON:-0}" ;;
  -m)
    if [ "$2" = venv ]; then
      mkdir -p "$3/bin" "$3/lib"
      cp "$0" "$3/bin/python"
      exit 0
    fi
    if [ "$2" = pip ]; then
      echo "pip $*" >>"$FAKE_LOG"
      case "$*" in *" -e "*) exit "${FAKE_PIP_EXIT:-0}" ;; esac
      exit 0
    fi ;;
esac
exit 0
"""


def _make(tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(Path(REPO) / name, tmp / name)
    python = tmp / "fake-python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return subprocess.run(["make", "install", f"PYTHON={python}"], cwd=tmp, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FAKE_LOG": str(tmp / "pip.log"), **env})


def test_a_failed_install_removes_the_venv(tmp_path: Path) -> None:
    out = _make(tmp_path, FAKE_PIP_EXIT="1")
    assert out.returncode != 0
    assert "installing into .venv failed" in out.stderr and "removed .venv" in out.stderr
    assert not (tmp_path / ".venv").exists()
    assert "-e .[test]" in (tmp_path / "pip.log").read_text()  # it got as far as the package install


def test_a_good_install_keeps_the_venv_and_its_stamp(tmp_path: Path) -> None:
    out = _make(tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / ".venv" / ".installed").exists()


def test_an_old_python_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    out = _make(tmp_path, FAKE_OLD_PYTHON="1")
    assert out.returncode != 0
    assert "needs Python >= 3.11" in out.stderr
    assert not (tmp_path / ".venv").exists() and not (tmp_path / "pip.log").exists()
