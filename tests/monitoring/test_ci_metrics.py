"""The CI/CD metrics (apiary.monitoring.ci_metrics over apiary.ci.records): computed from the store at
each scrape, so a restarted control plane exports exactly what the records say; bounded windows;
the histogram's buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.api.test_ci_records import a_deployment, a_run, finished_run
from tests.monitoring.helpers import parse, scrape, value
from tests.support.auth import Principals, bearer
from tests.support.plane import Harness

from apiary.api import create_app
from apiary.auth import Directory
from apiary.ci.records import METRICS_WINDOW_RUNS, CiRecords
from apiary.monitoring.ci_metrics import STAGE_BUCKETS, CiCollector
from apiary.store.models import CiRecord


def metrics(client: TestClient) -> dict[str, list]:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    return parse(r.text)


def test_the_metrics_are_rebuilt_from_the_store_after_a_restart(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    bridge = bearer(Principals(Directory(harness.plane.sessions), ["default"]).service("bridge"))
    with TestClient(create_app(harness.plane)) as c:
        def post(path: str, body: dict) -> None:
            r = c.post(path, json=body, headers=bridge)
            assert r.status_code in (200, 201), r.text

        # acme/apiary's default branch: succeeded, then failed (newest); a later PR run and a running
        # default-branch run do not change its gauge. acme/docs: failed, then succeeded.
        post("/api/v2/ci/runs", finished_run("m1", "success", kind="deploy", prNumber=None,
                                             startedAt="2026-11-25T08:00:00Z", finishedAt="2026-11-25T08:05:00Z"))
        post("/api/v2/ci/runs", finished_run("m2", "failure", kind="deploy", prNumber=None,
                                             startedAt="2026-11-25T09:00:00Z", finishedAt="2026-11-25T09:05:00Z"))
        post("/api/v2/ci/runs", finished_run("p1", "success", startedAt="2026-11-25T09:30:00Z",
                                             finishedAt="2026-11-25T09:35:00Z"))
        post("/api/v2/ci/runs", a_run("m3", kind="deploy", prNumber=None, startedAt="2026-11-25T10:00:00Z"))
        post("/api/v2/ci/runs", finished_run("d1", "failure", repo="acme/docs", kind="deploy", prNumber=None,
                                             startedAt="2026-11-25T08:00:00Z", finishedAt="2026-11-25T08:05:00Z"))
        post("/api/v2/ci/runs", finished_run("d2", "error", repo="acme/docs", kind="deploy", prNumber=None,
                                             startedAt="2026-11-25T08:30:00Z", finishedAt="2026-11-25T08:35:00Z"))
        post("/api/v2/ci/runs", finished_run("d3", "success", repo="acme/docs", kind="deploy", prNumber=None,
                                             startedAt="2026-11-25T09:00:00Z", finishedAt="2026-11-25T09:05:00Z"))
        post("/api/v2/deployments", a_deployment(startedAt="2026-11-25T11:50:00Z", finishedAt="2026-11-25T12:00:00Z"))
        post("/api/v2/deployments", a_deployment(result="rolled_back", startedAt="2026-11-25T13:00:00Z",
                                                 finishedAt="2026-11-25T13:04:00Z"))
        post("/api/v2/deployments", a_deployment(trigger="rollback", actor="root", startedAt="2026-11-25T14:00:00Z",
                                                 finishedAt="2026-11-25T14:01:30Z"))
        before = metrics(c)

    restarted = harness.restart()  # a new control plane on the same database: nothing kept in memory
    with TestClient(create_app(restarted.plane)) as c:
        after = metrics(c)
    assert after == before

    assert value(after, "apiary_ci_default_branch_last_run_success", repo="acme/apiary") == 0.0
    assert value(after, "apiary_ci_default_branch_last_run_success", repo="acme/docs") == 1.0
    assert {s.labels["result"]: s.value for s in after["apiary_ci_runs_total"]} == {
        "success": 3.0, "failure": 2.0, "error": 1.0}
    assert {s.labels["result"]: s.value for s in after["apiary_deploy_total"]} == {
        "succeeded": 2.0, "rolled_back": 1.0, "failed": 0.0}
    assert value(after, "apiary_deploy_rollbacks_total") == 2.0  # the gate's rollback and the operator's
    assert value(after, "apiary_deploy_duration_seconds") == 90.0  # the newest deployment's
    assert value(after, "apiary_deploy_last_success_timestamp_seconds") == 1_795_615_290.0  # 14:01:30Z
    # The stages that ran in the 6 finished runs: lint (12.5 s) in all, unit (200 s) in all, build
    # (95 s) in the 3 that succeeded; skipped and running stages are not durations.
    assert value(after, "apiary_ci_stage_duration_seconds_count", stage="lint") == 6.0
    assert value(after, "apiary_ci_stage_duration_seconds_sum", stage="unit") == 1200.0
    assert value(after, "apiary_ci_stage_duration_seconds_count", stage="build") == 3.0
    assert value(after, "apiary_ci_stage_duration_seconds_bucket", stage="unit", le="120.0") == 0.0
    assert value(after, "apiary_ci_stage_duration_seconds_bucket", stage="unit", le="300.0") == 6.0
    assert value(after, "apiary_ci_stage_duration_seconds_bucket", stage="lint", le="30.0") == 6.0
    assert value(after, "apiary_ci_stage_duration_seconds_bucket", stage="lint", le="10.0") == 0.0
    assert {s.labels["stage"] for s in after["apiary_ci_stage_duration_seconds_count"]} == {"lint", "unit", "build"}
    restarted.engine.dispose()


def test_an_empty_store_exports_zero_counters_and_no_gauges(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    got = parse(scrape(CiCollector(CiRecords(harness.plane.sessions).metrics_snapshot)))
    assert value(got, "apiary_deploy_rollbacks_total") == 0.0  # present from the start: increase() sees the first
    assert {s.value for s in got["apiary_ci_runs_total"]} == {0.0} and len(got["apiary_ci_runs_total"]) == 3
    assert {s.value for s in got["apiary_deploy_total"]} == {0.0} and len(got["apiary_deploy_total"]) == 3
    for absent in ("apiary_deploy_duration_seconds", "apiary_deploy_last_success_timestamp_seconds",
                   "apiary_ci_default_branch_last_run_success", "apiary_ci_stage_duration_seconds_count"):
        assert absent not in got
    harness.engine.dispose()


def test_the_stage_histogram_covers_a_bounded_window_of_the_newest_runs(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    total = METRICS_WINDOW_RUNS + 20
    with harness.plane.sessions() as session, session.begin():
        for i in range(total):
            # the 20 oldest runs took an hour each; the window must leave them out
            seconds = 3600.0 if i < 20 else 10.0
            session.add(CiRecord(flow_run_id=f"r{i}", repo="acme/apiary", sha="a" * 40, ref="refs/heads/main",
                              kind="deploy", result="success", started_at=1000.0 + i, finished_at=2000.0 + i,
                              duration_s=1.0, stages=[{"name": "unit", "state": "passed", "durationS": seconds,
                                                       "summary": ""}]))
    got = parse(scrape(CiCollector(CiRecords(harness.plane.sessions).metrics_snapshot)))
    assert value(got, "apiary_ci_stage_duration_seconds_count", stage="unit") == METRICS_WINDOW_RUNS
    assert value(got, "apiary_ci_stage_duration_seconds_sum", stage="unit") == 10.0 * METRICS_WINDOW_RUNS
    assert value(got, "apiary_ci_runs_total", result="success") == total  # the counter counts every run
    harness.engine.dispose()


@pytest.mark.parametrize(("seconds", "first_le"), [(0.2, 1.0), (1.0, 1.0), (1.5, 5.0), (3600.0, 3600.0),
                                                   (3600.5, None)])
def test_stage_buckets_are_inclusive_upper_bounds(seconds: float, first_le: float | None) -> None:
    got = parse(scrape(CiCollector(lambda: {"stage_durations": [("unit", seconds)]})))
    counted = {float(s.labels["le"]): s.value for s in got["apiary_ci_stage_duration_seconds_bucket"]}
    assert counted[float("inf")] == 1.0
    for le in STAGE_BUCKETS:
        assert counted[le] == (1.0 if first_le is not None and le >= first_le else 0.0), le


def test_stage_label_values_are_bounded() -> None:
    durations = [(f"stage-{i}", 1.0) for i in range(150)]
    got = parse(scrape(CiCollector(lambda: {"stage_durations": durations}, max_stages=100)))
    assert len(got["apiary_ci_stage_duration_seconds_count"]) == 100
