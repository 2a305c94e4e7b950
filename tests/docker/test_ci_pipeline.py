"""Apiary's CI/CD end to end: signed GitHub webhooks -> the intake -> Prefect deployments
``platform-ci/pr`` / ``platform-deploy/main`` -> every stage for real -> a production platform
rolled forward or back.

What is real: a local bare git repository holding a copy of this working tree (the "GitHub
repository"; its pull requests are branches pushed to it), the CI platform (an embedded Apiary
with the webhook intake, its Prefect server and flows/serve.py serving the CI flows), dockerd, a
registry on loopback, Apiary's images built from each commit, a staging platform started from
them (control plane + agent containers), Locust, chaostoolkit and the benchmark; a production
platform of containers (control plane, agent with the docker runtime, Prefect bridge) that the
deploy flow rolls. What is faked: GitHub itself. The deliveries are GitHub's example payloads
(tests/data/github, from @octokit/webhooks-examples) with this repository's sha, signed here with
the webhook secret, and the commit statuses go to a local receiver.

The reduced profile (``APIARY_CI_PROFILE=reduced``, documented in apiary.ci.config): the unit stage
runs ``make lint test-fast`` over tests/spec and tests/lifecycle only; every other stage is the same
as in the full profile (the chaos stage runs one experiment, gpu-faults, in both).

Three pull requests: (a) a good change passes every stage, and once pushed to main is deployed with
a job running through the rollout; (b) a failing unit test fails at unit, builds no image and posts
a failure status; (c) a control plane that exits at start passes unit, fails at staging, and when
forced to production is rolled back automatically. A forged delivery starts nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from tests.support.builders import LAB6
from tests.support.gitrepo import git, snapshot
from tests.support.polling import until
from tests.support.serving import serving

from apiary.ci.config import ProductionTarget
from apiary.ci.containers import ContainerPlatform, PlatformImages
from apiary.ci.pipeline import STAGE_NAMES
from apiary.ci.webhooks import sign
from apiary.client import ApiaryClient
from apiary.embedded import REPO_ROOT, Embedded
from apiary.images.build import build_platform
from apiary.images.daemons import list_images
from apiary.tracking.prefect_server import free_port, start_prefect_server

pytestmark = [pytest.mark.docker, pytest.mark.e2e, pytest.mark.prefect, pytest.mark.timeout(3600)]

SECRET = "e2e-webhook-secret-" + uuid.uuid4().hex
FIXTURES = REPO_ROOT / "tests" / "data" / "github"
REPO_NAME = "apiary-e2e/apiary"
PIPELINE_TIMEOUT_S = 1500.0


@dataclass
class Repo:
    src: Path
    bare: Path
    base: str

    def pull_request(self, branch: str, edit: Any) -> str:
        """A branch off main with ``edit(src)`` applied, committed and pushed; its sha."""
        git("checkout", "-q", "-B", branch, "main", cwd=self.src)
        edit(self.src)
        git("add", "-A", cwd=self.src)
        git("commit", "-q", "-m", branch, cwd=self.src)
        git("push", "-q", "origin", branch, cwd=self.src)
        return git("rev-parse", "HEAD", cwd=self.src)

    def merge(self, branch: str) -> str:
        git("checkout", "-q", "main", cwd=self.src)
        git("merge", "-q", "--ff-only", branch, cwd=self.src)
        git("push", "-q", "origin", "main", cwd=self.src)
        return git("rev-parse", "HEAD", cwd=self.src)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Repo:
    """This working tree's tracked files (as they are on disk) as the first commit of a
    repository, pushed to a bare one."""
    src, bare, sha = snapshot(tmp_path_factory.mktemp("ci-repo"))
    return Repo(src, bare, sha)


@pytest.fixture(scope="module")
def statuses() -> Iterator[tuple[str, list[dict]]]:
    """A receiver of commit statuses in GitHub's API shape."""
    got: list[dict] = []
    app = FastAPI()

    @app.post("/repos/{owner}/{name}/statuses/{sha}", status_code=201)
    async def status(owner: str, name: str, sha: str, request: Request) -> dict:
        got.append({"repo": f"{owner}/{name}", "sha": sha, **(await request.json())})
        return {}

    with serving(app) as url:
        yield url, got


