"""What-if report: a replay's summary table and its plots as markdown (for the Prefect flow and others).

Plots are embedded in the markdown as base64 ``data:image/png`` URIs, so the Prefect UI shows them
without access to the files; the PNG paths are returned too.
"""

from __future__ import annotations

import base64
import tempfile
from collections.abc import Sequence
from pathlib import Path

from apiary.sim.replay import POLICIES, replay


def summary_rows(doc: dict) -> list[dict]:
    rows = []
    for name, m in doc["policies"].items():
        rows.append({
            "policy": name,
            "jobs": m["jobs"],
            "rejected": m["rejected"],
            "wall_s": m["wall_s"],
            "queue_delay_mean_s": m["queue_delay_s"]["mean"],
            "queue_delay_p95_s": m["queue_delay_s"]["p95"],
            "queue_delay_p99_s": m["queue_delay_s"]["p99"],
            "jct_mean_s": m["jct_s"]["mean"],
            "jct_p95_s": m["jct_s"]["p95"],
            "gpu_utilization": m["gpu_utilization"],
            "preemptions": m["preemptions"],
            "sharing_anomaly_s": m["sharing_anomaly_s"],
        })
    return rows


def plot_markdown(path: Path, title: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f"### {title}\n\n![{title}](data:image/png;base64,{data})\n\n`{path}`\n"


def whatif(
    trace: str | Path,
    *,
    cluster: str | Path | None = None,
    machines: str | Path | None = None,
    policies: Sequence[str] = POLICIES,
    limit: int | None = None,
    out_dir: str | Path | None = None,
) -> dict:
    """Replay and build the report: ``{"doc": metrics JSON, "rows": table rows, "plots": {title: markdown},
    "plot_paths": [...]}``."""
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="apiary-whatif-"))
    doc, _ = replay(trace, cluster=cluster, machines=machines, policies=list(policies), limit=limit, plots=out)
    paths = [Path(p) for p in doc.get("plots", [])]
    titles = {"queue_delay_cdf.png": "CDF of queuing delay per policy",
              "gpu_utilization.png": "Cluster GPU utilization over time"}
    plots = {titles.get(p.name, p.name): plot_markdown(p, titles.get(p.name, p.name)) for p in paths}
    return {"doc": doc, "rows": summary_rows(doc), "plots": plots, "plot_paths": [str(p) for p in paths]}
