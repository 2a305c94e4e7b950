"""The scenario files under ``tests/sim/scenarios/`` through ``apiary sim scenario`` (the CLI), each
with the decision HiveD makes."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from apiary.cli.main import app

PARITY = Path(__file__).resolve().parent / "scenarios" / "hived-parity"


def scenario(name: str) -> dict:
    result = CliRunner().invoke(app, ["sim", "scenario", str(PARITY / name), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["jobs"]


def nodes(job: dict, attempt: int) -> list[str]:
    return sorted(p["node"] for p in job["attempts"][attempt]["placements"])


def test_priority_inversion_scenario_preempts_the_lower_priority_job_of_the_same_vc() -> None:
    jobs = scenario("priority-inversion.yaml")
    gang, victim = jobs["alice~a-prod-2x4gpu"], jobs["alice~a-test-2gpu"]
    assert gang["started"] == 3 and gang["finished"] == 103  # at once, not after the test job (t=1000)
    assert victim["preemptions"] == 1 and victim["attempts"][0]["finished"] == 3
    assert nodes(victim, 0)[0] in nodes(gang, 0) and len(set(nodes(gang, 0))) == 2
    assert victim["attempts"][1]["started"] == 103  # back when the gang is done
    assert all(jobs[j]["preemptions"] == 0 for j in ("bob~b-prod-4gpu", "bob~b-test-4gpu"))
    assert all(j["state"] == "SUCCEEDED" for j in jobs.values())


def test_victim_choice_scenario_stops_the_cheaper_opportunistic_job() -> None:
    jobs = scenario("victim-choice.yaml")
    assert jobs["alice~a-oppo-2gpu"]["preemptions"] == 1
    assert jobs["bob~b-oppo-3gpu"]["preemptions"] == 0
    needy = jobs["alice~a-test-3gpu"]
    assert needy["started"] == 4 and nodes(needy, 0) == nodes(jobs["alice~a-oppo-2gpu"], 0)


def test_opportunistic_job_once_every_node_is_bound_leaves_the_owning_vc_room() -> None:
    jobs = scenario("opportunistic-once-bound.yaml")
    oppo, needy = jobs["bob~b-oppo-1gpu"], jobs["alice~a-prod-1gpu"]
    assert nodes(oppo, 0) == nodes(jobs["bob~b-prod-1gpu"], 0)  # beside 1 guaranteed GPU, not 3
    assert needy["started"] == 5 and needy["preemptions"] == 0  # at once
    assert nodes(needy, 0) == nodes(jobs["alice~a-prod-3gpu"], 0)
    assert all(j["preemptions"] == 0 for j in jobs.values())
    assert all(j["state"] == "SUCCEEDED" for j in jobs.values())
