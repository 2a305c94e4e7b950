"""Against a real MLflow server (MLflow's venv) with Apiary's authorization plugin: Lab 6's mnist
logs its run through the standard-library REST client (tags, parameters, per-epoch metrics, the
model artifact) and registers a version; the model registry service reads it as its owner (list,
lineage, a tar that loads and scores) and another user is refused by MLflow itself; the plugin
maps an Apiary admin to an MLflow admin and refuses unknown tokens."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from tests.support.mlflow import IdentityStub, mlflow_server, needs_mlflow
from tests.support.mnist import MAIN, load_mnist

from apiary.errors import NotFoundError, UnauthorizedError
from apiary.marketplace.mlflow_server import MlflowServer
from apiary.marketplace.models import ModelRegistry

pytestmark = [pytest.mark.mlflow, needs_mlflow, pytest.mark.timeout(600)]

ALICE, BOB, ROOT = "alice-token", "bob-token", "root-token"
JOB = "alice~mnist-mlflow"


@pytest.fixture(scope="module")
def stub() -> Iterator[IdentityStub]:
    s = IdentityStub({ALICE: {"user": "alice", "admin": False, "groups": ["default"]},
                      BOB: {"user": "bob", "admin": False, "groups": ["team-b"]},
                      ROOT: {"user": "root", "admin": True, "groups": ["admin"]}})
    yield s
    s.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, stub: IdentityStub) -> Iterator[MlflowServer]:
    with mlflow_server(tmp_path_factory.mktemp("home"), stub.url) as s:
        yield s


@pytest.fixture(scope="module")
def trained(server: MlflowServer) -> dict:
    """mnist run as alice's job's task would run it: its output."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": server.url, "MLFLOW_TRACKING_TOKEN": ALICE,
           "MLFLOW_EXPERIMENT_NAME": "users/alice", "APIARY_JOB_ID": JOB, "PAI_JOB_ATTEMPT_ID": "0",
           "PAI_USER_NAME": "alice", "PAI_CURRENT_TASK_ROLE_NAME": "train",
           "PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX": "0"}
    out = subprocess.run([sys.executable, str(MAIN), "--epochs", "3", "--lr", "0.01", "--batch-size", "64",
                          "--register-model", "mnist"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return {"stdout": out.stdout}


def mlflow_get(server: MlflowServer, token: str, endpoint: str, **query: str) -> tuple[int, dict]:
    url = f"{server.url}/api/2.0/mlflow/{endpoint}?" + "&".join(f"{k}={v}" for k, v in query.items())
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def test_mnist_logs_its_run_and_registers_a_version(server: MlflowServer, trained: dict) -> None:
    lines = trained["stdout"].splitlines()
    assert lines[-1].startswith("final test_acc=")  # its output as before, MLflow lines before it
    assert any(line == "mlflow: registered model mnist version 1" for line in lines)
    status, doc = mlflow_get(server, ALICE, "model-versions/get", name="mnist", version="1")
    assert status == 200
    version = doc["model_version"]
    status, run = mlflow_get(server, ALICE, "runs/get", run_id=version["run_id"])
    assert status == 200
    tags = {t["key"]: t["value"] for t in run["run"]["data"]["tags"]}
    assert tags["apiary.job"] == JOB and tags["apiary.attempt"] == "0" and tags["apiary.task"] == "train/0"
    assert tags["mlflow.user"] == "alice" and tags["mlflow.source.name"] == "examples/mnist/main.py"
    params = {p["key"]: p["value"] for p in run["run"]["data"]["params"]}
    assert params["epochs"] == "3" and params["lr"] == "0.01"
    assert run["run"]["info"]["status"] == "FINISHED"
    assert version["source"] == run["run"]["info"]["artifact_uri"] + "/model"
    status, hist = mlflow_get(server, ALICE, "metrics/get-history", run_id=version["run_id"], metric_key="test_acc")
    assert [m["step"] for m in hist["metrics"]] == [1, 2, 3]
    final = float(lines[-1].split("=")[1])
    assert hist["metrics"][-1]["value"] == pytest.approx(final, abs=1e-4)


def test_the_registry_service_reads_as_the_owner(server: MlflowServer, trained: dict) -> None:
    reg = ModelRegistry(server.url)
    assert [m["name"] for m in reg.list(ALICE)] == ["mnist"]
    model = reg.get(ALICE, "mnist")
    assert [v["version"] for v in model["versions"]] == ["1"]
    v = reg.version(ALICE, "mnist", "1")
    assert v["job"] == {"id": JOB, "attempt": "0", "task": "train/0"}
    assert v["run"]["metrics"]["test_acc"] >= 0.85
    assert v["run"]["url"].startswith(f"{server.url}/#/experiments/")
    [listed] = reg.files(ALICE, "mnist", "1")
    assert listed["path"] == "model.npz"
    with reg.tar(ALICE, "mnist", "1") as f, tarfile.open(fileobj=io.BytesIO(f.read())) as tar:
        assert tar.getnames() == ["model.npz"]
        data = tar.extractfile("model.npz")
        assert data is not None
        model_path = server.home / "downloaded.npz"
        model_path.write_bytes(data.read())
    assert listed["size"] == model_path.stat().st_size > 0  # the listing's size is the file's
    mnist = load_mnist()
    predict = mnist.load_model(model_path)
    x, y = mnist.raw_digits()
    _, test = mnist.split(len(x), 0, 0.2)
    assert float((predict(x[test]) == y[test]).mean()) >= 0.85
    assert reg.resolve("mnist/1", ALICE) == "models:/mnist/1"
    assert reg.resolve("mnist", ALICE) == "models:/mnist/1"
    assert [r["tags"]["apiary.job"] for r in reg.job_runs(ALICE, JOB)] == [JOB]


def test_another_user_is_refused_by_mlflow(server: MlflowServer, trained: dict) -> None:
    """MLflow refuses bob (403); the registry says 404, as for a model that does not exist (which
    MLflow also answers a user 403: permissions are checked first)."""
    reg = ModelRegistry(server.url)
    assert reg.list(BOB) == []
    for read in (lambda: reg.get(BOB, "mnist"), lambda: reg.version(BOB, "mnist", "1"),
                 lambda: reg.tar(BOB, "mnist", "1"), lambda: reg.resolve("mnist/1", BOB),
                 lambda: reg.get(ALICE, "no-such-model"), lambda: reg.get(ROOT, "no-such-model")):
        with pytest.raises(NotFoundError):
            read()
    assert reg.job_runs(BOB, JOB) == []
    with pytest.raises(UnauthorizedError):
        reg.list("not-a-token")
    # MLflow answers the same to bob's token directly.
    assert mlflow_get(server, BOB, "model-versions/get", name="mnist", version="1")[0] == 403


def test_an_apiary_admin_is_an_mlflow_admin(server: MlflowServer, trained: dict) -> None:
    assert [m["name"] for m in ModelRegistry(server.url).list(ROOT)] == ["mnist"]
    assert mlflow_get(server, ROOT, "model-versions/get", name="mnist", version="1")[0] == 200


def test_the_plugin_refuses_no_token_and_asks_apiary_once_per_token(server: MlflowServer, stub: IdentityStub) -> None:
    req = urllib.request.Request(f"{server.url}/api/2.0/mlflow/registered-models/search")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith("Basic")
    stub.tokens["carol-token"] = {"user": "carol", "admin": False, "groups": []}
    before = stub.calls
    for _ in range(3):
        assert mlflow_get(server, "carol-token", "registered-models/search")[0] == 200
    assert stub.calls - before == 1  # cached (30 s)
    # A browser's Basic login: any name, the token as the password.
    import base64

    basic = base64.b64encode(b"carol:carol-token").decode()
    req = urllib.request.Request(f"{server.url}/api/2.0/mlflow/registered-models/search",
                                 headers={"Authorization": f"Basic {basic}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


def test_a_users_experiment_name_is_reserved_for_them(server: MlflowServer, trained: dict) -> None:
    def create(token: str, name: str) -> int:
        req = urllib.request.Request(f"{server.url}/api/2.0/mlflow/experiments/create",
                                     data=json.dumps({"name": name}).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert create(BOB, "users/carol") == 403
    assert create(BOB, "users/bob") == 200
    assert mlflow_get(server, BOB, "experiments/get-by-name", experiment_name="users/bob")[0] == 200


def run_mnist(server: MlflowServer, token: str, user: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": server.url, "MLFLOW_TRACKING_TOKEN": token,
           "MLFLOW_EXPERIMENT_NAME": f"users/{user}", "PAI_USER_NAME": user}
    return subprocess.run([sys.executable, str(MAIN), "--lr", "0.01", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def first_loss(stdout: str) -> float:
    line = next(line for line in stdout.splitlines() if line.startswith("epoch 1/"))
    return float(line.split("loss=")[1].split()[0])


def test_mnist_fine_tunes_from_a_registered_version_its_user_may_read(server: MlflowServer, trained: dict) -> None:
    """--init-model starts from mnist/1's weights: the first epoch's loss is well below that of the
    same run from random weights (same seed, same data); bob may not read mnist/1 and fails."""
    tuned = run_mnist(server, ALICE, "alice", "--epochs", "1", "--init-model", "models:/mnist/1")
    assert tuned.returncode == 0, tuned.stderr
    assert "init: weights from models:/mnist/1" in tuned.stdout
    fresh = run_mnist(server, ALICE, "alice", "--epochs", "1")
    assert fresh.returncode == 0, fresh.stderr
    assert first_loss(tuned.stdout) < 0.5 * first_loss(fresh.stdout), (tuned.stdout, fresh.stdout)
    refused = run_mnist(server, BOB, "bob", "--epochs", "1", "--init-model", "models:/mnist/1")
    assert refused.returncode == 1 and "--init-model" in refused.stderr and "403" in refused.stderr, refused.stderr
    wrong = run_mnist(server, ALICE, "alice", "--epochs", "1", "--hidden", "32", "--init-model", "models:/mnist/1")
    assert wrong.returncode == 1 and "--hidden" in wrong.stderr, wrong.stderr
