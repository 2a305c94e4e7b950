"""The inspection probe, the stress drill and the guard against an in-memory API (tests/drills/fakes.py).

No clock is waited on: the drills take ``clock`` and ``sleep``, and a fake clock moves only when
the drill sleeps. The same drills against a real platform: tests/drills/test_drills_e2e.py.
"""

from __future__ import annotations

import json
import threading

import pytest
from tests.drills.fakes import T0, FakeApi, job, node

from apiary.drills.diagnosis import load_rules
from apiary.drills.guard import GuardConfig, SteadyStateGuard, guarded
from apiary.drills.inspection import ProbeResult, probe, run_inspection
from apiary.drills.stress import run_stress, stress

IMAGE = "python:3.11"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def quick(doc: dict) -> list[dict]:
    """WAITING, RUNNING, then SUCCEEDED 2.5 s after submission (1.5 s to start)."""
    i = doc["id"]
    return [job(i, "WAITING"), job(i, "RUNNING", started=T0 + 1.5),
            job(i, "SUCCEEDED", started=T0 + 1.5, completed=T0 + 2.5)]


def stuck(doc: dict) -> list[dict]:
    return [job(doc["id"], "WAITING", waiting_reason="no schedulable node")]


# ----------------------------------------------------------------------------------- inspection


def test_a_probe_per_vc_measures_its_phases_and_reports_them() -> None:
    api, clock = FakeApi(quick), Clock()
    outcome = run_inspection(api, slo_s=120, image=IMAGE, clock=clock, sleep=clock.sleep)
    assert outcome.result == "passed" and outcome.summary == "2/2 VCs met the SLO of 120 s"
    sub = api.submitted[0]
    assert sub["extras"]["hivedScheduler"]["jobPriorityClass"] == "oppo"
    assert [s["defaults"]["virtualCluster"] for s in api.submitted] == ["default", "vc1"]
    assert sub["taskRoles"]["main"]["resourcePerInstance"]["gpu"] == 1
    (rep,) = api.reports
    assert rep["drill"] == "inspection" and rep["result"] == "passed"
    assert rep["probes"][0] == {"virtualCluster": "default", "success": True, "jobId": f"admin~{sub['name']}",
                                "phases": {"schedule": 1.5, "run": 1.0, "total": 2.5}, "reason": ""}
    assert api.stopped == []


def test_a_probe_past_its_slo_is_stopped_and_says_where_it_was_stuck() -> None:
    api, clock = FakeApi(stuck), Clock()
    results = probe(api, ["vc1"], slo_s=5, image=IMAGE, clock=clock, sleep=clock.sleep, poll_s=0.5)
    (r,) = results
    assert not r.success and r.state == "WAITING"
    assert r.reason == "still WAITING after the SLO of 5 s: no schedulable node"
    assert api.stopped == [r.job_id] and clock.now == pytest.approx(5.0)


@pytest.mark.parametrize(("plan", "reason"), [
    pytest.param(lambda d: [job(d["id"], "FAILED", completed=T0 + 1, exit_code=1)],
                 "FAILED (exit code 1: n/a)", id="failed job"),
    pytest.param(lambda d: [job(d["id"], "SUCCEEDED", started=T0 + 1, completed=T0 + 200)],
                 "took 200.0 s > SLO 120 s", id="too slow"),
])
def test_a_probe_that_ends_badly_fails(plan, reason: str) -> None:
    api, clock = FakeApi(plan, vcs=("default",)), Clock()
    (r,) = probe(api, slo_s=120, image=IMAGE, clock=clock, sleep=clock.sleep)
    assert not r.success and r.reason == reason


def test_an_unreachable_api_is_a_failed_probe_not_an_exception() -> None:
    api = FakeApi(quick)
    api.down = True
    (r,) = probe(api, slo_s=5, image=IMAGE)
    assert not r.success and "not reachable" in r.reason


# --------------------------------------------------------------------------------------- stress

def bench_line(matmul: float, membw: float = 10.0, ok: bool = True) -> str:
    return "matmul ...\n" + json.dumps({"apiary_bench": 1, "ok": ok, "note": "cpu",
                                        "metrics": {"matmul_gflops": matmul, "mem_bandwidth_gbps": membw}})


def placed(where: dict[str, str]):
    """Each stress job runs on the node of its SKU (``where``: sku -> node) and succeeds."""
    def plan(doc: dict) -> list[dict]:
        sku = doc["extras"]["hivedScheduler"]["taskRoles"]["bench"]["skuType"]
        return [job(doc["id"], "WAITING"), job(doc["id"], "SUCCEEDED", node=where[sku], started=T0, completed=T0 + 1)]
    return plan


