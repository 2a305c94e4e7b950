"""Lab 6 scenarios replayed at scheduler level (AI-System Lab 6, HiveD feature demos)."""

from __future__ import annotations

import pytest
from tests.support.builders import LAB6  # examples/lab6: Lab 6's files, copied unmodified

from apiary.errors import PlatformError, QuotaExceededError, ValidationError
from apiary.scheduler import Decision, GroupRequest, HivedScheduler, TaskPlacement, TaskRequest
from apiary.spec.cluster import load_cluster_config

PRIO = {"crit": 120, "prod": 100, "test": 10, "oppo": -1}


def sched(which: str) -> HivedScheduler:
    return HivedScheduler(load_cluster_config(LAB6 / f"hived-config-{which}.yaml"))


def job(
    name: str,
    vc: str,
    cls: str,
    instances: int = 1,
    gang: bool = True,
    gpu: int = 1,
    cpu: float = 2,
    mem: int = 4096,
    sku: str | None = None,
    pinned: str | None = None,
    pending=None,
) -> GroupRequest:
    return GroupRequest(
        name=f"alice~{name}",
        virtual_cluster=vc,
        priority=PRIO[cls],
        gang=gang,
        tasks=(TaskRequest("train", instances, gpu, cpu, mem, sku, pinned),),
        pending=pending,
    )


def run(s: HivedScheduler, req: GroupRequest) -> Decision:
    """schedule and, for "place", commit."""
    d = s.schedule(req)
    if d.kind == "place":
        s.allocate(req.name, req, d.placements)
    return d


def nodes_of(s: HivedScheduler, name: str) -> list[str]:
    return sorted(p.node for p in s.group_of(name))


# ---------------------------------------------------------------- 1. VC safety
def test_vc_safety_vc1_jobs_never_leave_hostname_dan():
    s = sched("two-vcs")
    jobs = [job(f"job-config-0-{i}", "vc1", "prod") for i in range(3)]
    d0 = run(s, jobs[0])
    assert d0.kind == "place" and nodes_of(s, jobs[0].name) == ["hostname-dan"]
    for j in jobs[1:]:  # default VC (hostname-carol) is idle, yet vc1 jobs wait
        d = s.schedule(j)
        assert d.kind == "wait", d
        assert "VC vc1 has 0 of 1 GPU-D leaf cells free" in d.reason
        assert "cannot preempt" in d.reason
    s.release(jobs[0].name)
    for j in jobs[1:]:
        assert run(s, j).kind == "place"
        assert nodes_of(s, j.name) == ["hostname-dan"]
        s.release(j.name)


# ---------------------------------------------------------------- 2. priority and preemption
def test_prod_preempts_test_in_vc1_and_gets_the_reserved_cell():
    s = sched("two-vcs")
    t = job("job-config-1", "vc1", "test")
    p = job("job-config-2", "vc1", "prod")
    assert run(s, t).kind == "place"
    d = s.schedule(p)
    assert d.kind == "preempt" and d.victims == (t.name,)
    assert d.reason == "Preempting alice~job-config-1 (test, priority 10) to free 1 cell in VC vc1."
    assert s.schedule(p) == d  # idempotent
    assert s.status()["reservations"][p.name]["victims"] == [t.name]
    # the restarted test job cannot take the reserved cell back
    s.release(t.name)
    assert s.schedule(t).kind == "wait"
    d2 = run(s, p)
    assert d2.kind == "place" and nodes_of(s, p.name) == ["hostname-dan"]
    w = s.schedule(t)
    assert w.kind == "wait"
    assert "used by alice~job-config-2 (prod, priority 100) which this job (test, 10) cannot preempt" in w.reason


def test_equal_priority_never_preempts():
    s = sched("two-vcs")
    assert run(s, job("a", "vc1", "prod")).kind == "place"
    assert s.schedule(job("b", "vc1", "prod")).kind == "wait"


