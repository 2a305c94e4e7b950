"""A load result as Prefect artifacts (for the flows that run load tests, e.g. the chaos drills).

:func:`publish_artifacts` creates, in the current flow run (or unattached outside one):

* a **table artifact** ``<key>-gates``: one row per gate check (endpoint, metric, measured,
  threshold, PASS/FAIL, note), the run's verdict in its description;
* a **markdown artifact** ``<key>-report``: the verdict, the jobs check, the per-endpoint numbers
  and the plots embedded as base64 ``data:image/png`` URIs. Prefect's ``create_image_artifact``
  only takes an image URL, which the UI's browser must be able to fetch; the output folder usually
  is not served, so the PNGs travel inside the markdown (as ``flows/whatif.py`` does), and their
  file paths are listed under them. The Prefect UI renders both.

Importable without Locust or a Prefect server: Prefect is imported when :func:`publish_artifacts`
runs, and :func:`table_rows` / :func:`markdown` are pure.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from apiary.load.runner import LoadResult


def artifact_key(text: str) -> str:
    """``text`` as a Prefect artifact key (lowercase letters, digits and dashes only)."""
    key = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return re.sub(r"-{2,}", "-", key) or "load"


def table_rows(result: LoadResult) -> list[dict[str, Any]]:
    """The gate rows, as the table artifact shows them."""
    return [
        {"endpoint": r.endpoint, "metric": r.metric,
         "measured": None if r.measured is None else round(r.measured, 4), "threshold": r.threshold,
         "result": r.verdict, "note": r.note}
        for r in result.rows
    ]


def _png(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f"![{path.stem}](data:image/png;base64,{data})\n\n`{path}`\n"


def markdown(result: LoadResult, embed_plots: bool = True) -> str:
    """The report: verdict, jobs, per-endpoint numbers, and the plots (embedded when ``embed_plots``)."""
    j = result.jobs
    failed = [r for r in result.rows if not r.passed]
    lines = [
        f"# Load test `{result.profile}`: {'PASS' if result.passed else 'FAIL'}",
        "",
        f"{result.users} people and {result.agents} simulated node agents for {result.duration_s:g} s against "
        f"`{result.target}` (VC `{result.virtual_cluster}`), gates `{result.gates_file}`.",
        "",
        f"Jobs: {j.accepted} accepted (202), {j.listed} listed afterwards, {len(j.lost)} lost.",
        "",
    ]
    if failed:
        lines += ["Failed gates:", ""]
        lines += [f"- {r.endpoint} {r.metric}: {r.measured if r.measured is not None else '-'} "
                  f"(threshold {r.threshold}) {r.note}".rstrip() for r in failed]
        lines.append("")
    if result.failures:
        lines += ["Most frequent errors:", ""]
        lines += [f"- {f.occurrences} x `{f.endpoint}`: {f.error[:300]}" for f in result.failures[:10]]
        lines.append("")
    lines += ["| endpoint | requests | failures | p50 ms | p95 ms | p99 ms | req/s |", "|---|---|---|---|---|---|---|"]
    for e in result.endpoints:
        lines.append(f"| `{e.key}` | {e.requests} | {e.failures} | {e.p50_ms} | {e.p95_ms} | {e.p99_ms} | "
                     f"{e.rps:.2f} |")
    lines += ["", f"Raw output: `{result.out_dir}` (Locust's `stats.json`, `locust_stats.csv`, "
                  "`locust_stats_history.csv`, `locust.log`).", ""]
    for p in result.plots:
        if embed_plots and p.exists():
            lines += [f"## {p.stem}", "", _png(p)]
        else:
            lines.append(f"- `{p}`")
    return "\n".join(lines) + "\n"


def publish_artifacts(result: LoadResult, key: str | None = None) -> dict[str, Any]:
    """Create the table and markdown artifacts (see the module doc) with keys ``<key>-gates`` and
    ``<key>-report`` (default key ``load-<profile>``); returns ``{"gates": id, "report": id}``.
    Needs a Prefect API (a flow run's, or ``PREFECT_API_URL``)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    base = artifact_key(key or f"load-{result.profile}")
    verdict = "PASS" if result.passed else "FAIL"
    gates_id = create_table_artifact(
        table=table_rows(result), key=f"{base}-gates",
        description=f"Load gates {result.profile}: {verdict} ({sum(not r.passed for r in result.rows)} failed of "
                    f"{len(result.rows)})",
    )
    report_id = create_markdown_artifact(
        markdown=markdown(result), key=f"{base}-report",
        description=f"Load test {result.profile}: {verdict}, latency and throughput plots",
    )
    return {"gates": gates_id, "report": report_id}
