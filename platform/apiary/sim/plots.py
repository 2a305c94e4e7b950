"""Replay plots (PNG, matplotlib's Agg backend): queuing-delay CDF and GPU utilization over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(results: Sequence, out_dir: Path) -> list[Path]:
    """Write ``queue_delay_cdf.png`` and ``gpu_utilization.png`` into ``out_dir``; return their paths."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        d = np.sort(r.delays)
        if d.size == 0:
            continue
        y = np.arange(1, d.size + 1) / d.size
        ax.plot(np.maximum(d, 1.0), y, label=r.name)
    ax.set_xscale("log")
    ax.set_xlabel("queuing delay (s, values < 1 s drawn at 1 s)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("CDF of queuing delay per policy")
    ax.grid(True, alpha=0.3)
    ax.legend()
    p = out_dir / "queue_delay_cdf.png"
    fig.tight_layout()
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        tl = np.array(r.timeline, dtype=float)
        if tl.size == 0 or not r.total_gpus:
            continue
        t, busy = tl[:, 0], tl[:, 1] / r.total_gpus
        if t.size > 4000:  # time-weighted mean per bin keeps the plot light and honest
            edges = np.linspace(t[0], t[-1], 2001)
            ends = np.append(t[1:], t[-1])
            area = np.concatenate([[0.0], np.cumsum(busy * (ends - t))])
            at = np.interp(edges, np.append(t, t[-1]), area)
            width = np.diff(edges)
            busy = np.where(width > 0, np.diff(at) / np.where(width > 0, width, 1), 0)
            t = edges[:-1]
        ax.step(t / 86400.0, busy, where="post", label=r.name, linewidth=0.8)
    ax.set_xlabel("simulated time (days)")
    ax.set_ylabel("GPUs busy / total")
    ax.set_ylim(0, 1.05)
    ax.set_title("Cluster GPU utilization over time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    p = out_dir / "gpu_utilization.png"
    fig.tight_layout()
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths
