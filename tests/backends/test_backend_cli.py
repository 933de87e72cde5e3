"""``session-backend``'s command line: help with every default, any-case log levels, --version."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from backends.__main__ import build_parser, parse_args
from tests.support import REPO


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest not in ("help", "version")]


def test_help_gives_every_flag_a_help_text_and_its_default() -> None:
    parser = build_parser()
    formatter = parser._get_formatter()
    flags = _flags(parser)
    assert len(flags) >= 20
    for action in flags:
        text = formatter._get_help_string(action) or ""  # what --help prints for this flag, before wrapping
        assert action.help and "default" in text.lower(), (action.option_strings, text)


def test_help_runs_and_shows_the_defaults() -> None:
    out = subprocess.run([sys.executable, "-m", "backends", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # undo argparse's wrapping
    for shown in ("--port PORT port to bind; 0 = any free port (default: 8100)", "(default: 127.0.0.1)",
                  "(default: the model folder's name)", "(default: the shipped models/tiny-llama)",
                  "(default: the model's, config.json max_position_embeddings)", "(default: INFO)", "--version"):
        assert shown in text, shown


@pytest.mark.parametrize(("given", "level"), [("info", "INFO"), ("INFO", "INFO"), ("Warning", "WARNING"),
                                              ("debug", "DEBUG")])
def test_log_level_is_case_insensitive(given: str, level: str) -> None:
    assert parse_args(["--log-level", given]).log_level == level


def test_an_unknown_log_level_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--log-level", "loud"])
    assert info.value.code == 2
    assert "invalid choice: 'LOUD'" in capsys.readouterr().err


def test_prompt_tokens_details_is_on_unless_turned_off() -> None:
    assert parse_args([]).enable_prompt_tokens_details is True
    assert parse_args(["--no-enable-prompt-tokens-details"]).enable_prompt_tokens_details is False
