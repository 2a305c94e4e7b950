"""Latency and throughput over time (PNG, matplotlib's Agg backend) from Locust's
``--csv-full-history`` file (``PREFIX_stats_history.csv``: one row per endpoint and one
``Aggregated`` row about every second; its percentiles cover Locust's last 10 s window)."""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Series:
    """One endpoint's history: time (s since the first row), requests/s, failures/s, p95 and p99 (ms)."""

    t: list[float] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)
    fps: list[float] = field(default_factory=list)
    p95: list[float | None] = field(default_factory=list)
    p99: list[float | None] = field(default_factory=list)


def _series(history_csv: Path) -> tuple[dict[str, Series], list[float], list[float]]:
    """``({endpoint key: Series}, aggregate times, user counts)``."""
    series: dict[str, Series] = defaultdict(Series)
    users_t: list[float] = []
    users: list[float] = []
    t0: float | None = None

    def num(raw: str | None) -> float | None:
        raw = (raw or "").strip()
        return None if not raw or raw == "N/A" else float(raw)

    with history_csv.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            ts = num(row.get("Timestamp"))
            if ts is None:
                continue
            t0 = ts if t0 is None else t0
            t = ts - t0
            key = f"{row['Type']} {row['Name']}".strip() if row.get("Type") else row["Name"]
            s = series[key]
            s.t.append(t)
            s.rps.append(num(row.get("Requests/s")) or 0.0)
            s.fps.append(num(row.get("Failures/s")) or 0.0)
            s.p95.append(num(row.get("95%")))
            s.p99.append(num(row.get("99%")))
            if key == "Aggregated":
                users_t.append(t)
                users.append(num(row.get("User Count")) or 0.0)
    return series, users_t, users


def render(history_csv: Path | str, out_dir: Path | str, title: str = "") -> list[Path]:
    """Write ``latency.png`` (p95 and p99 per endpoint, log scale) and ``throughput.png``
    (requests/s per endpoint, failures/s of all, Locust users on a second axis) into ``out_dir``;
    returns their paths ([] when the history has no rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series, users_t, users = _series(Path(history_csv))
    if not series:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    endpoints = sorted(k for k in series if k != "Aggregated")
    paths: list[Path] = []

    fig, axes = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    for ax, pct in zip(axes, ("p95", "p99"), strict=True):
        for key in endpoints:
            values = series[key].p95 if pct == "p95" else series[key].p99
            pts = [(t, v) for t, v in zip(series[key].t, values, strict=True) if v]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key, linewidth=1.2)
        ax.set_yscale("log")
        ax.set_ylabel(f"{pct} response time (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_title(f"Latency per endpoint (last 10 s window) {title}".strip())
    axes[1].set_xlabel("seconds since the first sample")
    axes[0].legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 5))
    for key in endpoints:
        ax.plot(series[key].t, series[key].rps, label=key, linewidth=1.2)
    if "Aggregated" in series:
        agg = series["Aggregated"]
        ax.plot(agg.t, agg.fps, label="failures/s (all)", color="red", linestyle="--")
    ax.set_ylabel("requests/s")
    ax.set_xlabel("seconds since the first sample")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    if users:
        ax2 = ax.twinx()
        ax2.plot(users_t, users, color="black", linewidth=2, alpha=0.4, label="Locust users")
        ax2.set_ylabel("Locust users (people + node agents)")
    ax.set_title(f"Throughput per endpoint {title}".strip())
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths
