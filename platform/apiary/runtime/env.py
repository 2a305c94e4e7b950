"""The environment OpenPAI gives a task, built for Apiary's runtime backends.

Every name below comes from OpenPAI (microsoft/pai) unless it starts with ``APIARY_``:

========================================== ==================================================
Variable                                   Source in OpenPAI
========================================== ==================================================
``PAI_JOB_NAME``, ``PAI_FRAMEWORK_NAME``   rest-server ``runtime-env.js``: both are the
                                           framework name ``<user>~<jobName>``
``PAI_USER_NAME``                          rest-server ``runtime-env.js``
``PAI_TASK_ROLE_COUNT``                    rest-server ``runtime-env.js`` (number of roles)
``PAI_TASK_ROLE_LIST``                     rest-server ``runtime-env.js`` (comma-separated,
                                           in job-spec order)
``PAI_TASK_ROLE_TASK_COUNT_<role>``        rest-server ``runtime-env.js`` (instances)
``PAI_CURRENT_TASK_ROLE_NAME``             rest-server ``k8s.js`` (from ``FC_TASKROLE_NAME``)
``PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX`` rest-server ``k8s.js`` (from ``FC_TASK_INDEX``)
``PAI_TASK_INDEX``                         rest-server ``k8s.js`` ("backward compatibility")
``PAI_HOST_IP_<role>_<index>``             webportal's documented env list / kube-runtime
``PAI_PORT_LIST_<role>_<index>_<port>``    webportal's documented env list (comma-separated
                                           ports; Apiary reserves one port per name)
``PAI_CURRENT_CONTAINER_IP``               OpenPAI v0.x job docs ("allocated ip for current
                                           docker container")
``PAI_CONTAINER_HOST_IP``                  OpenPAI job docs (same value, newer name)
``PAI_CONTAINER_HOST_PORT_LIST``           OpenPAI job docs: ``name:p1,p2;name2:p3``
``PAI_CONTAINER_HOST_<port>_PORT_LIST``    OpenPAI job docs: this instance's ports of a name
``PAI_CONTAINER_SSH_PORT``                 openpai-runtime ``framework_parser.py``: this
                                           instance's ``ssh`` port (the ssh runtime plugin)
``FC_FRAMEWORK_ATTEMPT_ID``                FrameworkController's attempt annotation, which
                                           OpenPAI pods see; 0 for the first attempt
``PAI_JOB_ATTEMPT_ID``                     Apiary alias of ``FC_FRAMEWORK_ATTEMPT_ID``
``CUDA_VISIBLE_DEVICES``                   CUDA: comma-joined indices, ``""`` hides all GPUs
``NVIDIA_VISIBLE_DEVICES``                 nvidia-container-runtime: indices, or ``void``
``APIARY_JOB_ID``                          Apiary's job id
``APIARY_SIMULATED_GPUS``                  ``1`` when the node's GPUs are simulated, else ``0``
``APIARY_PROXY_TOKEN``                     this instance's secret that the API's proxy presents
                                           (``apiary.control.proxy``; given as ``extra``)
``MLFLOW_TRACKING_URI``                    MLflow's own: the platform's tracking server (when it
                                           runs MLflow; ``apiary.marketplace.identity``, as ``extra``)
``MLFLOW_TRACKING_TOKEN``                  MLflow's own (sent as a bearer token): this run's MLflow
                                           secret, valid while the run lives; never a platform's
``MLFLOW_EXPERIMENT_NAME``                 MLflow's own: ``users/<user>``, the user's experiment
========================================== ==================================================

The ``<role>`` and ``<port>`` parts are used verbatim, so role and port names must be valid in
environment variable names (``[A-Za-z_][A-Za-z0-9_]*``); OpenPAI has the same restriction.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from apiary.errors import ValidationError

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def gpu_env(gpus: Sequence[int]) -> dict[str, str]:
    """GPU visibility for a task given its node-local GPU indices.

    Returns ``{"CUDA_VISIBLE_DEVICES": "0,1", "NVIDIA_VISIBLE_DEVICES": "0,1"}``; with no GPUs
    ``CUDA_VISIBLE_DEVICES`` is ``""`` (CUDA then sees no device) and
    ``NVIDIA_VISIBLE_DEVICES`` is ``"void"`` (NVIDIA's container convention for "no GPU").
    Raises :class:`ValidationError` for a negative or non-integer index.
    """
    for i, g in enumerate(gpus):
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ValidationError(f"gpus[{i}]", f"must be a non-negative integer, got {g!r}")
    joined = ",".join(str(g) for g in gpus)
    return {"CUDA_VISIBLE_DEVICES": joined, "NVIDIA_VISIBLE_DEVICES": joined or "void"}


def _check_name(field: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValidationError(
            field, f"{name!r} cannot be used in an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"
        )


def build_task_env(
    *,
    job_id: str,
    user: str,
    job_name: str,
    task_roles: Mapping[str, int],
    host_ips: Mapping[tuple[str, int], str],
    ports: Mapping[tuple[str, int], Mapping[str, int]] | None,
    task_role: str,
    index: int,
    gpus: Sequence[int],
    attempt: int,
    simulated_gpus: bool,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The OpenPAI environment of instance ``index`` of ``task_role`` (see the module table).

    ``task_roles``: role name -> instance count, in job-spec order (gives ``PAI_TASK_ROLE_LIST``).
    ``host_ips``: ``(role, index) -> node IP`` for every placed instance; the current instance
    must be among them. ``ports``: optional ``(role, index) -> {port name: port}``.
    ``gpus``: this instance's node-local GPU indices. ``attempt``: the job attempt, 0-based.
    ``extra``: more variables (e.g. the job's own); they may not redefine a generated name.

    Returns a new ``dict[str, str]``. Raises :class:`ValidationError` (naming the field) for an
    unknown role, an index out of range, an unplaced current instance, a name unusable in an
    environment variable, or an ``extra`` key that collides with a generated one.
    """
    if not task_roles:
        raise ValidationError("task_roles", "at least one task role is required")
    for role, count in task_roles.items():
        _check_name("task_roles", role)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValidationError(f"task_roles.{role}", f"instances must be an integer >= 1, got {count!r}")
    if task_role not in task_roles:
        raise ValidationError("task_role", f"{task_role!r} is not one of {sorted(task_roles)}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < task_roles[task_role]:
        raise ValidationError(
            "index", f"{index!r} is outside 0..{task_roles[task_role] - 1} for task role {task_role!r}"
        )
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ValidationError("attempt", f"must be an integer >= 0, got {attempt!r}")

    def check_instance(field: str, key: tuple[str, int]) -> None:
        role, i = key
        if role not in task_roles or not isinstance(i, int) or not 0 <= i < task_roles[role]:
            raise ValidationError(field, f"{key!r} is not an instance of this job")

    for key, ip in host_ips.items():
        check_instance("host_ips", key)
        if not isinstance(ip, str) or not ip:
            raise ValidationError(f"host_ips.{key[0]}.{key[1]}", "must be a non-empty IP string")
    current = (task_role, index)
    if current not in host_ips:
        raise ValidationError("host_ips", f"the current instance {task_role}[{index}] has no host IP")

    framework_name = f"{user}~{job_name}"
    env: dict[str, str] = {
        "PAI_FRAMEWORK_NAME": framework_name,
        "PAI_JOB_NAME": framework_name,
        "PAI_USER_NAME": user,
        "PAI_TASK_ROLE_COUNT": str(len(task_roles)),
        "PAI_TASK_ROLE_LIST": ",".join(task_roles),
        "PAI_CURRENT_TASK_ROLE_NAME": task_role,
        "PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX": str(index),
        "PAI_TASK_INDEX": str(index),
        "PAI_CURRENT_CONTAINER_IP": host_ips[current],
        "PAI_CONTAINER_HOST_IP": host_ips[current],
        "FC_FRAMEWORK_ATTEMPT_ID": str(attempt),
        "PAI_JOB_ATTEMPT_ID": str(attempt),
        "APIARY_JOB_ID": job_id,
        "APIARY_SIMULATED_GPUS": "1" if simulated_gpus else "0",
    }
    for role, count in task_roles.items():
        env[f"PAI_TASK_ROLE_TASK_COUNT_{role}"] = str(count)
    for (role, i), ip in sorted(host_ips.items()):
        env[f"PAI_HOST_IP_{role}_{i}"] = ip
    for (role, i), named in sorted((ports or {}).items()):
        check_instance("ports", (role, i))
        for port_name, port in named.items():
            _check_name(f"ports.{role}.{i}", port_name)
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise ValidationError(f"ports.{role}.{i}.{port_name}", f"not a TCP port: {port!r}")
            env[f"PAI_PORT_LIST_{role}_{i}_{port_name}"] = str(port)
            if (role, i) == current:
                env[f"PAI_CONTAINER_HOST_{port_name}_PORT_LIST"] = str(port)
    mine = (ports or {}).get(current) or {}
    if "ssh" in mine:
        env["PAI_CONTAINER_SSH_PORT"] = str(mine["ssh"])
    if mine:
        env["PAI_CONTAINER_HOST_PORT_LIST"] = ";".join(f"{n}:{p}" for n, p in mine.items())
    env.update(gpu_env(gpus))

    for name, value in (extra or {}).items():
        _check_name("extra", name)
        if name in env:
            raise ValidationError(f"extra.{name}", "redefines a variable the platform sets")
        if not isinstance(value, str):
            raise ValidationError(f"extra.{name}", f"value must be a string, got {type(value).__name__}")
        env[name] = value
    return env
