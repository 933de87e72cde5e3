"""``bench/kv_index.py --quick`` runs end to end (a smoke test: the numbers belong to the benchmark)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import kv_index


def test_the_quick_run_reports_every_measurement(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    assert kv_index.main(["--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for row in ("decode step", "prefill", "reuse report", "BlockRemoved", "at the bound", "fast path",
                "queueing", "session_tokens", "prefix_tokens", "bytes per indexed block", "gc.collect"):
        assert row in text, row
    assert not out.exists()  # --quick writes nothing


def test_the_quick_compare_places_alike_with_every_policy(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    baseline = Path(kv_index.__file__).parent.parent / "router" / "placement" / "kv_aware.py"
    assert kv_index.main(["--quick", "--compare", "--baseline", str(baseline)]) == 0
    text = capsys.readouterr().out
    assert "| scenario | reference | baseline | current | decisions |" in text
    for row in ("fast path", "queueing alike (", "one finished per placement", "KV cache full"):
        line = next(line for line in text.splitlines() if row in line)
        assert line.endswith("| identical STICKY/cached |"), line
