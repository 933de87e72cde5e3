"""``bench/kv_reader.py`` runs end to end on a short run: every reader receives every batch of its
measured window from a real publisher process (the numbers belong to the benchmark)."""

from __future__ import annotations

import pytest

from bench import kv_reader


def test_a_short_run_measures_every_reader(capsys: pytest.CaptureFixture[str]) -> None:
    assert kv_reader.main(["--rate", "400", "--seconds", "0.25", "--rounds", "1"]) == 0
    table = capsys.readouterr().out
    for reader in kv_reader.READERS:
        line = next(line for line in table.splitlines() if line.startswith(f"| {reader} |"))
        assert float(line.split("|")[2].split()[0]) > 0, line

