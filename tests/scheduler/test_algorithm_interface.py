"""Every scheduler behind SchedulerAlgorithm (HiveD and the simulator's quota and fifo baselines)
implements the whole interface the control plane and the simulator call."""

from __future__ import annotations

import inspect

import pytest

from apiary.errors import PlatformError, ValidationError
from apiary.scheduler import GroupRequest, HivedScheduler, SchedulerAlgorithm, TaskRequest
from apiary.sim.cluster import Machine, machines_to_cluster
from apiary.sim.policies import FifoScheduler, QuotaScheduler

# VC a = the 8-GPU node, VC b = the 2-GPU node.
CONFIG = machines_to_cluster([Machine("m0", 8), Machine("m1", 2)], {"a": {8: 1}, "b": {2: 1}})
SMALLER = machines_to_cluster([Machine("m0", 8)], {"a": {8: 1}})

SCHEDULERS = {"hived": HivedScheduler, "quota": QuotaScheduler, "fifo": FifoScheduler}


@pytest.fixture(params=list(SCHEDULERS))
def scheduler(request: pytest.FixtureRequest) -> SchedulerAlgorithm:
    return SCHEDULERS[request.param](CONFIG)


def test_every_protocol_method_is_documented() -> None:
    methods = [n for n, v in vars(SchedulerAlgorithm).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"reconfigure", "groups", "status", "validate", "schedule", "allocate", "release"} <= set(methods)
    for name in methods:
        doc = inspect.getdoc(getattr(SchedulerAlgorithm, name)) or ""
        assert len(doc) > 40, f"SchedulerAlgorithm.{name} needs a docstring (shapes, errors, idempotency)"


def test_implements_the_protocol(scheduler: SchedulerAlgorithm) -> None:
    assert isinstance(scheduler, SchedulerAlgorithm)


def test_groups_and_status_follow_the_placements(scheduler: SchedulerAlgorithm) -> None:
    req = GroupRequest("alice~j1", "a", 100, True, (TaskRequest("train", 2, 2, 0.0, 0),))
    scheduler.validate(req)
    d = scheduler.schedule(req)
    assert d.kind == "place"
    scheduler.allocate(req.name, req, d.placements)
    assert scheduler.groups() == {req.name: req}

    status = scheduler.status()
    assert set(status) >= {"nodes", "groups", "virtualClusters"}
    group = status["groups"][req.name]
    assert group["vc"] == "a" and group["priority"] == 100
    assert sorted(p["task"] for p in group["placements"]) == ["train[0]", "train[1]"]
    assert {p["node"] for p in group["placements"]} == {"m0"}
    assert status["nodes"]["m0"]["leafCells"] == 8 and status["nodes"]["m0"]["healthy"] is True
    assert status["nodes"]["m0"]["used"] == {req.name: 4}
    assert status["nodes"]["m1"]["used"] == {}

    only_b = scheduler.status("b")  # narrowed to VC b: no group there, no node in use
    assert only_b["groups"] == {} and only_b["nodes"] == {}
    with pytest.raises(ValidationError):
        scheduler.status("nope")

    scheduler.release(req.name)
    scheduler.release(req.name)  # idempotent
    assert scheduler.groups() == {} and scheduler.status()["groups"] == {}


def test_allocate_refuses_an_unknown_node_and_changes_nothing(scheduler: SchedulerAlgorithm) -> None:
    req = GroupRequest("alice~j1", "a", 100, True, (TaskRequest("train", 2, 2, 0.0, 0),))
    good, _ = scheduler.schedule(req).placements
    bad = type(good)("train", 1, "nowhere", (0, 1), (0, 1))
    with pytest.raises((PlatformError, ValidationError)) as err:  # HiveD's / the baselines' error
        scheduler.allocate(req.name, req, [good, bad])
    assert "nowhere" in str(err.value)
    assert scheduler.groups() == {} and scheduler.group_of(req.name) == []


def test_hived_reconfigure_keeps_what_fits_and_names_what_does_not() -> None:
    s = HivedScheduler(CONFIG)
    on_b = GroupRequest("bob~j2", "b", 100, True, (TaskRequest("train", 1, 2, 0.0, 0),))
    s.allocate(on_b.name, on_b, s.schedule(on_b).placements)
    on_a = GroupRequest("alice~j1", "a", 100, True, (TaskRequest("train", 1, 8, 0.0, 0),))
    s.allocate(on_a.name, on_a, s.schedule(on_a).placements)
    dropped = s.reconfigure(SMALLER)  # node m1 and VC b are gone
    assert set(dropped) == {on_b.name} and "VC b no longer exists" in dropped[on_b.name]
    assert s.groups() == {on_a.name: on_a}
    assert s.reconfigure(SMALLER) == {}  # idempotent in effect


@pytest.mark.parametrize("baseline", [QuotaScheduler, FifoScheduler], ids=["quota", "fifo"])
def test_baselines_do_not_reconfigure(baseline: type[QuotaScheduler] | type[FifoScheduler]) -> None:
    s = baseline(CONFIG)
    req = GroupRequest("alice~j1", "a", 100, True, (TaskRequest("train", 1, 2, 0.0, 0),))
    s.allocate(req.name, req, s.schedule(req).placements)
    with pytest.raises(ValidationError, match="does not support reconfiguration"):
        s.reconfigure(SMALLER)
    assert s.groups() == {req.name: req}  # nothing changed
