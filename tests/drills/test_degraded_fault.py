"""The simulated ``degraded`` fault: API -> queued fault -> agent -> slowed tasks and a throttled GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.support.auth import with_auth
from tests.support.builders import LAB6

from apiary.api import create_app
from apiary.control import ControlPlane
from apiary.monitoring.gpu import SimulatedGpus
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.runtime.agent import SLOWDOWN_ENV, SLOWDOWN_GPUS_ENV, NodeAgent
from apiary.runtime.base import TaskStatus
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory


@pytest.fixture
def client(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                         tmp_path / "logs")
    with TestClient(create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}))) as c:
        yield with_auth(c, plane), plane
    engine.dispose()


def test_the_api_queues_a_degraded_fault_for_the_agent(client) -> None:
    c, plane = client
    r = c.post("/api/v2/nodes/hostname-dan/faults", json={"gpu": 0, "degraded": 3})
    assert r.status_code == 200, r.text
    fault = r.json()
    assert fault == {"id": fault["id"], "gpu": 0, "degraded": 3.0}
    assert plane.node_faults("hostname-dan") == [fault]


@pytest.mark.parametrize("factor", [0.5, 0, -1, 1001])
def test_a_degraded_factor_below_1_or_absurd_is_a_400(client, factor: float) -> None:
    c, _ = client
    r = c.post("/api/v2/nodes/hostname-dan/faults", json={"gpu": 0, "degraded": factor})
    assert r.status_code == 400 and r.json()["field"] == "degraded"


def test_a_degraded_gpu_is_throttled_in_the_simulation() -> None:
    busy = [{"job": "a~j", "task_role": "train", "index": 0, "pid": 10, "gpus": [0]}]
    sim = SimulatedGpus("n1", 2, tasks=lambda: busy, clock=lambda: 0.0)
    assert sim.inject(0, degraded=4) == {"degraded": 4.0}
    clocks = {s.index: s.sm_clock_mhz for s in sim.samples()}
    assert clocks == {0: round(1410 / 4), 1: 210}  # GPU 1 is idle
    assert sim.faults() == {0: {"degraded": 4.0}}
    sim.clear(0)
    assert sim.faults() == {} and sim.samples()[0].sm_clock_mhz == 1410
    with pytest.raises(ValueError):
        sim.inject(0, degraded=0.5)


class Recording:
    """A runtime that records launches (the agent's reconciliation needs no real process here)."""

    name = "process"
    runs_probes = False

    def __init__(self) -> None:
        self.launched: dict[str, dict[str, str]] = {}

    def launch(self, task):
        self.launched[task.run_id] = dict(task.env)
        return TaskStatus(run_id=task.run_id, state="running", exit_code=None, pid=1, started_at=0.0,
                          finished_at=None)

    def status(self, run_id):
        return None

    def list(self):
        return []


def assignment(run_id: str, gpus: list[int]) -> dict:
    return {"runId": run_id, "desired": "RUN", "launch": {
        "run_id": run_id, "job_id": "a~j", "user": "a", "job_name": "j", "task_role": "t", "index": 0,
        "commands": ["true"], "env": {"PAI_JOB_NAME": "j"}, "gpus": gpus, "image": None, "cpu": 1, "memory_mb": 1}}


def test_the_agent_slows_down_only_tasks_on_the_degraded_gpu() -> None:
    backend = Recording()
    agent = NodeAgent("n1", "http://unused", backend, client=None, gpus=2, simulated_gpus=True)
    agent._apply_faults([{"id": 1, "gpu": 1, "degraded": 2.5}])
    agent._reconcile([assignment("r-gpu0", [0]), assignment("r-gpu1", [1]), assignment("r-both", [0, 1]),
                      assignment("r-none", [])])
    env = {run: e.get(SLOWDOWN_ENV) for run, e in backend.launched.items()}
    assert env == {"r-gpu0": None, "r-gpu1": "2.5", "r-both": "2.5", "r-none": "2.5"}
    # Per GPU: only the degraded GPU of the task is named, so the benchmark slows that GPU's figures only.
    per_gpu = {run: e.get(SLOWDOWN_GPUS_ENV) for run, e in backend.launched.items()}
    assert per_gpu == {"r-gpu0": None, "r-gpu1": "1:2.5", "r-both": "1:2.5", "r-none": None}
    assert agent.faults.applied == 1
    agent._apply_faults([{"id": 1, "gpu": 1, "degraded": 9}, {"id": 2, "gpu": 1, "clear": True}])  # 1: seen
    agent._reconcile([assignment("r-later", [1])])
    assert SLOWDOWN_ENV not in backend.launched["r-later"] and agent.faults.applied == 2
    assert SLOWDOWN_GPUS_ENV not in backend.launched["r-later"]


def test_a_task_on_two_degraded_gpus_gets_each_gpus_own_factor() -> None:
    backend = Recording()
    agent = NodeAgent("n1", "http://unused", backend, client=None, gpus=4, simulated_gpus=True)
    agent._apply_faults([{"id": 1, "gpu": 3, "degraded": 4}, {"id": 2, "gpu": 1, "degraded": 1.5}])
    agent._reconcile([assignment("r-all", [0, 1, 2, 3])])
    env = backend.launched["r-all"]
    assert env[SLOWDOWN_ENV] == "4" and env[SLOWDOWN_GPUS_ENV] == "1:1.5,3:4"
