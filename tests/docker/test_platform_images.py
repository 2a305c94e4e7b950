"""Apiary's own images (deploy/docker/): built from the local base with the locked requirements,
pushed to a real registry, then the control plane and one node agent run as containers (host
networking, their own ports) and a Lab 6 job succeeds on them (the agent's process runtime runs
the task inside the agent's container)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.support.builders import LAB6
from tests.support.polling import until

from apiary.client import ApiaryClient
from apiary.images.build import PLATFORM_IMAGES, build_platform
from apiary.images.daemons import list_images
from apiary.tracking.prefect_server import free_port

pytestmark = [pytest.mark.docker, pytest.mark.e2e, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def images(docker_client: Any, registry: Any) -> dict[str, str]:
    built = build_platform(docker_client, registry.address, "test")
    return {name.rsplit("/", 1)[-1].split(":")[0]: name for name in built}


@pytest.fixture
def running(docker_client: Any) -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for c in started:
        c.remove(force=True)


def test_images_are_in_the_registry(images, registry):
    assert set(images) == {"python", *PLATFORM_IMAGES}
    found = list_images(registry.url)
    for name in images.values():
        repo, tag = name.split("/", 1)[1].rsplit(":", 1)
        assert tag in found[repo], (repo, found)


def test_containerised_control_plane_and_agent_run_a_lab6_job(images, docker_client, registry, running,
                                                               tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copyfile(LAB6 / "hived-config-two-vcs.yaml", home / "cluster.yaml")
    port = free_port()
    volumes = {str(home): {"bind": "/var/lib/apiary", "mode": "rw"}}
    for name in images.values():  # pulled from the registry, not the local build
        docker_client.images.remove(name, force=True)
    cp = docker_client.containers.run(images["control-plane"], ["--host", "127.0.0.1", "--port", str(port)],
                                      network_mode="host", volumes=volumes, detach=True, name=f"apiary-cp-{port}")
    running.append(cp)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            cp.reload()
            assert cp.status != "exited", cp.logs().decode()[-3000:]
            return False

    until(healthy, 120, "the containerised control plane")
    agent = docker_client.containers.run(
        images["agent"], ["--api", url, "--all-nodes", "--simulated-gpus", "--state-dir", "/var/lib/apiary/agents",
                          "--workdir", "/opt/apiary", "--metrics-ports", "auto"],
        network_mode="host", volumes=volumes, detach=True, name=f"apiary-agent-{port}")
    running.append(agent)
    client = ApiaryClient(url, token=(home / "token").read_text().strip())
    until(lambda: sum(n["ready"] for n in client.nodes()) == 2, 120, "the containerised agent's nodes")
    job = client.submit((LAB6 / "job-config-0.yaml").read_text())
    t0 = time.monotonic()
    final = client.wait(job["id"], timeout=300, poll_s=0.5)
    assert final["state"] == "SUCCEEDED", (final, agent.logs().decode()[-3000:])
    log = client.logs(job["id"], "train", 0)
    assert "final test_acc=" in log and time.monotonic() - t0 < 300
