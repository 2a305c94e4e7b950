"""Jenkins' entry points (``ci/run-pipeline``, ``ci/deploy``; :mod:`apiary.ci.entry`).

The pieces with fakes (stage table, exit codes, artifact copy, log tail, one whole run on a fake
Prefect client and clock), then ``ci/run-pipeline`` as Jenkins runs it, against a real Prefect
server on loopback that serves a stand-in ``platform-ci/pr`` flow (marked ``prefect``, ``e2e``).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prefect.client.schemas.objects import StateType
from tests.support.polling import until

from apiary.ci import entry
from apiary.ci.entry import (
    CI_STAGES,
    DEPLOY,
    DEPLOY_STEPS,
    RUN_PIPELINE,
    CannotRun,
    LogTail,
    Options,
    StageRow,
    build_request,
    copy_artifacts,
    exit_code,
    format_table,
    report_summaries,
    stage_table,
)

REPO = Path(__file__).resolve().parents[2]
SHA = "0123456789abcdef0123456789abcdef01234567"
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


# --- builders --------------------------------------------------------------------------------------------


def state(kind: str, name: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(type=StateType[kind], name=name or kind.title())


def task_run(name: str, kind: str = "COMPLETED", start_s: float = 0.0, run_s: float | None = 1.5,
             state_name: str | None = None) -> SimpleNamespace:
    start = T0 + timedelta(seconds=start_s)
    return SimpleNamespace(
        id=uuid.uuid4(), name=name, state=state(kind, state_name), start_time=start, expected_start_time=start,
        end_time=None if run_s is None else start + timedelta(seconds=run_s),
        total_run_time=timedelta(seconds=run_s or 0),
    )


def log(message: str, at_s: float, task_run_id: Any = None, level: int = 20) -> SimpleNamespace:
    return SimpleNamespace(id=uuid.uuid4(), message=message, timestamp=T0 + timedelta(seconds=at_s),
                           task_run_id=task_run_id, level=level)


# --- the stage table -------------------------------------------------------------------------------------


def _results(rows: list[StageRow]) -> dict[str, str]:
    return {r.stage: r.result for r in rows}


@pytest.mark.parametrize(("runs", "expected"), [
    pytest.param([task_run(s, start_s=i) for i, s in enumerate(CI_STAGES)], dict.fromkeys(CI_STAGES, "passed"),
                 id="all-passed"),
    pytest.param([task_run("checkout"), task_run("unit", "FAILED", 1)],
                 {"checkout": "passed", "unit": "failed", **dict.fromkeys(CI_STAGES[2:], "skipped")},
                 id="unit-failed-rest-skipped"),
    pytest.param([task_run("checkout"), task_run("unit", "CRASHED", 1), task_run("image", "CANCELLED", 2)],
                 {"checkout": "passed", "unit": "failed", "image": "cancelled",
                  **dict.fromkeys(CI_STAGES[3:], "skipped")}, id="crashed-is-failed"),
    pytest.param([task_run("checkout-0"), task_run("unit-3", "RUNNING", 1, None), task_run("unit-tests", "FAILED")],
                 {"checkout": "passed", "unit": "running", **dict.fromkeys(CI_STAGES[2:], "skipped")},
                 id="prefect-default-names-count-other-names-do-not"),
    pytest.param([task_run("unit", "FAILED", 1), task_run("unit", "COMPLETED", 5)],
                 {"unit": "passed"}, id="a-rerun-shows-the-latest"),
    pytest.param([], dict.fromkeys(CI_STAGES, "skipped"), id="no-task-runs"),
])
def test_stage_table_results(runs, expected):
    rows = stage_table(CI_STAGES, runs)
    assert [r.stage for r in rows] == list(CI_STAGES)
    assert {k: v for k, v in _results(rows).items() if k in expected} == expected


def test_stage_table_states_durations_and_summaries():
    runs = [task_run("checkout", run_s=2.04), task_run("unit", "FAILED", 3, 7.25, state_name="Failed")]
    runs[0].total_run_time = timedelta(0)  # Prefect reports 0 for a run it timed poorly: start/end instead
    rows = stage_table(CI_STAGES, runs, {"unit": "2 failed, 10 passed", "image": "not built"})
    assert rows[0] == StageRow("checkout", "passed", "Completed", 2.0, str(runs[0].id), "")
    assert rows[1] == StageRow("unit", "failed", "Failed", 7.2, str(runs[1].id), "2 failed, 10 passed")
    assert rows[2] == StageRow("image", "skipped", None, None, None, "not built")
    text = format_table(rows)
    assert text.splitlines()[0].split() == ["STAGE", "RESULT", "STATE", "DURATION", "SUMMARY"]
    assert "unit         failed   Failed     7.2s      2 failed, 10 passed" in text
    assert all(line == line.rstrip() for line in text.splitlines())


def test_deploy_steps_table():
    runs = [task_run("control-plane"), task_run("agent", "FAILED", 1), task_run("rollback-agent", start_s=2),
            task_run("rollback-control-plane", start_s=3)]
    rows = stage_table(DEPLOY_STEPS, runs, None, DEPLOY.aliases)
    assert _results(rows) == {"ci": "skipped", "control-plane": "passed", "agent": "failed", "bridge": "skipped",
                              "canary": "skipped", "rollback-bridge": "skipped", "rollback-agent": "passed",
                              "rollback-control-plane": "passed"}
    # CI run as a platform-ci subflow: its tracking task run is named after the flow
    rows = stage_table(DEPLOY_STEPS, [task_run("platform-ci-0"), task_run("control-plane", start_s=9)], None,
                       DEPLOY.aliases)
    assert _results(rows)["ci"] == "passed"
    assert format_table(rows, "step").startswith("STEP ")


@pytest.mark.parametrize(("data", "expected"), [
    pytest.param([{"stage": "unit", "state": "failed", "summary": "2 failed"}, {"stage": "image"}],
                 {"unit": "2 failed", "image": ""}, id="rows"),
    pytest.param(json.dumps([{"stage": "unit", "summary": "ok"}]), {"unit": "ok"}, id="json-text"),
    pytest.param("not json", {}, id="garbage"),
    pytest.param({"stage": ["unit"]}, {}, id="columns-not-rows"),
])
def test_report_summaries(data, expected):
    assert report_summaries(data) == expected


# --- exit codes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("state_type", "timed_out", "code"), [
    ("COMPLETED", False, 0),
    ("FAILED", False, 1),
    ("CRASHED", False, 1),
    ("CANCELLED", False, 1),
    ("RUNNING", True, 1),
    ("COMPLETED", True, 1),
    (None, True, 1),
])
def test_exit_code(state_type, timed_out, code):
    assert exit_code(state_type, timed_out) == code


# --- the run's files -------------------------------------------------------------------------------------


def test_copy_artifacts_copies_the_runs_tree_and_merges(tmp_path):
    run_id = str(uuid.uuid4())
    src = tmp_path / "root" / run_id
    (src / "journals").mkdir(parents=True)
    (src / "junit-unit.xml").write_text("<testsuite/>")
    (src / "journals" / "chaos.json").write_text("{}")
    (tmp_path / "root" / "other-run").mkdir()
    dest = tmp_path / "ws" / "ci-artifacts"
    (dest / run_id).mkdir(parents=True)
    (dest / run_id / "stale.txt").write_text("kept")
    assert copy_artifacts(tmp_path / "root", run_id, dest) == dest / run_id
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        f"{run_id}/journals/chaos.json", f"{run_id}/junit-unit.xml", f"{run_id}/stale.txt"]


def test_copy_artifacts_without_files_is_none(tmp_path):
    assert copy_artifacts(tmp_path, "no-such-run", tmp_path / "dest") is None
    assert not (tmp_path / "dest").exists()


def test_artifacts_root_from_env(tmp_path):
    assert entry.artifacts_root({"APIARY_CI_ARTIFACTS": str(tmp_path)}) == tmp_path
    assert entry.artifacts_root({}) == Path("~/.apiary/ci-artifacts").expanduser()


# --- the request -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "name"), [
    ("https://github.com/acme/apiary.git", "acme/apiary"),
    ("https://github.com/acme/apiary", "acme/apiary"),
    ("git@github.com:acme/apiary.git", "acme/apiary"),
    ("ssh://git@ghe.example.com:2222/acme/apiary.git/", "acme/apiary"),
    ("apiary", None),
])
def test_repo_name(url, name):
    assert entry.repo_name(url) == name


def test_build_request_for_a_pr_and_a_deploy():
    pr = build_request(RUN_PIPELINE, Options(sha=SHA.upper(), repo_url="https://github.com/acme/apiary.git", pr=7),
                       {"CHANGE_AUTHOR": "alice"})
    assert pr.parameters() == {
        "kind": "pr", "repo": "acme/apiary", "clone_url": "https://github.com/acme/apiary.git", "sha": SHA,
        "ref": "refs/pull/7/head", "base_ref": "main", "default_branch": "main", "action": None, "sender": "alice",
        "pr_number": 7}
    dep = build_request(DEPLOY, Options(sha=SHA, repo_url="u", repo="acme/apiary", pr=7), {})
    assert (dep.kind, dep.ref, dep.base_ref, dep.pr_number, dep.sender) == ("deploy", "main", "main", None, "jenkins")
    assert build_request(RUN_PIPELINE, Options(sha=SHA, repo_url="u", repo="a/b"), {}).ref == SHA


@pytest.mark.parametrize(("opts", "says"), [
    (Options(sha="abc", repo_url="https://github.com/a/b"), "40-hex"),
    (Options(sha=SHA, repo_url="  "), "--repo-url is empty"),
    (Options(sha=SHA, repo_url="apiary"), "give --repo"),
    (Options(sha=SHA, repo_url="https://github.com/a/b", pr=0), "--pr"),
])
def test_build_request_refuses_bad_flags(opts, says):
    with pytest.raises(CannotRun, match=says):
        build_request(RUN_PIPELINE, opts, {})


def test_delivery_id():
    assert entry.delivery_id({"BUILD_TAG": "jenkins-apiary-PR-7-12"}) == "jenkins-jenkins-apiary-PR-7-12"
    assert entry.delivery_id({}).startswith("jenkins-") and len(entry.delivery_id({})) == len("jenkins-") + 32


# --- a fake Prefect --------------------------------------------------------------------------------------


class FakePrefect:
    """Prefect's sync client as the entry point uses it. ``logs`` are visible once ``now`` (the fake
    clock) reaches their ``arrives_s``; the flow run's state follows ``states`` (one per read)."""

    def __init__(self, deployments=("platform-ci/pr",), states=("RUNNING", "COMPLETED"), healthy=True):
        self.deployments = set(deployments)
        self.states = list(states)
        self.healthy = healthy
        self.now = 0.0
        self.logs: list[tuple[float, SimpleNamespace]] = []
        self.task_runs: list[SimpleNamespace] = []
        self.artifacts: list[SimpleNamespace] = []
        self.created: list[dict] = []
        self.flow_run_id = uuid.uuid4()
        self.log_reads = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def api_healthcheck(self):
        return None if self.healthy else ConnectionRefusedError(111, "Connection refused")

    def read_deployment_by_name(self, name):
        from prefect.exceptions import ObjectNotFound

        if name not in self.deployments:
            raise ObjectNotFound(http_exc=Exception("404"), help_message=f"{name} not found")
        return SimpleNamespace(id=uuid.uuid4(), name=name)

    def create_flow_run_from_deployment(self, deployment_id, parameters, tags):
        self.created.append({"parameters": parameters, "tags": tags})
        return SimpleNamespace(id=self.flow_run_id, name="fake-run")

    def read_flow_run(self, flow_run_id):
        assert flow_run_id == self.flow_run_id
        kind = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return SimpleNamespace(id=flow_run_id, state=state(kind))

    def read_logs(self, log_filter, limit, offset, sort):
        self.log_reads += 1
        assert log_filter.flow_run_id.any_ == [self.flow_run_id]
        after = log_filter.timestamp.after_ if log_filter.timestamp else None
        visible = sorted((lg for at, lg in self.logs if at <= self.now), key=lambda lg: lg.timestamp)
        return [lg for lg in visible if after is None or lg.timestamp >= after][offset:offset + limit]

    def read_task_runs(self, task_run_filter, limit):
        assert task_run_filter.flow_run_id.any_ == [self.flow_run_id]
        return list(self.task_runs)

    def read_artifacts(self, artifact_filter, limit):
        assert artifact_filter.key.any_ == ["ci-report"]
        return list(self.artifacts)


