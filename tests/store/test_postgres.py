"""The store on a real PostgreSQL server: migrations, type round-trips and a Lab 6 lifecycle.

Each test gets a fresh database (``pg_url``) on one server started for the session
(``tests/store/conftest.py``); the same code paths run on SQLite everywhere else.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select, text

from apiary.control import ControlPlane
from apiary.spec.cluster import load_cluster_config
from apiary.store import Base, Event, Job, Node, Placement, Task, make_engine, migrate, session_factory
from apiary.store.engine import MIGRATIONS

pytestmark = pytest.mark.postgres

REPO = Path(__file__).resolve().parents[2]
LAB6 = REPO / "examples" / "lab6"
CAROL, DAN = "hostname-carol", "hostname-dan"
TABLES = {"alembic_version", *(t.name for t in Base.metadata.sorted_tables)}  # every model table


def head_revision() -> str:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(cfg).get_current_head()


class Clock:
    """A fake clock with a fractional part, so float times must round-trip exactly."""

    def __init__(self, t: float = 1_700_000_000.123456) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_migrate_twice_creates_the_schema(pg_url: str) -> None:
    engine = make_engine(pg_url)
    try:
        assert engine.dialect.name == "postgresql"
        migrate(engine)
        migrate(engine)  # idempotent: a second start changes nothing and does not fail
        insp = inspect(engine)
        assert set(insp.get_table_names()) == TABLES
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [head_revision()]
        # Native types, not SQLite's affinities: booleans, JSON, autoincrementing integer keys.
        cols = {t: {c["name"]: c for c in insp.get_columns(t)} for t in ("placements", "events", "nodes", "tasks")}
        assert str(cols["placements"]["released"]["type"]) == "BOOLEAN"
        assert str(cols["nodes"]["simulated_gpus"]["type"]) == "BOOLEAN"
        assert str(cols["placements"]["leaf_cells"]["type"]) == "JSON"
        assert str(cols["events"]["data"]["type"]) == "JSON"
        for table, key in (("placements", "id"), ("tasks", "id"), ("events", "seq")):
            assert cols[table][key]["autoincrement"] is True
            assert "nextval" in str(cols[table][key]["default"]) or cols[table][key].get("identity"), cols[table][key]
        assert {u["column_names"][0] for u in insp.get_unique_constraints("tasks")} == {"run_id"}
        # The unique (job_id, attempt, task_role, index) of placements is enforced by the server.
        assert [sorted(u["column_names"]) for u in insp.get_unique_constraints("placements")] == [
            sorted(["job_id", "attempt", "task_role", "index"])
        ]
    finally:
        engine.dispose()


def test_types_round_trip(pg_url: str) -> None:
    engine = make_engine(pg_url)
    migrate(engine)
    sessions = session_factory(engine)
    data = {"placements": [{"taskRole": "train", "index": 0, "gpus": [0, 3]}], "ok": True, "none": None,
            "float": 0.1, "text": "naïve ✓ \"quoted\""}
    try:
        with sessions() as s:
            events = [Event(time=1.5 + i, job_id="alice~x", type="t", data={**data, "i": i}) for i in range(3)]
            s.add_all(events)
            s.add(Node(name="n1", simulated_gpus=True, healthy=False))
            s.flush()
            seqs = [e.seq for e in events]
            assert all(isinstance(q, int) for q in seqs) and seqs == sorted(seqs) and len(set(seqs)) == 3
            s.commit()
        engine.dispose()
        with sessions() as s:
            got = list(s.scalars(select(Event).order_by(Event.seq)))
            assert [e.seq for e in got] == seqs
            assert [e.data for e in got] == [{**data, "i": i} for i in range(3)]
            assert got[0].time == 1.5
            node = s.get(Node, "n1")
            # Defaults apply and booleans come back as bool, not 0/1.
            assert (node.simulated_gpus, node.healthy, node.cordoned) == (True, False, False)
            assert all(type(v) is bool for v in (node.simulated_gpus, node.healthy, node.cordoned))
            assert node.gpus == 0 and node.address == "127.0.0.1"
            # The server stores real JSON (not text): its operators see inside it.
            n = s.execute(text(
                "SELECT count(*) FROM events WHERE (data->>'ok')::boolean AND data->>'none' IS NULL"
                " AND (data->'placements'->0->'gpus'->>1)::int = 3"
            )).scalar()
            assert n == 3
    finally:
        engine.dispose()


def _status(run_id: str, state: str, started_at: float, **kw) -> dict:
    """A run status as a node agent sends it."""
    return {"run_id": run_id, "state": state, "pid": 1, "started_at": started_at, "finished_at": None,
            "exit_code": None, "lost": False, "stopped": False, **kw}


def _plane(url: str, logs: Path, clock: Clock) -> tuple[ControlPlane, object]:
    engine = make_engine(url)
    migrate(engine)
    plane = ControlPlane(session_factory(engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"), logs,
                         clock=clock)
    return plane, engine


def _report(plane: ControlPlane, node: str, runs: list[dict] | None = None) -> dict:
    return plane.node_report(node, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="t", runs=runs or [])


def test_lab6_preemption_lifecycle_and_restart(pg_url: str, tmp_path: Path) -> None:
    clock = Clock()
    plane, engine = _plane(pg_url, tmp_path / "logs", clock)
    try:
        for node in (CAROL, DAN):
            assert _report(plane, node) == {"ack": []}

        # job-config-1: test priority in vc1 (hostname-dan).
        low = plane.submit((LAB6 / "job-config-1.yaml").read_text(), "alice")["id"]
        assert low == "alice~job-config-1"
        assert plane.cycle().placed == [low]
        (a,) = plane.assignments(DAN)
        low_run, started = a["runId"], clock()
        assert a["desired"] == "RUN" and a["launch"]["gpus"] == [0]
        _report(plane, DAN, [_status(low_run, "running", started)])
        job = plane.get_job(low)
        assert job["state"] == "RUNNING" and job["tasks"][0]["state"] == "RUNNING"

        # job-config-2: prod priority in vc1 preempts it.
        clock.t += 1
        high = plane.submit((LAB6 / "job-config-2.yaml").read_text(), "bob")["id"]
        result = plane.cycle()
        assert result.preempted == [low] and result.placed == [] and high in result.waiting
        (a,) = plane.assignments(DAN)
        assert (a["runId"], a["desired"]) == (low_run, "STOP")

        clock.t += 1
        ack = _report(plane, DAN, [_status(low_run, "exited", started, exit_code=143, stopped=True,
                                           finished_at=clock())])
        assert ack == {"ack": [low_run]}
        job = plane.get_job(low)
        assert (job["state"], job["attempt"], job["retryDetails"]) == ("WAITING", 1, {"user": 0, "platform": 1})
        assert plane.assignments(DAN) == []

        result = plane.cycle()
        assert result.placed == [high] and low in result.waiting and result.preempted == []
        (a,) = plane.assignments(DAN)
        assert a["launch"]["job_id"] == high and a["desired"] == "RUN"
        high_run = a["runId"]

        # What PostgreSQL stored: JSON lists, real booleans, server-generated keys.
        with session_factory(engine)() as s:
            placements = list(s.scalars(select(Placement).order_by(Placement.id)))
            assert [(p.job_id, p.attempt, p.node, p.released) for p in placements] == [
                (low, 0, DAN, True),
                (high, 0, DAN, False),
            ]
            assert all(type(p.released) is bool and isinstance(p.id, int) for p in placements)
            assert placements[0].id < placements[1].id
            assert [(p.leaf_cells, p.gpus) for p in placements] == [([0], [0]), ([0], [0])]
            tasks = list(s.scalars(select(Task).order_by(Task.id)))
            assert [(t.job_id, t.attempt, t.state, t.latest, t.gpus) for t in tasks] == [
                (low, 0, "STOPPED", True, [0]),
                (high, 0, "STARTING", True, [0]),
                (low, 1, "WAITING", True, None),
            ]
            assert tasks[0].exit_code == 143 and tasks[0].started == started and tasks[0].pid == 1
            nodes = {n.name: n for n in s.scalars(select(Node))}
            assert {n: (r.simulated_gpus, r.healthy, r.cordoned) for n, r in nodes.items()} == {
                CAROL: (True, True, False), DAN: (True, True, False)
            }
            seqs = list(s.scalars(select(Event.seq).order_by(Event.seq)))
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            job_row = s.get(Job, low)
            assert type(job_row.gang) is bool and job_row.submission_time == Clock().t
        placed = [e for e in plane.events(job_id=high) if e["type"] == "job.placed"]
        assert placed[0]["data"]["placements"] == [{"taskRole": "train", "index": 0, "node": DAN, "gpus": [0]}]
        assert [e["type"] for e in plane.events(job_id=low)][:4] == [
            "job.submitted", "job.placed", "task.started", "job.preempted"
        ]

        before_jobs = plane.list_jobs()
        before_events = plane.events()
        before_assignments = {n: plane.assignments(n) for n in (CAROL, DAN)}
    finally:
        engine.dispose()

    # Restart: a fresh control plane on the same database rebuilds everything from it.
    clock.t += 5
    plane2, engine2 = _plane(pg_url, tmp_path / "logs", clock)
    try:
        assert plane2.list_jobs() == before_jobs
        assert plane2.events() == before_events
        assert {n: plane2.assignments(n) for n in (CAROL, DAN)} == before_assignments
        assert [j["id"] for j in before_jobs] == [low, high]
        # The recovered scheduler still counts high's cells: once the nodes report, nothing moves.
        for node in (CAROL, DAN):
            _report(plane2, node)
        result = plane2.cycle()
        assert result.placed == [] and result.preempted == [] and low in result.waiting
        _report(plane2, DAN, [_status(high_run, "running", clock())])
        assert plane2.get_job(high)["state"] == "RUNNING"
        assert plane2.get_job(low)["state"] == "WAITING"
    finally:
        engine2.dispose()
