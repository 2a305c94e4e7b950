"""build_task_env: OpenPAI's variable names and values for a 2-role job."""

from __future__ import annotations

import pytest

from apiary.errors import ValidationError
from apiary.runtime import build_task_env, gpu_env

ROLES = {"ps": 1, "worker": 2}
IPS = {("ps", 0): "10.0.0.1", ("worker", 0): "10.0.0.2", ("worker", 1): "10.0.0.3"}
PORTS = {("ps", 0): {"grpc": 20001}, ("worker", 1): {"grpc": 20011, "http": 20012}}


def env_for(**overrides: object) -> dict[str, str]:
    kwargs: dict = dict(
        job_id="job-42",
        user="alice",
        job_name="tf-dist",
        task_roles=ROLES,
        host_ips=IPS,
        ports=PORTS,
        task_role="worker",
        index=1,
        gpus=[2, 3],
        attempt=1,
        simulated_gpus=True,
    )
    kwargs.update(overrides)
    return build_task_env(**kwargs)


def test_two_role_job_names_and_values() -> None:
    env = env_for()
    expected = {
        "PAI_JOB_NAME": "alice~tf-dist",
        "PAI_FRAMEWORK_NAME": "alice~tf-dist",
        "PAI_USER_NAME": "alice",
        "PAI_TASK_ROLE_LIST": "ps,worker",
        "PAI_TASK_ROLE_COUNT": "2",
        "PAI_TASK_ROLE_TASK_COUNT_ps": "1",
        "PAI_TASK_ROLE_TASK_COUNT_worker": "2",
        "PAI_CURRENT_TASK_ROLE_NAME": "worker",
        "PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX": "1",
        "PAI_TASK_INDEX": "1",
        "PAI_HOST_IP_ps_0": "10.0.0.1",
        "PAI_HOST_IP_worker_0": "10.0.0.2",
        "PAI_HOST_IP_worker_1": "10.0.0.3",
        "PAI_PORT_LIST_ps_0_grpc": "20001",
        "PAI_PORT_LIST_worker_1_grpc": "20011",
        "PAI_PORT_LIST_worker_1_http": "20012",
        "PAI_CURRENT_CONTAINER_IP": "10.0.0.3",
        "PAI_CONTAINER_HOST_IP": "10.0.0.3",
        "PAI_CONTAINER_HOST_PORT_LIST": "grpc:20011;http:20012",
        "PAI_CONTAINER_HOST_grpc_PORT_LIST": "20011",
        "PAI_CONTAINER_HOST_http_PORT_LIST": "20012",
        "FC_FRAMEWORK_ATTEMPT_ID": "1",
        "PAI_JOB_ATTEMPT_ID": "1",
        "APIARY_JOB_ID": "job-42",
        "APIARY_SIMULATED_GPUS": "1",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "NVIDIA_VISIBLE_DEVICES": "2,3",
    }
    assert env == expected
    assert all(isinstance(v, str) for v in env.values())


def test_ps_instance_without_ports_and_real_gpus() -> None:
    env = env_for(task_role="ps", index=0, ports=None, gpus=[], simulated_gpus=False, attempt=0)
    assert env["PAI_CURRENT_TASK_ROLE_NAME"] == "ps"
    assert env["PAI_TASK_INDEX"] == "0"
    assert env["PAI_CURRENT_CONTAINER_IP"] == "10.0.0.1"
    assert env["APIARY_SIMULATED_GPUS"] == "0"
    assert env["PAI_JOB_ATTEMPT_ID"] == "0"
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert not any(k.startswith(("PAI_PORT_LIST_", "PAI_CONTAINER_HOST_PORT")) for k in env)


def test_extra_variables_are_added_but_cannot_redefine_platform_ones() -> None:
    assert env_for(extra={"LR": "0.1"})["LR"] == "0.1"
    with pytest.raises(ValidationError, match="extra.PAI_TASK_INDEX"):
        env_for(extra={"PAI_TASK_INDEX": "7"})
    with pytest.raises(ValidationError, match="extra"):
        env_for(extra={"not a name": "x"})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"task_role": "chief"}, "task_role"),
        ({"index": 2}, "index"),
        ({"index": -1}, "index"),
        ({"host_ips": {("ps", 0): "10.0.0.1"}}, "host_ips"),
        ({"host_ips": {**IPS, ("evaluator", 0): "10.0.0.9"}}, "host_ips"),
        ({"ports": {("worker", 5): {"grpc": 1}}}, "ports"),
        ({"ports": {("worker", 1): {"grpc": 70000}}}, "ports.worker.1.grpc"),
        ({"task_roles": {"ps-1": 1}, "task_role": "ps-1"}, "task_roles"),
        ({"task_roles": {}}, "task_roles"),
        ({"attempt": -1}, "attempt"),
        ({"gpus": [-1]}, "gpus[0]"),
    ],
)
def test_invalid_input_names_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        env_for(**overrides)
    assert info.value.field == field


def test_gpu_env() -> None:
    assert gpu_env([0]) == {"CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": "0"}
    assert gpu_env([]) == {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"}
