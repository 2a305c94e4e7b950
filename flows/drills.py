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

Who a drill acts as, and what a run from the UI may do. The drills act as the admin
(:func:`apiary.drills.common.drill_token`): they cordon nodes, inject faults and run chaos
actions. That token stays in the serving process and goes only to the platform's configured URL
(``APIARY_API_URL``): no parameter names a URL or a token, and Prefect refuses a run with one.
Whoever holds the Prefect password may still press Run on a drill, so its parameters are bounded
to the drill the schedule runs: a subset of the VCs or nodes, or of the experiments tagged for
drills (``root`` and ``disrupts-guaranteed-jobs`` ones are for ``python -m apiary.drills`` on the
host only); cordoning turned off, never on when ``APIARY_DRILL_STRESS_CORDON`` is off; a known load
profile (at most 50 simulated people); times capped (:data:`MAX_PROBE_SLO_S` and the others: an
hour for the probe SLO and the stress wait, ten minutes per chaos experiment and per load run).
Anything else is refused before the drill starts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Completed, Failed, State
from pydantic import Field

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


#: Upper bounds of the drills' time parameters from the UI, seconds.
MAX_PROBE_SLO_S = 3600.0
MAX_STRESS_TIMEOUT_S = 3600.0
MAX_CHAOS_TIMEOUT_S = 600.0
MAX_LOAD_DURATION_S = 600.0
#: The load profiles a run may pick (:data:`apiary.load.profiles.PROFILES`).
LoadProfile = Literal["smoke", "ramp", "steady", "spike"]


@flow(name="inspection", persist_result=False)
def inspection(
    virtual_clusters: Annotated[list[str] | None, Field(description="Probe only these VCs (default: every VC).")]
    = None,
    slo_s: Annotated[float | None, Field(gt=0, le=MAX_PROBE_SLO_S,
                                         description="SLO, seconds (default APIARY_DRILL_PROBE_SLO_S, 120).")] = None,
) -> State:
    """Probe every VC (or ``virtual_clusters``) with a tiny opportunistic job against ``slo_s``
    (default APIARY_DRILL_PROBE_SLO_S, 120 s)."""
    return _publish(run.inspection(virtual_clusters=virtual_clusters, slo_s=slo_s))


@flow(name="stress-drill", persist_result=False)
def stress_drill(
    nodes: Annotated[list[str] | None, Field(description="Test only these nodes (default: every node).")] = None,
    cordon: Annotated[bool, Field(description="false: cordon none. true: cordon failed nodes as configured "
                                              "(APIARY_DRILL_STRESS_CORDON; never when it is off).")] = True,
    timeout_s: Annotated[float | None, Field(gt=0, le=MAX_STRESS_TIMEOUT_S,
                                             description="How long to wait for the benchmarks, seconds (default "
                                                         "APIARY_DRILL_STRESS_TIMEOUT_S, 900).")] = None,
) -> State:
    """Benchmark every node (or ``nodes``), diagnose, and cordon the nodes that fail (unless
    ``cordon`` is false, or the platform's setting is off)."""
    return _publish(run.stress_drill(nodes=nodes, cordon=None if cordon else False, timeout_s=timeout_s))


@flow(name="chaos-drill", persist_result=False)
def chaos_drill(
    experiments: Annotated[list[str] | None, Field(description="Run only these of the experiments tagged for "
                                                               "drills (default: all of them).")] = None,
    timeout_s: Annotated[float, Field(gt=0, le=MAX_CHAOS_TIMEOUT_S, description="Per experiment, seconds.")] = 300.0,
) -> State:
    """The chaos experiments tagged for drills (or those of them named in ``experiments``), each
    under the steady-state guard. Never the disruptive or ``root`` ones (the CLI's
    ``--allow-disruptive`` / ``--experiment`` on the host run those)."""
    return _publish(run.chaos_drill(experiments=experiments, timeout_s=timeout_s, tagged_only=True))


@flow(name="load-drill", persist_result=False)
def load_drill(
    profile: Annotated[LoadProfile, Field(description="The load profile.")] = "smoke",
    duration_s: Annotated[float | None, Field(gt=0, le=MAX_LOAD_DURATION_S,
                                              description="Seconds (default: the profile's).")] = None,
) -> State:
    """The load ``profile`` (default smoke) for ``duration_s`` (default: the profile's), guarded."""
    return _publish(run.load_drill(profile=profile, duration_s=duration_s))
