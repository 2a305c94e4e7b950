"""A run started from the Prefect form reaches its final state after the platform restarts under it.

The form's flow run (deployment ``apiary-job/submit``) submits its job and follows it in the
``prefect-serve`` process; the bridge attaches the job's lifecycle to that run and leaves its end
to the flow. A restart of the platform (every child stopped, a new platform on the same home)
ends that process, so nothing follows the job any more: the run must still end with the job's
state when the job is then stopped (Cancelled), as the bridge's state table says.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tests.support.builders import LAB6
from tests.support.polling import nodes_ready, until

from apiary.client import Tenants
from apiary.embedded import REPO_ROOT, Embedded

pytestmark = [pytest.mark.e2e, pytest.mark.prefect]

CLUSTER = LAB6 / "hived-config-two-vcs.yaml"


def _platform(home: Path) -> tuple[Embedded, Tenants]:
    p = Embedded(home=home, cluster=CLUSTER, prefect=True, workdir=str(REPO_ROOT))
    p.start()
    p.start_supervisor(period_s=0.2)
    c = Tenants(p.client())
    until(lambda: nodes_ready(c, 2), 120, "node agents")
    return p, c


def _prefect(p: Embedded, coro_fn):
    """``coro_fn(client)`` with a client of ``p``'s Prefect server (its URL changes with a restart)."""
    from prefect.client.orchestration import PrefectClient

    assert p.prefect_server is not None

    async def main():
        async with PrefectClient(p.prefect_server.api_url, auth_string=p.prefect_auth_string) as client:
            return await coro_fn(client)

    return asyncio.run(main())


def _try(fn):
    try:
        return fn()
    except Exception:
        return None


def _run(p: Embedded, run_id):
    return _try(lambda: _prefect(p, lambda cl: cl.read_flow_run(run_id)))


def test_form_run_ends_cancelled_when_its_job_is_stopped_after_a_restart(tmp_path):
    home = tmp_path / "home"
    p, c = _platform(home)
    try:
        c.create_user("dave")
        role = {"name": "train", "instances": 1, "gpus": 1, "cpu": 2, "memory_mb": 4096, "image": "python:3.11",
                "commands": ["sleep 900"]}
        params = {"name": "restarted", "user": "dave", "virtual_cluster": "vc1", "priority_class": "prod",
                  "task_roles": [role]}

        async def create(client):
            deployment = await client.read_deployment_by_name("apiary-job/submit")
            return await client.create_flow_run_from_deployment(deployment.id, parameters=params)

        run = until(lambda: _try(lambda: _prefect(p, create)), 120, "the apiary-job/submit deployment")
        job = until(lambda: (j := _try(lambda: c.get("dave~restarted"))) and j["state"] == "RUNNING" and j, 180,
                    "the form's job running")
        assert job["flowRunId"] == str(run.id)
        until(lambda: (r := _run(p, run.id)) is not None and r.state_name == "Running", 120, "the form run Running")
    finally:
        p.stop()

    p, c = _platform(home)  # `apiary up` again on the same home
    try:
        job = c.get("dave~restarted")
        assert job["flowRunId"] == str(run.id)
        if job["state"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
            c.stop("dave~restarted")
        job = c.wait("dave~restarted", timeout=180)
        assert job["state"] == "STOPPED"
        final = until(lambda: (r := _run(p, run.id)) is not None and r.state is not None and r.state.is_final()
                      and r, 180, "the form run to reach its final state")
        assert final.state_name == "Cancelled", (final.state_name, final.state.message)
        assert "job STOPPED" in (final.state.message or "")
    finally:
        p.stop()
