"""``apiary sim scenario``: the five Lab 6 behaviours, fail-node/recover-node and the output shape,
replayed deterministically on the Lab 6 configs (examples/lab6) with the real HivedScheduler."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from apiary.sim.scenario import run_scenario

LAB6 = Path(__file__).resolve().parents[2] / "examples" / "lab6"
TWO_VCS = str(LAB6 / "hived-config-two-vcs.yaml")
ONE_VC = str(LAB6 / "hived-config-one-vc.yaml")


def job(n: int, **changes) -> dict | str:
    """Lab 6's job-config-N (its path), or an inline copy with dotted-key ``changes``."""
    if not changes:
        return str(LAB6 / f"job-config-{n}.yaml")
    doc = yaml.safe_load((LAB6 / f"job-config-{n}.yaml").read_text())
    for dotted, value in changes.items():
        node = doc
        *path, last = dotted.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return doc


def run(tmp_path: Path, cluster: str, events: list[dict]) -> dict:
    p = tmp_path / "scenario.yaml"
    p.write_text(yaml.safe_dump({"cluster": cluster, "events": events}, sort_keys=False))
    return run_scenario(p)["jobs"]


def nodes(j: dict, attempt: int = -1) -> list[str]:
    return [p["node"] for p in j["attempts"][attempt]["placements"]]


def test_vc_safety(tmp_path):
    jobs = run(tmp_path, TWO_VCS, [
        {"at": 0, "user": u, "duration": 100, "submit": job(0)} for u in ("alice", "bob", "carol")
    ])
    spans = sorted((j["started"], j["finished"]) for j in jobs.values())
    assert spans == [(0, 100), (100, 200), (200, 300)]  # one at a time on vc1's single GPU
    assert {n for j in jobs.values() for n in nodes(j)} == {"hostname-dan"}  # never the idle VC default node
    assert all(j["state"] == "SUCCEEDED" for j in jobs.values())
    assert any("VC vc1" in r for r in jobs["carol~job-config-0"]["waitingReasons"])


def test_preemption_with_retry(tmp_path):
    jobs = run(tmp_path, TWO_VCS, [
        {"at": 0, "user": "alice", "duration": 100, "submit": job(1)},  # test
        {"at": 10, "user": "bob", "duration": 50, "submit": job(2)},  # prod
    ])
    low, high = jobs["alice~job-config-1"], jobs["bob~job-config-2"]
    assert (high["started"], high["finished"]) == (10, 60)
    assert low["preemptions"] == 1 and low["retries"] == 1
    assert [(a["started"], a["finished"]) for a in low["attempts"]] == [(0, 10), (60, 160)]
    assert low["state"] == high["state"] == "SUCCEEDED"
    assert any("Preempted by bob~job-config-2" in r for r in low["waitingReasons"])
    assert any(r.startswith("Preempting alice~job-config-1") for r in high["waitingReasons"])


def test_opportunistic_placement_and_preemption(tmp_path):
    jobs = run(tmp_path, TWO_VCS, [
        {"at": 0, "user": "alice", "duration": 100, "submit": job(3)},  # prod, vc1 -> dan
        {"at": 10, "user": "bob", "duration": 100, "submit": job(4)},  # oppo, vc1 -> idle carol (VC default)
        {"at": 20, "user": "carol", "duration": 100,
         "submit": job(5, name="test-in-default", **{"extras.hivedScheduler.jobPriorityClass": "test"})},
    ])
    oppo = jobs["bob~job-config-4"]
    assert oppo["attempts"][0]["started"] == 10 and nodes(oppo, 0) == ["hostname-carol"]
    assert oppo["preemptions"] == 1 and oppo["attempts"][0]["finished"] == 20
    test_job = jobs["carol~test-in-default"]
    assert (test_job["started"], nodes(test_job)) == (20, ["hostname-carol"])
    # resumes when a cell frees: dan at 100 when the prod job ends
    assert oppo["attempts"][1]["started"] == 100 and nodes(oppo) == ["hostname-dan"]
    assert oppo["state"] == "SUCCEEDED" and oppo["finished"] == 200


