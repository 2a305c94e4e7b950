"""The node agent across an unreliable network: self-fencing, healing, replicas, tokens in clear.

The agents here talk to a fake control plane (an ``httpx.MockTransport`` answering as the
node-agent routes do, the grace in their header) that can be cut off (every request then fails as
a partition does) and run real sleeping processes through the process backend. The grace is
:data:`GRACE_S`, so the agent fences after ``GRACE_S - self_fence_margin_s(GRACE_S)`` = 3 s.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from tests.support.plane import CAROL, DAN, Harness

from apiary.errors import PlaintextTokenError, ValidationError
from apiary.lifecycle import EXIT_NODE_LOST
from apiary.runtime.agent import NodeAgent
from apiary.runtime.beat import HEARTBEAT_JITTER, RECOVERY_PERIOD_MIN, REPORT_RETRY_MIN_S
from apiary.runtime.link import (
    GRACE_HEADER,
    ContactClock,
    Replicas,
    self_fence_margin_s,
)
from apiary.runtime.process import ProcessBackend

GRACE_S = 6.0
FENCE_AFTER_S = GRACE_S - self_fence_margin_s(GRACE_S)
RUN = "alice~j.a0.train.0.t0"
#: Deadline for what takes a moment on a loaded 2-core machine (a launch, a report).
SOON_S = 20.0


def assignment(run_id: str = RUN, command: str = "sleep 60") -> dict:
    return {
        "runId": run_id, "desired": "RUN",
        "launch": {
            "run_id": run_id, "job_id": "alice~j", "user": "alice", "job_name": "j", "task_role": "train",
            "index": 0, "commands": [command], "env": {}, "gpus": [0], "image": None, "cpu": 1, "memory_mb": 1,
        },
    }


class FakeControlPlane:
    """The node-agent routes of one or more replicas (by URL host), answering from memory.

    ``assignments``: what every replica lists for the node; ``cut``: hosts that are partitioned
    away (a request to one fails with ConnectError); ``reports``: ``(host, monotonic time handled,
    body)`` of every answered report; runs reported exited are acknowledged."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.assignments: list[dict] = []
        self.cut: set[str] = set()
        self.reports: list[tuple[str, float, dict]] = []
        self.polls: list[str] = []  # host of every answered assignments poll

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.cut:
            raise httpx.ConnectError("no route to host (partitioned)", request=request)
        headers = {GRACE_HEADER: f"{self.grace_s:g}"}
        if request.url.path.endswith("/status"):
            body = json.loads(request.content)
            self.reports.append((host, time.monotonic(), body))
            ack = [r["run_id"] for r in body["runs"] if r["state"] == "exited"]
            return httpx.Response(200, json={"ack": ack}, headers=headers)
        if request.url.path.endswith("/assignments"):
            self.polls.append(host)
            if "wait" in request.url.params:
                await asyncio.sleep(0.2)  # a long poll with nothing new: answer a little later
            return httpx.Response(200, json={"generation": 1, "assignments": self.assignments, "faults": []},
                                  headers=headers)
        return httpx.Response(200, json={"size": 0}, headers=headers)

    def last_report_at(self) -> float:
        return self.reports[-1][1] if self.reports else float("-inf")

    def run_reports(self, run_id: str) -> list[dict]:
        return [r for _, _, body in self.reports for r in body["runs"] if r["run_id"] == run_id]


def make_agent(tmp_path: Path, cp: FakeControlPlane, urls: tuple[str, ...] = ("https://cp-a:8470",)) -> NodeAgent:
    client = httpx.AsyncClient(transport=httpx.MockTransport(cp))
    return NodeAgent("n1", list(urls), ProcessBackend(tmp_path / "n1"), client, gpus=1, simulated_gpus=True,
                     workdir=str(tmp_path), token="node-token")


