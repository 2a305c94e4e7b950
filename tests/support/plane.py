"""The control plane driven by hand, for tests: a fake clock, fake node agents, explicit cycles.

Everything is synchronous: ``Harness.cycle()`` runs one scheduling cycle, ``Harness.start`` /
``Harness.exit`` report what a node agent would report for a run, ``Harness.tick`` moves the clock.
After every submission, report and cycle the harness checks the cluster-wide invariants (no run on
two nodes, no GPU given to two live runs of one node, no task instance running twice) and that the
store and the scheduler agree (:meth:`apiary.control.ControlPlane.check_consistency`).

:class:`FlakySession` is a real SQLAlchemy session whose commits can be made to fail the way a full
disk makes SQLite fail (``sqlite3.OperationalError: database or disk is full``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from tests.support.builders import job_text

from apiary.control import ControlPlane
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate

REPO = Path(__file__).resolve().parents[2]
LAB6 = REPO / "examples" / "lab6"
T0 = 1_700_000_000.0

CAROL, DAN = "hostname-carol", "hostname-dan"


class StoreFault:
    """Makes :class:`FlakySession` commits fail: ``failing`` for all of them, or ``fail_at``: the
    commit numbers (1-based, counted from when it was set) that fail."""

    def __init__(self) -> None:
        self.failing = False
        self.fail_at: set[int] = set()
        self.commits = 0
        self.failed = 0

    def check(self) -> None:
        self.commits += 1
        if self.failing or self.commits in self.fail_at:
            self.failed += 1
            raise OperationalError("COMMIT", {}, sqlite3.OperationalError("database or disk is full"))

    def fail_commits(self, *numbers: int) -> None:
        self.commits = 0
        self.fail_at = set(numbers)


class FlakySession(Session):
    """A session whose ``commit`` first asks its :class:`StoreFault` (``info["fault"]``)."""

    def commit(self) -> None:
        fault = self.info.get("fault")
        if fault is not None:
            fault.check()
        super().commit()


def flaky_sessions(engine, fault: StoreFault) -> sessionmaker:
    return sessionmaker(engine, class_=FlakySession, expire_on_commit=False, info={"fault": fault})


class Clock:
    """A mutable fake clock (unix seconds)."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Harness:
    """A ControlPlane over a temp SQLite file, plus fake agents for every node of the cluster."""

    def __init__(
        self,
        tmp_path: Path,
        config: str = "two-vcs",
        *,
        clock: Clock | None = None,
        node_lost_after_s: float = 30.0,
        report_nodes: bool = True,
    ) -> None:
        self.tmp_path = tmp_path
        self.config = config
        self.clock = clock or Clock()
        self.node_lost_after_s = node_lost_after_s
        self.engine = make_engine(f"sqlite:///{tmp_path}/a.db")
        migrate(self.engine)
        self.fault = StoreFault()
        self.sessions = flaky_sessions(self.engine, self.fault)
        self.plane = ControlPlane(
            self.sessions,
            load_cluster_config(LAB6 / f"hived-config-{config}.yaml"),
            tmp_path / "logs",
            clock=self.clock,
            node_lost_after_s=node_lost_after_s,
        )
        self.nodes = sorted(self.plane.scheduler.nodes())
        self.started: dict[str, float] = {}  # run_id -> started_at the fake agent reported
        self.run_nodes: dict[str, str] = {}  # run_id -> the node it was first assigned to
        if report_nodes:
            self.report_all()

    # ------------------------------------------------------------------ restart
    def restart(self) -> Harness:
        """A NEW ControlPlane on the same database and clock (kill -9 + restart); nodes not reported yet."""
        self.engine.dispose()
        new = Harness(
            self.tmp_path, self.config, clock=self.clock, node_lost_after_s=self.node_lost_after_s, report_nodes=False
        )
        new.started = dict(self.started)
        new.run_nodes = dict(self.run_nodes)
        return new

    # ------------------------------------------------------------------ driving
    def tick(self, seconds: float) -> None:
        self.clock.t += seconds

    def submit(self, n: int, user: str = "alice", **changes) -> str:
        job_id = self.plane.submit(job_text(n, **changes), user)["id"]
        self.check_invariants()
        return job_id

    def cycle(self):
        result = self.plane.cycle()
        self.check_invariants()
        return result

    def report(self, node: str, runs: Iterable[dict] = ()) -> dict:
        ack = self.plane.node_report(
            node, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=list(runs)
        )
        self.check_invariants()
        return ack

    def report_all(self, *, except_: Iterable[str] = ()) -> None:
        for n in self.nodes:
            if n not in set(except_):
                self.report(n)

    def find(self, job_id: str, index: int = 0, role: str = "train") -> dict | None:
        """The assignment of one task instance, with its ``node`` added; None if no node has it."""
        found = [
            {**a, "node": n}
            for n in self.nodes
            for a in self.plane.assignments(n)
            if (a["launch"]["job_id"], a["launch"]["task_role"], a["launch"]["index"]) == (job_id, role, index)
        ]
        assert len(found) <= 1, f"{job_id} {role}[{index}] is assigned more than once: {found}"
        return found[0] if found else None

    def start(self, job_id: str, index: int = 0, role: str = "train") -> str:
        a = self.find(job_id, index, role)
        assert a is not None, f"{job_id} {role}[{index}] has no assignment"
        run_id = a["runId"]
        self.started.setdefault(run_id, self.clock())
        self.report(a["node"], [self.status(run_id, "running")])
        return run_id

    def exit(self, job_id: str, code: int | None, index: int = 0, role: str = "train", *, stopped: bool = False) -> str:
        a = self.find(job_id, index, role)
        assert a is not None, f"{job_id} {role}[{index}] has no assignment"
        run_id = a["runId"]
        self.started.setdefault(run_id, self.clock())
        self.report(a["node"], [self.status(run_id, "exited", code, stopped=stopped)])
        return run_id

    def status(self, run_id: str, state: str, code: int | None = None, *, stopped: bool = False) -> dict:
        """A run status as the node agent sends it."""
        return {
            "run_id": run_id,
            "state": state,
            "exit_code": code,
            "pid": 4242,
            "started_at": self.started.get(run_id, self.clock()),
            "finished_at": self.clock() if state == "exited" else None,
            "lost": False,
            "stopped": stopped,
        }

    # ------------------------------------------------------------------ looking
    def job(self, job_id: str) -> dict:
        return self.plane.get_job(job_id)

    def task(self, job_id: str, index: int = 0, role: str = "train") -> dict:
        tasks = [t for t in self.job(job_id)["tasks"] if (t["taskRole"], t["index"]) == (role, index)]
        assert len(tasks) == 1
        return tasks[0]

    def event_types(self, job_id: str) -> list[str]:
        return [e["type"] for e in self.plane.events(job_id=job_id)]

    def events(self, job_id: str, type_: str) -> list[dict]:
        return [e["data"] for e in self.plane.events(job_id=job_id) if e["type"] == type_]

    def check_invariants(self) -> None:
        seen_runs: dict[str, str] = {}
        seen_instances: set[tuple] = set()
        for n in self.nodes:
            gpus_in_use: list[int] = []
            for a in self.plane.assignments(n):
                run_id = a["runId"]
                launch = a["launch"]
                assert run_id, f"assignment without a run id on {n}: {a}"
                assert run_id not in seen_runs, f"run {run_id} assigned to {seen_runs[run_id]} and {n}"
                seen_runs[run_id] = n
                # A run id, once given to a node, never moves to another node.
                assert self.run_nodes.setdefault(run_id, n) == n, f"run {run_id} moved to {n}"
                key = (launch["job_id"], launch["task_role"], launch["index"])
                assert key not in seen_instances, f"task instance {key} has two live runs"
                seen_instances.add(key)
                gpus_in_use += launch["gpus"]
            assert len(gpus_in_use) == len(set(gpus_in_use)), f"a GPU of {n} is given twice: {gpus_in_use}"
            assert len(gpus_in_use) <= 1, f"{n} has one GPU, assignments use {gpus_in_use}"
        assert self.plane.check_consistency() == []


