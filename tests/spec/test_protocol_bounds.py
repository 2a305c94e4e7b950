"""Apiary's upper bounds on the OpenPAI job protocol's integers, and the per-job instance cap.

OpenPAI's schema leaves these integers open; apiary.spec.job sets maxima (``MAX_*``) and every
rejection names the field by its dotted wire path.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from tests.support.builders import minimal_job

from apiary.errors import ValidationError
from apiary.spec.job import (
    DEFAULT_MAX_JOB_INSTANCES,
    MAX_CPU,
    MAX_GPU,
    MAX_INSTANCES,
    MAX_MEMORY_MB,
    MAX_PORTS,
    MAX_RETRY_COUNT,
    parse_job,
)

HUGE = 10**30  # the value from the report: accepted before the bounds existed
TRAIN = "taskRoles.train"
RESOURCES = f"{TRAIN}.resourcePerInstance"


def job(**changes: Any) -> dict:
    """A minimal valid job with ``changes`` set by dotted path (``"taskRoles.train.instances"``)."""
    return minimal_job("bounds", **changes)


def text(**changes: Any) -> str:
    return yaml.safe_dump(job(**changes), sort_keys=False)


def rejection(source: str, **kwargs: Any) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        parse_job(source, **kwargs)
    return info.value


# (field path, its maximum); instances is checked with the job cap raised to its maximum.
BOUNDED = [
    pytest.param("jobRetryCount", MAX_RETRY_COUNT, id="jobRetryCount"),
    pytest.param(f"{TRAIN}.taskRetryCount", MAX_RETRY_COUNT, id="taskRetryCount"),
    pytest.param(f"{TRAIN}.instances", MAX_INSTANCES, id="instances"),
    pytest.param(f"{RESOURCES}.cpu", MAX_CPU, id="cpu"),
    pytest.param(f"{RESOURCES}.memoryMB", MAX_MEMORY_MB, id="memoryMB"),
    pytest.param(f"{RESOURCES}.gpu", MAX_GPU, id="gpu"),
    pytest.param(f"{RESOURCES}.ports.ssh", MAX_PORTS, id="ports-one-label"),
    pytest.param(f"{TRAIN}.extraContainerOptions.shmMB", MAX_MEMORY_MB, id="shmMB"),
    pytest.param(f"{TRAIN}.completion.minFailedInstances", MAX_INSTANCES, id="minFailedInstances"),
    pytest.param(f"{TRAIN}.completion.minSucceededInstances", MAX_INSTANCES, id="minSucceededInstances"),
]


@pytest.mark.parametrize(("field", "maximum"), BOUNDED)
def test_maximum_is_accepted(field, maximum):
    spec = parse_job(text(**{field: maximum}), max_instances=MAX_INSTANCES)
    assert spec.to_wire() == parse_job(spec.to_yaml(), max_instances=MAX_INSTANCES).to_wire()


@pytest.mark.parametrize("over", [pytest.param(1, id="max+1"), pytest.param(HUGE, id="10**30")])
@pytest.mark.parametrize(("field", "maximum"), BOUNDED)
def test_over_the_maximum_is_refused_naming_the_field(field, maximum, over):
    value = maximum + 1 if over == 1 else over
    err = rejection(text(**{field: value}), max_instances=MAX_INSTANCES)
    assert err.field == field
    assert err.message.startswith(f"{field}: ")
    assert f"more than {maximum}, Apiary's maximum" in err.reason


def test_memory_of_10_to_the_30_names_memory_not_leaf_cells():
    err = rejection(text(**{f"{RESOURCES}.memoryMB": HUGE}))
    assert err.field == f"{RESOURCES}.memoryMB"
    assert "leaf" not in err.message.lower()


def test_integer_too_long_to_print_is_refused_naming_the_field():
    # YAML's 0b form builds ints past Python's 4,300-digit str limit; the message must not need repr().
    source = text() + "jobRetryCount: 0b" + "1" * 20_000 + "\n"
    err = rejection(source)
    assert err.field == "jobRetryCount"
    assert "an integer of 20000 bits" in err.reason


@pytest.mark.parametrize(
    ("ports", "ok"),
    [
        pytest.param({"ssh": MAX_PORTS // 2, "http": MAX_PORTS // 2}, True, id="at-maximum-in-all"),
        pytest.param({"ssh": MAX_PORTS // 2, "http": MAX_PORTS // 2 + 1}, False, id="over-maximum-in-all"),
    ],
)
def test_ports_are_bounded_over_all_labels(ports, ok):
    source = text(**{f"{RESOURCES}.ports": ports})
    if ok:
        assert parse_job(source).task_roles["train"].resource_per_instance.ports == ports
    else:
        err = rejection(source)
        assert err.field == f"{RESOURCES}.ports"
        assert f"more than Apiary's maximum of {MAX_PORTS}" in err.reason


@pytest.mark.parametrize("field", ["jobRetryCount", f"{TRAIN}.taskRetryCount", f"{RESOURCES}.gpu"])
def test_lower_bounds_still_hold(field):
    assert rejection(text(**{field: -1})).field == field


# --------------------------------------------------------------------------- instances per job


def two_roles(first: int, second: int, *, gang: bool = True) -> str:
    data = job(**{"taskRoles.train.instances": first, "extras.gangAllocation": gang})
    data["taskRoles"]["eval"] = {**data["taskRoles"]["train"], "instances": second}
    return yaml.safe_dump(data, sort_keys=False)


@pytest.mark.parametrize(
    ("source", "max_instances", "total"),
    [
        pytest.param(text(**{"taskRoles.train.instances": 1_000}), None, None, id="1000-at-default-cap"),
        pytest.param(text(**{"taskRoles.train.instances": 1_001}), None, 1_001, id="1001-over-default-cap"),
        pytest.param(two_roles(600, 400), None, None, id="sum-at-cap"),
        pytest.param(two_roles(600, 401), None, 1_001, id="sum-over-cap"),
        pytest.param(
            text(**{"taskRoles.train.instances": 50_000, "extras.gangAllocation": False}),
            None,
            50_000,
            id="50000-non-gang-by-default",
        ),
        pytest.param(
            text(**{"taskRoles.train.instances": 50_000, "extras.gangAllocation": False}),
            50_000,
            None,
            id="50000-non-gang-when-configured",
        ),
        pytest.param(two_roles(3, 3, gang=False), 5, 6, id="custom-cap"),
    ],
)
def test_instances_per_job_are_capped(source, max_instances, total):
    kwargs = {} if max_instances is None else {"max_instances": max_instances}
    cap = max_instances or DEFAULT_MAX_JOB_INSTANCES
    if total is None:
        spec = parse_job(source, **kwargs)
        assert sum(tr.instances for tr in spec.task_roles.values()) <= cap
        return
    err = rejection(source, **kwargs)
    assert err.field == "taskRoles"
    assert f"{total} instances" in err.reason
    assert f"more than the {cap}" in err.reason
    assert "configures" in err.reason


def test_default_cap_is_1000():
    assert DEFAULT_MAX_JOB_INSTANCES == 1000
