"""The incident store writes through the unit of work: a store that refuses is a 503
(UnavailableError naming the operation) with nothing half-written, never a bare SQLAlchemy error."""

from __future__ import annotations

from pathlib import Path

import pytest

from apiary.errors import UnavailableError
from apiary.incidents import Severity, apply, open_incident
from apiary.response.store import IncidentStore
from apiary.store import make_engine, migrate, session_factory


@pytest.fixture
def engine(tmp_path: Path):
    e = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(e)
    return e


def test_a_refused_write_is_unavailable_and_writes_nothing(engine):
    store = IncidentStore(session_factory(engine))
    incident = store.create(lambda iid: open_incident(iid, "GPU down", Severity.SEV2, "k", "alice", 1.0), None)
    with engine.begin() as c:  # the timeline's table goes away: every write of an entry fails
        c.exec_driver_sql("ALTER TABLE incident_entries RENAME TO gone")
    with pytest.raises(UnavailableError, match="incident store: change"), store.change(incident.id) as box:
        box[0] = apply(box[0], "acknowledge", "alice", 2.0)
    with engine.begin() as c:
        c.exec_driver_sql("ALTER TABLE gone RENAME TO incident_entries")
    assert store.get(incident.id).state.value == "triggered"  # the row's state was rolled back too


def test_a_refused_read_is_unavailable(engine):
    store = IncidentStore(session_factory(engine))
    with engine.begin() as c:
        c.exec_driver_sql("ALTER TABLE escalations RENAME TO gone")
    with pytest.raises(UnavailableError, match="incident store: due"):
        store.due(10.0)
