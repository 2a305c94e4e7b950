"""The embedded platform with ``--runtime docker``: real dockerd, the platform's own registry,
the mnist image built here and pulled from that registry (see conftest.py). Lab 6's files run
unmodified: ``openpai/pai.example.pytorch`` resolves through the image map."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.support.builders import LAB6, job_text
from tests.support.polling import done, nodes_ready, task_running, until

from apiary.client import Tenants
from apiary.embedded import REPO_ROOT, Embedded
from apiary.images.build import build_example

pytestmark = [pytest.mark.docker, pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, docker_client: Any) -> Iterator[tuple[Embedded, Tenants]]:
    home = tmp_path_factory.mktemp("docker-platform")
    p = Embedded(home=home, cluster=LAB6 / "hived-config-two-vcs.yaml", prefect=False, workdir=str(REPO_ROOT),
                 runtime="docker")
    try:
        p.start()
        p.start_supervisor(period_s=0.2)
        assert p.registry is not None and p.dockerd is None  # the session's dockerd was reused
        build_example(docker_client, "mnist", p.registry.address)
        c = Tenants(p.client())
        until(lambda: nodes_ready(c, 2), 60, "node agents")
        yield p, c
    finally:
        p.stop()


def run_dirs(p: Embedded, job_id: str) -> list[Path]:
    return sorted(d for d in (p.home / "agents").glob(f"*/{job_id}.*") if d.is_dir())


def containers(client: Any, job_id: str) -> list[Any]:
    return client.containers.list(all=True, filters={"label": f"apiary.job={job_id}"})


def test_lab6_mnist_runs_as_a_container_through_the_cli(platform, docker_client):
    p, c = platform
    env = {**os.environ, "APIARY_HOME": str(p.home)}
    env.pop("APIARY_API_URL", None)
    out = subprocess.run([sys.executable, "-m", "apiary", "job", "submit", str(LAB6 / "job-config-0.yaml")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip()
    job = done(c, job_id)
    assert job["state"] == "SUCCEEDED", job
    log = c.logs(job_id, "train", 0)
    acc = float(log.split("final test_acc=")[1].split()[0])
    assert acc > 0.5, log  # Lab 6's own arguments learn (chance is 0.1)
    launched = json.loads((run_dirs(p, job_id)[0] / "launch.json").read_text())
    assert launched["image"] == "openpai/pai.example.pytorch"
    assert launched["resolved_image"] == f"{p.registry.address}/apiary/mnist:latest"
    until(lambda: containers(docker_client, job_id) == [], 30, "the finished container to be removed")


def test_container_over_its_memory_limit_fails_with_1200_and_is_not_retried(platform):
    _p, c = platform
    text = job_text(0, name="oom", jobRetryCount=2, taskRoles__train__resourcePerInstance__memoryMB=64,
                    taskRoles__train__commands=["python3 -c 'x = bytearray(300 * 2**20)'"])
    job = done(c, c.submit(text, user="alice")["id"])
    assert job["state"] == "FAILED"
    assert job["tasks"][0]["exitCode"] == -1200 and job["tasks"][0]["exitPhrase"] == "UserContainerDockerOOMKilled"
    assert job["retries"] == 0  # the exit spec: PERMANENT, NEVER_RETRY


def test_missing_image_fails_the_attempt_with_254_naming_the_image(platform):
    p, c = platform
    doc = job_text(0, name="noimage")
    doc = doc.replace("uri: openpai/pai.example.pytorch", f"uri: {p.registry.address}/nobody/nothing:7")
    job = done(c, c.submit(doc, user="alice")["id"])
    assert job["state"] == "FAILED" and job["tasks"][0]["exitCode"] == 254
    assert job["tasks"][0]["exitPhrase"] == "ContainerImageNotExists" and job["retries"] == 0
    assert f"{p.registry.address}/nobody/nothing:7" in c.logs(job["id"], "train", 0, stream="stderr")


def test_agent_sigkill_readopts_the_running_container(platform, docker_client):
    p, c = platform
    text = job_text(0, name="readopt", taskRoles__train__commands=[
        "echo started >> /apiary-run/starts", "sleep 6", "echo finished"])
    job_id = c.submit(text, user="alice")["id"]
    until(lambda: task_running(c, job_id), 120, "the container to run")
    agent = p.children["agent"]
    restarts = agent.restarts
    os.kill(agent.proc.pid, signal.SIGKILL)
    until(lambda: agent.restarts == restarts + 1 and agent.alive(), 60, "the agent restarted")
    job = done(c, job_id)
    assert job["state"] == "SUCCEEDED" and job["retries"] == 0
    (run_dir,) = run_dirs(p, job_id)
    assert (run_dir / "starts").read_text() == "started\n"  # ran once
    assert "finished" in c.logs(job_id, "train", 0)


def test_preempted_container_is_removed(platform, docker_client):
    _p, c = platform
    low = c.submit(job_text(1, 120), user="alice")["id"]  # vc1's test job on its single GPU
    until(lambda: task_running(c, low), 120, "job-config-1 running")
    until(lambda: len(containers(docker_client, low)) == 1, 30, "its container")
    high = c.submit(job_text(2, 1), user="bob")["id"]  # prod on vc1: preempts it
    until(lambda: containers(docker_client, low) == [] and c.get(low)["retryDetails"]["platform"] >= 1, 120,
          "the preempted container to be removed")
    assert done(c, high)["state"] == "SUCCEEDED"
    c.stop(low)
    done(c, low)


def test_lab6_demo_passes_with_the_docker_runtime(docker_client):
    """``apiary demo lab6 --runtime docker --no-prefect``: all five scenarios with every task a
    container (each platform's registry gets the mnist image first)."""
    out = subprocess.run([sys.executable, "-m", "apiary", "demo", "lab6", "--runtime", "docker", "--no-prefect"],
                         capture_output=True, text=True, timeout=800, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    assert out.stdout.count("PASS ") == 5 and "5 of 5 scenarios passed." in out.stdout
    assert "pushed " in out.stdout  # the image really went to the platforms' registries


def test_mnist_reads_and_writes_glusterfs_storage_through_bind_mounts(platform, docker_client, tmp_path):
    """The Docker runtime mounts a job's storage as bind mounts of the node's GlusterFS mount:
    Lab 6's mnist reads the uploaded digits set and writes its model, which comes back and loads."""
    import numpy as np
    import yaml
    from tests.support.dfs import loopback_gluster
    from tests.support.mnist import load_mnist

    p, c = platform
    admin = c.admin
    with loopback_gluster("apiary-docker") as volume:
        admin.put_storage_server("gfs-docker", "glusterfs", volume.server_data())
        admin.put_storage_config("team-docker", [{"mountPoint": "/mnt/team", "server": "gfs-docker", "path": "m"}])
        admin.set_storage_grant("default", "team-docker")
        mnist = load_mnist()
        mnist.main(["--export-data", str(tmp_path / "digits.npz")])
        admin.storage_upload("team-docker", "data/digits.npz", tmp_path / "digits.npz")
        doc = yaml.safe_load(job_text(0))
        doc["name"] = "mnist-docker-storage"
        doc["extras"] = {"storages": [{"name": "team-docker"}]}
        doc["taskRoles"]["train"]["commands"] = [
            "python3 examples/mnist/main.py --epochs 1 --lr 0.01 --data-dir /mnt/team/data --output-dir /mnt/team/out"]
        job = done(c, c.submit(yaml.safe_dump(doc, sort_keys=False), user="alice")["id"])
        assert job["state"] == "SUCCEEDED", (job, c.logs(job["id"], "train", 0, stream="stderr"))
        assert "1438 train / 359 test" in c.logs(job["id"], "train", 0)
        admin.storage_download("team-docker", "out/model.npz", tmp_path / "model.npz")
        predict = mnist.load_model(tmp_path / "model.npz")
        with np.load(tmp_path / "digits.npz") as f:
            pixels, labels = f["data"], f["target"]
        _, test = mnist.split(len(labels), 0, 0.2)
        assert float((predict(pixels[test]) == labels[test]).mean()) >= 0.85
        until(lambda: containers(docker_client, job["id"]) == [], 30, "the finished container to be removed")
