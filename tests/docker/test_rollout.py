"""Rolling a containerised platform forward (apiary.ci.rollout over apiary.ci.containers), for real.

Apiary's images are built once for the module (tag ``r1``, :func:`build_platform`, minutes). Two more
releases are made from them cheaply: ``r2`` re-tags r1 (another name, the same content: enough to
prove the mechanics) and ``r2-broken`` is the r1 control plane with an entrypoint that exits 1. The
production platforms run the docker runtime (tasks are sibling containers, pulled through the image
map from the session's registry), the Prefect bridge against a Prefect URL that does not answer (it
backs off and keeps running), and Lab 6's two-VC cluster.
"""

from __future__ import annotations

import io
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.support.builders import LAB6, job_text
from tests.support.polling import nodes_ready, task_running, until

from apiary.ci.containers import CLUSTER_LABEL, PLATFORM_LABEL, ContainerPlatform, PlatformImages
from apiary.ci.rollout import rollout
from apiary.client import ApiaryClient
from apiary.images.build import build_platform, push
from apiary.tracking.prefect_server import free_port

pytestmark = [pytest.mark.docker, pytest.mark.e2e, pytest.mark.timeout(1500)]

#: Seconds each phase took, printed at the end of the module (pytest -s or -rA shows them).
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def report_timings() -> Iterator[None]:
    yield
    print("\nrollout timings (s): " + ", ".join(f"{k}={v:.1f}" for k, v in TIMINGS.items()))


@pytest.fixture(scope="module")
def releases(docker_client: Any, registry: Any) -> dict[str, PlatformImages]:
    """``r1`` (built), ``r2`` (r1 re-tagged) and ``broken`` (r2 with a control plane that exits 1)."""
    t0 = time.monotonic()
    build_platform(docker_client, registry.address, "r1")
    TIMINGS["build_platform"] = time.monotonic() - t0
    r1 = PlatformImages.from_registry(registry.address, "r1")
    r2 = PlatformImages.from_registry(registry.address, "r2")
    for old, new in zip(r1.as_dict().values(), r2.as_dict().values(), strict=True):
        docker_client.images.get(old).tag(*new.rsplit(":", 1))
        push(docker_client, new)
    broken_cp = f"{registry.address}/apiary/control-plane:r2-broken"
    dockerfile = (f"FROM {r1.control_plane}\n"
                  'ENTRYPOINT ["/bin/sh", "-c", "echo broken control plane r2 >&2; exit 1", "--"]\n')
    docker_client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=broken_cp, rm=True, network_mode="host")
    push(docker_client, broken_cp)
    return {"r1": r1, "r2": r2, "broken": PlatformImages(broken_cp, r2.agent, r2.prefect)}


@pytest.fixture
def production(docker_client: Any, registry: Any, mnist_image: str, releases: dict[str, PlatformImages],
               tmp_path: Path) -> Iterator[ContainerPlatform]:
    """A production platform at r1 with the docker runtime and a bridge, nodes ready; torn down after
    the test, and then no container of it (components or tasks) may be left."""
    name = f"prod-{uuid.uuid4().hex[:8]}"
    p = ContainerPlatform(docker_client, name, tmp_path / "home", free_port(),
                          cluster_config=LAB6 / "hived-config-two-vcs.yaml", agent_runtime="docker",
                          registry=registry.address, prefect_api_url=f"http://127.0.0.1:{free_port()}/api")
    try:
        t0 = time.monotonic()
        p.start(releases["r1"])
        until(lambda: nodes_ready(admin(p), 2), 120, "the agent's nodes")
        TIMINGS.setdefault("start", time.monotonic() - t0)
        yield p
    finally:
        cluster = p.cluster_id()
        p.teardown()
        assert leftovers(docker_client, PLATFORM_LABEL, name) == []
        if cluster:
            assert leftovers(docker_client, CLUSTER_LABEL, cluster) == []


def leftovers(client: Any, label: str, value: str) -> list[str]:
    return [c.name for c in client.containers.list(all=True, filters={"label": f"{label}={value}"})]


def admin(p: ContainerPlatform) -> ApiaryClient:
    return ApiaryClient(p.url, token=p.admin_token())


def long_job(name: str, sleep_s: int) -> str:
    """Lab 6's job-config-0 (VC vc1, the mnist image through the image map) sleeping ``sleep_s``."""
    return job_text(0, name=name, taskRoles__train__commands=[f"sleep {sleep_s}", "echo survived"])


#: The canary: a one-line job in VC default, so it never waits for the long job's vc1 cell.
CANARY = job_text(0, name="canary", taskRoles__train__commands=["echo canary"],
                  defaults={"virtualCluster": "default"})


