"""The ``prefect`` benchmark (bench/prefect_lag.py): how lags are computed (pure), and a smoke run of
``bench/run.py --quick --only prefect.catch_up`` on SQLite (no PostgreSQL needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def prefect_lag(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import prefect_lag

    return prefect_lag


def ev(job: str, kind: str, t: float) -> dict:
    return {"jobId": job, "type": kind, "time": t, "data": {}}


def test_lags_per_transition(prefect_lag) -> None:
    events = [
        ev("a~1", "job.submitted", 100.0),
        ev("a~1", "job.placed", 100.1),
        ev("a~1", "task.started", 100.5),
        ev("a~1", "task.started", 100.7),  # the first one counts
        ev("a~1", "job.completed", 101.0),
    ]
    states = {
        "a~1": [
            ("RUNNING", "Submitted", 100.2),
            ("PENDING", "Waiting", 100.3),
            ("RUNNING", "Running", 102.5),
            ("COMPLETED", "Completed", 104.0),
        ]
    }
    lags, missing = prefect_lag.job_lags(events, states, t_end=200.0)
    assert lags == {"created": [pytest.approx(0.2)], "running": [pytest.approx(2.0)], "final": [pytest.approx(3.0)]}
    assert missing == {}


def test_submitted_is_not_running_but_a_terminal_state_is(prefect_lag) -> None:
    events = [ev("a~1", "job.submitted", 10.0), ev("a~1", "task.started", 11.0), ev("a~1", "job.completed", 12.0)]
    states = {"a~1": [("RUNNING", "Submitted", 10.5), ("COMPLETED", "Completed", 15.0)]}
    lags, missing = prefect_lag.job_lags(events, states, t_end=50.0)
    assert lags["running"] == [4.0] and lags["final"] == [3.0] and missing == {}


def test_missing_states_count_as_lower_bounds(prefect_lag) -> None:
    events = [
        ev("a~1", "job.submitted", 10.0),
        ev("a~1", "task.started", 11.0),
        ev("a~1", "job.completed", 12.0),
        ev("b~2", "job.submitted", 20.0),
    ]
    states = {"a~1": [("RUNNING", "Submitted", 10.5), ("RUNNING", "Running", 13.0)]}  # no end; b: no run
    lags, missing = prefect_lag.job_lags(events, states, t_end=100.0)
    assert lags["final"] == [88.0] and missing["final"] == 1
    assert sorted(lags["created"]) == [0.5, 80.0] and missing["created"] == 1
    assert lags["running"] == [2.0] and "running" not in missing


def test_lag_result_pools_running_and_final(prefect_lag) -> None:
    r = prefect_lag.LagResult(database="postgresql", rate_per_s=20, duration_s=60, submitted=2)
    r.lags = {"created": [100.0, 100.0], "running": [1.0, 2.0], "final": [3.0, 4.0]}
    r.missing = {"final": 1}
    d = r.to_dict()
    assert d["ui_lag_samples"] == 4 and d["ui_lag_missing"] == 1
    assert d["ui_lag_max_s"] == 4.0 and d["ui_lag_p50_s"] == 2.5
    assert d["ui_lag_by_transition"]["created"]["count"] == 2


def test_request_summary(prefect_lag) -> None:
    rows = [
        [1.0, "POST", "/api/task_runs/", 201, 0.010],
        [1.1, "POST", "/api/task_runs/", 503, 0.030],
        [1.2, "POST", "/api/flow_runs/{id}/set_state", 201, 0.020],
    ]
    s = prefect_lag.summarize_requests(rows, jobs=2, wall_s=2.0)
    assert s["requests"] == 3 and s["requests_per_job"] == 1.5 and s["requests_per_s"] == 1.5
    tr = s["endpoints"]["POST /api/task_runs/"]
    assert tr["count"] == 2 and tr["per_job"] == 1.0 and tr["errors"] == 1 and tr["total_s"] == 0.0


@pytest.mark.e2e
@pytest.mark.prefect
@pytest.mark.timeout(600)
def test_quick_catch_up_on_sqlite_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"lifecycle": {"kept": True}}))
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "run.py"),
            "--quick",
            "--only",
            "prefect.catch_up",
            "--prefect-only-sqlite",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["lifecycle"] == {"kept": True}
    sec = data["prefect"]["sqlite"]
    assert sec["catch_up_jobs"] == 100 and sec["catch_up_complete"] is True
    assert sec["catch_up_100_s"] > 0 and sec["catch_up_cpu"]["cpu_s"]["prefect-server"] > 0
    assert sec["method"] and data["prefect"]["measured_at"]


def test_steady_window_counts_jobs_final_in_both_and_only_platform_processes(prefect_lag) -> None:
    events = [
        {"jobId": "a", "type": "job.completed", "time": 105.0},
        {"jobId": "b", "type": "job.completed", "time": 106.0},
        {"jobId": "c", "type": "job.completed", "time": 107.0},  # Prefect final after the window
        {"jobId": "d", "type": "job.completed", "time": 95.0},  # before the window
        {"jobId": "e", "type": "job.submitted", "time": 101.0},  # never finished
    ]
    states = {
        "a": [("RUNNING", "Submitted", 104.0), ("COMPLETED", "Completed", 106.0)],
        "b": [("COMPLETED", "Completed", 109.5)],
        "c": [("COMPLETED", "Completed", 121.0)],
        "d": [("COMPLETED", "Completed", 99.0)],
    }
    done = prefect_lag.finished_both(events, states)
    assert done == {"a": 106.0, "b": 109.5, "c": 121.0, "d": 99.0}
    w = prefect_lag.WindowMeter(None, 0, 0)
    w.snaps = [
        (100.0, {"control-plane": 1.0, "agent": 1.0, "postgres": 0.0, "prefect-server": 2.0, "bench": 5.0}),
        (120.0, {"control-plane": 1.5, "agent": 1.1, "postgres": 0.2, "prefect-server": 2.2, "bench": 9.0}),
    ]
    r = w.result(done)
    assert r["jobs_final"] == 2  # a and b
    # 0.5 + 0.1 + 0.2 + 0.2 CPU-s of the platform over 2 jobs; the bench's own 4 s are left out
    assert r["cpu_ms_per_job"] == 500.0
    assert r["by_process_ms_per_job"]["bench"] == 2000.0
    assert r["cores_used"] == 0.05


def test_steady_window_without_both_snapshots_or_jobs_gives_no_figure(prefect_lag) -> None:
    w = prefect_lag.WindowMeter(None, 0, 0)
    assert w.result({"a": 1.0}) == {}
    w.snaps = [(100.0, {"agent": 0.0}), (110.0, {"agent": 1.0})]
    assert w.result({})["cpu_ms_per_job"] is None


def test_job_durations_run_from_submission_to_completion(prefect_lag) -> None:
    events = [
        {"jobId": "a", "type": "job.submitted", "time": 10.0},
        {"jobId": "b", "type": "job.submitted", "time": 10.5},
        {"jobId": "a", "type": "task.started", "time": 10.1},
        {"jobId": "a", "type": "job.completed", "time": 10.25},
        {"jobId": "c", "type": "job.completed", "time": 11.0},  # its submission was not read: left out
    ]
    assert prefect_lag.job_durations(events) == [pytest.approx(0.25)]  # b has not ended
