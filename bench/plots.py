"""PNG plots of the routing benchmarks' JSON results (matplotlib: the ``bench`` extra, not a runtime
dependency; imported only here, and only when a plot is drawn).

From a ``bench.multiturn`` result (run with ``--records`` for the TTFT plot):

- ``multiturn-ttft.png``: per variant, the TTFT distribution of every policy and peer: the CDF on a
  log time axis (top) and a box plot (bottom; box = p25-p75, whiskers p1-p99, dot = p99);
- ``multiturn-load-<variant>.png``: per cell, each backend's own load (``/load``: requests in flight
  at the backend) over time, as a 1-second moving average, one line per backend.

From a ``bench.stickiness`` result: ``stickiness-slow.png``: the slow-backend cell, per policy, the
TTFT p99 per time window and the share of requests the slowed backend served, with the moment it
was slowed marked.

    python -m bench.plots RESULTS.json [--out DIR]     # default DIR: bench/plots
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from bench.multiturn import BenchResult, CellResult
    from bench.stickiness import StickinessResult

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plots")
#: seconds of the moving average in the load plots
LOAD_SMOOTH_S = 1.0


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - the bench extra is missing
        raise SystemExit("bench.plots needs matplotlib: pip install -e '.[bench]' (or make bench)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ok_ttfts(cell: CellResult) -> list[float]:
    return sorted(r.ttft_s for r in cell.records or () if r.ok)


def _percentile(data: Sequence[float], q: float) -> float:
    if not data:
        return 0.0
    pos = (len(data) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def _variants(result: BenchResult) -> list[str]:
    """The variants drawn: not the repeats of one at other seeds (``skewed@seed2``), which are judged
    only in the target checks."""
    seen: list[str] = []
    for c in result.cells:
        if c.variant not in seen and "@" not in c.variant:
            seen.append(c.variant)
    return seen


def _short(target: str) -> str:
    """A peer's label without its policy in parentheses (legend and tick space)."""
    return target.split(" (")[0]


