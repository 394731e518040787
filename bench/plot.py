"""The comparison figure: TTFT CDF per configuration (one panel per rate factor, first run) and
goodput bars (median over runs, with the min-max range as error bars); the sweep's heat maps.
Agg backend: no display."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from bench.compare import Measurement
from bench.sweep import DIVERGE, SweepPoint, ratios

__all__ = ["plot_compare", "plot_sweep", "ttft_cdf"]


def ttft_cdf(ttft_s: Sequence[float], sent: int) -> tuple[np.ndarray, np.ndarray]:
    """The TTFT CDF of the served requests over every request sent: a curve tops out at the share
    served (until 2026-12-06 it reached 1.0 for a configuration that refused a tenth)."""
    ttfts = np.sort(np.asarray(ttft_s, dtype=float))
    return ttfts, np.arange(1, len(ttfts) + 1) / max(sent, len(ttfts), 1)


def plot_compare(ms: Sequence[Measurement], path: str | Path, *, title: str = "") -> Path:
    if not ms:
        raise ValueError("nothing to plot: no measurements")
    rates = sorted({m.rate for m in ms})
    configs = list(dict.fromkeys(m.configuration for m in ms))
    fig, axes = plt.subplots(1, len(rates) + 1, figsize=(5.5 * (len(rates) + 1), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=False):
        for config in configs:
            first = min(
                (m for m in ms if m.rate == rate and m.configuration == config), key=lambda m: m.run, default=None
            )
            if first is None or not first.ttft_s:
                continue
            ax.step(*ttft_cdf(first.ttft_s, first.summary.requests), where="post", label=config)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, simulated)")
        ax.set_ylabel("fraction of requests sent")
        ax.set_title(f"TTFT CDF, rate x{rate:g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    bars = axes[0][-1]
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        mids, lows, highs = [], [], []
        for rate in rates:
            values = [m.summary.goodput_rps for m in ms if m.rate == rate and m.configuration == config]
            mid = statistics.median(values) if values else 0.0
            mids.append(mid)
            lows.append(mid - min(values, default=0.0))
            highs.append(max(values, default=0.0) - mid)
        x = np.arange(len(rates)) + (i - (len(configs) - 1) / 2) * width
        bars.bar(x, mids, width, yerr=[lows, highs], capsize=2, label=config)
    bars.set_xticks(np.arange(len(rates)), [f"x{r:g}" for r in rates])
    bars.set_xlabel("rate factor")
    bars.set_ylabel("goodput (req/s within SLO, simulated)")
    bars.set_title("goodput")
    bars.legend(fontsize=8)
    return _save(fig, path, title)


def plot_sweep(points: Sequence[SweepPoint], policy: str, path: str | Path, *, title: str = "") -> Path:
    """Two heat maps, fleet x load: round_robin / kv TTFT p90, and the policy's goodput over the
    better fixed mode (max of kv and kv_disagg); cells where the fixed modes diverge are framed."""
    if not points:
        raise ValueError("nothing to plot: no sweep points")
    cells = ratios(points, policy)
    fleets = list(dict.fromkeys(name for name, _ in cells))
    rates = sorted({rate for _, rate in cells})
    fig, axes = plt.subplots(1, 2, figsize=(5.0 + 1.1 * len(rates) * 2, 1.4 + 0.6 * len(fleets)), squeeze=False)
    panels = [
        ("kv/rr", "round_robin / kv TTFT p90 (target >= 3x)", "viridis", None),
        ("policy/best", f"{policy} goodput / best fixed mode (target >= 1.15x)", "RdYlGn", (0.5, 1.5)),
    ]
    for ax, (key, label, cmap, limits) in zip(axes[0], panels, strict=True):
        grid = np.full((len(fleets), len(rates)), np.nan)
        for (fleet, rate), cell in cells.items():
            value = cell[key]
            if value is not None:
                grid[fleets.index(fleet), rates.index(rate)] = value
        vmin, vmax = limits if limits is not None else (np.nanmin(grid), np.nanmax(grid))
        image = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        for i, fleet in enumerate(fleets):
            for j, rate in enumerate(rates):
                value = grid[i, j]
                if not np.isnan(value):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=9)
                diverge = cells[fleet, rate]["diverge"]
                if key == "policy/best" and diverge is not None and diverge > DIVERGE:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2, ec="black"))
        ax.set_xticks(range(len(rates)), [f"x{r:g}" for r in rates])
        ax.set_yticks(range(len(fleets)), fleets)
        ax.set_xlabel("load (x the trace's arrival rate)")
        ax.set_title(label, fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    return _save(fig, path, title)


def _save(fig: Figure, path: str | Path, title: str) -> Path:
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
