"""Job-failure triage on a real control plane (the harness): each FAILED job classed once (a durable
tag), the owner of a user error told, and a platform failure rate over the threshold opening one
incident. No network: the owner notifications are recorded."""

from __future__ import annotations

from tests.support.plane import Harness

from apiary.response.config import ResponseConfig
from apiary.response.service import IncidentService
from apiary.response.store import IncidentStore
from apiary.response.triage import JobTriage


def _setup(tmp_path):
    h = Harness(tmp_path, "one-vc")
    told: list[tuple[str, str]] = []
    service = IncidentService(IncidentStore(h.plane.sessions), ResponseConfig.parse({}), plane=h.plane,
                              clock=h.clock, notify_owner=lambda user, subject, body: told.append((user, subject)))
    return h, told, JobTriage(service, h.plane, window_s=600, threshold=0.5, min_failures=3), service


def _run(h: Harness, name: str, code: int, user: str = "alice") -> str:
    job = h.submit(0, user=user, **{"defaults.virtualCluster": "default", "name": name})
    h.cycle()
    h.start(job)
    h.exit(job, code)
    h.cycle()
    return job


def _kill_again(h: Harness, job: str) -> None:
    """The retried attempt (placed by the last cycle) is SIGKILLed too."""
    h.start(job)
    h.exit(job, 137)
    h.cycle()


def test_a_user_failure_is_classed_once_and_its_owner_told(tmp_path):
    h, told, triage, _ = _setup(tmp_path)
    job = _run(h, "oom", -1200, user="bob")  # the container ran out of memory: the user's to fix
    out = triage.run_once()
    assert out["classified"] == [{"job": job, "class": "user", "rule": "exit-spec:UserContainerDockerOOMKilled"}]
    assert "failure:user" in h.job(job)["tags"]
    assert told == [("bob", f"Your job {job} failed: exit-spec:UserContainerDockerOOMKilled")]
    # Durable: a new triage (a restarted control plane) does not class or tell twice.
    again = JobTriage(triage.service, h.plane).run_once()
    assert again["classified"] == [] and len(told) == 1
    assert out["incident"] is None


def test_platform_failures_above_the_threshold_open_one_incident(tmp_path):
    h, _, triage, service = _setup(tmp_path)
    _run(h, "user-error", -1200)
    killed = _run(h, "killed", 137)  # SIGKILL: a platform failure, retried
    _kill_again(h, killed)
    assert triage.run_once()["incident"] is None  # 2 platform failures: under min_failures
    _kill_again(h, killed)
    out = triage.run_once()
    assert out["platformFailures"] == 3 and out["rate"] == 0.75
    incident = service.store.get(out["incident"])
    assert incident.severity.value == "sev2" and "platform" in incident.title
    # The rate stays high: the same incident, not a second one.
    _kill_again(h, killed)
    assert triage.run_once()["incident"] == out["incident"]
    assert len(service.store.recent()) == 1
    # Out of the window, the failures no longer count.
    h.tick(601)
    assert triage.run_once()["platformFailures"] == 0
