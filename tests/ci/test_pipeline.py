"""The pipeline's engine without Prefect or Docker: which stages run after a failure, clean-ups,
the report and the commit status; and the stages that need only git and make (checkout, unit)
on a throwaway repository."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from tests.support.serving import serving

from apiary.ci import stages
from apiary.ci.config import CiConfig, ProductionTarget
from apiary.ci.pipeline import (
    STAGE_NAMES,
    STAGES,
    CiContext,
    Commit,
    StageFailed,
    StageOutcome,
    blocked_by,
    run_pipeline,
)
from apiary.errors import ValidationError

COMMIT = Commit(repo="acme/apiary", clone_url="/nowhere.git", sha="1a2b3c4d" * 5, ref="feature", pr_number=7)


def ctx(tmp_path: Path, **config) -> CiContext:
    return CiContext(commit=COMMIT, config=CiConfig(workdir=tmp_path / "work", artifacts=tmp_path / "art", **config),
                     workspace=tmp_path / "ws", artifacts=tmp_path / "art")


def recorder(calls: list[str], fail: dict[str, Exception] | None = None):
    def make(name: str):
        def stage(c: CiContext) -> str:
            calls.append(name)
            if fail and name in fail:
                raise fail[name]
            return f"{name} ok"
        return stage
    return {name: make(name) for name in STAGE_NAMES}


def test_all_stages_pass_in_order(tmp_path):
    calls: list[str] = []
    report = run_pipeline(ctx(tmp_path), recorder(calls))
    assert calls == list(STAGE_NAMES)
    assert report.passed and report.result == "success"
    assert [r["stage"] for r in report.rows()] == list(STAGE_NAMES)
    assert report.description().startswith("all 9 stages passed")


def test_a_failed_unit_stage_skips_everything_that_needs_it(tmp_path):
    calls: list[str] = []
    report = run_pipeline(ctx(tmp_path), recorder(calls, {"unit": StageFailed("2 of 9 unit tests failed: t::x")}))
    assert calls == ["checkout", "unit", "report"]  # no image is built, nothing deployed
    states = {o.name: o.state for o in report.outcomes}
    assert states["unit"] == "failed"
    assert all(states[s] == "skipped" for s in ("image", "staging", "integration", "load", "chaos", "regression"))
    assert report.stage("image").summary == "needs unit, which failed"
    assert report.result == "failure" and report.first_failure.name == "unit"
    assert report.description() == "unit failed: 2 of 9 unit tests failed: t::x"


def test_a_failed_integration_stage_stops_load_and_chaos_but_not_regression(tmp_path):
    calls: list[str] = []
    report = run_pipeline(ctx(tmp_path), recorder(calls, {"integration": StageFailed("1 of 5 failed")}))
    assert calls == ["checkout", "unit", "image", "staging", "integration", "regression", "report"]
    assert report.stage("load").state == "skipped" and report.stage("chaos").state == "skipped"


def test_an_exception_is_an_error_not_a_verdict(tmp_path):
    report = run_pipeline(ctx(tmp_path), recorder([], {"checkout": OSError("disk full")}))
    assert report.result == "error"
    assert report.stage("checkout").state == "error" and "OSError: disk full" in report.stage("checkout").summary


def test_missing_implementation_errors(tmp_path):
    impl = recorder([])
    del impl["load"]
    report = run_pipeline(ctx(tmp_path), impl)
    assert report.stage("load").state == "error" and "NotImplementedError" in report.stage("load").summary


def test_cleanups_run_before_the_report_whatever_happened(tmp_path):
    events: list[str] = []
    impl = recorder(events, {"integration": StageFailed("broken")})

    def staging(c: CiContext) -> str:
        events.append("staging")
        c.defer("teardown", lambda: events.append("teardown"))
        return "up"

    def report_stage(c: CiContext) -> str:
        events.append("report")
        assert c.data["report"].first_failure.name == "integration"  # the report sees the verdict
        return "done"

    impl.update(staging=staging, report=report_stage)
    run_pipeline(ctx(tmp_path), impl)
    assert events.index("teardown") > events.index("regression") and events[-1] == "report"


def test_blocked_by_is_the_first_need_that_did_not_pass():
    spec = next(s for s in STAGES if s.name == "load")
    assert blocked_by(spec, {"integration": StageOutcome("integration", "passed")}) is None
    assert blocked_by(spec, {"integration": StageOutcome("integration", "skipped")}) == "integration"
    assert blocked_by(spec, {}) == "integration"


def test_record_and_commit_status_shapes(tmp_path):
    report = run_pipeline(ctx(tmp_path), recorder([], {"staging": StageFailed("healthz gate failed: exit 3")}))
    report.flow_run_id, report.target_url = "f-1", "http://ui/runs/flow-run/f-1"
    body = report.record()
    assert body["flowRunId"] == "f-1" and body["result"] == "failure" and body["failedStage"] == "staging"
    assert body["prNumber"] == 7 and body["sha"] == COMMIT.sha and len(body["stages"]) == 9
    status = stages.commit_status(report, "apiary/platform-ci")
    assert status == {"state": "failure", "context": "apiary/platform-ci",
                      "description": "staging failed: healthz gate failed: exit 3",
                      "target_url": "http://ui/runs/flow-run/f-1"}
    assert "| staging | failed |" in report.markdown()


def test_run_name_names_repo_pr_and_short_sha():
    assert COMMIT.run_name() == "acme/apiary-pr7-1a2b3c4d"
    push = Commit.from_request({"repo": "acme/apiary", "clone_url": "u", "sha": "f" * 40, "ref": "main",
                                "kind": "deploy", "pr_number": None})
    assert push.run_name() == "acme/apiary-main-ffffffff" and push.kind == "deploy"


def test_config_from_env(tmp_path):
    target = tmp_path / "prod.yaml"
    ProductionTarget(name="prod", home=tmp_path / "home", port=8470, registry="127.0.0.1:5000").dump(target)
    cfg = CiConfig.from_env({"APIARY_CI_PROFILE": "reduced", "APIARY_CI_UNIT_PATHS": "tests/a,tests/b",
                             "APIARY_API_URL": "http://x", "APIARY_TOKEN": "t", "APIARY_CI_PRODUCTION": str(target)})
    assert cfg.reduced and cfg.unit_paths == ("tests/a", "tests/b") and cfg.record_url == "http://x"
    assert cfg.production is not None and cfg.production.port == 8470 and cfg.production.agent_runtime == "docker"
    assert cfg.ui_url is None
    assert CiConfig.from_env({"PREFECT_API_URL": "http://127.0.0.1:4200/api"}).ui_url == "http://127.0.0.1:4200"
    assert CiConfig.from_env({"PREFECT_API_URL": "http://h/api", "PREFECT_UI_URL": "http://ui"}).ui_url == "http://ui"
    with pytest.raises(ValidationError) as exc:
        CiConfig.from_env({"APIARY_CI_PROFILE": "fast"})
    assert exc.value.field == "APIARY_CI_PROFILE"


def test_junit_summary_names_failing_tests(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                   '<testcase classname="tests.a" name="ok"/><testcase classname="tests.a" name="bad">'
                   '<failure message="x"/></testcase><testcase classname="tests.a" name="s"><skipped/></testcase>'
                   '</testsuite></testsuites>')
    counts, failing = stages.junit_summary(xml)
    assert counts == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1} and failing == ["tests.a::bad"]
    assert stages.junit_summary(tmp_path / "missing.xml")[0]["tests"] == 0


# -- checkout and unit on a throwaway repository ------------------------------------------------

MAKEFILE = """\
VENV ?= .venv
SETUP ?= setup
PYTEST_ARGS ?=
lint: $(SETUP)
\t$(VENV)/bin/python -c "print('lint ok')"
test-fast: $(SETUP)
\t$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests
setup:
\techo "a workspace must not install its own venv" && exit 9
"""


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def origin(tmp_path: Path) -> tuple[Path, Path]:
    """A bare repository and a clone to commit into, with a tiny project: a Makefile like Apiary's
    and a package ``apiary`` under platform/ (the unit stage checks imports resolve there)."""
    src = tmp_path / "src"
    (src / "platform" / "apiary").mkdir(parents=True)
    (src / "tests").mkdir()
    (src / "platform" / "apiary" / "__init__.py").write_text("")
    (src / "Makefile").write_text(MAKEFILE)
    (src / "tests" / "test_ok.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    git("init", "-q", "-b", "main", cwd=src)
    git("-c", "user.name=t", "-c", "user.email=t@x", "commit", "-q", "--allow-empty", "-m", "empty", cwd=src)
    git("add", "-A", cwd=src)
    git("-c", "user.name=t", "-c", "user.email=t@x", "commit", "-q", "-m", "base", cwd=src)
    bare = tmp_path / "origin.git"
    git("clone", "-q", "--bare", str(src), str(bare), cwd=tmp_path)
    git("remote", "add", "ci", str(bare), cwd=src)
    return src, bare


def commit_change(src: Path, bare: Path, files: dict[str, str], branch: str) -> str:
    git("checkout", "-q", "-B", branch, "main", cwd=src)
    for name, text in files.items():
        (src / name).write_text(text)
    git("add", "-A", cwd=src)
    git("-c", "user.name=t", "-c", "user.email=t@x", "commit", "-q", "-m", branch, cwd=src)
    git("push", "-q", "ci", branch, cwd=src)
    return git("rev-parse", "HEAD", cwd=src)


def unit_ctx(tmp_path: Path, bare: Path, sha: str) -> CiContext:
    c = CiContext(commit=Commit("acme/tiny", str(bare), sha, "b", 1),
                  config=CiConfig(workdir=tmp_path / "work", artifacts=tmp_path / "art"),
                  workspace=tmp_path / "work" / f"ws-{sha[:8]}", artifacts=tmp_path / "art")
    c.artifacts.mkdir(parents=True, exist_ok=True)
    return c


def test_checkout_and_unit_pass_on_a_good_commit(origin, tmp_path):
    src, bare = origin
    sha = commit_change(src, bare, {"README": "hello\n"}, "good")
    c = unit_ctx(tmp_path, bare, sha)
    assert stages.checkout(c).startswith(sha[:12])
    assert (c.workspace / "README").read_text() == "hello\n"
    summary = stages.unit(c)
    assert summary.startswith("lint clean; 1 tests")
    assert "lint ok" in (c.artifacts / "unit.log").read_text()
    assert (c.artifacts / "junit-unit.xml").exists()


def test_unit_fails_naming_the_failing_test(origin, tmp_path):
    src, bare = origin
    sha = commit_change(src, bare, {"tests/test_bad.py": "def test_breaks():\n    assert 1 + 1 == 3\n"}, "bad")
    c = unit_ctx(tmp_path, bare, sha)
    stages.checkout(c)
    with pytest.raises(StageFailed) as exc:
        stages.unit(c)
    assert exc.value.summary.startswith("1 of 2 unit tests failed: tests.test_bad::test_breaks")


def test_the_checkout_is_readable_by_others_though_the_platform_runs_with_umask_077(origin, tmp_path):
    """The images built from the workspace run tasks as uids of their own: the code must be 0644
    and its directories 0755 even when the flows' process has the platform's umask 077."""
    src, bare = origin
    sha = commit_change(src, bare, {"README": "hello\n"}, "modes")
    c = unit_ctx(tmp_path, bare, sha)
    old = os.umask(0o077)
    try:
        stages.checkout(c)
    finally:
        os.umask(old)
    assert stat.S_IMODE((c.workspace / "README").stat().st_mode) == 0o644
    assert stat.S_IMODE(c.workspace.stat().st_mode) == 0o755


def test_checkout_of_an_unknown_sha_fails(origin, tmp_path):
    _src, bare = origin
    c = unit_ctx(tmp_path, bare, "0123456789abcdef0123456789abcdef01234567")
    with pytest.raises(StageFailed, match="is not in"):
        stages.checkout(c)
    with pytest.raises(StageFailed, match="not a commit sha"):
        stages.checkout(unit_ctx(tmp_path, bare, "--upload-pack=evil"))


def test_report_posts_the_status_to_the_configured_url(tmp_path):
    got: list[dict] = []
    app = FastAPI()

    @app.post("/repos/{owner}/{name}/statuses/{sha}")
    async def status(owner: str, name: str, sha: str, request: Request) -> dict:
        got.append({"path": f"{owner}/{name}/{sha}", "auth": request.headers.get("authorization"),
                    **(await request.json())})
        return {}

    with serving(app) as url:
        c = ctx(tmp_path, status_url=url + "/repos/{repo}/statuses/{sha}", status_token="s3cret")
        c.artifacts.mkdir(parents=True)
        report = run_pipeline(c, {**recorder([], {"unit": StageFailed("1 of 1 failed")}), "report": stages.report})
    assert report.stage("report").state == "passed", report.stage("report").summary
    assert got == [{"path": f"acme/apiary/{COMMIT.sha}", "auth": "Bearer s3cret", "state": "failure",
                    "context": "apiary/platform-ci", "description": "unit failed: 1 of 1 failed", "target_url": None}]
    assert json.loads((c.artifacts / "status.json").read_text())["state"] == "failure"
    assert "FAILED at unit" in (c.artifacts / "report.md").read_text()
