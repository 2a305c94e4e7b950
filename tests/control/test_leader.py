"""Leader election on the ``leases`` row and fencing by epoch, against a real PostgreSQL.

Two (or three) electors share one database: one leads, each takeover raises the epoch by one, a
follower takes over only once the lease expired by the store's clock, a session that began under the
old epoch cannot commit after a takeover, and a leader that cannot renew steps down. Election rounds
are driven by hand (``try_acquire_or_renew``) except where the thread itself is under test.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import select, text
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tests.pg import create_database, start_postgres_or_skip
from tests.support.polling import until

from apiary.api.replica import FORWARDED_BY, ReplicaRouter, served_by_followers
from apiary.control.health import ReplicaRole
from apiary.control.leader import STEPPED_DOWN_EXIT, LeaderElector, check_timings
from apiary.errors import UnavailableError, ValidationError
from apiary.settings import Settings
from apiary.store import make_engine, migrate, session_factory
from apiary.store.fencing import CONTROL_PLANE_LEASE, NotLeaderError, install_fence
from apiary.store.models import Event, Lease
from apiary.store.unit import Sessions, UnitOfWork, reading
from apiary.wiring import electing

pytestmark = pytest.mark.postgres

DURATION_S = 0.6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, stop = start_postgres_or_skip(tmp_path_factory.mktemp("pg"))
    try:
        yield url
    finally:
        stop()


@pytest.fixture
def sessions(server: str) -> Iterator[Sessions]:
    engine = make_engine(create_database(server, f"t_{uuid.uuid4().hex[:12]}"))
    migrate(engine)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


class Exits:
    """An injected exit: records the codes instead of ending the test process."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.why: list[str] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


def elector(sessions: Sessions, name: str, exits: Exits | None = None, **kw) -> LeaderElector:
    exits = exits if exits is not None else Exits()
    kw.setdefault("lease_duration_s", DURATION_S)
    kw.setdefault("renew_deadline_s", DURATION_S * 0.7)
    kw.setdefault("retry_period_s", 0.1)
    return LeaderElector(sessions, identity=name, url=f"http://{name}:8470", exit=exits,
                         on_stopped_leading=exits.why.append, **kw)


def lease(sessions: Sessions) -> Lease:
    with reading(sessions) as s:
        row = s.scalars(select(Lease).where(Lease.name == CONTROL_PLANE_LEASE)).one()
        s.expunge(row)
        return row


def store_now(sessions: Sessions) -> float:
    with reading(sessions) as s:
        return float(s.execute(text("SELECT extract(epoch from clock_timestamp())")).scalar_one())


def take_over(e: LeaderElector, timeout_s: float = 15.0) -> None:
    until(e.try_acquire_or_renew, timeout_s, f"{e.identity} takes the lease")


def test_one_of_two_leads_and_the_other_takes_over_only_after_the_duration(sessions: Sessions) -> None:
    a, b = elector(sessions, "a"), elector(sessions, "b")
    assert a.try_acquire_or_renew() is True
    assert b.try_acquire_or_renew() is False
    assert (a.epoch, b.epoch, a.leading, b.leading) == (1, None, True, False)
    row = lease(sessions)
    assert (row.holder, row.holder_url, row.epoch) == ("a", "http://a:8470", 1)
    # b follows and knows where the leader is
    seen = b.observed
    assert seen is not None and (seen.holder, seen.holder_url, seen.epoch, seen.expired) == ("a", "http://a:8470", 1,
                                                                                               False)
    # a keeps renewing: b never takes over, however long it tries
    deadline = time.monotonic() + 3 * DURATION_S
    while time.monotonic() < deadline:
        assert a.try_acquire_or_renew() is True
        assert b.try_acquire_or_renew() is False
        time.sleep(0.05)
    # a stops renewing (killed): b takes over once the lease expired by the store's clock
    last_renew = lease(sessions).renewed
    take_over(b)
    row = lease(sessions)
    assert (row.holder, row.epoch) == ("b", 2)
    assert row.acquired - last_renew > DURATION_S
    assert b.epoch == 2


def test_epochs_rise_by_one_per_takeover_and_a_deposed_leader_steps_down(sessions: Sessions) -> None:
    exits_a = Exits()
    a, b, c = elector(sessions, "a", exits_a), elector(sessions, "b"), elector(sessions, "c")
    assert a.try_acquire_or_renew()
    take_over(b)
    # a's next round finds b's lease: it steps down (on_stopped_leading, then exit) and never leads again
    assert a.try_acquire_or_renew() is False
    assert exits_a.codes == [STEPPED_DOWN_EXIT] and "names b at epoch 2" in exits_a.why[0]
    assert (a.leading, a.epoch, a.stepped_down) == (False, None, True)
    take_over(c)
    assert lease(sessions).epoch == 3 and c.epoch == 3
    assert a.try_acquire_or_renew() is False and exits_a.codes == [STEPPED_DOWN_EXIT]