NODES = [node("carol", "GPU-C"), node("dan", "GPU-D"), node("erin", "GPU-E", cordoned=True)]
SKU_NODE = {"GPU-C": "carol", "GPU-D": "dan"}


def test_only_the_slow_node_is_flagged_cordoned_and_reported() -> None:
    logs = {"carol": bench_line(40), "dan": bench_line(4, 1)}
    api, clock = FakeApi(placed(SKU_NODE), nodes=NODES, logs=logs), Clock()
    outcome = run_stress(api, load_rules(), image=IMAGE, clock=clock, sleep=clock.sleep)
    assert outcome.result == "failed" and api.cordons == [("dan", True)]
    (call,) = api.cordon_calls  # the drill's own cordon source, the failed rules its reason
    assert call["source"] == "drill:stress" and call["reason"].startswith("stress drill failed: matmul-below-baseline")
    assert outcome.summary == "1/2 tested nodes passed; failed: dan (cordoned: dan); untested: erin"
    by_node = {r["node"]: r for r in outcome.rows}
    assert by_node["dan"]["verdict"] == "FAILED" and by_node["carol"]["verdict"] == "passed"
    assert by_node["erin"]["verdict"] == "untested" and by_node["erin"]["detail"] == "cordoned"
    assert by_node["dan"]["failedRules"] == "matmul-below-baseline, memory-bandwidth-below-baseline"
    (rep,) = api.reports
    assert {(f["node"], f["rule"]) for f in rep["nodeFailures"]} == {
        ("dan", "matmul-below-baseline"), ("dan", "memory-bandwidth-below-baseline")}
    # One whole-node, opportunistic job per schedulable node, of that node's SKU; dan failed, so a
    # confirmation wave over its group (the simulated nodes) ran, and dan failed it too.
    hived = [s["extras"]["hivedScheduler"] for s in api.submitted]
    assert [h["taskRoles"]["bench"]["skuType"] for h in hived] == ["GPU-C", "GPU-D", "GPU-C", "GPU-D"]
    assert all(h["jobPriorityClass"] == "oppo" for h in hived)
    assert [s["name"].endswith("-confirm-0") for s in api.submitted] == [False, False, True, False]
    assert outcome.plots  # a bar chart per benchmark


def test_a_node_slow_once_but_not_on_confirmation_passes() -> None:
    logs = {"carol": bench_line(40), "dan": [bench_line(4), bench_line(39)]}  # disturbed once, then fine
    api, clock = FakeApi(placed(SKU_NODE), nodes=NODES[:2], logs=logs), Clock()
    outcome = run_stress(api, load_rules(), image=IMAGE, clock=clock, sleep=clock.sleep)
    assert outcome.result == "passed" and api.cordons == [] and api.reports[0]["nodeFailures"] == []
    assert {r["node"]: r["verdict"] for r in outcome.rows} == {"carol": "passed", "dan": "passed on confirmation"}
    rep = stress(FakeApi(placed(SKU_NODE), nodes=NODES[:2], logs={"carol": bench_line(40),
                                                                  "dan": [bench_line(4), bench_line(39)]}),
                 load_rules(), image=IMAGE, confirm=False, clock=clock, sleep=clock.sleep)
    assert rep.failed_nodes == ["dan"]


def test_no_cordon_when_asked_or_refused() -> None:
    logs = {"carol": bench_line(40), "dan": bench_line(4)}
    api, clock = FakeApi(placed(SKU_NODE), nodes=NODES[:2], logs=logs), Clock()
    rep = stress(api, load_rules(), image=IMAGE, cordon=False, clock=clock, sleep=clock.sleep)
    assert rep.failed_nodes == ["dan"] and api.cordons == []
    api = FakeApi(placed(SKU_NODE), nodes=NODES[:2], logs=logs, refuse_cordon=True)
    rep = stress(api, load_rules(), image=IMAGE, clock=clock, sleep=clock.sleep)
    assert rep.cordoned == [] and "Only admins" in rep.cordon_errors["dan"]


