"""Prefect flow ``what-if-replay``: replay a job trace under several scheduling policies from the UI.

Thin: the replay and the report are :func:`apiary.sim.report.whatif`.  Artifacts: a table artifact
``what-if-summary`` (one row per policy) and one markdown artifact per plot with the PNG embedded
as a base64 ``data:image/png`` URI (the file path is printed under it).

What a run from the UI may read. It calls no API and holds no token, but its parameters are paths
on the serving host, chosen by whoever holds the Prefect password. So a path inside
``APIARY_HOME`` (the platform's tokens, store and logs) is refused, for reading or as ``out_dir``,
and an input the replay refuses fails the run without the replay's reason (which may quote the
file: a token, a password hash); that reason goes to the serving process's own log only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from apiary.errors import ApiaryError, UserError
from apiary.sim.report import whatif

#: The serving process's own log (``apiary up``'s log file), never the flow run's.
local_log = logging.getLogger("apiary.flows.whatif")


def outside_home(field: str, value: str | None) -> str | None:
    """``value`` resolved to an absolute path; :class:`~apiary.errors.UserError` naming ``field``
    when it lies inside ``APIARY_HOME`` (:attr:`apiary.settings.Settings.home_dir`)."""
    if value is None:
        return None
    from apiary.settings import Settings

    path = Path(value).expanduser().resolve()
    home = Settings().home_dir.resolve()
    if path == home or home in path.parents:
        raise UserError(f"{field}: {value} is inside APIARY_HOME, which holds the platform's secrets; "
                        f"use a file of your own")
    return str(path)


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
    (default hived, quota, fifo), the first ``limit`` jobs only when given; returns the metrics JSON.

    Raises :class:`~apiary.errors.UserError` for a path inside ``APIARY_HOME`` (naming the field) and
    for an input the replay refuses (naming the field, not quoting the file)."""
    log = get_run_logger()
    paths = {k: outside_home(k, v) for k, v in
             (("trace", trace), ("cluster", cluster), ("machines", machines), ("out_dir", out_dir))}
    try:
        report = whatif(paths["trace"] or trace, cluster=paths["cluster"], machines=paths["machines"],
                        policies=policies or ["hived", "quota", "fifo"], limit=limit, out_dir=paths["out_dir"])
    except (ApiaryError, OSError, ValueError) as exc:
        local_log.warning("what-if replay refused its input: %s", exc)
        where = getattr(exc, "field", "") or "trace, cluster or machines"
        raise UserError(f"{where}: the replay could not use this input ({type(exc).__name__}); its reason may "
                        f"quote the file, so it is in the Prefect serving process's log, not here") from None
    create_table_artifact(key="what-if-summary", table=report["rows"],
                          description=f"What-if replay of {trace} ({report['doc']['trace']['jobs']} jobs)")
    for i, (title, md) in enumerate(report["plots"].items()):
        create_markdown_artifact(key=f"what-if-plot-{i}", markdown=md, description=title)
    for row in report["rows"]:
        log.info("policy=%s jobs=%s wall_s=%s delay_mean_s=%s anomaly_s=%s", row["policy"], row["jobs"],
                 row["wall_s"], row["queue_delay_mean_s"], row["sharing_anomaly_s"])
    return report["doc"]
