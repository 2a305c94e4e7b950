"""``GET /healthz`` says ok only while the store takes writes and no node's agent says it cannot record.

A store that cannot write is a read-only SQLite database (refused to root as well) and, where this
machine lets a test mount one, a SQLite file on a full tmpfs; an agent that cannot record says so in
its report (``cannotRecord``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.support.builders import LAB6

from apiary.api import create_app
from apiary.control import ControlPlane
from apiary.errors import UnavailableError, error_from_response
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

CONFIG = LAB6 / "hived-config-two-vcs.yaml"
CAROL = "hostname-carol"
REPO = Path(__file__).resolve().parents[2]


def _client(plane: ControlPlane) -> TestClient:
    return TestClient(create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={}), cluster_id="c-1"))


def _plane(url: str, logs: Path) -> ControlPlane:
    return ControlPlane(session_factory(make_engine(url)), load_cluster_config(CONFIG), logs)


def test_healthz_is_ok_while_the_store_writes_and_503_once_it_cannot(tmp_path: Path) -> None:
    db = tmp_path / "a.db"
    migrate(make_engine(f"sqlite:///{db}"))
    with _client(_plane(f"sqlite:///{db}", tmp_path / "logs")) as c:
        r = c.get("/healthz")
        assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["clusterId"] == "c-1"
    # The same database, opened read-only: reads work, every write fails.
    with _client(_plane(f"sqlite:///file:{db}?mode=ro&uri=true", tmp_path / "logs")) as c:
        r = c.get("/healthz")
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["status"] == "unhealthy" and "store cannot write" in body["reason"]
        assert "readonly" in body["reason"] and body["clusterId"] == "c-1"  # the CLI still learns the platform
        # As any error answer: a client that raises on the 503 says why.
        error = error_from_response(r.status_code, r.content)
        assert isinstance(error, UnavailableError) and "store cannot write" in error.message


def test_healthz_lists_an_agent_that_cannot_record_until_it_can(tmp_path: Path) -> None:
    db = tmp_path / "a.db"
    migrate(make_engine(f"sqlite:///{db}"))
    plane = _plane(f"sqlite:///{db}", tmp_path / "logs")

    def report(cannot_record: str | None) -> None:
        plane.node_report(CAROL, gpus=1, simulated_gpus=True, address="127.0.0.1", agent_id="a", runs=[],
                          cannot_record=cannot_record)

    with _client(plane) as c:
        report(None)
        assert c.get("/healthz").status_code == 200
        report("cannot write to /var/lib/apiary/agent: No space left on device")
        r = c.get("/healthz")
        assert r.status_code == 503
        assert r.json()["problems"] == [
            f"node {CAROL} cannot record runs: cannot write to /var/lib/apiary/agent: No space left on device"]
        report(None)
        assert c.get("/healthz").status_code == 200


_FULL_DISK = """
import os, sys
sys.path[:0] = [{repo!r}, {platform!r}]
from fastapi.testclient import TestClient
from apiary.api import create_app
from apiary.control import ControlPlane
from apiary.ops.alerts import ActionsConfig, AlertReceiver
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

try:
    from apiary.control import health
    health.STORE_PROBE_S = 0.0  # every /healthz probes the store afresh
except ImportError:  # a platform from before the store probe
    pass
mnt = {mnt!r}
engine = make_engine(f"sqlite:///{{mnt}}/a.db")
migrate(engine)
plane = ControlPlane(session_factory(engine), load_cluster_config({config!r}), {logs!r})
app = create_app(plane, AlertReceiver(plane, ActionsConfig(), notifiers={{}}))
with TestClient(app) as c:
    print("before", c.get("/healthz").status_code)
    with open(f"{{mnt}}/filler", "wb", buffering=0) as f:
        for chunk in (65536, 4096, 512):
            try:
                while True:
                    f.write(b"x" * chunk)
            except OSError:
                pass
    r = c.get("/healthz")
    print("full", r.status_code, r.json().get("reason"))
"""


@pytest.mark.e2e
def test_healthz_says_so_when_the_sqlite_disk_is_full(tmp_path: Path) -> None:
    """A SQLite store on a tmpfs filled up: /healthz answers 503 naming the disk (needs a private mount
    namespace, as root; skipped where this machine does not allow one)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "full.py"
    script.write_text(textwrap.dedent(_FULL_DISK).format(
        repo=str(REPO), platform=str(REPO / "platform"), mnt=str(mnt), config=str(CONFIG),
        logs=str(tmp_path / "logs")))
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=4m tmpfs {mnt}"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=4m tmpfs {mnt} && exec {sys.executable} {script}"],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "before 200" in lines, out.stdout
    full = [line for line in lines if line.startswith("full ")]
    assert full and full[0].startswith("full 503") and "No space left" in full[0], out.stdout
