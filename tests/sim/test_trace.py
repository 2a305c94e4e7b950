"""Trace loading, machine lists -> HiveD cluster configs, and the VC quota rule."""

from __future__ import annotations

import pytest
from tests.support.shared import PHILLY_2K, PHILLY_MACHINES, PHILLY_MACHINES_REVISED, shared_file

from apiary.errors import ValidationError
from apiary.scheduler import HivedScheduler
from apiary.sim.cluster import (
    Machine,
    derive_quotas,
    load_machines,
    machines_to_cluster,
    min_cells,
    private_cluster,
    vc_gpus,
)
from apiary.sim.policies import config_nodes
from apiary.sim.trace import load_trace, task_split, trace_stats


def test_philly_sample():
    jobs = load_trace(PHILLY_2K)
    assert len(jobs) == 2000
    assert jobs[0].submit == 0.0
    assert all(a.submit <= b.submit for a, b in zip(jobs, jobs[1:], strict=False))
    assert {j.priority for j in jobs} == {100} and all(j.gang for j in jobs)
    assert {j.gpus for j in jobs} <= {1, 2, 4, 8, 12, 16, 24, 32, 64, 128}
    assert "6214e9" in {j.vc for j in jobs}
    first = PHILLY_2K.read_text().splitlines()[1].split(",")
    assert any(j.duration == float(first[1]) and j.vc == first[4] for j in jobs)
    assert len(load_trace(PHILLY_2K, limit=10)) == 10


def test_generic_csv(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("submit_s,duration_s,gpus,vc,priority,gang,name\n"
                 "100,60,16,research,crit,true,big\n"
                 "50,30,1,prod-vc,,false,\n"
                 "50,10,2,research,oppo,,\n")
    jobs = load_trace(p)
    assert [(j.submit, j.name, j.gpus, j.vc, j.priority, j.gang) for j in jobs] == [
        (0.0, "job-2", 1, "prod-vc", 100, False),
        (0.0, "job-3", 2, "research", -1, True),
        (50.0, "big", 16, "research", 120, True),
    ]
    bad = tmp_path / "bad.csv"
    bad.write_text("submit_s,duration_s,gpus,vc\n0,10,0,a\n")
    with pytest.raises(ValidationError):
        load_trace(bad)
    with pytest.raises(ValidationError):
        (tmp_path / "x.csv").write_text("a,b\n1,2\n")
        load_trace(tmp_path / "x.csv")


def test_task_split():
    assert task_split(1) == (1, 1)
    assert task_split(8) == (1, 8)
    assert task_split(12) == (2, 8)
    assert task_split(16) == (2, 8)
    assert task_split(128) == (16, 8)


def test_philly_machines_cluster():
    ms = load_machines(PHILLY_MACHINES)
    assert len(ms) == 552 and sum(m.gpus for m in ms) == 2490
    assert sorted({m.gpus for m in ms}) == [2, 8]
    assert sum(m.gpus == 8 for m in ms) == 231 and sum(m.gpus == 2 for m in ms) == 321
    cfg = machines_to_cluster(ms)
    nodes = config_nodes(cfg)
    assert len(nodes) == 552 and sum(n.gpus for n in nodes) == 2490
    assert set(cfg.physical_cluster.cell_types) == {"NODE-8GPU", "POOL-8GPU", "NODE-2GPU", "POOL-2GPU"}
    assert {n.name for n in nodes} == {m.name for m in ms}
    revised = load_machines(PHILLY_MACHINES_REVISED)
    assert len(revised) == 539 and {m.gpus for m in revised} == {2, 3, 4, 8}  # 13 machines with 0 GPUs skipped
    assert len(config_nodes(machines_to_cluster(revised))) == 539


def test_largest_remainder_and_minimum():
    q = derive_quotas({"a": 55.0, "b": 45.0}, {"a": 1, "b": 1}, {8: 10})
    assert q == {"a": {8: 6}, "b": {8: 4}}  # 5.5 / 4.5 -> the tie goes to "a" (name order)
    q = derive_quotas({"big": 990.0, "tiny": 10.0}, {"big": 8, "tiny": 32}, {8: 10, 2: 10})
    assert q["tiny"][8] >= 4  # its 32-GPU job needs 4 whole 8-GPU cells
    assert q["big"][8] + q["tiny"][8] == 10 and q["big"][2] + q["tiny"][2] == 10
    assert min_cells(1, [2, 8]) == {2: 1} and min_cells(4, [2, 8]) == {8: 1} and min_cells(24, [2, 8]) == {8: 3}


def test_quota_too_small_vc_is_left_short():
    q = derive_quotas({"a": 1.0, "b": 1.0}, {"a": 64, "b": 64}, {8: 10})
    assert q["a"][8] + q["b"][8] == 10  # both want 8 cells: the first served gets them, the other does not


def test_philly_quotas_sum_and_cover():
    jobs = load_trace(shared_file("traces/philly.csv"))  # the whole trace: all 15 VCs
    gt, big = trace_stats(jobs)
    assert len(gt) == 15
    q = derive_quotas(gt, big, {8: 231, 2: 321})
    assert sum(v[8] for v in q.values()) == 231 and sum(v[2] for v in q.values()) == 321
    for vc, n in big.items():
        need = min_cells(n, [2, 8])
        ((g, k),) = need.items()
        assert q[vc][g] >= k or (k == 1 and any(q[vc][s] for s in (2, 8) if s >= g)), vc
    cfg = machines_to_cluster(load_machines(PHILLY_MACHINES), q)
    assert sum(vc_gpus(cfg).values()) == 2490
    HivedScheduler(cfg)  # binds


def test_private_cluster_has_the_vc_cells():
    ms = [Machine(f"m{i}", 8) for i in range(3)] + [Machine(f"s{i}", 2) for i in range(4)]
    cfg = machines_to_cluster(ms, {"a": {8: 2, 2: 1}, "b": {8: 1, 2: 3}})
    priv = private_cluster(cfg, "a")
    nodes = config_nodes(priv)
    assert sorted(n.gpus for n in nodes) == [2, 8, 8]
    assert vc_gpus(priv) == {"a": 18}
    assert set(HivedScheduler(priv).nodes()) == {n.name for n in nodes}