def test_a_restarted_replica_with_the_same_identity_takes_a_new_epoch_at_once(sessions: Sessions) -> None:
    first = elector(sessions, "cp-a", lease_duration_s=30.0, renew_deadline_s=20.0)
    assert first.try_acquire_or_renew() and first.epoch == 1
    again = elector(sessions, "cp-a", lease_duration_s=30.0, renew_deadline_s=20.0)  # the process restarted
    assert again.try_acquire_or_renew() and again.epoch == 2  # no wait for its old lease to expire
    assert first.try_acquire_or_renew() is False and first.stepped_down  # the old incarnation is deposed


def test_a_session_of_the_old_epoch_cannot_commit_after_a_takeover(sessions: Sessions) -> None:
    exits_a = Exits()
    # The election's sessions are not fenced; the plane's (``sessions`` here) are.
    unfenced = session_factory(sessions.kw["bind"])
    a, b = elector(unfenced, "a", exits_a), elector(unfenced, "b")
    fence = install_fence(sessions, CONTROL_PLANE_LEASE, "a", lambda: a.epoch, on_refused=a.step_down)
    assert a.try_acquire_or_renew()
    with UnitOfWork(sessions, "a write under epoch 1") as uow:  # a leads: its writes commit
        uow.s.add(Event(time=1.0, job_id="j0", type="job.test", data={}))
    assert fence.refused == 0
    applied: list[str] = []
    uow = UnitOfWork(sessions, "a write begun under epoch 1")
    uow.s.add(Event(time=2.0, job_id="j1", type="job.test", data={}))
    uow.flush()  # the row is written in the open transaction, before the takeover
    uow.after_commit(lambda: applied.append("j1"))
    take_over(b)  # a was paused past its lease; b leads at epoch 2
    with pytest.raises(NotLeaderError) as caught:
        uow.commit()
    uow.s.close()
    assert isinstance(caught.value, UnavailableError) and caught.value.status_code == 503
    assert "b at epoch 2" in caught.value.message and "epoch 1" in caught.value.message
    assert applied == []  # nothing reached memory
    assert fence.refused == 1
    assert exits_a.codes == [STEPPED_DOWN_EXIT]  # the refusal deposed a at once
    with reading(sessions) as s:
        assert sorted(s.scalars(select(Event.job_id))) == ["j0"]
    # every later write of the deposed replica is refused too, not only the one in flight
    with pytest.raises(NotLeaderError), UnitOfWork(sessions, "a write after stepping down") as later:
        later.s.add(Event(time=3.0, job_id="j2", type="job.test", data={}))
    # reads are not fenced
    with reading(sessions) as s:
        assert s.scalar(select(Lease.holder)) == "b"


def test_a_takeover_waits_for_the_writes_in_flight(sessions: Sessions) -> None:
    a, b = elector(sessions, "a"), elector(sessions, "b")
    assert a.try_acquire_or_renew()
    # A write of a's at its commit: the fence's share lock on the lease row is held until it ends.
    with reading(sessions) as s:
        s.execute(text("SELECT epoch FROM leases WHERE name = :n FOR SHARE"), {"n": CONTROL_PLANE_LEASE})
        time.sleep(DURATION_S * 1.5)  # the lease expires meanwhile (a's write is slow, or a is paused)
        for _ in range(3):  # b's takeover cannot pass the in-flight write: its round fails (statement timeout)
            with pytest.raises(UnavailableError):
                b.try_acquire_or_renew()
        assert lease(sessions).holder == "a"
    take_over(b)  # the write ended: the takeover goes through
    assert lease(sessions).epoch == 2


def test_a_leader_that_cannot_renew_steps_down_at_its_renew_deadline(sessions: Sessions) -> None:
    exits = Exits()
    a = elector(sessions, "a", exits)
    assert a.try_acquire_or_renew()
    broken = session_factory(make_engine("postgresql+psycopg://nobody:x@127.0.0.1:1/none?connect_timeout=1"))
    a.sessions = broken  # the store is gone for this replica
    started = time.monotonic()
    a.start()
    try:
        until(lambda: exits.codes, 10, "the leader steps down")
    finally:
        a.stop()
    assert exits.codes == [STEPPED_DOWN_EXIT] and "no renew succeeded" in exits.why[0]
    assert time.monotonic() - started >= a.renew_deadline_s * 0.5  # not at the first failed round
    assert a.epoch is None


def test_the_deadline_is_measured_on_the_monotonic_clock() -> None:
    now = [100.0]
    exits = Exits()
    a = LeaderElector(None, identity="a", url="http://a", lease_duration_s=6, renew_deadline_s=4,  # type: ignore[arg-type]
                      retry_period_s=1, exit=exits, monotonic=lambda: now[0])
    a._epoch, a._renewed_at = 1, 100.0  # as after a successful acquire at t=100
    now[0] = 103.9
    assert a.check_deadline() is False and exits.codes == []
    now[0] = 104.1
    assert a.check_deadline() is True and exits.codes == [STEPPED_DOWN_EXIT]


