"""The model registry end to end on the embedded platform with MLflow on (process runtime): alice
runs the marketplace's mnist template (Lab 6's mnist) with ``apiary template run``; its job logs
its run to MLflow as alice (its own run's secret, never a platform credential), tagged with the
job, and registers version 1 of ``mnist``; ``apiary job get`` links the run,
``apiary model get`` shows its lineage and ``apiary model download`` gets a model that loads and
scores; bob, of another group, is refused by the platform and by MLflow itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tests.support.mlflow import needs_mlflow
from tests.support.mnist import load_mnist
from tests.support.polling import done, until

pytestmark = [pytest.mark.e2e, pytest.mark.mlflow, needs_mlflow, pytest.mark.timeout(900)]


def cli(home: Path, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "APIARY_HOME": str(home), "APIARY_TOKEN": token}
    env.pop("APIARY_API_URL", None)
    return subprocess.run([sys.executable, "-m", "apiary", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def submit_mnist(home: Path, token: str, epochs: int = 3) -> str:
    """The marketplace's mnist template (Lab 6's mnist, registering its model as ``mnist`` by
    default) run with ``apiary template run`` as the token's user; the job's id."""
    ran = cli(home, token, "template", "run", "mnist", "-p", f"epochs={epochs}", "-p", "register_model=mnist")
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.split()[0]


def mlflow_status(url: str, token: str, endpoint: str) -> int:
    req = urllib.request.Request(f"{url}/api/2.0/mlflow/{endpoint}", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_job_registers_its_model_and_only_its_user_reads_it(platform_factory, tmp_path: Path) -> None:
    p, c = platform_factory(mlflow=True)
    assert p.mlflow_server is not None
    mlflow = p.mlflow_server.url
    admin = c.admin
    admin.create_group("team-b", virtual_clusters=["default"])
    admin.create_user("alice")  # the default group
    admin.create_user("bob", groups=["team-b"])
    alice = admin.create_token("alice", expires_in_s=3600)["token"]
    bob = admin.create_token("bob", expires_in_s=3600)["token"]

    job_id = submit_mnist(p.home, alice)
    job = done(c, job_id)
    assert job["state"] == "SUCCEEDED", (job, c.logs(job_id, "train", 0, stream="stderr"))
    log = c.logs(job_id, "train", 0)
    assert "mlflow: registered model mnist version 1" in log
    final = float(next(line for line in log.splitlines() if line.startswith("final test_acc=")).split("=")[1])

    # The run is in MLflow, alice's, tagged with the job, with its metrics; the model is mnist/1.
    shown = cli(p.home, alice, "model", "get", "mnist/1", "--json")
    assert shown.returncode == 0, shown.stderr
    version = json.loads(shown.stdout)
    assert version["version"] == "1" and version["job"] == {"id": job_id, "attempt": "0", "task": "train/0"}
    run = version["run"]
    assert run["status"] == "FINISHED" and run["tags"]["mlflow.user"] == "alice"
    assert run["metrics"]["test_acc"] == pytest.approx(final, abs=1e-4)
    assert {"loss", "train_acc", "test_acc"} <= set(run["metrics"])
    listed = cli(p.home, alice, "model", "list")
    assert listed.returncode == 0 and "mnist" in listed.stdout, listed.stderr

    # apiary job get links the job's run.
    detail = admin.as_token(alice).get(job_id)
    assert [r["runId"] for r in detail["mlflowRuns"]] == [run["runId"]]
    assert detail["mlflowRuns"][0]["url"].startswith(mlflow)

    # The model out: it loads and scores on the digits' test split.
    got = cli(p.home, alice, "model", "download", "mnist/1", "-o", str(tmp_path / "m"))
    assert got.returncode == 0, got.stderr
    mnist = load_mnist()
    predict = mnist.load_model(tmp_path / "m" / "model.npz")
    x, y = mnist.raw_digits()
    _, test = mnist.split(len(x), 0, 0.2)
    accuracy = float((predict(x[test]) == y[test]).mean())
    assert accuracy >= 0.85 and accuracy == pytest.approx(final, abs=1e-4)

    # Bob (another group): refused by the platform and by MLflow itself, with his own token.
    denied = cli(p.home, bob, "model", "get", "mnist/1")
    assert denied.returncode == 1 and "(404)" in denied.stderr, denied.stderr  # as if it did not exist
    denied = cli(p.home, bob, "model", "download", "mnist/1", "-o", str(tmp_path / "bob"))
    assert denied.returncode == 1 and not (tmp_path / "bob" / "model.npz").exists()
    assert mlflow_status(mlflow, bob, "model-versions/get?name=mnist&version=1") == 403
    assert mlflow_status(mlflow, bob, f"runs/get?run_id={run['runId']}") == 403
    # Bob sees the job (his group grants its VC) but not its MLflow runs.
    assert "mlflowRuns" not in admin.as_token(bob).get(job_id)
    # No token Apiary knows, no access.
    assert mlflow_status(mlflow, "not-a-token", "registered-models/search") == 401

    # From model to job: the mnist-finetune template's model parameter resolves as its caller, through
    # MLflow; alice's job starts from mnist/1 and registers version 2; bob's run is refused.
    tuned = cli(p.home, alice, "template", "run", "mnist-finetune", "-p", "base_model=mnist/1", "-p", "epochs=1")
    assert tuned.returncode == 0, tuned.stderr
    tuned_id = tuned.stdout.split()[0]
    assert done(c, tuned_id)["state"] == "SUCCEEDED", c.logs(tuned_id, "train", 0, stream="stderr")
    log = c.logs(tuned_id, "train", 0)
    assert "init: weights from models:/mnist/1" in log and "registered model mnist version 2" in log, log
    assert json.loads(cli(p.home, alice, "model", "get", "mnist/2", "--json").stdout)["job"]["id"] == tuned_id
    refused = cli(p.home, bob, "template", "run", "mnist-finetune", "-p", "base_model=mnist/1")
    assert refused.returncode == 1 and "base_model" in refused.stderr, refused.stderr

    # MLflow is a supervised child: killed, it is back on the same URL with the same registry.
    child = p.children["mlflow"]
    old = child.proc.pid
    child.proc.kill()
    until(lambda: child.alive() and child.restarts >= 1, 60, "the mlflow child restarted")
    until(lambda: not group_alive(old), 20, "the killed child's server process gone (the port is the new one's)")
    p.mlflow_server.wait(timeout_s=180)
    assert [m["name"] for m in admin.as_token(alice).models()] == ["mnist"]
