"""The what-if simulator runs the live platform's logic: the same scenario through the live control
plane (real store, fake clock, agents played by this test) and through ``apiary sim scenario`` gives
every job the same history, event for event: states, attempts, placements, waiting reasons, times.

The live side is driven as the simulator models the world: at every instant, runs whose duration is
over report exit 0, failed nodes stop heart-beating (``node_lost_after_s = 0``: a node that did not
report at this instant is lost at the next cycle) and recovered ones report again, submissions
arrive; then cycles run, and after each cycle the agents start what was placed and kill what was
told to stop, until a cycle and its agents change nothing. The two sides share the lifecycle core
and the scheduler, and nothing else: the harness below is written against the plane's public API.
"""

from __future__ import annotations

import heapq
import itertools
from pathlib import Path

import pytest
import yaml
from tests.support.builders import LAB6, job_text

from apiary.control import ControlPlane
from apiary.errors import ApiaryError
from apiary.sim.scenario import load_scenario, run_scenario, simulate
from apiary.store import make_engine, migrate, session_factory

TWO_VCS = str(LAB6 / "hived-config-two-vcs.yaml")
ONE_VC = str(LAB6 / "hived-config-one-vc.yaml")


def inline(n: int, **changes) -> dict:
    return yaml.safe_load(job_text(n, **changes))


SCENARIOS = {
    # Lab 6 scenario 2: job-config-2 (prod) preempts job-config-1 (test) in vc1, which retries.
    "lab6-priority-preemption": (TWO_VCS, [
        {"at": 0, "user": "alice", "duration": 100, "submit": str(LAB6 / "job-config-1.yaml")},
        {"at": 10, "user": "bob", "duration": 50, "submit": str(LAB6 / "job-config-2.yaml")},
    ]),
    # A node failure and recovery with two jobs running.
    "node-failure": (ONE_VC, [
        {"at": 0, "user": "alice", "duration": 100, "submit": str(LAB6 / "job-config-5.yaml")},
        {"at": 0, "user": "bob", "duration": 100, "submit": str(LAB6 / "job-config-5.yaml")},
        {"at": 30, "fail-node": "hostname-dan"},
        {"at": 60, "recover-node": "hostname-dan"},
    ]),
    # The other Lab 6 behaviours, and a gang job on a node that fails.
    "lab6-vc-safety": (TWO_VCS, [
        {"at": 0, "user": u, "duration": 100, "submit": str(LAB6 / "job-config-0.yaml")} for u in ("alice", "bob")
    ]),
    "lab6-opportunistic": (TWO_VCS, [
        {"at": 0, "user": "alice", "duration": 100, "submit": str(LAB6 / "job-config-3.yaml")},
        {"at": 10, "user": "bob", "duration": 100, "submit": str(LAB6 / "job-config-4.yaml")},
        {"at": 20, "user": "carol", "duration": 100,
         "submit": inline(5, name="test-in-default", **{"extras.hivedScheduler.jobPriorityClass": "test"})},
    ]),
    "lab6-gang-and-incremental": (ONE_VC, [
        {"at": 0, "user": "alice", "duration": 100, "submit": str(LAB6 / "job-config-5.yaml")},
        {"at": 10, "user": "alice", "duration": 50, "submit": str(LAB6 / "job-config-6.yaml")},
        {"at": 20, "user": "bob", "duration": 200, "submit": str(LAB6 / "job-config-7.yaml")},
        {"at": 30, "user": "bob", "duration": 10,
         "submit": inline(6, name="gang-4", **{"taskRoles.train.instances": 4})},
    ]),
    "gang-on-a-failing-node": (ONE_VC, [
        {"at": 0, "user": "alice", "duration": 100, "submit": str(LAB6 / "job-config-6.yaml")},
        {"at": 5, "user": "bob", "duration": 40, "submit": str(LAB6 / "job-config-7.yaml")},
        {"at": 20, "fail-node": "hostname-carol"},
        {"at": 50, "recover-node": "hostname-carol"},
    ]),
}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run_live(tmp_path: Path, path: Path) -> dict[str, list[tuple[float, str, dict]]]:
    """The scenario through a live ControlPlane; each accepted job's events ``(time, type, data)``."""
    config, events = load_scenario(path)
    engine = make_engine(f"sqlite:///{tmp_path}/live.db")
    migrate(engine)
    clock = Clock()
    plane = ControlPlane(session_factory(engine), config, tmp_path / "logs", clock=clock, node_lost_after_s=0.0)
    nodes = sorted(n["name"] for n in plane.list_nodes())
    down: set[str] = set()
    durations: dict[str, float] = {}
    started: dict[str, float] = {}  # run id -> when the agent started it
    finishes: list[tuple[float, int, str, str]] = []  # (time, order, run id, node)
    order = itertools.count()
    last_seq = 0

    def report(node: str, run: dict) -> None:
        plane.node_report(node, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=[run])

    def agents(since: int) -> bool:
        """What the node agents do after a cycle; True if they did anything."""
        acted = False
        placed = [e for e in plane.events(after=since, limit=5000) if e["type"] == "job.placed"]
        for e in placed:  # start what was placed, in placement order
            for p in e["data"]["placements"]:
                a = next((x for x in plane.assignments(p["node"]) if x["launch"]["job_id"] == e["jobId"]
                          and (x["launch"]["task_role"], x["launch"]["index"]) == (p["taskRole"], p["index"])), None)
                if a is None or a["desired"] != "RUN" or a["runId"] in started:
                    continue
                started[a["runId"]] = clock.t
                report(p["node"], {"run_id": a["runId"], "state": "running", "started_at": clock.t})
                heapq.heappush(finishes, (clock.t + durations[e["jobId"]], next(order), a["runId"], p["node"]))
                acted = True
        for node in nodes:  # kill what was told to stop
            if node in down:
                continue
            for a in plane.assignments(node):
                if a["desired"] == "STOP":
                    report(node, {"run_id": a["runId"], "state": "exited", "exit_code": None,
                                  "started_at": started.get(a["runId"]), "finished_at": clock.t, "stopped": True})
                    acted = True
        return acted

    by_time: dict[float, list[dict]] = {}
    for ev in events:
        by_time.setdefault(ev["at"], []).append(ev)
    accepted: list[str] = []
    while by_time or finishes:
        t = min([*by_time, *([finishes[0][0]] if finishes else [])])
        clock.t = t
        todo = by_time.pop(t, [])
        for ev in todo:
            if "fail-node" in ev:
                down.add(ev["fail-node"])
            elif "recover-node" in ev:
                down.discard(ev["recover-node"])
        for node in nodes:
            if node not in down:
                report_hb = {"gpus": 1, "simulated_gpus": True, "address": "127.0.0.1", "agent_id": "t"}
                plane.node_report(node, runs=[], **report_hb)
        while finishes and finishes[0][0] == t:
            _, _, run_id, node = heapq.heappop(finishes)
            if node not in down:
                report(node, {"run_id": run_id, "state": "exited", "exit_code": 0,
                              "started_at": started[run_id], "finished_at": t})
        for ev in todo:
            if "submit" in ev:
                try:
                    job = plane.submit(ev["text"], str(ev.get("user", "user")))
                except ApiaryError:
                    continue
                durations[job["id"]] = ev["duration"]
                accepted.append(job["id"])
        for _ in range(100):
            before = last_seq
            plane.cycle()
            assert plane.check_consistency() == []
            acted = agents(before)
            new = plane.events(after=last_seq, limit=5000)
            last_seq = new[-1]["seq"] if new else last_seq
            if not acted and not new:
                break
        else:  # pragma: no cover
            pytest.fail(f"the live platform did not settle at t={t}")
    return {j: [(e["time"], e["type"], e["data"]) for e in plane.events(job_id=j, limit=5000)] for j in accepted}


