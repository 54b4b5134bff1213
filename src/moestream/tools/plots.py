"""The pictures a user looks at to choose a budget: hit rate against budget per policy with the optimum,
expert popularity per layer, and the reuse distance histogram. PNG files, drawn with matplotlib's Agg
backend (no display needed); matplotlib is an optional dependency (`pip install moestream[plot]`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import UsageError
from ..units import format_bytes
from .trace import Trace, popularity, reuse_distances

if TYPE_CHECKING:  # (plots draw results; simulate computes them and calls plots: no import back)
    from .simulate import SimResult


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'moestream[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: works without a display, and never opens a window
    import matplotlib.pyplot as plt

    return plt


def plot_hit_rates(trace: Trace, rows: list[list[SimResult]], path: Path) -> Path:
    plt = _pyplot()
    records = int(trace.layer_experts.sum())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(r.policy for r in rows[0]):
        points = sorted((row[i].slots, row[i].hit_rate) for row in rows)
        x = [100 * s / records for s, _ in points]
        ax.plot(
            x,
            [h for _, h in points],
            "k--" if name == "belady" else "-",
            marker="o",
            markersize=3,
            label="Belady (optimum)" if name == "belady" else name,
        )
    ax.set_xlabel(f"expert cache, % of all {records} experts ({format_bytes(trace.slot_bytes)} each)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend()
    top = ax.secondary_xaxis(
        "top",
        functions=(
            lambda p: p * records * trace.slot_bytes / 100 / 2**20,
            lambda m: m * 2**20 * 100 / (records * trace.slot_bytes),
        ),
    )
    top.set_xlabel("budget, MiB")
    ax.set_title(f"{trace.meta.get('model_type', '')}: {trace.tokens} tokens", fontsize=10, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_popularity(trace: Trace, path: Path) -> Path:
    plt = _pyplot()
    counts = popularity(trace)
    share = counts / np.maximum(1, counts.sum(axis=1, keepdims=True))
    flat = np.sort(counts.reshape(-1))[::-1]
    top10 = flat[: max(1, len(flat) // 10)].sum() / max(1, flat.sum())
    fig, ax = plt.subplots(figsize=(9, 0.35 * trace.layers + 1.8))
    image = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=ax, label="share of the layer's expert uses")
    ax.set_xlabel("expert id")
    ax.set_ylabel("MoE layer")
    ax.set_title(f"expert popularity: the top 10% of experts take {top10:.1%} of the uses", fontsize=10, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_reuse(trace: Trace, path: Path) -> Path:
    plt = _pyplot()
    distances = reuse_distances(trace)
    reuses = distances[distances >= 0]
    records = int(trace.layer_experts.sum())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bins = np.unique(np.geomspace(1, max(2, records), 40).astype(int))
    ax.hist(reuses + 1, bins=bins, color="tab:blue", alpha=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("reuse distance + 1: distinct experts looked up since this expert's last use")
    ax.set_ylabel("expert uses")
    cumulative = ax.twinx()
    xs = np.arange(1, records + 1)
    # Uses with distance < C are the ones an LRU cache of C slots keeps (pins aside): the LRU hit-rate curve.
    sorted_d = np.sort(reuses)
    cumulative.plot(xs, np.searchsorted(sorted_d, xs, side="left") / len(distances), "k-", label="hit rate of LRU with C slots")
    cumulative.set_ylim(0, 1)
    cumulative.set_ylabel("share of all uses with distance < C")
    cumulative.legend(loc="upper left")
    cold = (distances < 0).mean()
    ax.set_title(f"reuse distance ({cold:.1%} of uses are first uses, never hits)", fontsize=10, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(trace: Trace, rows: list[list[SimResult]], directory: str | Path) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return [
        plot_hit_rates(trace, rows, directory / "hit_rate_vs_budget.png"),
        plot_popularity(trace, directory / "expert_popularity.png"),
        plot_reuse(trace, directory / "reuse_distance.png"),
    ]