def draw_ttft(result: BenchResult, out_dir: str) -> str | None:
    """``multiturn-ttft.png``, or None when the result has no per-request records."""
    variants = [v for v in _variants(result)
                if any(c.records for c in result.cells if c.variant == v and not c.skipped)]
    if not variants:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(variants), figsize=(6.2 * len(variants), 9.5), squeeze=False)
    targets = [t for t in dict.fromkeys(c.target for c in result.cells if not c.skipped)]
    colors = {t: plt.get_cmap("tab10")(i % 10) for i, t in enumerate(targets)}
    for col, variant in enumerate(variants):
        cells = [c for c in result.cells if c.variant == variant and not c.skipped and c.records]
        cdf, box = axes[0][col], axes[1][col]
        for c in cells:
            data = _ok_ttfts(c)
            if not data:
                continue
            ys = [(i + 1) / len(data) for i in range(len(data))]
            cdf.step(data, ys, where="post", color=colors[c.target], linewidth=1.6,
                     label=f"{_short(c.target)} (p99 {_percentile(data, 0.99) * 1e3:.0f} ms)")
        cdf.set_xscale("log")
        cdf.set_xlabel("TTFT (s, log scale)")
        cdf.set_ylabel("share of requests")
        cdf.set_ylim(0, 1.01)
        cdf.axhline(0.99, color="grey", linewidth=0.8, linestyle=":")
        cdf.grid(True, which="both", alpha=0.3)
        cdf.set_title(f"{variant}: TTFT CDF")
        cdf.legend(loc="lower right", fontsize=8)
        data_sets = [_ok_ttfts(c) for c in cells]
        positions = list(range(1, len(cells) + 1))
        parts = box.boxplot(data_sets, positions=positions, whis=(1, 99), showfliers=False, patch_artist=True,
                            widths=0.6)
        for patch, c in zip(parts["boxes"], cells, strict=True):
            patch.set_facecolor(colors[c.target])
            patch.set_alpha(0.55)
        for x, data in zip(positions, data_sets, strict=True):
            if data:
                box.plot([x], [_percentile(data, 0.99)], marker="o", color="black", markersize=4)
        box.set_xticks(positions)
        box.set_xticklabels([_short(c.target) for c in cells], rotation=25, ha="right", fontsize=8)
        box.set_yscale("log")
        box.set_ylabel("TTFT (s, log scale)")
        box.grid(True, axis="y", which="both", alpha=0.3)
        box.set_title(f"{variant}: box p25-p75, whiskers p1-p99, dot p99")
    fig.suptitle("Multi-turn routing: time to first token per policy")
    fig.tight_layout()
    path = os.path.join(out_dir, "multiturn-ttft.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smooth(ts: Sequence[float], values: Sequence[float], window_s: float) -> list[float]:
    """Trailing moving average over ``window_s`` seconds."""
    out: list[float] = []
    start, total = 0, 0.0
    for i, (t, v) in enumerate(zip(ts, values, strict=True)):
        total += v
        while ts[start] < t - window_s:
            total -= values[start]
            start += 1
        out.append(total / (i - start + 1))
    return out


def draw_load(result: BenchResult, variant: str, out_dir: str) -> str | None:
    """``multiturn-load-<variant>.png``: a panel per cell, a line per backend."""
    cells = [c for c in result.cells if c.variant == variant and not c.skipped and c.samples]
    if not cells:
        return None
    plt = _pyplot()
    ncols = min(3, len(cells))
    nrows = math.ceil(len(cells) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.6 * ncols, 3.3 * nrows), squeeze=False)
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    for ax, c in zip(axes.flat, cells):
        ts = [s.t for s in c.samples]
        n = len(c.samples[0].server)
        for b in range(n):
            ys = _smooth(ts, [float(s.server[b]) for s in c.samples], LOAD_SMOOTH_S)
            ax.plot(ts, ys, linewidth=1.0, label=f"backend {b + 1}")
        ax.set_title(f"{_short(c.target)}: /load max/mean {c.server_load_imbalance:.2f}, worst-backend TTFT p99 "
                     f"{c.worst_backend_ttft_p99 * 1e3:.0f} ms", fontsize=9)
        ax.set_xlabel("time in the cell (s)")
        ax.set_ylabel("in flight at the backend")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right", fontsize=7)
    fig.suptitle(f"Multi-turn routing, {variant}: each backend's load over time "
                 f"({LOAD_SMOOTH_S:g} s moving average of /load, sampled every "
                 f"{result.config.sample_s:g} s)")
    fig.tight_layout()
    path = os.path.join(out_dir, f"multiturn-load-{variant}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_multiturn(result: BenchResult, out_dir: str = DEFAULT_DIR) -> list[str]:
    """Every multi-turn plot the result has data for; the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [draw_ttft(result, out_dir)]
    paths += [draw_load(result, v, out_dir) for v in _variants(result)]
    return [p for p in paths if p]


def draw_stickiness(result: StickinessResult, out_dir: str = DEFAULT_DIR) -> list[str]:
    """``stickiness-slow.png`` when the result has slow-backend cells."""
    cells = [c for c in result.slow if c.windows]
    if not cells:
        return []
    os.makedirs(out_dir, exist_ok=True)
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True)
    for c in cells:
        xs = [w.end_s for w in c.windows]
        top.plot(xs, [w.ttft_p99_ms for w in c.windows], marker="o", markersize=3, label=c.policy)
        bottom.plot(xs, [w.slow_share * 100 for w in c.windows], marker="o", markersize=3, label=c.policy)
    for ax in (top, bottom):
        ax.axvline(cells[0].slowed_at_s, color="red", linestyle="--", linewidth=1)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    top.set_yscale("log")
    top.yaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    top.yaxis.set_minor_formatter(plt.matplotlib.ticker.ScalarFormatter())
    top.set_ylabel("TTFT p99 in the window (ms, log)")
    top.set_title(f"One of 2 backends slow from t = {cells[0].slowed_at_s:g} s (red line):\n{cells[0].slowdown}",
                  fontsize=10)
    bottom.set_ylabel("requests served by the slowed backend (%)")
    bottom.set_xlabel("end of the window (s)")
    bottom.set_ylim(-2, 102)
    fig.tight_layout()
    path = os.path.join(out_dir, "stickiness-slow.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def draw_file(path: str, out_dir: str = DEFAULT_DIR) -> list[str]:
    """The plots of a results JSON written by ``bench.multiturn`` or ``bench.stickiness``."""
    with open(path, "rb") as fh:
        raw = fh.read()
    kind = msgspec.json.decode(raw, type=dict[str, Any]).get("benchmark", "multiturn")
    if kind == "stickiness":
        from bench.stickiness import StickinessResult

        return draw_stickiness(msgspec.json.decode(raw, type=StickinessResult), out_dir)
    from bench.multiturn import BenchResult

    return draw_multiturn(msgspec.json.decode(raw, type=BenchResult), out_dir)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a JSON results file of bench.multiturn or bench.stickiness")
    p.add_argument("--out", default=DEFAULT_DIR, help="directory for the PNGs (default bench/plots)")
    args = p.parse_args(argv)
    paths = draw_file(args.results, args.out)
    if not paths:
        print(f"{args.results}: nothing to draw (multiturn: run it with --records for the TTFT plot)", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
