"""The store's schema: Alembic migrations agree with the models, and committed rows are durable."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text

from apiary.store import Event, Job, make_engine, migrate, session_factory
from apiary.store.engine import MIGRATIONS
from apiary.store.models import Base, Node

HEAD = "0016"  # the newest Alembic revision


@pytest.fixture
def engine(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path}/store.db")
    yield engine
    engine.dispose()


def a_job(job_id: str = "alice~mnist") -> Job:
    user, name = job_id.split("~")
    return Job(
        id=job_id, user=user, name=name, virtual_cluster="default", priority_class="prod", priority=100, gang=True,
        spec_yaml="name: mnist\n", state="WAITING", execution_type="START", attempt=0, retries_user=0,
        retries_platform=0, submission_time=1.5, submit_seq=1,
    )


def test_migrate_creates_exactly_the_model_tables(engine) -> None:
    migrate(engine)
    insp = inspect(engine)
    assert set(insp.get_table_names()) == set(Base.metadata.tables) | {"alembic_version"}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [HEAD]


@pytest.mark.parametrize("table", sorted(Base.metadata.tables))
def test_migrated_columns_match_the_model(engine, table: str) -> None:
    migrate(engine)
    insp = inspect(engine)
    model = Base.metadata.tables[table]
    db_cols = {c["name"]: c for c in insp.get_columns(table)}
    assert list(db_cols) == [c.name for c in model.columns]
    for col in model.columns:
        got = db_cols[col.name]
        assert got["nullable"] == col.nullable, col.name
        assert str(got["type"]) == col.type.compile(engine.dialect), col.name
    assert set(insp.get_pk_constraint(table)["constrained_columns"]) == {c.name for c in model.primary_key}
    model_indexes = {(tuple(c.name for c in ix.columns), bool(ix.unique)) for ix in model.indexes}
    db_indexes = {(tuple(ix["column_names"]), bool(ix["unique"])) for ix in insp.get_indexes(table)}
    assert db_indexes == model_indexes
    model_fks = {
        (tuple(fk.parent.name for fk in c.elements), c.referred_table.name) for c in model.foreign_key_constraints
    }
    db_fks = {(tuple(fk["constrained_columns"]), fk["referred_table"]) for fk in insp.get_foreign_keys(table)}
    assert db_fks == model_fks


def test_autogenerate_finds_no_difference(engine) -> None:
    migrate(engine)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []


def test_migrate_twice_is_idempotent(engine) -> None:
    migrate(engine)
    with session_factory(engine)() as s:
        s.add(a_job())
        s.commit()
    before = {t: inspect(engine).get_columns(t) for t in Base.metadata.tables}
    migrate(engine)
    migrate(engine)
    after = {t: inspect(engine).get_columns(t) for t in Base.metadata.tables}
    assert [str(c) for t in sorted(after) for c in after[t]] == [str(c) for t in sorted(before) for c in before[t]]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [HEAD]
    with session_factory(engine)() as s:
        assert [j.id for j in s.scalars(select(Job))] == ["alice~mnist"]


def test_committed_job_survives_closing_and_reopening(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/durable.db"
    engine = make_engine(url)
    migrate(engine)
    with session_factory(engine)() as s:
        s.add(a_job())
        s.add(Event(time=2.0, job_id="alice~mnist", type="job.submitted", data={"user": "alice", "n": [1, 2]}))
        s.commit()
        s.add(a_job("bob~never"))  # never committed
    engine.dispose()

    engine = make_engine(url)
    migrate(engine)  # every start migrates; must not touch the data
    with session_factory(engine)() as s:
        jobs = list(s.scalars(select(Job)))
        assert [(j.id, j.state, j.gang, j.submission_time, j.spec_yaml) for j in jobs] == [
            ("alice~mnist", "WAITING", True, 1.5, "name: mnist\n")
        ]
        (ev,) = s.scalars(select(Event))
        assert (ev.seq, ev.type, ev.data) == (1, "job.submitted", {"user": "alice", "n": [1, 2]})
    engine.dispose()


def test_sqlite_pragmas_for_durability(engine) -> None:
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA synchronous")).scalar() == 2  # FULL
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1


def test_0011_carries_a_cordoned_node_over_as_an_admin_cordon_and_back(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/old.db")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0010")
        conn.execute(text("INSERT INTO nodes (name, address, gpus, simulated_gpus, healthy, cordoned) VALUES "
                          "('n1', '127.0.0.1', 4, 1, 1, 1), ('n2', '127.0.0.1', 4, 1, 1, 0)"))
    migrate(engine)
    with session_factory(engine)() as s:
        nodes = {n.name: n for n in s.scalars(select(Node))}
        assert {name: n.cordoned for name, n in nodes.items()} == {"n1": True, "n2": False}
        (c,) = nodes["n1"].cordons
        assert (c.source, c.reason) == ("admin", "cordoned before cordons had reasons") and c.at > 0
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0010")
        assert dict(conn.execute(text("SELECT name, cordoned FROM nodes")).tuples().all()) == {"n1": 1, "n2": 0}
    engine.dispose()
