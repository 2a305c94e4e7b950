"""The four drills as Prefect deployments served by ``apiary up`` (a real Prefect server, Lab 6's
two-VC cluster): each is a deployment with its cron schedule, and one run of each, created through
Prefect's API as the UI's Run button does, ends with its table artifact and its result in the
control plane's /metrics. The smallest configurations: one quick chaos experiment
(``gpu-oom-job``), a 10-second smoke load.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.support.builders import LAB6
from tests.support.polling import nodes_ready, until

from apiary.client import Tenants
from apiary.embedded import REPO_ROOT, Embedded

pytestmark = [pytest.mark.e2e, pytest.mark.prefect]

SCHEDULES = {
    "inspection/inspection": "*/5 * * * *",
    "stress-drill/nightly": "0 2 * * *",
    "chaos-drill/weekly": "0 10 * * 2",
    "load-drill/weekly": "0 3 * * 0",
}
RUNS = {
    "inspection/inspection": {"slo_s": 90},
    "stress-drill/nightly": {"cordon": False, "timeout_s": 150},
    "chaos-drill/weekly": {"experiments": ["gpu-oom-job"], "timeout_s": 240},
    "load-drill/weekly": {"duration_s": 10},
}


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    home = tmp_path_factory.mktemp("apiary")
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME", "DO_NOT_TRACK")}
    p = Embedded(home=home, cluster=LAB6 / "hived-config-two-vcs.yaml", prefect=True, workdir=str(REPO_ROOT),
                 drill_schedules=True)
    p.start()
    p.start_supervisor(period_s=0.2)
    until(lambda: nodes_ready(Tenants(p.client()), 2), 60, "node agents")
    yield p
    p.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def prefect(p: Embedded, coro_fn):
    from prefect.client.orchestration import PrefectClient

    async def main():
        async with PrefectClient(p.prefect_server.api_url, auth_string=p.prefect_auth_string) as client:
            return await coro_fn(client)

    return asyncio.run(main())


def _try(fn):
    try:
        return fn()
    except Exception:  # not served yet: prefect-serve registers the deployments after it starts
        return None


def test_the_drills_are_scheduled_deployments_and_a_run_of_each_ends_with_its_artifacts(platform) -> None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    p = platform

    async def deployments(client):
        return {name: await client.read_deployment_by_name(name) for name in SCHEDULES}

    found = until(lambda: _try(lambda: prefect(p, deployments)), 120, "the drill deployments")
    assert {n: [s.schedule.cron for s in d.schedules] for n, d in found.items()} == {
        n: [cron] for n, cron in SCHEDULES.items()}
    assert all(s.active for d in found.values() for s in d.schedules)

    # One after another, as their schedules run them: the stress drill's benchmarks compare the
    # simulated nodes with each other, and a load test beside them would skew the comparison.
    final = {}
    for name, params in RUNS.items():
        run = prefect(p, lambda client, n=name, pr=params: client.create_flow_run_from_deployment(found[n].id,
                                                                                               parameters=pr))
        final[name] = until(lambda r=run: (x := prefect(p, lambda client: client.read_flow_run(r.id))).state
                            and x.state.is_final() and x, 300, f"the {name} run to finish")
    states = {n: (r.state.type.value, r.state.message) for n, r in final.items()}
    assert states["inspection/inspection"][0] == "COMPLETED", states
    assert states["stress-drill/nightly"][0] == "COMPLETED", states

    async def artifacts(client):
        out = {}
        for n, r in final.items():
            arts = await client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[r.id])))
            out[n] = {a.key: a.type for a in arts}
        return out

    def all_published():
        got = prefect(p, artifacts)
        return got if all(got.values()) else None

    arts = until(all_published, 60, "the artifacts")
    assert arts["inspection/inspection"]["inspection"] == "table"
    assert arts["stress-drill/nightly"]["stress-drill"] == "table"
    assert arts["stress-drill/nightly"]["stress-drill-plot-0"] == "markdown"
    assert arts["chaos-drill/weekly"]["chaos-drill"] == "table"
    assert arts["load-drill/weekly"]["load-drill"] == "table"
    # Each run reported its result: the control plane's /metrics shows all four drills.
    text = p.client()._call("GET", "/metrics").text
    results = {s.labels["drill"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "apiary_drill_result"}
    assert set(results) == {"inspection", "stress-drill", "chaos-drill", "load-drill"}, results
    assert results["inspection"] == 1.0 and results["stress-drill"] == 1.0
    # The chaos and load drills ran (their runners' verdicts, not "could not run").
    for name in ("chaos-drill/weekly", "load-drill/weekly"):
        assert "could not run" not in (states[name][1] or ""), states
