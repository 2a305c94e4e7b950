"""DockerBackend against the real dockerd and registry (see conftest.py): the RuntimeBackend
contract, OpenPAI's exit codes for OOM and missing images, re-adoption by a restarted agent."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from tests.support.polling import until

from apiary.lifecycle.exitspec import classify_exit
from apiary.runtime.base import TaskLaunch
from apiary.runtime.docker import LABEL, DockerBackend, container_name

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]

BASE = "apiary/base:bookworm"


def launch(run_id: str, commands: list[str], **kw: Any) -> TaskLaunch:
    fields = dict(run_id=run_id, job_id="alice~j", user="alice", job_name="j", task_role="train", index=0,
                  commands=commands, env={"PAI_JOB_NAME": "j"}, gpus=[1], image=BASE, cpu=1, memory_mb=256,
                  virtual_cluster="vc1")
    fields.update(kw)
    return TaskLaunch(**fields)


def ended(b: DockerBackend, run_id: str):
    return until(lambda: (s := b.status(run_id)) is not None and not s.running and s, 60, f"{run_id} to end")


def containers_of(client: Any, run_id: str) -> list[Any]:
    return client.containers.list(all=True, filters={"label": f"{LABEL}={run_id}"})


def test_task_runs_in_its_image_with_env_labels_limits_and_logs(docker_client, state_dir, node):
    b = DockerBackend(state_dir, node=node, client=docker_client)
    run = "alice~j.a0.train.0.t0"
    st = b.launch(launch(run, ["echo hello $PAI_JOB_NAME gpus=$CUDA_VISIBLE_DEVICES/$NVIDIA_VISIBLE_DEVICES",
                                "echo to-stderr >&2", "cat /etc/debian_version >/dev/null", "sleep 30"]))
    assert st.running and st.pid
    c = docker_client.containers.get(container_name(run))
    assert c.labels[LABEL] == run and c.labels["apiary.vc"] == "vc1" and c.labels["apiary.node"] == node
    assert c.labels["apiary.task-role"] == "train" and c.labels["apiary.index"] == "0"
    host = c.attrs["HostConfig"]
    assert host["NetworkMode"] == "host" and host["Init"] is True
    assert host["NanoCpus"] == 1_000_000_000 and host["Memory"] == 256 * 2**20 == host["MemorySwap"]
    assert c.attrs["Config"]["Cmd"][:2] == ["/bin/sh", "-c"]
    out = b.log_path(run, "stdout")
    until(lambda: "hello j gpus=1/1" in out.read_text(), 30, "stdout in the log file")
    until(lambda: "to-stderr" in b.log_path(run, "stderr").read_text(), 30, "stderr in the log file")
    b.stop(run, grace_s=2)
    st = b.status(run)
    assert st.state == "exited" and st.stopped and st.exit_code == 143  # SIGTERM reached the shell
    assert containers_of(docker_client, run) == []  # a stop removes the container


def test_exit_codes_and_set_e(docker_client, state_dir, node):
    b = DockerBackend(state_dir, node=node, client=docker_client)
    b.launch(launch("alice~j.a0.train.0.t1", ["true", "false", "echo never"]))
    b.launch(launch("alice~j.a0.train.0.t2", ["exit 0"]))
    assert ended(b, "alice~j.a0.train.0.t1").exit_code == 1
    assert "never" not in b.log_path("alice~j.a0.train.0.t1", "stdout").read_text()
    ok = ended(b, "alice~j.a0.train.0.t2")
    assert ok.succeeded and ok.started_at and ok.finished_at and ok.finished_at >= ok.started_at


def test_container_over_its_memory_limit_is_oom_killed_with_1200(docker_client, state_dir, node):
    b = DockerBackend(state_dir, node=node, client=docker_client)
    run = "alice~j.a0.train.0.t3"
    b.launch(launch(run, ["python3 -c 'x = bytearray(300 * 2**20); print(len(x))'"], memory_mb=64))
    st = ended(b, run)
    assert st.exit_code == -1200
    info = classify_exit(st.exit_code)
    assert info.phrase == "UserContainerDockerOOMKilled" and info.reaction == "NEVER_RETRY"


def test_missing_image_fails_with_254_naming_it(docker_client, state_dir, registry, node):
    b = DockerBackend(state_dir, node=node, client=docker_client,
                      image_map={"openpai/nothing": f"{registry.address}/apiary/nothing:1"})
    run = "alice~j.a0.train.0.t4"
    st = b.launch(launch(run, ["true"], image="openpai/nothing"))
    assert st.state == "exited" and st.exit_code == 254 and not st.lost
    assert classify_exit(254).phrase == "ContainerImageNotExists"
    message = b.log_path(run, "stderr").read_text()
    assert f"{registry.address}/apiary/nothing:1" in message and "openpai/nothing" in message
    assert b.launch(launch(run, ["true"], image="openpai/nothing")).exit_code == 254  # idempotent
    assert containers_of(docker_client, run) == []


def test_mapped_image_is_pulled_from_the_registry(docker_client, state_dir, image_map, mnist_image, node):
    b = DockerBackend(state_dir, node=node, client=docker_client, image_map=image_map)
    run = "alice~j.a0.train.0.t5"
    b.launch(launch(run, ["python3 examples/mnist/main.py --epochs 1 --lr 0.1 --batch-size 64"],
                    image="openpai/pai.example.pytorch", memory_mb=1024))
    st = ended(b, run)
    assert st.succeeded, b.log_path(run, "stderr").read_text()
    assert "final test_acc=" in b.log_path(run, "stdout").read_text()
    assert docker_client.images.get(mnist_image)  # pulled into the local store


def test_restarted_agent_readopts_the_container_and_never_starts_it_twice(docker_client, state_dir, node):
    first = DockerBackend(state_dir, node=node, client=docker_client)
    run = "alice~j.a0.train.0.t6"
    task = launch(run, ["echo started >> /apiary-run/starts", "sleep 30"])
    first.launch(task)
    until(lambda: (state_dir / run / "starts").exists(), 30, "the task to start")
    # A new backend on the same state: what a restarted agent builds.
    second = DockerBackend(state_dir, node=node, client=docker_client)
    assert [s.run_id for s in second.list() if s.running] == [run]
    again = second.launch(task)
    assert again.running and len(containers_of(docker_client, run)) == 1
    # Even with its state directory lost, the container is found by its labels.
    third = DockerBackend(state_dir.parent / "state-lost", node=node, client=docker_client)
    assert run in [s.run_id for s in third.list() if s.running]
    second.stop(run, grace_s=1)
    assert (state_dir / run / "starts").read_text() == "started\n"


def test_container_removed_behind_its_back_reads_as_lost(docker_client, state_dir, node):
    b = DockerBackend(state_dir, node=node, client=docker_client)
    run = "alice~j.a0.train.0.t7"
    b.launch(launch(run, ["sleep 30"]))
    docker_client.containers.get(container_name(run)).remove(force=True)
    st = b.status(run)
    assert st.state == "exited" and st.lost and st.exit_code is None


def test_forget_removes_the_container_and_keeps_the_record(docker_client, state_dir, node):
    b = DockerBackend(state_dir, node=node, client=docker_client)
    run = "alice~j.a0.train.0.t8"
    b.launch(launch(run, ["sleep 30"]))
    with pytest.raises(Exception, match="running"):
        b.forget(run)
    b.stop(run, grace_s=0)
    b.forget(run)
    assert run not in [s.run_id for s in b.list()] and containers_of(docker_client, run) == []
    assert b.launch(launch(run, ["echo again"])).stopped  # never launched a second time


def test_run_id_is_validated(docker_client, state_dir, node):
    b = DockerBackend(state_dir, node=node, client=docker_client)
    with pytest.raises(Exception, match="run_id"):
        b.launch(dataclasses.replace(launch("x", ["true"]), run_id="../escape"))
    assert b.status("../escape") is None and not Path(state_dir.parent / "escape").exists()


def test_another_platforms_containers_on_the_same_node_name_are_not_adopted(docker_client, state_dir, node):
    """Two platforms on one dockerd may both have a node called hostname-dan: a backend adopts
    only the containers of its own cluster id."""
    mine = DockerBackend(state_dir, node=node, client=docker_client, cluster="cluster-a")
    run = "alice~j.a0.train.0.t12"
    mine.launch(launch(run, ["sleep 30"]))
    assert docker_client.containers.get(container_name(run)).labels["apiary.cluster"] == "cluster-a"
    theirs = DockerBackend(state_dir.parent / "other", node=node, client=docker_client, cluster="cluster-b")
    assert theirs.list() == []
    lost_state = DockerBackend(state_dir.parent / "lost", node=node, client=docker_client, cluster="cluster-a")
    assert [s.run_id for s in lost_state.list()] == [run]
    mine.stop(run, grace_s=0)
