"""The alert log: an alert action is claimed once per (fingerprint, startsAt, action, target);
a failed run may be claimed again; a store that refuses is a 503, not a claim."""

from __future__ import annotations

from pathlib import Path

import pytest

from apiary.errors import UnavailableError
from apiary.ops.alertlog import AlertLog
from apiary.store import make_engine, migrate, session_factory

KEY = {"fingerprint": "f1", "starts_at": "2026-11-22T00:00:00Z", "action": "cordon-node", "target": "n1"}


@pytest.fixture
def engine(tmp_path: Path):
    e = make_engine(f"sqlite:///{tmp_path}/a.db")
    migrate(e)
    return e


def test_a_claim_runs_once_and_a_failed_run_may_be_claimed_again(engine):
    log = AlertLog(session_factory(engine), clock=lambda: 5.0)
    assert log.claim_alert_action(alertname="A", **KEY) is True
    assert log.claim_alert_action(alertname="A", **KEY) is False  # running
    log.finish_alert_action(status="failed", detail="smtp down", **KEY)
    assert log.claim_alert_action(alertname="A", **KEY) is True  # retried on the resend
    log.finish_alert_action(status="ok", detail="node n1 cordoned", **KEY)
    assert log.claim_alert_action(alertname="A", **KEY) is False
    assert log.recent_alert_actions() == [{"alertname": "A", "action": "cordon-node", "target": "n1",
                                           "status": "ok", "detail": "node n1 cordoned", "time": 5.0}]


def test_a_claim_the_store_refuses_is_unavailable_not_a_claim(engine):
    log = AlertLog(session_factory(engine))
    with engine.begin() as c:  # a store that fails every statement on the table
        c.exec_driver_sql("ALTER TABLE alert_actions RENAME TO gone")
    with pytest.raises(UnavailableError, match="claim alert action"):
        log.claim_alert_action(alertname="A", **KEY)