class FakeClock:
    def __init__(self, prefect: FakePrefect) -> None:
        self.prefect = prefect

    def __call__(self) -> float:
        return self.prefect.now

    def sleep(self, s: float) -> None:
        self.prefect.now += s


def test_log_tail_pages_dedupes_and_catches_late_batches():
    fake = FakePrefect()
    tail = LogTail(str(fake.flow_run_id), page=2, lookback_s=30)
    fake.logs = [(0, log(f"m{i}", i)) for i in range(5)]
    assert [lg.message for lg in tail.poll(fake)] == ["m0", "m1", "m2", "m3", "m4"]
    assert tail.poll(fake) == []
    fake.now = 10
    fake.logs += [(10, log("late", 3.5)), (10, log("m5", 6))]  # shipped in a later batch, older than m4
    assert [lg.message for lg in tail.poll(fake)] == ["late", "m5"]
    assert tail.poll(fake) == []
    fake.now = 20
    fake.logs += [(20, log(f"burst{i}", 7)) for i in range(5)]  # more than a page at one instant
    assert [lg.message for lg in tail.poll(fake)] == [f"burst{i}" for i in range(5)]
    assert tail.poll(fake) == []


def _run(fake: FakePrefect, tmp_path: Path, timeout_s: float = 60, **opts) -> tuple[int, str]:
    clock = FakeClock(fake)
    out = io.StringIO()
    env = {"APIARY_CI_ARTIFACTS": str(tmp_path / "root"), "BUILD_TAG": "jenkins-apiary-PR-7-3"}
    options = Options(sha=SHA, repo_url="https://github.com/acme/apiary.git", pr=7, artifacts=tmp_path / "ws",
                      stages_file=tmp_path / "ws" / "stages.json", timeout_s=timeout_s, poll_s=1, **opts)
    code = entry.run(RUN_PIPELINE, options, out, env=env, client_factory=lambda: fake,
                     api=lambda: "http://prefect:4200/api", clock=clock, sleep=clock.sleep)
    return code, out.getvalue()