def test_rollout_to_r2_keeps_a_running_job(production, releases):
    p, api = production, admin(production)
    job = api.submit(long_job("survivor", 60))["id"]
    until(lambda: task_running(api, job), 180, "the long job to run")
    t0 = time.monotonic()
    result = rollout(p, releases["r2"], sha="r2", actor="test", canary_job=CANARY, gate_timeout_s=120)
    TIMINGS["rollout_r2"] = time.monotonic() - t0
    record = result.to_record()
    assert result.result == "succeeded", record
    assert [(s["component"], s["gate"], s["ok"]) for s in record["steps"]] == [
        ("control-plane", "healthz", True), ("agent", "agents", True), ("bridge", "bridge", True),
        ("canary", "canary", True)]
    assert record["previousImages"] == releases["r1"].as_dict() and record["images"] == releases["r2"].as_dict()
    assert p.current_images() == releases["r2"].as_dict()
    # The job ran through the whole rollout: still the same run, never retried by the platform.
    assert api.get(job)["state"] == "RUNNING", "the job ended before the rollout did: make it longer"
    final = api.wait(job, timeout=180, poll_s=0.5)
    assert final["state"] == "SUCCEEDED", final
    assert final["retryDetails"] == {"user": 0, "platform": 0}
    assert "survived" in api.logs(job, "train", 0)


def test_rollout_to_a_broken_control_plane_rolls_back(production, releases, docker_client):
    p, api = production, admin(production)
    previous = p.current_images()
    t0 = time.monotonic()
    result = rollout(p, releases["broken"], sha="r2-broken", actor="test", gate_timeout_s=60)
    TIMINGS["rollout_broken"] = time.monotonic() - t0
    assert result.result == "rolled_back", result.to_record()
    assert "control-plane" in result.reason and "healthz" in result.reason
    assert "broken control plane r2" in result.steps[0].detail  # the exited container's log tail
    assert [(s.phase, s.component, s.ok) for s in result.steps] == [("forward", "control-plane", False),
                                                                   ("rollback", "control-plane", True)]
    assert p.current_images() == previous == releases["r1"].as_dict()
    assert p.gate_healthz(30).ok and p.gate_agents(60).ok
    job = api.submit(job_text(0, name="after-rollback", taskRoles__train__commands=["echo ok"]))["id"]
    assert api.wait(job, timeout=180, poll_s=0.5)["state"] == "SUCCEEDED"
    # Teardown takes the task containers too: one is running when it starts.
    running = api.submit(long_job("running-at-teardown", 300))["id"]
    until(lambda: task_running(api, running), 180, "a job running at teardown")
    cluster = p.cluster_id()
    assert cluster and leftovers(docker_client, CLUSTER_LABEL, cluster)
    p.teardown()
    assert leftovers(docker_client, PLATFORM_LABEL, p.name) == []
    assert leftovers(docker_client, CLUSTER_LABEL, cluster) == []
    assert p.teardown() == []  # again: nothing left, nothing raised


def test_deploy_rollback_command_goes_back_to_the_previous_deployment(production, releases):
    """``apiary deploy rollback`` against the platform's own deployment history (recorded as the
    deploy flow does: POST /api/v2/deployments after each rollout)."""
    import typer
    from typer.testing import CliRunner

    from apiary.cli.rollout import add_rollout_commands

    p, api = production, admin(production)
    http = httpx.Client(base_url=p.url, headers={"Authorization": f"Bearer {p.admin_token()}"}, timeout=30)
    now = time.time()
    first = {"sha": "a1a1a1a", "images": releases["r1"].as_dict(), "actor": "test", "trigger": "push",
             "startedAt": now - 60, "finishedAt": now - 50, "result": "succeeded", "steps": []}
    assert http.post("/api/v2/deployments", json=first).status_code == 201
    second = rollout(p, releases["r2"], sha="b2b2b2b", actor="test", gate_timeout_s=120)
    assert second.ok and http.post("/api/v2/deployments", json=second.to_record()).status_code == 201
    group = typer.Typer()
    add_rollout_commands(group)

    @group.callback()
    def _group() -> None:  # keeps "rollback" a subcommand, as under `apiary deploy`
        pass

    t0 = time.monotonic()
    out = CliRunner().invoke(group, ["rollback", "--home", str(p.home), "--port", str(p.port), "--name", p.name])
    TIMINGS["cli_rollback"] = time.monotonic() - t0
    assert out.exit_code == 0, out.output
    assert "result: succeeded" in out.output and "rolling" in out.output
    assert p.current_images() == releases["r1"].as_dict()
    newest = http.get("/api/v2/deployments").json()["deployments"][0]
    assert (newest["sha"], newest["trigger"], newest["result"]) == ("a1a1a1a", "rollback", "succeeded")
    assert newest["previousImages"] == releases["r2"].as_dict()
    assert nodes_ready(api, 2)