def test_when_most_nodes_fail_none_is_cordoned() -> None:
    nodes = [node(n, f"S{n}") for n in "abc"]

    def broken_image(doc: dict) -> list[dict]:  # python3 not found: every job fails, wherever it runs
        where = doc["extras"]["hivedScheduler"]["taskRoles"]["bench"]["skuType"][1:]
        return [job(doc["id"], "FAILED", node=where, exit_code=127)]

    api, clock = FakeApi(broken_image, nodes=nodes), Clock()
    rep = stress(api, load_rules(), image=IMAGE, clock=clock, sleep=clock.sleep)
    assert sorted(rep.failed_nodes) == ["a", "b", "c"] and api.cordons == []
    assert "3 of 3 nodes failed" in rep.cordon_errors["a"]


def test_jobs_not_placed_in_time_are_stopped_and_their_nodes_untested() -> None:
    def plan(doc: dict) -> list[dict]:
        if doc["extras"]["hivedScheduler"]["taskRoles"]["bench"]["skuType"] == "GPU-D":
            return [job(doc["id"], "WAITING")]
        return placed(SKU_NODE)(doc)

    api, clock = FakeApi(plan, nodes=NODES[:2], logs={"carol": bench_line(40)}), Clock()
    outcome = run_stress(api, load_rules(), image=IMAGE, timeout_s=30, clock=clock, sleep=clock.sleep)
    assert outcome.result == "passed" and len(api.stopped) == 1
    assert {r["node"]: r["verdict"] for r in outcome.rows} == {"carol": "passed", "dan": "untested"}


# ---------------------------------------------------------------------------------------- guard

def prober(*rounds: bool):
    """A prober whose successive rounds succeed or fail as given (the last repeats)."""
    seq = list(rounds)

    def probe_round() -> list[ProbeResult]:
        ok = seq.pop(0) if len(seq) > 1 else seq[0]
        return [ProbeResult("vc1", ok, reason="" if ok else "still WAITING")]
    return probe_round


def test_the_budget_trips_after_max_failures_plus_one() -> None:
    guard = SteadyStateGuard(FakeApi(quick), GuardConfig(max_probe_failures=2), image=IMAGE,
                             prober=prober(False, True, False, False))
    assert [guard.check() for _ in range(3)] == [False, True, False]
    assert not guard.tripped.is_set()
    guard.check()
    assert guard.tripped.is_set() and guard.reasons == ["inspection probe failed 3 times (error budget 2)"]


def test_a_disrupted_guaranteed_job_trips_at_once_unless_the_experiment_allows_it() -> None:
    api = FakeApi(quick)
    api.running = [job("bob~train", "RUNNING", priority="prod"), job("x~oppo", "RUNNING")]
    reasons = {}
    for allow in (False, True):
        api.running[0]["retryDetails"]["platform"] = 0
        guard = SteadyStateGuard(api, GuardConfig(allow_disruption=allow), image=IMAGE, prober=prober(True))
        guard.snapshot_guaranteed()
        api.running[0]["retryDetails"]["platform"] = 1  # its node was lost: the platform retried it
        guard.check()
        reasons[allow] = guard.reasons
    assert reasons == {False: ["guaranteed jobs disrupted: bob~train (platform retries 0 -> 1)"], True: []}


def test_a_broken_steady_state_before_the_drill_means_no_drill() -> None:
    ran = []
    g = guarded(lambda abort: ran.append(1), FakeApi(quick), GuardConfig(), image=IMAGE, prober=prober(False))
    assert g.aborted and not g.started and ran == []
    assert g.reasons == ["steady state broken before the drill started: vc1: still WAITING"]


def test_an_abort_stops_the_work_and_rolls_back_what_it_cordoned() -> None:
    api = FakeApi(quick, nodes=[node("carol"), node("dan")])
    entered = threading.Event()

    def work(abort: threading.Event) -> str:
        api.cordon("dan", True, source="chaos:cordon_node")  # the experiment's doing
        entered.set()
        assert abort.wait(30), "the guard never aborted"
        return "stopped early"

    cfg = GuardConfig(max_probe_failures=0, interval_s=0.01, grace_s=30)
    g = guarded(work, api, cfg, image=IMAGE, prober=prober(True, False),
                rollback=lambda: ["cleared the experiment's faults"])
    assert entered.is_set() and g.aborted and g.started
    assert g.reasons == ["inspection probe failed 1 times (error budget 0)"]
    assert g.rolled_back == ["uncordoned dan (chaos:cordon_node)", "cleared the experiment's faults"]
    assert api.cordons == [("dan", True), ("dan", False)] and g.result == "stopped early"