def test_run_streams_logs_and_reports_a_passing_pipeline(tmp_path):
    fake = FakePrefect(states=["PENDING", "RUNNING", "RUNNING", "COMPLETED"])
    checkout, unit = task_run("checkout"), task_run("unit", start_s=2)
    fake.task_runs = [checkout, unit]
    fake.logs = [(0, log("Beginning flow run", 0)), (1, log("cloning", 0.5, checkout.id)),
                 (3, log("12 passed", 2.5, unit.id)), (4.5, log("Finished in state Completed()", 4))]
    fake.artifacts = [SimpleNamespace(data=json.dumps([{"stage": "unit", "summary": "12 passed"}]))]
    (tmp_path / "root" / str(fake.flow_run_id)).mkdir(parents=True)
    (tmp_path / "root" / str(fake.flow_run_id) / "junit-unit.xml").write_text("<testsuite/>")

    code, out = _run(fake, tmp_path)

    assert code == 0
    [created] = fake.created
    assert created["parameters"]["delivery"] == "jenkins-jenkins-apiary-PR-7-3"
    assert created["parameters"]["request"]["pr_number"] == 7 and created["tags"] == ["ci", "jenkins", "pr"]
    assert f"flow run {fake.flow_run_id}" in out and f"http://prefect:4200/runs/flow-run/{fake.flow_run_id}" in out
    lines = out.splitlines()
    streamed = [ln.split(maxsplit=2)[2] for ln in lines if ln[:2].isdigit()]
    assert streamed == ["flow | Beginning flow run", "checkout | cloning", "unit | 12 passed",
                        "flow | Finished in state Completed()"]
    assert any(ln.split()[:3] == ["unit", "passed", "Completed"] and ln.endswith("12 passed") for ln in lines)
    assert any(ln.split()[:2] == ["report", "skipped"] for ln in lines)
    assert lines[-1].endswith("ended Completed: PASSED")
    assert (tmp_path / "ws" / str(fake.flow_run_id) / "junit-unit.xml").is_file()
    stages = json.loads((tmp_path / "ws" / "stages.json").read_text())
    assert (stages["exit_code"], stages["state"], stages["failed"]) == (0, "Completed", [])
    assert [s["stage"] for s in stages["stages"]] == list(CI_STAGES)


