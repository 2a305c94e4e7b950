"""Prefect flows of the drills (AI-System 7.6.3.3), served on cron schedules by ``flows/serve.py``.

=================  ======================  ==================================================
flow               schedule (UTC)          what (logic: :mod:`apiary.drills.run`)
=================  ======================  ==================================================
``inspection``     every 5 minutes         a tiny opportunistic job per VC against the SLO
``stress-drill``   nightly, 02:00          a benchmark job per node, diagnosed; cordons
``chaos-drill``    weekly, Tue 10:00       the chaos experiments tagged for drills, guarded
``load-drill``     weekly, Sun 03:00       the smoke load profile, guarded
=================  ======================  ==================================================

Thin: each flow calls its drill, which reports the result to the control plane
(``apiary_drill_*`` / ``apiary_probe_*`` in ``/metrics``), and publishes a table artifact (key =
the drill's name) plus its plots as markdown artifacts. A drill that did not pass ends its flow
run Failed, with the drill's summary as the message.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Completed, Failed, State

from apiary.drills import run
from apiary.drills.common import DrillOutcome


def _publish(outcome: DrillOutcome) -> State:
    """Artifacts of ``outcome`` and the run's final state."""
    log = get_run_logger()
    create_table_artifact(key=outcome.drill, table=outcome.rows or [{"result": outcome.result}],
                          description=f"{outcome.drill}: {outcome.result} - {outcome.summary}"[:5000])
    for i, (title, markdown) in enumerate(outcome.plots.items()):
        create_markdown_artifact(key=f"{outcome.drill}-plot-{i}", markdown=markdown, description=title)
    if outcome.details.get("reportError"):
        log.error("result not recorded by the control plane: %s", outcome.details["reportError"])
    log.info("drill=%s result=%s %s", outcome.drill, outcome.result, outcome.summary)
    data: dict[str, Any] = {"drill": outcome.drill, "result": outcome.result, "summary": outcome.summary,
                            "rows": outcome.rows}
    if outcome.passed:
        return Completed(message=outcome.summary[:1000], data=data)
    return Failed(message=f"{outcome.result}: {outcome.summary}"[:1000], data=data)


@flow(name="inspection", persist_result=False)
def inspection(api_url: str | None = None, virtual_clusters: list[str] | None = None,
               slo_s: float | None = None) -> State:
    """Probe every VC (or ``virtual_clusters``) with a tiny opportunistic job against ``slo_s``
    (default APIARY_DRILL_PROBE_SLO_S, 120 s)."""
    return _publish(run.inspection(api_url, virtual_clusters=virtual_clusters, slo_s=slo_s))


@flow(name="stress-drill", persist_result=False)
def stress_drill(api_url: str | None = None, nodes: list[str] | None = None, cordon: bool | None = None,
                 timeout_s: float | None = None) -> State:
    """Benchmark every node (or ``nodes``), diagnose, and cordon the nodes that fail (unless
    ``cordon`` is false)."""
    return _publish(run.stress_drill(api_url, nodes=nodes, cordon=cordon, timeout_s=timeout_s))


@flow(name="chaos-drill", persist_result=False)
def chaos_drill(api_url: str | None = None, experiments: list[str] | None = None, timeout_s: float = 300.0,
                allow_disruptive: bool = False) -> State:
    """The chaos experiments tagged for drills (or ``experiments`` by name), each under the
    steady-state guard."""
    return _publish(run.chaos_drill(api_url, experiments=experiments, timeout_s=timeout_s,
                                    allow_disruptive=allow_disruptive))


@flow(name="load-drill", persist_result=False)
def load_drill(api_url: str | None = None, profile: str = "smoke", duration_s: float | None = None) -> State:
    """The load ``profile`` (default smoke) for ``duration_s`` (default: the profile's), guarded."""
    return _publish(run.load_drill(api_url, profile=profile, duration_s=duration_s))
