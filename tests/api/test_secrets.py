"""A planted secret (a job's ``secrets``) and planted tokens never leak.

alice's job carries ``secrets: {token: SECRET}`` and its command uses it; the job runs on
hostname-carol and prints it into its own log. Only two places may hold it: the launch the agent
of hostname-carol receives, and alice's own logs. Everything else is grepped: every log record
the platform wrote (all loggers, DEBUG), every event, every answer to bob (another VC), eve (same
VC, not the owner), the admin's job views, the assignments of the other node. Tokens: the store
keeps only their digests.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tests.api.test_authz import CAROL, DAN, JOB, SECRET, World, secret_job

from apiary.auth.tokens import split


@pytest.fixture
def leaked(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG)
    w = World(tmp_path)
    c, h = w.client, w.headers
    # a second job of alice's with a bad template reference: its error must not echo the secrets
    bad = secret_job("bad-ref").replace("<% $secrets.token %>", "<% $secrets.nope %> <% $secrets.token %>")
    refused = c.post("/api/v2/jobs", content=bad, headers=h["alice"])
    assert refused.status_code == 400
    # the job ends; everything about it has been said
    assert w.report(CAROL, [{"run_id": w.run_id, "state": "exited", "exit_code": 0}]) == 200
    assert w.state() == "SUCCEEDED"
    seen: dict[str, str] = {"refused submission": refused.text}
    seen["events (admin, all)"] = c.get("/api/v2/events", params={"limit": 5000}, headers=h["admin"]).text
    for who in ("bob", "eve", "admin", "bridge"):
        seen[f"job list ({who})"] = c.get("/api/v2/jobs", headers=h[who]).text
        seen[f"job ({who})"] = c.get(f"/api/v2/jobs/{JOB}", headers=h[who]).text
        seen[f"events ({who})"] = c.get("/api/v2/events", headers=h[who]).text
        seen[f"cluster status ({who})"] = c.get("/api/v2/cluster/status", headers=h[who]).text
        seen[f"nodes ({who})"] = c.get("/api/v2/nodes", headers=h[who]).text
    for who in ("bob", "eve"):
        seen[f"logs ({who})"] = c.get(f"/api/v2/jobs/{JOB}/logs", headers=h[who]).text
        seen[f"assignments of {CAROL} ({who})"] = c.get(f"/api/v2/nodes/{CAROL}/assignments", headers=h[who]).text
    seen[f"assignments of {DAN} (its agent)"] = json.dumps(w.assignments(DAN))
    seen["alerts (admin)"] = c.get("/api/v2/alerts", headers=h["admin"]).text
    seen["platform log records"] = "\n".join(r.getMessage() for r in caplog.records)
    yield w, seen
    w.close()


def test_the_secret_reaches_only_the_right_agent_and_the_owner(leaked) -> None:
    w, seen = leaked
    assert len(seen) > 20
    assert {where for where, text in seen.items() if SECRET in text} == set()
    # and it is really there for the two who may have it, so the grep could have found it
    assert SECRET in w.client.get(f"/api/v2/jobs/{JOB}/logs", headers=w.headers["alice"]).text
    w2 = w.client.post("/api/v2/jobs", content=secret_job("again"), headers=w.headers["alice"])
    assert w2.status_code == 202
    assert w.client.post("/api/v2/scheduler/cycle", headers=w.headers["admin"]).status_code == 200
    assert SECRET in json.dumps(w.assignments(CAROL))


def test_the_store_keeps_token_digests_never_tokens(tmp_path: Path) -> None:
    w = World(tmp_path)
    try:
        tokens = [h["Authorization"].split()[1] for h in w.headers.values() if h]
        new = w.client.post("/api/v2/tokens", json={}, headers=w.headers["alice"]).json()["token"]
        listed = w.client.get("/api/v2/tokens", headers=w.headers["admin"]).text
        w.engine.dispose()  # the WAL checkpointed into the file
        store = b"".join(p.read_bytes() for p in tmp_path.glob("a.db*"))
        for token in [*tokens, new]:
            secret = split(token)[1]
            assert secret.encode() not in store
            assert secret not in listed
    finally:
        w.close()