def test_higher_priority_preemptor_supersedes_reservation():
    s = sched("two-vcs")
    oppo = job("o", "vc1", "oppo")
    assert run(s, job("t", "vc1", "test")).kind == "place"
    d = s.schedule(job("p", "vc1", "prod"))
    assert d.kind == "preempt"
    d = s.schedule(job("c", "vc1", "crit"))
    assert d.kind == "preempt" and d.victims == ("alice~t",)
    assert list(s.status()["reservations"]) == ["alice~c"]
    s.release("alice~t")
    assert s.schedule(job("p", "vc1", "prod")).kind == "wait"
    assert s.schedule(oppo).kind == "place"  # oppo goes to the idle default VC instead
    assert run(s, job("c", "vc1", "crit")).kind == "place"


# ---------------------------------------------------------------- 3. opportunistic
def test_oppo_runs_on_idle_vc_and_is_preempted_by_test_job_there():
    s = sched("two-vcs")
    prod = job("job-config-3", "vc1", "prod")
    oppo = job("job-config-4", "vc1", "oppo")
    assert run(s, prod).kind == "place"
    assert run(s, oppo).kind == "place"
    assert nodes_of(s, oppo.name) == ["hostname-carol"]
    assert s.status()["virtualClusters"]["vc1"]["opportunisticUsed"] == 1  # counted for the job's VC
    test = job("job-config-5", "default", "test")
    d = s.schedule(test)
    assert d.kind == "preempt" and d.victims == (oppo.name,)
    assert d.reason == "Preempting alice~job-config-4 (opportunistic) to free 1 cell in VC default."
    s.release(oppo.name)
    w = s.schedule(oppo)  # the cluster is full now: oppo waits, never preempts
    assert w.kind == "wait" and "never preempt" in w.reason
    assert run(s, test).kind == "place" and nodes_of(s, test.name) == ["hostname-carol"]


# ---------------------------------------------------------------- 4. gang / incremental (one VC)
def test_gang_of_two_waits_then_both_placed_together():
    s = sched("one-vc")
    first = job("job-config-5", "default", "prod")
    gang = job("job-config-6", "default", "prod", instances=2)
    assert run(s, first).kind == "place"
    d = s.schedule(gang)
    assert d.kind == "wait"
    assert "Gang of 2 tasks needs 2 nodes with 1 free leaf cell each in VC default; 1 available." in d.reason
    s.release(first.name)
    d = run(s, gang)
    assert d.kind == "place" and len(d.placements) == 2
    assert nodes_of(s, gang.name) == ["hostname-carol", "hostname-dan"]


def test_incremental_places_one_then_the_other():
    s = sched("one-vc")
    first = job("job-config-5", "default", "prod")
    inc = job("job-config-7", "default", "prod", instances=2, gang=False)
    assert run(s, first).kind == "place"
    d = run(s, inc)
    assert d.kind == "place" and [(p.task_role, p.index) for p in d.placements] == [("train", 0)]
    d = s.schedule(inc)  # pending computed from what is already placed
    assert d.kind == "wait"
    s.release(first.name)
    d = run(s, inc)
    assert [(p.task_role, p.index) for p in d.placements] == [("train", 1)]
    assert nodes_of(s, inc.name) == ["hostname-carol", "hostname-dan"]


def test_gang_over_quota_rejected_with_openpai_message():
    s = sched("one-vc")
    with pytest.raises(QuotaExceededError) as e:
        s.validate(job("big", "default", "prod", instances=4))
    assert e.value.message == "Job requests 4 SKUs, exceeds maximum 2 SKUs in VC default."


def test_non_gang_four_instances_accepted_and_placed_two_at_a_time():
    s = sched("one-vc")
    inc = job("big", "default", "prod", instances=4, gang=False)
    s.validate(inc)
    d = run(s, inc)
    assert [p.index for p in d.placements] == [0, 1]
    assert s.schedule(inc).kind == "wait"
    s.release(inc.name, [("train", 0), ("train", 1)])  # both finished: the caller says what is pending
    inc = job("big", "default", "prod", instances=4, gang=False, pending=(("train", 2), ("train", 3)))
    d = run(s, inc)
    assert [p.index for p in d.placements] == [2, 3]