def test_timings_are_checked_like_client_go() -> None:
    check_timings(6, 4, 1)
    with pytest.raises(ValidationError, match="APIARY_RENEW_DEADLINE_S"):
        check_timings(4, 4, 1)
    with pytest.raises(ValidationError, match="APIARY_RETRY_PERIOD_S"):
        check_timings(6, 1, 1)


def test_sqlite_runs_one_replica_and_refuses_election(tmp_path) -> None:
    assert electing(Settings(home=tmp_path)) is False
    assert electing(Settings(home=tmp_path, database_url="postgresql+psycopg://x@h/db")) is True
    assert electing(Settings(home=tmp_path, database_url="postgresql+psycopg://x@h/db", leader_elect=False)) is False
    with pytest.raises(ValidationError, match="APIARY_LEADER_ELECT"):
        electing(Settings(home=tmp_path, leader_elect=True))


# ---------------------------------------------------------------------- the follower's middleware
async def _leader_endpoint(request: Request) -> JSONResponse:
    return JSONResponse({"served": "leader", "method": request.method, "path": request.url.path,
                         "query": request.url.query, "auth": request.headers.get("authorization"),
                         "forwardedBy": request.headers.get(FORWARDED_BY), "body": (await request.body()).decode()},
                        status_code=201)


async def _local_endpoint(request: Request) -> JSONResponse:
    return JSONResponse({"served": "here", "path": request.url.path})


def _router(role: ReplicaRole) -> ReplicaRouter:
    local = Starlette(routes=[Route("/{path:path}", _local_endpoint, methods=["GET", "POST", "PUT"])])
    leader = Starlette(routes=[Route("/{path:path}", _leader_endpoint, methods=["GET", "POST", "PUT"])])
    return ReplicaRouter(local, lambda: role, transport=httpx.ASGITransport(app=leader))


async def _call(router: ReplicaRouter, method: str, path: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://follower") as c:
        return await c.request(method, path, **kw)


def test_a_follower_serves_store_reads_and_forwards_the_rest() -> None:
    asyncio.run(_follower_serves_and_forwards())


async def _follower_serves_and_forwards() -> None:
    follower = _router(ReplicaRole("follower", "http://leader:8470", 4, "b"))
    r = await _call(follower, "POST", "/api/v2/jobs?x=1", content=b"jobName: j", headers={"Authorization": "Bearer t"})
    assert r.status_code == 201
    assert r.json() == {"served": "leader", "method": "POST", "path": "/api/v2/jobs", "query": "x=1",
                        "auth": "Bearer t", "forwardedBy": "b", "body": "jobName: j"}
    assert (await _call(follower, "GET", "/api/v2/jobs")).json()["served"] == "here"
    # the agents' long polls and the leader's memory are the leader's
    assert (await _call(follower, "GET", "/api/v2/nodes/n1/assignments?wait=1")).json()["served"] == "leader"
    assert (await _call(follower, "GET", "/api/v2/cluster/status")).json()["served"] == "leader"
    # a request another replica forwarded is never forwarded again
    r = await _call(follower, "POST", "/api/v2/jobs", headers={FORWARDED_BY: "a"})
    assert r.status_code == 503 and r.json()["code"] == "NotLeaderError"
    leader = _router(ReplicaRole("leader", "http://leader:8470", 4, "a"))
    assert (await _call(leader, "POST", "/api/v2/jobs")).json()["served"] == "here"


def test_without_a_leader_a_follower_answers_503_and_healthz_says_the_role() -> None:
    asyncio.run(_no_leader())


async def _no_leader() -> None:
    orphan = _router(ReplicaRole("follower", "", 7, "b"))
    r = await _call(orphan, "POST", "/api/v2/jobs")
    assert r.status_code == 503 and "no leader elected yet" in r.json()["message"]
    assert r.headers["retry-after"] == "1"
    body = (await _call(orphan, "GET", "/healthz")).json()
    assert body == {"served": "here", "path": "/healthz", "role": "follower", "leader": "", "epoch": 7,
                    "replica": "b", "fencedWrites": 0}


def test_follower_reads_are_the_store_backed_ones() -> None:
    for path in ("/api/v2/jobs", "/api/v2/jobs/alice~j1", "/api/v2/events", "/api/v2/users", "/api/v2/incidents/i1"):
        assert served_by_followers("GET", path), path
    for path in ("/api/v2/nodes", "/api/v2/jobs/alice~j1/logs", "/metrics", "/api/v2/drills", "/api/v2/cluster/status"):
        assert not served_by_followers("GET", path), path
    assert not served_by_followers("POST", "/api/v2/jobs")
