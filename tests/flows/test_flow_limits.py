"""What a run started from the Prefect UI may make the admin-acting flows do (no Prefect server).

The drills and runbooks act as the admin inside the serving process; whoever holds the Prefect
password may start them, so their parameters may only narrow them (flows/drills.py) and a runbook
acts only for an open incident that names its node (flows/runbooks.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from apiary.drills import run
from apiary.errors import NotFoundError
from apiary.load.profiles import PROFILES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "flows"))

import drills as drill_flows  # noqa: E402
import runbooks as runbook_flows  # noqa: E402


def refused(fl: Any, params: dict[str, Any]) -> bool:
    try:
        fl.validate_parameters(params)
    except Exception:  # Prefect's ParameterTypeError / SignatureMismatchError: no run starts
        return True
    return False


@pytest.mark.parametrize(("fl", "params"), [
    (drill_flows.chaos_drill, {"allow_disruptive": True}),
    (drill_flows.chaos_drill, {"timeout_s": 86_400}),
    (drill_flows.load_drill, {"profile": "http://127.0.0.1:1/huge"}),
    (drill_flows.load_drill, {"duration_s": 86_400}),
    (drill_flows.stress_drill, {"timeout_s": 86_400}),
    (drill_flows.inspection, {"slo_s": 0}),
    (runbook_flows.alert_quality, {"days": 1e9}),
    (runbook_flows.runbook, {"incident_id": "i", "node": "n", "which": "rm-rf"}),
])
def test_parameters_that_would_widen_a_drill_are_refused(fl: Any, params: dict[str, Any]) -> None:
    assert refused(fl, params)


def test_the_parameters_the_schedule_and_the_drill_e2e_use_are_accepted() -> None:
    assert not refused(drill_flows.inspection, {"slo_s": 90})
    assert not refused(drill_flows.stress_drill, {"cordon": False, "timeout_s": 150})
    assert not refused(drill_flows.chaos_drill, {"experiments": ["gpu-oom-job"], "timeout_s": 240})
    assert not refused(drill_flows.load_drill, {"duration_s": 10})
    assert set(drill_flows.LoadProfile.__args__) == set(PROFILES)


def test_cordon_from_a_run_can_only_turn_cordoning_off(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(drill_flows.run, "stress_drill", lambda **kw: seen.append(kw["cordon"]) or "outcome")
    monkeypatch.setattr(drill_flows, "_publish", lambda outcome: outcome)
    drill_flows.stress_drill.fn(cordon=True)
    drill_flows.stress_drill.fn(cordon=False)
    assert seen == [None, False]  # None: APIARY_DRILL_STRESS_CORDON decides; a run cannot force it on


def test_a_named_experiment_outside_the_drills_set_is_refused_before_anything_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIARY_API_URL", "http://127.0.0.1:9")  # nothing listens: the report fails, logged
    ran: list[Any] = []
    monkeypatch.setattr("apiary.drills.live.run_chaos_drill", lambda *a, **kw: ran.append(a))
    for name in ("store-disk-full", "kill-postgres", "../chaos/store-disk-full"):  # root-tagged, untagged, a path
        outcome = run.chaos_drill(experiments=[name], tagged_only=True)
        assert outcome.result == "failed" and "not among the experiments tagged for drills" in outcome.summary
    assert ran == []


class FakeIncidents:
    """``DrillApi`` as the runbook uses it: incidents by id, and every call recorded."""

    def __init__(self, incidents: dict[str, dict[str, Any]]) -> None:
        self.incidents = incidents
        self.calls: list[tuple[str, str]] = []

    def _call(self, method: str, path: str, **_kw: Any) -> Any:
        self.calls.append((method, path))
        iid = path.rsplit("/", 1)[-1]
        if method == "GET" and path.startswith("/api/v2/incidents/"):
            if iid not in self.incidents:
                raise NotFoundError(f"Incident {iid} not found.")
            body = self.incidents[iid]
            return type("Resp", (), {"json": lambda _self: body})()
        return type("Resp", (), {"json": lambda _self: {"result": "ok", "detail": ""}})()

    def nodes(self) -> list[dict[str, Any]]:
        return [{"name": "node1", "gpus": 1, "cordoned": False}]

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("incident_id", "node", "why"), [
    ("inc-open", "node2", "not one of incident inc-open's nodes"),
    ("inc-resolved", "node1", "acts only for an open incident"),
    ("inc-missing", "node1", "not found"),
])
def test_a_runbook_acts_only_for_an_open_incident_naming_the_node(monkeypatch: pytest.MonkeyPatch,
                                                                  incident_id: str, node: str, why: str) -> None:
    api = FakeIncidents({"inc-open": {"state": "acknowledged", "links": {"nodes": ["node1"]}},
                         "inc-resolved": {"state": "resolved", "links": {"nodes": ["node1"]}}})
    monkeypatch.setattr(runbook_flows.DrillApi, "from_env", classmethod(lambda cls, *a, **kw: api))
    steps = runbook_flows._run.fn("node-drain", incident_id, node)
    assert [(s.name, s.ok) for s in steps] == [("check-incident", False)] and why in steps[0].detail
    assert [m for m, _ in api.calls] == ["GET"]  # no action was posted


def test_a_runbook_for_an_open_incident_naming_the_node_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeIncidents({"inc-open": {"state": "triggered", "links": {"nodes": ["node1"]}}})
    monkeypatch.setattr(runbook_flows.DrillApi, "from_env", classmethod(lambda cls, *a, **kw: api))
    steps = runbook_flows._run.fn("node-drain", "inc-open", "node1")
    assert [(s.name, s.ok) for s in steps] == [("cordon-node", True), ("drain-node", True)]
    assert api.calls[1:] == [("POST", "/api/v2/incidents/inc-open/actions")] * 2