def test_logs_shipped_a_batch_interval_after_the_final_state_are_still_streamed(tmp_path):
    """A flow that ends between two of Prefect's log batches: the run reads Completed before any of
    its logs, which land 3.5 s later (the 2 s batch interval and a busy machine). The tail waits for
    LOG_QUIET_S without a log, not for a count of empty polls, and stops by LOG_DRAIN_S."""
    fake = FakePrefect(states=["COMPLETED"])
    unit = task_run("unit")
    fake.task_runs = [unit]
    fake.logs = [(3.5, log("stand-in stage unit running", 0.5, unit.id)),
                 (3.5, log("Finished in state Completed()", 1))]

    code, out = _run(fake, tmp_path)

    assert code == 0
    assert "unit | stand-in stage unit running" in out and "flow | Finished in state Completed()" in out
    assert 3.5 + entry.LOG_QUIET_S <= fake.now <= entry.LOG_DRAIN_S + 1
    fake_late = FakePrefect(states=["COMPLETED"])  # a log every second forever: the drain still ends
    fake_late.logs = [(t, log(f"tick{t}", t)) for t in range(100)]
    code, _ = _run(fake_late, tmp_path / "late")
    assert code == 0 and fake_late.now <= entry.LOG_DRAIN_S + 1


def test_run_names_the_failed_stage_and_exits_1(tmp_path):
    fake = FakePrefect(states=["RUNNING", "FAILED"])
    fake.task_runs = [task_run("checkout"), task_run("unit", "FAILED", 2)]
    code, out = _run(fake, tmp_path)
    assert code == 1
    assert out.splitlines()[-1].endswith("ended Failed: FAILED stages: unit")
    assert "no files in" in out  # the flow wrote none: said, not fatal
    assert json.loads((tmp_path / "ws" / "stages.json").read_text())["failed"] == ["unit"]