# ---------------------------------------------------------------- validation table
@pytest.mark.parametrize(
    "req, error, field",
    [
        pytest.param(job("x", "nope", "prod"), ValidationError, "defaults.virtualCluster", id="unknown-vc"),
        pytest.param(
            job("x", "vc1", "prod", sku="GPU-X"),
            ValidationError,
            "extras.hivedScheduler.taskRoles.train.skuType",
            id="unknown-sku",
        ),
        pytest.param(
            job("x", "vc1", "prod", sku="GPU-C"),
            ValidationError,
            "taskRoles.train.resourcePerInstance",
            id="sku-of-other-vc",
        ),
        pytest.param(
            job("x", "vc1", "prod", pinned="p1"),
            ValidationError,
            "extras.hivedScheduler.taskRoles.train.pinnedCellId",
            id="unknown-pinned",
        ),
        pytest.param(
            job("x", "vc1", "prod", gpu=2, gang=False),
            ValidationError,
            "taskRoles.train.resourcePerInstance",
            id="task-bigger-than-node",
        ),
        pytest.param(
            job("x", "vc1", "prod", cpu=3, gang=False),
            ValidationError,
            "taskRoles.train.resourcePerInstance",
            id="cpu-needs-two-leaf-cells",
        ),
        pytest.param(job("x", "vc1", "prod", instances=2), QuotaExceededError, None, id="gang-over-vc"),
    ],
)
def test_validate_rejects(req, error, field):
    s = sched("two-vcs")
    with pytest.raises(error) as e:
        s.validate(req)
    if field:
        assert e.value.field == field


def test_oppo_checked_against_cluster_not_vc():
    s = sched("two-vcs")
    with pytest.raises(ValidationError):  # a guaranteed vc1 job cannot use default's GPU-C
        s.validate(job("g", "vc1", "prod", sku="GPU-C"))
    oppo = job("o", "vc1", "oppo", sku="GPU-C")
    s.validate(oppo)
    assert run(s, oppo).kind == "place" and nodes_of(s, oppo.name) == ["hostname-carol"]
    # one affinity group uses one leaf type (HiveD): 2 oppo instances exceed the 1 GPU-C cell
    with pytest.raises(QuotaExceededError, match="in the cluster"):
        s.validate(job("o2", "vc1", "oppo", instances=2))


# ---------------------------------------------------------------- allocate / release / health
def test_allocate_conflict_raises_platform_error():
    s = sched("one-vc")
    a, b = job("a", "default", "prod"), job("b", "default", "test")
    pl = (TaskPlacement("train", 0, "hostname-carol", (0,), (0,)),)
    s.allocate(a.name, a, pl)
    s.allocate(a.name, a, pl)  # identical re-allocate is a no-op
    with pytest.raises(PlatformError):
        s.allocate(b.name, b, pl)
    with pytest.raises(PlatformError):
        s.allocate(b.name, b, (TaskPlacement("train", 0, "hostname-x", (0,), (0,)),))
    with pytest.raises(PlatformError):
        s.allocate(b.name, b, (TaskPlacement("train", 0, "hostname-dan", (0,), (3,)),))


def test_release_is_idempotent_and_frees_everything():
    s = sched("one-vc")
    g = job("g", "default", "prod", instances=2)
    run(s, g)
    s.release(g.name)
    s.release(g.name)
    s.release("never-seen")
    st = s.status()["virtualClusters"]["default"]
    assert {k: st[k] for k in ("quota", "used", "free", "reserved", "opportunisticUsed")} == {
        "quota": 2,
        "used": 0,
        "free": 2,
        "reserved": 0,
        "opportunisticUsed": 0,
    }
    assert st["cells"] == {"GPU-NODE-POOL/2": {"total": 2, "bound": 0, "free": 2}}  # lazily unbound again
    s.check_invariants()


def test_unhealthy_node_skipped_but_counted():
    s = sched("one-vc")
    s.set_node_health("hostname-carol", False)
    d = run(s, job("a", "default", "prod"))
    assert nodes_of(s, "alice~a") == ["hostname-dan"]
    w = s.schedule(job("b", "default", "test"))
    assert w.kind == "wait" and "node hostname-carol unhealthy" in w.reason
    assert s.status()["virtualClusters"]["default"]["quota"] == 2
    s.set_node_health("hostname-carol", True)
    assert run(s, job("b", "default", "test")).kind == "place"
    assert d.reason.startswith("Placing 1 of 1")


def test_nodes_inventory():
    s = sched("two-vcs")
    inv = s.nodes()
    assert inv["hostname-carol"].sku_type == "GPU-C" and inv["hostname-dan"].gpus == 1