def test_an_abort_lifts_only_the_drill_s_own_cordons() -> None:
    """A chaos cordon set during the drill is lifted by its own source; an admin's cordon from
    before the drill, and an admin's and an incident's set while it ran, stay: they are not the
    drill's to undo."""
    api = FakeApi(quick, nodes=[node("carol"), node("dan")])
    api.cordon("dan", True, source="admin", reason="fan swap")
    entered = threading.Event()

    def work(abort: threading.Event) -> str:
        api.cordon("dan", True, source="chaos:cordon_node")  # the experiment's doing
        api.cordon("carol", True, source="admin", reason="memory test")  # meanwhile, people's
        api.cordon("carol", True, source="incident:7", reason="incident 7: XID 79")
        entered.set()
        assert abort.wait(30), "the guard never aborted"
        return "stopped early"

    cfg = GuardConfig(max_probe_failures=0, interval_s=0.01, grace_s=30)
    g = guarded(work, api, cfg, image=IMAGE, prober=prober(True, False))
    assert entered.is_set() and g.aborted
    assert g.rolled_back == ["uncordoned dan (chaos:cordon_node)"]
    held = {n["name"]: sorted(c["source"] for c in n["cordons"]) for n in api.nodes()}
    assert held == {"dan": ["admin"], "carol": ["admin", "incident:7"]}


def test_work_that_ends_within_its_budget_is_not_aborted() -> None:
    g = guarded(lambda abort: 42, FakeApi(quick, nodes=[]), GuardConfig(interval_s=3600), image=IMAGE,
                prober=prober(True))
    assert (g.result, g.aborted, g.error, g.rolled_back) == (42, False, None, [])


def test_work_that_raises_is_an_error_not_an_abort() -> None:
    def work(abort: threading.Event) -> None:
        raise RuntimeError("chaostoolkit crashed")

    g = guarded(work, FakeApi(quick, nodes=[]), GuardConfig(interval_s=3600), image=IMAGE, prober=prober(True))
    assert not g.aborted and g.error == "RuntimeError: chaostoolkit crashed"


# ------------------------------------------------------------------------ the chaos and load drills

def test_the_chaos_drill_stops_at_the_first_aborted_experiment(monkeypatch, tmp_path) -> None:
    from apiary.drills import adapters
    from apiary.drills.live import run_chaos_drill

    ran = []

    def experiment(path, *, abort, **kw):
        ran.append(path.stem)
        if path.stem == "b":
            assert abort.wait(30), "the guard never aborted"  # the runner's child would get SIGTERM now
            return adapters.ExperimentResult(path.stem, False, ["interrupted"])
        return adapters.ExperimentResult(path.stem, True)

    monkeypatch.setattr(adapters, "run_chaos_experiment", experiment)
    rounds = iter([True, True, True, False])  # a: before; b: before, then failing during it
    api = FakeApi(quick, nodes=[])
    outcome = run_chaos_drill(api, [tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"], home=tmp_path,
                              journal_dir=tmp_path, timeout_s=60, image=IMAGE,
                              guard=GuardConfig(max_probe_failures=0, interval_s=0.01),
                              prober=lambda: [ProbeResult("vc1", next(rounds, False))])
    assert ran == ["a", "b"] and outcome.result == "aborted"
    assert [(r["experiment"], r["passed"], r["aborted"]) for r in outcome.rows] == [("a", True, False),
                                                                                   ("b", False, True)]
    assert "inspection probe failed 1 times (error budget 0)" in outcome.rows[1]["reasons"]
    assert api.reports[0]["drill"] == "chaos-drill" and api.reports[0]["result"] == "aborted"


def test_the_load_drill_reports_the_runners_verdict(monkeypatch, tmp_path) -> None:
    from apiary.drills import adapters
    from apiary.drills.live import run_load_drill

    monkeypatch.setattr(adapters, "run_load", lambda **kw: adapters.LoadResult(
        True, {"requests": 50, "p99Ms": 40.0}, report="# Load test `smoke`: PASS"))
    api = FakeApi(quick, nodes=[])
    outcome = run_load_drill(api, profile="smoke", duration_s=10, out_dir=tmp_path, image=IMAGE,
                             guard=GuardConfig(interval_s=3600), prober=lambda: [ProbeResult("vc1", True)])
    assert outcome.result == "passed" and outcome.summary == "load profile smoke (10 s): passed"
    assert {"metric": "p99Ms", "value": 40.0} in outcome.rows
    assert list(outcome.plots.values()) == ["# Load test `smoke`: PASS"]
    assert api.reports[0]["result"] == "passed"