@pytest.fixture(scope="module")
def prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    server = start_prefect_server(tmp_path_factory.mktemp("prefect"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def production(docker_client: Any, registry: Any, mnist_image: str, repo: Repo, prefect: Any,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProductionTarget, ContainerPlatform]]:
    """Production before any pull request: containers from the base commit's images."""
    build_platform(docker_client, registry.address, repo.base[:12], repo=repo.src)
    home = tmp_path_factory.mktemp("production")
    target = ProductionTarget(name=f"prod-{uuid.uuid4().hex[:6]}", home=home, port=free_port(),
                              registry=registry.address, agent_runtime="docker", prefect_api_url=prefect.api_url,
                              gate_timeout_s=180)
    platform = ContainerPlatform(docker_client, target.name, home, target.port,
                                 cluster_config=LAB6 / "hived-config-two-vcs.yaml", agent_runtime="docker",
                                 registry=registry.address, prefect_api_url=prefect.api_url)
    try:
        platform.start(PlatformImages.from_registry(registry.address, repo.base[:12]))
        for gate in (platform.gate_healthz(180), platform.gate_agents(180)):
            assert gate.ok, gate.detail
        yield target, platform
    finally:
        platform.teardown()


@pytest.fixture(scope="module")
def ci(repo: Repo, registry: Any, statuses: tuple[str, list[dict]], prefect: Any, production: Any,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[Embedded]:
    """The CI platform: an embedded Apiary whose control plane takes the webhooks and whose
    flows/serve.py serves the CI flows, configured by the APIARY_CI_* variables."""
    root = tmp_path_factory.mktemp("ci")
    target, _ = production
    target.dump(root / "production.yaml")
    env = {
        "APIARY_GITHUB_WEBHOOK_SECRET": SECRET, "PREFECT_API_URL": prefect.api_url,
        "APIARY_CI_REPO_URL": str(repo.bare), "APIARY_CI_REGISTRY": registry.address,
        "APIARY_CI_PROFILE": "reduced", "APIARY_CI_WORKDIR": str(root / "work"),
        "APIARY_CI_ARTIFACTS": str(root / "artifacts"),
        "APIARY_CI_STATUS_URL": statuses[0] + "/repos/{repo}/statuses/{sha}",
        "APIARY_CI_PRODUCTION": str(root / "production.yaml"), "PREFECT_UI_URL": prefect.ui_url,
    }
    platform = Embedded(home=root / "home", cluster=LAB6 / "hived-config-one-vc.yaml", prefect=True,
                        prefect_api_url=prefect.api_url, env=env)
    with platform:
        admin = platform.client()
        # flows/serve.py registers the CI deployments when it starts serving.
        until(lambda: _deployment_exists(prefect.api_url, "platform-ci", "pr")
              and _deployment_exists(prefect.api_url, "platform-deploy", "main"), 180, "the CI deployments")
        platform.admin = admin  # type: ignore[attr-defined]
        platform.artifacts = root / "artifacts"  # type: ignore[attr-defined]
        yield platform


def _deployment_exists(api: str, flow: str, name: str) -> bool:
    return httpx.get(f"{api}/deployments/name/{flow}/{name}", timeout=10).status_code == 200


def _payload(name: str, repo: Repo, **sets: Any) -> dict:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    data["repository"].update(full_name=REPO_NAME, clone_url=str(repo.bare), default_branch="main")
    for path, value in sets.items():
        node = data
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return data


def deliver(ci: Embedded, event: str, payload: dict, secret: str = SECRET) -> httpx.Response:
    body = json.dumps(payload).encode()
    return httpx.post(f"{ci.api_url}/api/v2/ci/webhooks/github", content=body, timeout=10, headers={
        "Content-Type": "application/json", "X-GitHub-Event": event, "X-GitHub-Delivery": str(uuid.uuid4()),
        "X-Hub-Signature-256": sign(secret.encode(), body)})


def open_pr(ci: Embedded, repo: Repo, sha: str, number: int, branch: str) -> None:
    payload = _payload("pull_request.opened", repo, number=number, **{
        "pull_request.number": number, "pull_request.head.sha": sha, "pull_request.head.ref": branch,
        "pull_request.base.ref": "main"})
    resp = deliver(ci, "pull_request", payload)
    assert resp.status_code == 202 and resp.json()["kind"] == "pr", resp.text


def finished_run(ci: Embedded, sha: str, kind: str = "pr", timeout: float = PIPELINE_TIMEOUT_S) -> dict:
    def done() -> dict | None:
        for run in ci.admin.ci_runs(limit=50, kind=kind):  # type: ignore[attr-defined]
            if run["sha"] == sha and run["result"] != "running":
                return run
        return None

    return until(done, timeout, f"the {kind} pipeline of {sha[:8]}", poll_s=2.0)


def stage_states(run: dict) -> dict[str, str]:
    return {s["name"]: s["state"] for s in run["stages"]}


def statuses_for(got: list[dict], sha: str) -> list[str]:
    return [s["state"] for s in got if s["sha"] == sha]


def test_forged_delivery_starts_nothing(ci, repo):
    before = ci.admin.ci_runs(limit=50)  # type: ignore[attr-defined]
    payload = _payload("pull_request.opened", repo, **{"pull_request.head.sha": repo.base})
    resp = deliver(ci, "pull_request", payload, secret="not-the-secret")
    assert resp.status_code == 401, resp.text
    deliveries = httpx.get(f"{ci.api_url}/api/v2/ci/deliveries", timeout=10,
                           headers={"Authorization": f"Bearer {(ci.home / 'token').read_text().strip()}"}).json()
    assert deliveries["deliveries"] == []
    assert ci.admin.ci_runs(limit=50) == before  # type: ignore[attr-defined]


def task_run_names(prefect: Any, flow_run_id: str) -> set[str]:
    resp = httpx.post(f"{prefect.api_url}/task_runs/filter", timeout=30,
                      json={"flow_runs": {"id": {"any_": [flow_run_id]}}})
    resp.raise_for_status()
    return {t["name"] for t in resp.json()}


def test_good_change_passes_every_stage_and_deploys_with_a_job_surviving(ci, repo, production, registry, statuses,
                                                                        prefect):
    target, prod = production
    sha = repo.pull_request("good-change", lambda src: (src / "ci" / "CHANGELOG").write_text("a good change\n"))
    open_pr(ci, repo, sha, 101, "good-change")
    # PR (b) in parallel: it fails at unit within a minute or two, long before (a) finishes.
    bad = repo.pull_request("failing-unit-test", lambda src: (src / "tests" / "spec" / "test_ci_e2e_failure.py")
                            .write_text("def test_this_change_breaks_a_unit_test():\n    assert 1 + 1 == 3\n"))
    open_pr(ci, repo, bad, 102, "failing-unit-test")

    run_b = finished_run(ci, bad)
    assert run_b["result"] == "failure" and run_b["failedStage"] == "unit", run_b
    assert "test_this_change_breaks_a_unit_test" in run_b["reason"]
    states = stage_states(run_b)
    assert states["image"] == "skipped" and states["staging"] == "skipped" and states["report"] == "passed"
    assert bad[:12] not in list_images(registry.url).get("apiary/control-plane", []), "(b) built an image"
    assert statuses_for(statuses[1], bad) == ["pending", "failure"]

    run_a = finished_run(ci, sha)
    assert run_a["result"] == "success", run_a
    assert all(state == "passed" for state in stage_states(run_a).values()), run_a["stages"]
    # In the Prefect UI each stage is a task run of the pipeline's flow run, named after the stage.
    # (Prefect 3 clients report task runs to the server asynchronously: poll, with a deadline.)
    until(lambda: set(STAGE_NAMES) <= task_run_names(prefect, run_a["flowRunId"]), 60, "the stages' task runs")
    assert statuses_for(statuses[1], sha) == ["pending", "success"]
    final = next(s for s in statuses[1] if s["sha"] == sha and s["state"] == "success")
    assert final["context"] == "apiary/platform-ci" and run_a["flowRunId"] in final["target_url"]
    junit = ci.artifacts / run_a["flowRunId"] / "junit-unit.xml"  # type: ignore[attr-defined]
    assert junit.exists() and (ci.artifacts / run_a["flowRunId"] / "junit-integration.xml").exists()  # type: ignore[attr-defined]

    # A job is running on production when the merge is deployed.
    client = ApiaryClient(prod.url, token=prod.admin_token(), timeout=60)
    job = client.submit((LAB6 / "job-config-0.yaml").read_text().replace(
        "python3 examples/mnist/main.py", "sleep 60 && python3 examples/mnist/main.py"))
    until(lambda: client.get(job["id"])["state"] == "RUNNING", 180, "the production job running")
    merged = repo.merge("good-change")
    assert merged == sha
    push = _payload("push.default-branch", repo, ref="refs/heads/main", after=sha, deleted=False)
    resp = deliver(ci, "push", push)
    assert resp.status_code == 202 and resp.json()["kind"] == "deploy", resp.text

    deployment = until(lambda: next((d for d in ci.admin.deployments(limit=20)  # type: ignore[attr-defined]
                                     if d["sha"] == sha), None), 900, "the deployment of (a)", poll_s=2.0)
    assert deployment["result"] == "succeeded", deployment
    until(lambda: {"control-plane", "agent", "bridge", "canary"} <= task_run_names(prefect, deployment["flowRunId"]),
          60, "the rollout steps' task runs")
    assert [s["component"] for s in deployment["steps"] if s["ok"]][:3] == ["control-plane", "agent", "bridge"]
    assert prod.current_images()["control-plane"].endswith(f":{sha[:12]}")
    final_job = client.wait(job["id"], timeout=300, poll_s=1.0)
    assert final_job["state"] == "SUCCEEDED" and final_job["retryDetails"]["platform"] == 0, final_job


def test_broken_control_plane_fails_staging_and_is_rolled_back_from_production(ci, repo, production, prefect,
                                                                              statuses):
    target, prod = production
    before = prod.current_images()

    def break_start(src: Path) -> None:
        main = src / "platform" / "apiary" / "cli" / "main.py"
        text = main.read_text()
        # the first statement of the control-plane command: right after its signature's last line
        start = text.index("def control_plane(")
        end = text.index(") -> None:\n", start) + len(") -> None:\n")
        broken = '    raise SystemExit("a change that breaks the control plane start")\n'
        main.write_text(text[:end] + broken + text[end:])

    sha = repo.pull_request("breaks-control-plane", break_start)
    open_pr(ci, repo, sha, 103, "breaks-control-plane")
    run_c = finished_run(ci, sha)
    assert run_c["result"] == "failure" and run_c["failedStage"] in ("staging", "integration"), run_c
    states = stage_states(run_c)
    assert states["unit"] == "passed" and states["image"] == "passed", states
    assert statuses_for(statuses[1], sha) == ["pending", "failure"]

    # Forced to production anyway (an operator's decision): the control plane's health gate fails
    # and every replaced component goes back to the images it ran before.
    request = {"kind": "deploy", "repo": REPO_NAME, "clone_url": str(repo.bare), "sha": sha, "ref": "main",
               "base_ref": "main", "default_branch": "main", "action": None, "sender": "operator", "pr_number": None}
    dep = httpx.get(f"{prefect.api_url}/deployments/name/platform-deploy/main", timeout=10).json()
    made = httpx.post(f"{prefect.api_url}/deployments/{dep['id']}/create_flow_run", timeout=10,
                      json={"parameters": {"request": request, "delivery": "forced", "force": True}})
    assert made.status_code == 201, made.text
    deployment = until(lambda: next((d for d in ci.admin.deployments(limit=20)  # type: ignore[attr-defined]
                                     if d["sha"] == sha), None), 900, "the forced deployment of (c)", poll_s=2.0)
    assert deployment["result"] == "rolled_back" and deployment["trigger"] == "manual", deployment
    assert "control-plane" in deployment["reason"], deployment
    assert prod.current_images() == before
    assert prod.gate_healthz(120).ok
    client = ApiaryClient(prod.url, token=prod.admin_token(), timeout=60)
    job = client.submit((LAB6 / "job-config-0.yaml").read_text().replace("name: job-config-0", "name: after-rollback"))
    assert client.wait(job["id"], timeout=300, poll_s=1.0)["state"] == "SUCCEEDED"
