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