def write(tmp_path: Path, cluster: str, events: list[dict]) -> Path:
    p = tmp_path / "scenario.yaml"
    p.write_text(yaml.safe_dump({"cluster": cluster, "events": events}, sort_keys=False))
    return p


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_live_and_simulated_histories_are_identical(tmp_path: Path, name: str) -> None:
    cluster, events = SCENARIOS[name]
    path = write(tmp_path, cluster, events)
    engine, order, rejected = simulate(path)
    simulated = {j: engine.jobs[j].events for j in order if engine.jobs[j].state != "REJECTED"}
    live = run_live(tmp_path, path)
    assert list(live) == list(simulated)
    for job_id in simulated:
        assert live[job_id] == simulated[job_id], job_id
    # Not vacuous: the scenarios exercise placements, preemptions, node losses and retries.
    types = {t for hist in simulated.values() for _, t, _ in hist}
    assert {"job.placed", "task.started", "task.exited", "job.completed"} <= types
    doc = run_scenario(path)["jobs"]
    assert all(j["state"] in ("SUCCEEDED", "REJECTED") for j in doc.values())


def test_the_scenarios_cover_preemption_node_loss_and_retries(tmp_path: Path) -> None:
    seen: set[str] = set()
    kinds: set[str] = set()
    for cluster, events in SCENARIOS.values():
        engine, order, _ = simulate(write(tmp_path, cluster, events))
        for j in order:
            for _, type_, data in engine.jobs[j].events:
                seen.add(type_)
                if type_ == "task.exited":
                    kinds.add(data["phrase"])
    assert {"job.preempted", "job.retry", "job.waiting"} <= seen
    assert {"PodNodeLost", "Succeeded"} <= kinds
