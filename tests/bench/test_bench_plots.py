"""bench.plots: the PNGs drawn from benchmark results (multi-turn and stickiness), in process and
as ``python -m bench.plots FILE``."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from bench.multiturn import BenchConfig, BenchResult, CellResult, Sample, TurnRecord, quick_variants
from bench.plots import _smooth, draw_file, draw_multiturn, draw_stickiness
from bench.procs import REPO
from bench.stickiness import SlowCell, StickinessResult, Window

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png(path: str) -> bytes:
    with open(path, "rb") as fh:
        data = fh.read()
    assert data.startswith(PNG_MAGIC), path
    assert len(data) > 10_000, (path, len(data))  # axes, lines and text, not an empty canvas
    return data


def _cell(variant: str, target: str, scale: float, records: bool = True) -> CellResult:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    recs = [TurnRecord(s, t, False, True, s * 0.5 + t, ttft_s=scale * (1 + (s * 7 + t) % 13))
            for s in range(10) for t in range(4)]
    samples = [Sample(round(i * 0.1, 1), None, [(i + b) % 3 for b in range(4)]) for i in range(200)]
    return CellResult(variant=variant, target=target, kind="ours", records=recs if records else None,
                      samples=samples, backends=urls, load_imbalance=1.1, worst_backend_ttft_p99=scale * 13)


def _result(records: bool = True) -> BenchResult:
    cells = [_cell(v, t, s, records) for v in ("uniform", "skewed")
             for t, s in (("kv_aware", 0.03), ("session", 0.04), ("round_robin", 0.1))]
    cells.append(CellResult(variant="skewed", target="sglang-router (cache_aware)", kind="peer", skipped="not installed"))
    # a repeat at another workload seed: judged in the target checks, not drawn
    cells += [_cell("skewed@seed2", t, s, records) for t, s in (("kv_aware", 0.03), ("session", 0.04))]
    return BenchResult(started="2026-12-01T16:00:00", machine={}, command="python -m bench.multiturn",
                       config=BenchConfig(variants=quick_variants(1)), cells=cells, checks=[], peer_notes=[])


def test_multiturn_plots_ttft_per_variant_and_load_per_cell(tmp_path: os.PathLike[str]) -> None:
    out = os.path.join(str(tmp_path), "plots")
    paths = draw_multiturn(_result(), out)
    assert [os.path.basename(p) for p in paths] == ["multiturn-ttft.png", "multiturn-load-uniform.png",
                                                    "multiturn-load-skewed.png"]
    for path in paths:
        _png(path)


def test_without_records_only_the_load_is_drawn(tmp_path: os.PathLike[str]) -> None:
    paths = draw_multiturn(_result(records=False), str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["multiturn-load-skewed.png", "multiturn-load-uniform.png"]


def test_the_moving_average_trails_over_its_window() -> None:
    ts = [0.0, 0.5, 1.0, 1.5, 2.0]
    assert _smooth(ts, [0.0, 2.0, 4.0, 6.0, 8.0], 1.0) == pytest.approx([0.0, 1.0, 2.0, 4.0, 6.0])


def _stickiness() -> StickinessResult:
    def windows(recover: bool) -> list[Window]:
        out = []
        for i in range(10):
            slowed = i >= 3
            p99 = 90.0 if slowed and not (recover and i > 5) else 5.0
            share = 0.5 if not slowed else (0.05 if recover and i > 4 else 0.5)
            out.append(Window(start_s=i * 1.1, end_s=i * 1.1 + 1, slowed=slowed, requests=1000, ttft_p99_ms=p99,
                              slow_share=share, sessions_on_slow=int(64 * share)))
        return out

    slow = [SlowCell(policy=p, concurrency=16, slowdown="SIGSTOP 80 ms of every 100 ms", slowed_at_s=3.3,
                     windows=windows(p == "kv_aware")) for p in ("kv_aware", "session")]
    return StickinessResult(started="2026-12-01T16:00:00", facts={}, settings={}, slow=slow)


def test_stickiness_plot_and_the_command_line_on_a_results_file(tmp_path: os.PathLike[str]) -> None:
    result = _stickiness()
    [path] = draw_stickiness(result, str(tmp_path))
    assert os.path.basename(path) == "stickiness-slow.png"
    _png(path)
    # python -m bench.plots FILE tells the two kinds of results apart
    for name, res in (("stick.json", result), ("multi.json", _result())):
        src = os.path.join(str(tmp_path), name)
        with open(src, "wb") as fh:
            fh.write(msgspec.json.encode(res))
        out = os.path.join(str(tmp_path), name + ".d")
        done = subprocess.run([sys.executable, "-m", "bench.plots", src, "--out", out], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert sorted(os.listdir(out)) == sorted(os.path.basename(p) for p in done.stdout.split())
        assert draw_file(src, out)


def test_a_results_file_with_nothing_to_draw_says_so(tmp_path: os.PathLike[str]) -> None:
    src = os.path.join(str(tmp_path), "empty.json")
    with open(src, "wb") as fh:
        fh.write(msgspec.json.encode(StickinessResult(started="", facts={}, settings={})))
    done = subprocess.run([sys.executable, "-m", "bench.plots", src, "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "nothing to draw" in done.stderr
