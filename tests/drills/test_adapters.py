"""apiary.drills.adapters: which chaos experiments a drill runs, how the runners' results map, and
how an abort reaches a runner's child process."""

from __future__ import annotations

import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from apiary.drills import adapters
from apiary.errors import PlatformError

CHAOS = Path(__file__).resolve().parents[2] / "chaos"


def test_the_scheduled_chaos_drill_runs_the_ci_experiments_that_need_no_root() -> None:
    picked = [p.stem for p in adapters.chaos_experiments(CHAOS, skip_tags=adapters.SKIP_TAGS)]
    tagged = {p.stem for p in CHAOS.glob("*.json") if "ci" in adapters.experiment_tags(p)}
    rooted = {p.stem for p in CHAOS.glob("*.json") if "root" in adapters.experiment_tags(p)}
    assert picked and set(picked) == tagged - rooted
    assert "kill-postgres" not in picked  # tagged postgres, not ci


def test_named_experiments_need_no_tag_but_disruptive_ones_need_permission(tmp_path: Path) -> None:
    (tmp_path / "calm.json").write_text('{"title": "t", "tags": ["ci"]}')
    (tmp_path / "rough.json").write_text('{"title": "t", "tags": ["ci", "disrupts-guaranteed-jobs"]}')
    (tmp_path / "untagged.yaml").write_text("title: t\n")
    assert [p.name for p in adapters.chaos_experiments(tmp_path)] == ["calm.json"]
    assert [p.name for p in adapters.chaos_experiments(tmp_path, allow_disruptive=True)] == ["calm.json",
                                                                                              "rough.json"]
    assert [p.name for p in adapters.chaos_experiments(tmp_path, names=["untagged", "rough"])] == ["untagged.yaml"]


def test_the_chaos_runner_verdict_maps_to_an_experiment_result(monkeypatch, tmp_path: Path) -> None:
    seen = {}

    def run_experiment(path, *, api_url, token, home, journal_dir, timeout_s):
        seen.update(path=path, api_url=api_url, token=token, timeout_s=timeout_s)
        return types.SimpleNamespace(name="kill-agent", passed=False, reasons=["probe x failed"],
                                     journal=tmp_path / "kill-agent.journal.json")

    monkeypatch.setitem(sys.modules, "apiary.chaos.runner", types.SimpleNamespace(run_experiment=run_experiment))
    res = adapters.run_chaos_experiment(CHAOS / "kill-agent.json", api_url="http://x", token="t", home=tmp_path,
                                        journal_dir=tmp_path, timeout_s=60, abort=threading.Event())
    assert (res.name, res.passed, res.reasons) == ("kill-agent", False, ["probe x failed"])
    assert res.journal == str(tmp_path / "kill-agent.journal.json") and seen["timeout_s"] == 60


def test_a_missing_runner_fails_loudly(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "apiary.chaos.runner", None)  # import raises ImportError
    with pytest.raises(PlatformError, match="apiary.chaos.runner is not installed"):
        adapters.run_chaos_experiment(CHAOS / "kill-agent.json", api_url="http://x", token="t", home=Path("."),
                                      journal_dir=Path("."), timeout_s=1)


@pytest.mark.parametrize("own_session", [True, False], ids=["session leader (chaostoolkit)", "plain child (Locust)"])
def test_an_abort_interrupts_only_the_runners_child(tmp_path: Path, own_session: bool) -> None:
    marker = str(tmp_path / "this-run.journal.json")
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "another-run"],
                             stdin=subprocess.PIPE)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", marker], stdin=subprocess.PIPE,
                             start_new_session=own_session)
    abort = threading.Event()
    abort.set()
    try:
        code = adapters._abortable(lambda: child.wait(60), abort, marker, "test")
        assert code == -15  # SIGTERM, as the runners' own timeouts send
        assert other.poll() is None
    finally:
        for p in (child, other):
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_the_load_result_maps_to_a_summary_with_opportunistic_jobs(monkeypatch, tmp_path: Path) -> None:
    seen = {}
    row = types.SimpleNamespace(endpoint="POST /api/v2/jobs", metric="p99", measured=6000.0, threshold="<= 5000",
                                passed=False, note="")
    agg = types.SimpleNamespace(requests=120, failures=0, p50_ms=12.0, p99_ms=80.0, rps=11.987)
    result = types.SimpleNamespace(
        passed=False, users=5, duration_s=10.0, agents=2, rows=[row], out_dir=tmp_path,
        jobs=types.SimpleNamespace(accepted=7, lost=()), endpoint=lambda key: agg if key == "Aggregated" else None)

    def run_load(target, token, **kw):
        seen.update(target=target, token=token, **kw)
        return result

    monkeypatch.setitem(sys.modules, "apiary.load.runner", types.SimpleNamespace(run_load=run_load))
    monkeypatch.setattr("apiary.load.report.markdown", lambda res: "# Load test `smoke`: FAIL")
    res = adapters.run_load(api_url="http://x", token="t", profile="smoke", duration_s=10, out_dir=tmp_path / "o")
    assert seen["job"] == {"priority": "oppo"} and seen["duration_s"] == 10 and seen["profile"] == "smoke"
    assert not res.passed and res.reasons == ["POST /api/v2/jobs p99: 6000.0 (threshold <= 5000)"]
    assert res.summary == {"users": 5, "durationS": 10.0, "agents": 2, "jobsAccepted": 7, "jobsLost": 0,
                           "gatesFailed": 1, "gates": 1, "requests": 120, "failures": 0, "p50Ms": 12.0,
                           "p99Ms": 80.0, "rps": 11.99}
    assert res.report == "# Load test `smoke`: FAIL"