def test_run_times_out_with_exit_1(tmp_path):
    fake = FakePrefect(states=["RUNNING"])
    fake.task_runs = [task_run("checkout", "RUNNING", run_s=None)]
    code, out = _run(fake, tmp_path, timeout_s=5)
    assert code == 1 and fake.now <= 6
    assert "TIMEOUT" in out.splitlines()[-1] and "had not ended after 5s" in out
    assert json.loads((tmp_path / "ws" / "stages.json").read_text())["timed_out"] is True


@pytest.mark.parametrize(("fake", "says"), [
    pytest.param(FakePrefect(deployments=()), "deployment platform-ci/pr does not exist", id="no-deployment"),
    pytest.param(FakePrefect(healthy=False), "not reachable", id="unreachable"),
])
def test_run_cannot_run(tmp_path, fake, says):
    with pytest.raises(CannotRun, match=says):
        _run(fake, tmp_path)
    assert fake.created == []


def test_main_usage_errors_exit_2(capsys):
    assert entry.main(RUN_PIPELINE, ["--sha", "abc", "--repo-url", "https://github.com/a/b"]) == 2
    assert "40-hex" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        entry.main(RUN_PIPELINE, ["--repo-url", "https://github.com/a/b"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        entry.main(DEPLOY, ["--sha", SHA, "--repo-url", "u", "--pr", "3"])  # deploy takes no --pr
    assert exc.value.code == 2


# --- ci/run-pipeline against a real Prefect server -------------------------------------------------------

#: The stand-in platform-ci: checkout, then unit (failing when the ref says "fail"), then image;
#: a ci-report table artifact and a JUnit file in $APIARY_CI_ARTIFACTS/<flow run id>/.
STAND_IN = '''
import os
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run


@task(task_run_name="{name}")
def run_stage(name: str, fail: bool = False) -> str:
    get_run_logger().info("stand-in stage %s running", name)
    if fail:
        raise RuntimeError(f"{name}: 2 tests failed")
    return name


@flow(name="platform-ci")
def platform_ci(request: dict, delivery: str) -> None:
    get_run_logger().info("stand-in pipeline for %s at %s", request["repo"], request["sha"])
    out = Path(os.environ["APIARY_CI_ARTIFACTS"]) / str(flow_run.id)
    out.mkdir(parents=True, exist_ok=True)
    run_stage("checkout")
    unit = run_stage("unit", fail="fail" in request["ref"], return_state=True)
    (out / "junit-unit.xml").write_text('<testsuite name="unit" tests="1"/>\\n')
    failed = unit.is_failed()
    create_table_artifact([
        {"stage": "checkout", "state": "passed", "duration_s": 0.1, "summary": "cloned"},
        {"stage": "unit", "state": "failed" if failed else "passed", "duration_s": 0.1,
         "summary": "2 failed" if failed else "12 passed"},
    ], key="ci-report")
    if failed:
        raise RuntimeError("stage unit failed")
    run_stage("image")


if __name__ == "__main__":
    platform_ci.serve(name="pr", limit=4)
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[dict[str, str], Path]]:
    """A Prefect server serving the stand-in as ``platform-ci/pr``: the environment for ``ci/run-pipeline``."""
    from apiary.tracking.prefect_server import prefect_env, start_prefect_server

    tmp = tmp_path_factory.mktemp("jenkins-entry")
    srv = start_prefect_server(tmp / "server")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "BUILD_TAG"}
    env.update(prefect_env(tmp / "client", srv.api_url), APIARY_CI_ARTIFACTS=str(tmp / "flow-artifacts"),
               PREFECT_RUNNER_POLL_FREQUENCY="1")
    (tmp / "standin.py").write_text(STAND_IN)
    serve = subprocess.Popen([sys.executable, "standin.py"], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                             stdout=(tmp / "serve.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        import httpx

        def deployed() -> bool:
            if serve.poll() is not None:
                raise AssertionError(f"the stand-in's serve exited: {(tmp / 'serve.log').read_text()[-2000:]}")
            return bool(httpx.post(f"{srv.api_url}/deployments/filter", json={}).json())

        until(deployed, 60, "the stand-in deployment platform-ci/pr")
        yield env, tmp
    finally:
        serve.terminate()
        try:
            serve.wait(10)
        except subprocess.TimeoutExpired:
            serve.kill()
        srv.stop()


@pytest.fixture(scope="module")
def runs(served) -> dict[str, tuple[int, str, Path]]:
    """``ci/run-pipeline`` as Jenkins runs it, three variants at once (the runs overlap, to keep this
    fast): ``pass``, ``fail`` (unit fails) and ``missing`` (a deployment that does not exist)."""
    env, tmp = served
    argv = {
        "pass": ["--pr", "7", "--ref", "refs/heads/feature"],
        "fail": ["--pr", "8", "--ref", "refs/heads/fail-unit"],
        "missing": ["--deployment", "platform-ci/nope"],
    }
    procs = {}
    t0 = time.monotonic()
    for name, extra in argv.items():
        ws = tmp / f"ws-{name}"
        procs[name] = (subprocess.Popen(
            [str(REPO / "ci" / "run-pipeline"), "--sha", SHA, "--repo-url", "https://github.com/acme/apiary.git",
             "--poll", "0.5", "--timeout", "90", "--artifacts", str(ws / "ci-artifacts"),
             "--stages-file", str(ws / "stages.json"), *extra],
            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), ws)
    done = {}
    for name, (proc, ws) in procs.items():
        out, _ = proc.communicate(timeout=120)
        done[name] = (proc.returncode, out, ws)
    print(f"three ci/run-pipeline runs took {time.monotonic() - t0:.1f}s")
    return done




@pytest.mark.prefect
@pytest.mark.e2e
def test_run_pipeline_passing(runs):
    code, out, ws = runs["pass"]
    assert code == 0, out
    assert "stand-in stage unit running" in out  # a task's log, streamed
    lines = out.splitlines()
    table = [ln.split()[:2] for ln in lines[lines.index(next(ln for ln in lines if ln.startswith("STAGE "))):]]
    assert table[1:10] == [["checkout", "passed"], ["unit", "passed"], ["image", "passed"],
                           *([s, "skipped"] for s in CI_STAGES[3:])]
    assert any(ln.startswith("unit ") and ln.endswith("12 passed") for ln in lines)  # the ci-report summary
    assert lines[-1].endswith("ended Completed: PASSED")
    stages = json.loads((ws / "stages.json").read_text())
    [copied] = list((ws / "ci-artifacts").iterdir())
    assert copied.name == stages["flow_run_id"] and (copied / "junit-unit.xml").is_file()


@pytest.mark.prefect
@pytest.mark.e2e
def test_run_pipeline_failing_names_the_stage(runs):
    code, out, ws = runs["fail"]
    assert code == 1, out
    assert "unit: 2 tests failed" in out
    assert out.splitlines()[-1].endswith("ended Failed: FAILED stages: unit")
    stages = json.loads((ws / "stages.json").read_text())
    assert stages["failed"] == ["unit"] and stages["exit_code"] == 1
    assert [s["result"] for s in stages["stages"][:3]] == ["passed", "failed", "skipped"]
    assert (ws / "ci-artifacts" / stages["flow_run_id"] / "junit-unit.xml").is_file()


@pytest.mark.prefect
@pytest.mark.e2e
def test_run_pipeline_without_the_deployment_exits_2(runs):
    code, out, ws = runs["missing"]
    assert code == 2, out
    assert "Prefect deployment platform-ci/nope does not exist" in out
    assert not (ws / "stages.json").exists()
