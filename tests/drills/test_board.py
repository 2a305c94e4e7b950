"""Drill results reach /metrics: POST /api/v2/drills/results -> DrillBoard -> apiary_probe_* / apiary_drill_*."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.drills.board import DrillBoard
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

T0 = 1_700_000_000.0


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def report(drill: str = "inspection", result: str = "passed", **extra) -> dict:
    return {"drill": drill, "result": result, "startedAt": T0, "finishedAt": T0 + 12.5, **extra}


@pytest.fixture
def api(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs")
    principals = Principals(Directory(plane.sessions), plane.cluster.virtual_clusters)
    board = DrillBoard(tmp_path / "drills.json")
    with TestClient(create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}), drills=board)) as c:
        yield c, bearer(principals.admin()), bearer(principals.service("bridge")), board
    engine.dispose()


def test_probe_results_become_probe_metrics(api) -> None:
    c, admin, _, _ = api
    probes = [
        {"virtualCluster": "default", "success": True, "phases": {"schedule": 1.5, "run": 0.5, "total": 2.0},
         "jobId": "admin~apiary-probe-default-x"},
        {"virtualCluster": "vc1", "success": False, "phases": {}, "reason": "still WAITING after the SLO of 5 s"},
    ]
    r = c.post("/api/v2/drills/results", json=report(result="failed", probes=probes), headers=admin)
    assert r.status_code == 200, r.text
    assert r.json() == {"drill": "inspection", "result": "failed", "startedAt": T0, "finishedAt": T0 + 12.5,
                        "durationS": 12.5, "summary": "", "lastSuccessAt": None}
    m = samples(c.get("/metrics").text)
    assert m[("apiary_probe_success", (("virtual_cluster", "default"),))] == 1.0
    assert m[("apiary_probe_success", (("virtual_cluster", "vc1"),))] == 0.0
    assert m[("apiary_probe_duration_seconds", (("phase", "schedule"), ("virtual_cluster", "default")))] == 1.5
    assert ("apiary_probe_duration_seconds", (("phase", "total"), ("virtual_cluster", "vc1"))) not in m
    assert m[("apiary_probe_last_run_timestamp_seconds", (("virtual_cluster", "vc1"),))] == T0 + 12.5
    assert m[("apiary_probe_runs_total", (("result", "failure"), ("virtual_cluster", "vc1")))] == 1.0
    assert m[("apiary_drill_result", (("drill", "inspection"),))] == 0.0
    assert ("apiary_drill_last_success_timestamp_seconds", (("drill", "inspection"),)) not in m
    page = c.get("/api/v2/drills", headers=admin).json()
    assert [p["virtualCluster"] for p in page["probes"]] == ["default", "vc1"]
    assert page["probes"][1]["reason"] == "still WAITING after the SLO of 5 s"


def test_drill_results_and_node_failures(api) -> None:
    c, _, bridge, _ = api  # the drills' Prefect flows may report with the service token
    failures = [{"node": "hostname-dan", "rule": "matmul-below-baseline", "detail": "-90%"}]
    assert c.post("/api/v2/drills/results", json=report("stress-drill", "passed"), headers=bridge).status_code == 200
    assert c.post("/api/v2/drills/results", json=report("stress-drill", "failed", nodeFailures=failures),
                  headers=bridge).status_code == 200
    assert c.post("/api/v2/drills/results", json=report("chaos-drill", "aborted"), headers=bridge).status_code == 200
    m = samples(c.get("/metrics").text)
    assert m[("apiary_drill_result", (("drill", "stress-drill"),))] == 0.0
    assert m[("apiary_drill_last_success_timestamp_seconds", (("drill", "stress-drill"),))] == T0 + 12.5
    assert m[("apiary_drill_runs_total", (("drill", "stress-drill"), ("result", "failed")))] == 1.0
    assert m[("apiary_drill_runs_total", (("drill", "chaos-drill"), ("result", "aborted")))] == 1.0
    assert m[("apiary_drill_duration_seconds", (("drill", "chaos-drill"),))] == 12.5
    assert m[("apiary_drill_node_failed", (("node", "hostname-dan"), ("rule", "matmul-below-baseline")))] == 1.0
    # Another drill's report leaves the stress drill's failures; the next stress drill's [] clears them.
    c.post("/api/v2/drills/results", json=report("load-drill"), headers=bridge)
    assert ("apiary_drill_node_failed", (("node", "hostname-dan"), ("rule", "matmul-below-baseline"))) in samples(
        c.get("/metrics").text)
    c.post("/api/v2/drills/results", json=report("stress-drill", nodeFailures=[]), headers=bridge)
    assert not [k for k in samples(c.get("/metrics").text) if k[0] == "apiary_drill_node_failed"]


@pytest.mark.parametrize(("body", "field"), [
    pytest.param(report(result="maybe"), "result", id="result"),
    pytest.param(report(drill="Not A Name"), "drill", id="drill name"),
    pytest.param(report(startedAt=-1), "startedAt", id="negative time"),
    pytest.param(report(probes=[{"virtualCluster": "vc1", "success": True, "phases": {"warp": 1}}]),
                 "probes[0].phases.warp.[key]", id="unknown phase"),
    pytest.param(report(probes=[{"virtualCluster": "vc1", "success": True, "phases": {"run": -1}}]),
                 "probes[0].phases.run", id="negative phase"),
])
def test_a_bad_report_is_a_400_naming_the_field(api, body: dict, field: str) -> None:
    c, admin, _, _ = api
    r = c.post("/api/v2/drills/results", json=body, headers=admin)
    assert r.status_code == 400 and r.json()["field"] == field, r.text


def test_the_board_survives_a_restart_and_an_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "drills.json"
    board = DrillBoard(path, clock=lambda: T0)
    board.record(report("load-drill", "passed"))
    board.record(report("load-drill", "failed"))
    again = DrillBoard(path).snapshot()
    assert again["drills"][0]["lastSuccessAt"] == T0 + 12.5 and again["drills"][0]["result"] == "failed"
    assert again["drill_runs"] == {"load-drill": {"passed": 1, "failed": 1}}
    path.write_text("{not json")
    assert DrillBoard(path).snapshot()["drills"] == []  # logged, started afresh: never a failed start