def test_gang_waits_for_all(tmp_path):
    jobs = run(tmp_path, ONE_VC, [
        {"at": 0, "user": "alice", "duration": 100, "submit": job(5)},
        {"at": 10, "user": "alice", "duration": 50, "submit": job(6)},  # gang of 2
    ])
    g = jobs["alice~job-config-6"]
    assert len(g["attempts"]) == 1
    starts = {p["node"] for p in g["attempts"][0]["placements"]}
    assert g["started"] == 100 and starts == {"hostname-carol", "hostname-dan"}  # both at once, only then
    assert g["finished"] == 150 and g["waitingReasons"]


def test_incremental_and_gang_rejection(tmp_path):
    jobs = run(tmp_path, ONE_VC, [
        {"at": 0, "user": "bob", "duration": 100, "submit": job(5)},
        {"at": 10, "user": "bob", "duration": 200, "submit": job(7)},  # gangAllocation: false, 2 instances
        {"at": 20, "user": "bob", "duration": 10, "submit": job(6, name="gang-4", **{"taskRoles.train.instances": 4})},
    ])
    inc = jobs["bob~job-config-7"]
    placements = inc["attempts"][0]["placements"]
    assert len(placements) == 2 and {p["node"] for p in placements} == {"hostname-carol", "hostname-dan"}
    assert inc["started"] == 10
    # the second instance started at 100 when the holder ended; minSucceededInstances 1 ends the job at 210
    assert inc["state"] == "SUCCEEDED" and inc["finished"] == 210
    rej = jobs["bob~gang-4"]
    assert rej["state"] == "REJECTED" and rej["attempts"] == []
    assert "Job requests 4 SKUs, exceeds maximum 2 SKUs in VC default." in rej["waitingReasons"][0]


def test_fail_and_recover_node(tmp_path):
    jobs = run(tmp_path, ONE_VC, [
        {"at": 0, "user": "alice", "duration": 100, "submit": job(5)},
        {"at": 0, "user": "bob", "duration": 100, "submit": job(5)},
        {"at": 30, "fail-node": "hostname-dan"},
        {"at": 60, "recover-node": "hostname-dan"},
    ])
    on_dan = [j for j in jobs.values() if nodes(j, 0) == ["hostname-dan"]]
    other = [j for j in jobs.values() if nodes(j, 0) != ["hostname-dan"]]
    assert len(on_dan) == 1 and len(other) == 1
    lost = on_dan[0]
    assert lost["retries"] == 1 and lost["preemptions"] == 0
    assert lost["attempts"][0]["finished"] == 30
    assert lost["attempts"][1]["started"] == 60 and nodes(lost) == ["hostname-dan"]  # waits for the recovery
    assert lost["state"] == "SUCCEEDED" and lost["finished"] == 160
    assert any("Node hostname-dan was lost" in r for r in lost["waitingReasons"])
    assert other[0]["retries"] == 0 and other[0]["finished"] == 100


def test_output_shape_and_determinism(tmp_path):
    events = [
        {"at": 0, "user": "alice", "duration": 100, "submit": job(1)},
        {"at": 10, "user": "bob", "duration": 50, "submit": job(2)},
    ]
    a = run(tmp_path, TWO_VCS, events)
    b = run(tmp_path, TWO_VCS, events)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    for j in a.values():
        assert set(j) == {"state", "submitted", "started", "finished", "retries", "preemptions", "waitingReasons",
                          "attempts"}
        for att in j["attempts"]:
            assert set(att) == {"started", "finished", "placements"}
            for p in att["placements"]:
                assert set(p) == {"taskRole", "index", "node", "leafCellIndices"}
                assert all(isinstance(i, int) for i in p["leafCellIndices"])
    assert a["bob~job-config-2"]["attempts"][0]["placements"] == [
        {"taskRole": "train", "index": 0, "node": "hostname-dan", "leafCellIndices": [0]}
    ]
