"""Prefect flow ``what-if-replay``: replay a job trace under several scheduling policies from the UI.

Thin: the replay and the report are :func:`apiary.sim.report.whatif`.  Artifacts: a table artifact
``what-if-summary`` (one row per policy) and one markdown artifact per plot with the PNG embedded
as a base64 ``data:image/png`` URI (the file path is printed under it).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from apiary.sim.report import whatif


@flow(name="what-if-replay", persist_result=False)
def what_if_replay(
    trace: str,
    cluster: str | None = None,
    machines: str | None = None,
    policies: list[str] | None = None,
    limit: int | None = None,
    out_dir: str | None = None,
) -> dict:
    """Replay ``trace`` on ``cluster`` (HiveD config) or ``machines`` (machine list CSV) under ``policies``
    (default hived, quota, fifo), the first ``limit`` jobs only when given; returns the metrics JSON."""
    log = get_run_logger()
    report = whatif(trace, cluster=cluster, machines=machines, policies=policies or ["hived", "quota", "fifo"],
                    limit=limit, out_dir=out_dir)
    create_table_artifact(key="what-if-summary", table=report["rows"],
                          description=f"What-if replay of {trace} ({report['doc']['trace']['jobs']} jobs)")
    for i, (title, md) in enumerate(report["plots"].items()):
        create_markdown_artifact(key=f"what-if-plot-{i}", markdown=md, description=title)
    for row in report["rows"]:
        log.info("policy=%s jobs=%s wall_s=%s delay_mean_s=%s anomaly_s=%s", row["policy"], row["jobs"],
                 row["wall_s"], row["queue_delay_mean_s"], row["sharing_anomaly_s"])
    return report["doc"]