async def until(pred: Callable[[], object], timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def state(agent: NodeAgent, run_id: str = RUN) -> str | None:
    st = agent.backend.status(run_id)
    return None if st is None else st.state


async def running_and_reported(agent: NodeAgent, cp: FakeControlPlane) -> int:
    """Wait until the run runs and a report saying so was answered; returns its pid."""
    await until(lambda: state(agent) == "running", SOON_S, "the run to start")
    await until(lambda: any(r["state"] == "running" for r in cp.run_reports(RUN)), SOON_S, "its report")
    st = agent.backend.status(RUN)
    assert st is not None and st.pid
    return st.pid


async def cut_right_after_a_report(cp: FakeControlPlane, host: str = "cp-a") -> float:
    """Partition ``host`` just after it answered a report; returns when it handled that report."""
    seen = len(cp.reports)
    await until(lambda: len(cp.reports) > seen, SOON_S, "a heartbeat")
    cp.cut.add(host)
    return cp.last_report_at()


def scenario(agent: NodeAgent, body: Callable[[asyncio.Event], object]) -> None:
    """Run ``agent`` while ``body(stop)`` runs; stop it and its tasks after."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.create_task(agent.run(stop))
        try:
            await body(stop)  # type: ignore[misc]
        finally:
            stop.set()
            await loop
            await agent.stop_all()
            await agent.client.aclose()

    asyncio.run(main())


# ------------------------------------------------------------------------------ partitions
def test_a_partition_shorter_than_the_fence_deadline_leaves_the_runs_running(tmp_path):
    cp = FakeControlPlane()
    cp.assignments = [assignment()]
    agent = make_agent(tmp_path, cp)

    async def body(stop):
        pid = await running_and_reported(agent, cp)
        cut_at = await cut_right_after_a_report(cp)
        await asyncio.sleep(FENCE_AFTER_S / 2)  # the partition (the stimulus, not the judge)
        cp.cut.clear()
        await until(lambda: cp.last_report_at() > cut_at + FENCE_AFTER_S / 2, SOON_S, "a report after the heal")
        st = agent.backend.status(RUN)
        assert (st.state, st.pid) == ("running", pid) and not agent.fenced and agent._fenced == set()
        assert not [r for r in cp.run_reports(RUN) if r["state"] == "exited"]

    scenario(agent, body)


@pytest.mark.parametrize(("skew_s", "step_s"), [(0.0, 0.0), (600.0, 0.0), (-600.0, 0.0), (0.0, -600.0)],
                         ids=["true-clock", "10-min-ahead", "10-min-behind", "stepped-back-10-min-when-cut"])
def test_a_partition_past_the_deadline_kills_the_runs_before_the_grace_ends(tmp_path, monkeypatch, skew_s, step_s):
    """Cut off from the control plane, the agent stops its run between the fence deadline and the
    control plane's grace, counted from the last report the control plane handled. The node's wall
    clock minutes off, or stepped back (NTP) as the partition begins, changes nothing: only
    monotonic durations are used. Healed, it reports the run ended with EXIT_NODE_LOST and never
    starts it again although the stale list still names it."""
    real = time.time
    offset = [skew_s]
    monkeypatch.setattr(time, "time", lambda: real() + offset[0])
    cp = FakeControlPlane()
    cp.assignments = [assignment()]
    agent = make_agent(tmp_path, cp)

    async def body(stop):
        pid = await running_and_reported(agent, cp)
        handled = await cut_right_after_a_report(cp)
        offset[0] += step_s
        await until(lambda: state(agent) == "exited", GRACE_S + SOON_S, "the run to be stopped")
        dead = time.monotonic()  # an upper bound of when it died (polled every 0.05 s)
        assert dead < handled + GRACE_S, "still running when the control plane may place it elsewhere"
        assert dead > handled + FENCE_AFTER_S - 0.5, "fenced before the deadline"
        assert agent.fenced and agent._fenced == {RUN}
        assert agent.backend.status(RUN).pid == pid
        cp.cut.clear()  # heal; the control plane still lists the run (it has not heard yet)
        exits = await until(lambda: [r for r in cp.run_reports(RUN) if r["state"] == "exited"], SOON_S,
                            "the fenced run's report")
        assert [(r["exit_code"], r["stopped"]) for r in exits] == [(EXIT_NODE_LOST, False)]
        await until(lambda: RUN in agent._tombstones, SOON_S, "the acknowledged run to be tombstoned")
        assert not agent.fenced
        polls = len(cp.polls)
        await until(lambda: len(cp.polls) >= polls + 3, SOON_S, "assignment polls after the heal")
        st = agent.backend.status(RUN)  # forgotten once acknowledged, or still the fenced one
        assert st is None or (st.state, st.pid) == ("exited", pid), "launched again"

    scenario(agent, body)


def test_healed_the_agent_does_not_restart_a_run_placed_elsewhere_and_runs_the_new_one(tmp_path):
    cp = FakeControlPlane()
    cp.assignments = [assignment()]
    agent = make_agent(tmp_path, cp)
    new_run = "alice~j.a1.train.0.t0"

    async def body(stop):
        await running_and_reported(agent, cp)
        await cut_right_after_a_report(cp)
        await until(lambda: agent.fenced and state(agent) == "exited", GRACE_S + SOON_S, "self-fencing")
        # Meanwhile the control plane lost the node: the run's job went elsewhere, and (back on
        # this node later) a new attempt with a new run id is assigned here.
        cp.assignments = [assignment(new_run)]
        launched_while_fenced = state(agent, new_run)
        cp.cut.clear()
        await until(lambda: state(agent, new_run) == "running", SOON_S, "the new run")
        assert launched_while_fenced is None
        await until(lambda: RUN in agent._tombstones, SOON_S, "the fenced run to be acknowledged")
        assert state(agent) != "running"
        assert [r["exit_code"] for r in cp.run_reports(RUN) if r["state"] == "exited"] == [EXIT_NODE_LOST]

    scenario(agent, body)


def test_a_fenced_node_launches_nothing_until_a_report_is_answered(tmp_path):
    """A poll may get through while reports do not (the grace is renewed by reports only)."""
    cp = FakeControlPlane()
    agent = make_agent(tmp_path, cp)

    async def body(stop):
        await until(lambda: cp.reports, SOON_S, "a first report")
        await agent.fence()
        agent._reconcile([assignment()])
        assert state(agent) is None

    scenario(agent, body)


# ------------------------------------------------------------------------------ replicas
def test_a_replica_that_cannot_be_reached_is_left_for_the_next_and_back(tmp_path):
    cp = FakeControlPlane()
    cp.cut = {"cp-a"}
    cp.assignments = [assignment()]
    agent = make_agent(tmp_path, cp, urls=("https://cp-a:8470", "https://cp-b:8470"))

    async def body(stop):
        pid = await running_and_reported(agent, cp)
        assert agent.api == "https://cp-b:8470" and {h for h, _, _ in cp.reports} == {"cp-b"}
        cp.cut = {"cp-b"}
        seen = len(cp.reports)
        await until(lambda: any(h == "cp-a" for h, _, _ in cp.reports[seen:]), SOON_S, "a report to cp-a")
        assert agent.api == "https://cp-a:8470"
        assert agent.backend.status(RUN).pid == pid and not agent.fenced

    scenario(agent, body)


class HttpsControlPlane:
    """A tiny HTTPS server answering the node-agent routes (empty assignments), in a thread, with
    the certificate ``cert``/``key``; ``requests``: ``(method, path, Authorization)`` it read."""

    def __init__(self, cert: Path, key: Path) -> None:
        seen: list[tuple[str, str, str | None]] = []
        self.requests = seen

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                seen.append((self.command, self.path, self.headers.get("Authorization")))
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                body = (b'{"ack": []}' if self.command == "POST" else
                        b'{"generation": 1, "assignments": [], "faults": []}')
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header(GRACE_HEADER, "30")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)

        class TlsServer(ThreadingHTTPServer):
            # The handshake runs in the connection's own thread, with a deadline: done on the
            # listening socket it would run in serve_forever's thread, and one client that
            # connects and never finishes it (an agent cancelled by ``stop``) blocks every
            # later accept and ``shutdown`` for good.
            def finish_request(self, request, client_address):
                request.settimeout(5)
                try:
                    conn = ctx.wrap_socket(request, server_side=True)
                except OSError:  # the client refused the certificate, or went away
                    return
                try:
                    super().finish_request(conn, client_address)
                finally:
                    self.shutdown_request(conn)

        self.server = TlsServer(("127.0.0.1", 0), Handler)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_https_is_verified_against_the_platform_ca_and_an_impostor_is_left_for_the_next_replica(tmp_path):
    """``run_agents(verify=http_verify(ca.crt))``: the first replica's certificate is signed by
    another CA, so the agent never sends it a request (the TLS handshake fails: the token stays
    unsent) and reports to the second, genuine one."""
    from apiary import pki
    from apiary.client import http_verify
    from apiary.runtime.agent import run_agents

    ca = pki.init_ca(tmp_path / "ca")
    pki.init_ca(tmp_path / "other-ca")
    impostor = HttpsControlPlane(*pki.issue(tmp_path / "other-ca", tmp_path / "certs", "impostor", ["127.0.0.1"]))
    genuine = HttpsControlPlane(*pki.issue(tmp_path / "ca", tmp_path / "certs", "genuine", ["127.0.0.1"]))

    async def main() -> None:
        stop = asyncio.Event()
        agents = asyncio.create_task(run_agents(
            [impostor.url, genuine.url], {"n1": 1}, tmp_path / "agents", simulated_gpus=True, stop=stop,
            tokens={"n1": "node-token"}, verify=http_verify(ca)))
        try:
            await until(lambda: any(m == "POST" for m, _, _ in genuine.requests) or agents.done(), SOON_S,
                        "a report to the genuine replica")
        finally:
            stop.set()
            await agents

    try:
        asyncio.run(main())
    finally:
        impostor.close()
        genuine.close()
    assert impostor.requests == []
    assert ("POST", "/api/v2/nodes/n1/status", "Bearer node-token") in genuine.requests
    assert json.loads((tmp_path / "agents" / "n1.contact.json").read_text())["graceS"] == 30


def test_replica_urls_come_as_a_list_or_comma_separated():
    assert Replicas("https://a:1/, https://b:2").urls == ["https://a:1", "https://b:2"]
    assert Replicas(["https://a:1", "https://b:2/"]).urls == ["https://a:1", "https://b:2"]
    with pytest.raises(ValidationError) as e:
        Replicas("a:1")
    assert e.value.field == "APIARY_API_URL"


@pytest.mark.parametrize(("urls", "refused"), [
    ("http://198.18.0.2:8470", True),
    ("https://198.18.0.2:8470,http://cp.example:8470", True),
    ("https://198.18.0.2:8470", False),
    ("http://127.0.0.1:8470", False),
    ("http://localhost:8470", False),
], ids=["plain-http-to-another-host", "one-replica-in-clear", "https", "loopback", "localhost"])
def test_the_node_token_never_goes_over_plain_http_to_another_host(tmp_path, urls, refused):
    def make(token):
        return NodeAgent("n1", urls, ProcessBackend(tmp_path / "n1"), None, gpus=1,
                         simulated_gpus=True, token=token)

    if refused:
        with pytest.raises(PlaintextTokenError, match="APIARY_API_URL"):
            make("node-token")
    else:
        make("node-token")
    make(None)  # nothing secret to send


@pytest.mark.parametrize(("urls", "fences"), [
    ("https://198.18.0.2:8470", True),
    ("http://127.0.0.1:8470", False),
    ("http://127.0.0.1:8470,https://198.18.0.3:8470", True),
], ids=["another-host", "loopback", "one-replica-elsewhere"])
def test_self_fencing_is_on_unless_every_control_plane_is_on_this_host(tmp_path, urls, fences):
    agent = NodeAgent("n1", urls, ProcessBackend(tmp_path / "n1"), None, gpus=1,
                      simulated_gpus=True)
    assert agent.self_fence is fences


# ------------------------------------------------------------------------------ the contact clock
class FakeMonotonic:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(("grace", "margin", "after"), [(30, 6, 24), (8, 3, 5), (6, 3, 3), (2, 3, 0)])
def test_the_margin_is_a_fifth_of_the_grace_and_at_least_three_seconds(grace, margin, after):
    assert self_fence_margin_s(grace) == margin
    assert ContactClock(grace).fence_after_s() == after


def test_the_contact_clock_counts_from_the_send_of_the_last_answered_report():
    clock = FakeMonotonic()
    contact = ContactClock(30.0, clock=clock)
    assert not contact.must_fence()
    sent = clock.t
    clock.t += 1.5  # the answer came back 1.5 s later
    contact.answered(sent, 8.0)  # the control plane's grace replaces the one assumed
    assert contact.grace_s == 8.0 and contact.fence_after_s() == 5.0
    clock.t = sent + 4.9
    assert not contact.must_fence() and contact.until_fence_s() == pytest.approx(0.1)
    contact.answered(sent - 10, None)  # an old answer arriving late never moves it back
    clock.t = sent + 5.0
    assert contact.must_fence() and contact.grace_s == 8.0


def test_a_restarted_agent_counts_from_its_predecessors_last_contact(tmp_path):
    record = tmp_path / "n1.contact.json"
    clock = FakeMonotonic()
    first = ContactClock(30.0, record=record, clock=clock)
    first.answered(clock.t, 8.0)
    clock.t += 4.0  # the agent is restarted 4 s later, the partition going on
    second = ContactClock(30.0, record=record, clock=clock)
    assert second.grace_s == 8.0 and second.until_fence_s() == pytest.approx(1.0)
    # A record from before a reboot (another boot id) means nothing: counting starts now.
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "bootId": "another-boot"}))
    third = ContactClock(30.0, record=record, clock=clock)
    assert third.grace_s == 30.0 and third.until_fence_s() == 24.0


# ------------------------------------------------------------------------------ the control plane's side
def test_a_fenced_runs_late_report_leaves_the_job_placed_elsewhere_alone(tmp_path):
    """The node was lost and its job placed on the other node; the healed agent then reports the
    run it fenced (-1001): acknowledged, and the job and its new attempt are unchanged."""
    h = Harness(tmp_path, "one-vc", node_lost_after_s=30.0)
    jid = h.submit(0, defaults__virtualCluster="default")
    h.cycle()
    old_run = h.start(jid)
    first = h.find(jid)["node"]
    other = DAN if first == CAROL else CAROL
    h.tick(31)
    h.report_all(except_=[first])
    h.cycle()  # first is lost; the job waits for a platform retry
    h.cycle()
    placed = h.find(jid)
    assert placed is not None and placed["node"] == other and placed["runId"] != old_run
    new_run = h.start(jid)
    before = h.job(jid)
    fenced = h.status(old_run, "exited", EXIT_NODE_LOST)
    assert h.report(first, [fenced]) == {"ack": [old_run]}
    assert h.job(jid) == before and h.find(jid)["runId"] == new_run


def test_the_node_routes_tell_the_agent_the_grace(tmp_path):
    from fastapi.testclient import TestClient
    from tests.support.auth import with_auth

    from apiary.api import create_app
    from apiary.ops.alerts import ActionsConfig, AlertReceiver

    h = Harness(tmp_path, node_lost_after_s=12.5)
    with with_auth(TestClient(create_app(h.plane, AlertReceiver(h.plane, ActionsConfig()))), h.plane) as c:
        body = {"agentId": "t", "gpus": 1, "simulatedGpus": True, "address": "127.0.0.1", "runs": []}
        for r in (c.post(f"/api/v2/nodes/{CAROL}/status", json=body), c.get(f"/api/v2/nodes/{CAROL}/assignments")):
            assert r.status_code == 200, r.text
            assert r.headers[GRACE_HEADER] == "12.5"


@pytest.mark.parametrize(("urls", "grace", "period"), [
    ("https://198.18.0.2:8470", 30.0, 2.0),
    ("https://198.18.0.2:8470", 6.0, 1.0),
    ("http://127.0.0.1:8470", 6.0, 2.0),
], ids=["default-grace", "short-grace", "not-fencing"])
def test_heartbeats_come_at_least_three_times_before_the_fence(tmp_path, urls, grace, period):
    agent = NodeAgent("n1", urls, ProcessBackend(tmp_path / "n1"), None, gpus=1, simulated_gpus=True,
                      contact=ContactClock(grace))
    assert agent.heartbeat_period_s() == period
    agent.beat.stretch = 1.0 + HEARTBEAT_JITTER  # the latest a jittered heartbeat can come
    assert agent.heartbeat_period_s() == pytest.approx(period * (1.0 + HEARTBEAT_JITTER))
    if agent.self_fence:  # two lost heartbeats in a row still leave the agent short of its fence
        assert 2 * agent.heartbeat_period_s() < agent.contact.fence_after_s()


def test_each_answered_report_draws_the_next_periods_jitter(tmp_path):
    async def go() -> list[float]:
        answer = httpx.MockTransport(lambda request: httpx.Response(200, json={"ack": []}))
        async with httpx.AsyncClient(transport=answer) as client:
            agent = NodeAgent("n1", "http://127.0.0.1:9", ProcessBackend(tmp_path / "n1"), client, gpus=1,
                              simulated_gpus=True)
            drawn = []
            for _ in range(20):
                await agent._report_once()
                drawn.append(agent.beat.stretch)
                agent.beat.last -= 1000.0  # due again
            return drawn

    first, *rest = asyncio.run(go())
    assert RECOVERY_PERIOD_MIN <= first <= 1.0  # the first period: a random phase, never longer than a period
    assert all(1.0 <= j <= 1.0 + HEARTBEAT_JITTER for j in rest)
    assert len(set(rest)) > 1  # drawn anew, not one stretch for good


def test_failed_reports_are_retried_after_a_random_wait_that_grows_up_to_one_heartbeat_period(tmp_path):
    answers = [httpx.Response(503, json={"code": "UnavailableError", "message": "busy"})] * 8
    answers.append(httpx.Response(200, json={"ack": []}))
    it = iter(answers)

    async def go() -> tuple[NodeAgent, list[float]]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda request: next(it))) as client:
            agent = NodeAgent("n1", "https://198.18.0.2:8470", ProcessBackend(tmp_path / "n1"), client, gpus=1,
                              simulated_gpus=True, contact=ContactClock(30.0))
            waits = []
            for _ in range(8):
                with pytest.raises(httpx.HTTPStatusError):
                    await agent._report_once()
                waits.append(agent.beat.retry_s(agent.base_period_s()))
            await agent._report_once()
            return agent, waits

    agent, waits = asyncio.run(go())
    period = agent.heartbeat_period_s() / agent.beat.stretch  # the period, unstretched
    assert all(REPORT_RETRY_MIN_S <= w <= period * (1.0 + HEARTBEAT_JITTER) for w in waits)
    assert waits[0] <= 2 * REPORT_RETRY_MIN_S  # the first retry comes soon
    assert len(set(waits)) == len(waits)  # drawn, so agents that failed together retry apart
    assert agent.beat.failures == 0  # an answered report starts the backoff afresh
    assert RECOVERY_PERIOD_MIN <= agent.beat.stretch <= 1.0  # and a period of random length


@pytest.mark.parametrize("urls", ["http://127.0.0.1:9", "https://198.18.0.2:8470"], ids=["plain", "self-fencing"])
def test_a_report_answered_after_a_whole_period_schedules_the_next_from_its_answer_at_a_random_phase(tmp_path, urls):
    def slow(request: httpx.Request) -> httpx.Response:
        time.sleep(0.3)  # longer than the period below: the next heartbeat would be due at once
        return httpx.Response(200, json={"ack": []})

    async def go() -> tuple[NodeAgent, float, float]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as client:
            agent = NodeAgent("n1", urls, ProcessBackend(tmp_path / "n1"), client, gpus=1, simulated_gpus=True,
                              contact=ContactClock(30.0))
            agent.heartbeat_s = 0.2
            await agent._report_once()  # the first answer: a random phase anyway
            agent.beat.last -= 1000.0  # due
            before = time.monotonic()
            await agent._report_once()
            return agent, before, time.monotonic()

    agent, before, after = asyncio.run(go())
    assert before + 0.3 <= agent.beat.last <= after  # counted from the answer, not from the send
    assert RECOVERY_PERIOD_MIN <= agent.beat.stretch <= 1.0
    if agent.self_fence:  # never more than a third of what is left before the fence
        assert agent.heartbeat_period_s() <= agent.contact.until_fence_s() / 3 + 1e-9

