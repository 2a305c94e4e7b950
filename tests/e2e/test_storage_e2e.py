"""Team-wise storage end to end on the embedded platform (process runtime), over a real GlusterFS
volume on loopback: data in with ``apiary storage put``, Lab 6's mnist reading it from the mounted
config and writing its model there, the model out with ``apiary storage get``; another group's
user refused at submission and at ``storage get``; and a storage server that is down ending the
attempt in seconds as the platform's failure, retried."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from tests.support.dfs import loopback_gluster
from tests.support.mnist import load_mnist
from tests.support.polling import done, until

from apiary.embedded import REPO_ROOT
from apiary.hosts.gluster import GlusterVolume
from apiary.lifecycle import EXIT_MOUNT_FAILED

pytestmark = [pytest.mark.e2e, pytest.mark.dfs, pytest.mark.timeout(600),
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting GlusterFS and binding storage need root")]



@pytest.fixture(scope="module")
def volume() -> Iterator[GlusterVolume]:
    with loopback_gluster("apiary-e2e") as v:
        yield v


def mnist_job(name: str, storage: dict, output: str) -> str:
    """Lab 6's mnist job (job-config-0) reading its data from /mnt/team/data, writing to ``output``."""
    doc = yaml.safe_load((REPO_ROOT / "examples" / "lab6" / "job-config-0.yaml").read_text())
    doc["name"] = name
    doc["defaults"] = {"virtualCluster": "default"}
    doc["extras"] = storage
    doc["taskRoles"]["train"]["commands"] = [
        f"python3 examples/mnist/main.py --epochs 1 --lr 0.01 --data-dir /mnt/team/data --output-dir {output}"]
    return yaml.safe_dump(doc, sort_keys=False)


def cli(home: Path, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "APIARY_HOME": str(home), "APIARY_TOKEN": token}
    env.pop("APIARY_API_URL", None)
    return subprocess.run([sys.executable, "-m", "apiary", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_data_in_model_out_and_another_group_refused(platform_factory, volume: GlusterVolume,
                                                     tmp_path: Path) -> None:
    p, c = platform_factory()
    admin = c.admin
    admin.put_storage_server("gfs", "glusterfs", volume.server_data())
    admin.put_storage_config("team", [{"mountPoint": "/mnt/team", "server": "gfs", "path": "mnist"}])
    admin.create_group("team-b", virtual_clusters=["default"])
    admin.create_user("alice")  # the default group
    admin.create_user("bob", groups=["team-b"])
    admin.set_storage_grant("default", "team")
    alice = admin.create_token("alice", expires_in_s=3600)["token"]
    bob = admin.create_token("bob", expires_in_s=3600)["token"]

    # Data in: the digits set, uploaded into the GlusterFS volume through the API.
    mnist = load_mnist()
    mnist.main(["--export-data", str(tmp_path / "digits.npz")])
    out = cli(p.home, alice, "storage", "put", str(tmp_path / "digits.npz"), "team:data/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "team:data/digits.npz"
    brick = [d for d in volume.brick_dirs() if (d / "mnist" / "data" / "digits.npz").exists()]
    assert brick, "the upload did not reach the volume's brick"

    # The job reads it from the mounted config and writes its model there.
    text = mnist_job("mnist-storage", {"storages": [{"name": "team"}]}, "/mnt/team/models/run1")
    job = done(c, admin.as_token(alice).submit(text)["id"])
    assert job["state"] == "SUCCEEDED", (job, c.logs(job["id"], "train", 0, stream="stderr"))
    log = c.logs(job["id"], "train", 0)
    assert "1438 train / 359 test" in log
    listed = cli(p.home, alice, "storage", "ls", "team:models/run1")
    assert listed.returncode == 0 and "model.npz" in listed.stdout and "metrics.json" in listed.stdout

    # Model out: it loads and scores as the run said.
    got = cli(p.home, alice, "storage", "get", "team:models/run1/model.npz", str(tmp_path))
    assert got.returncode == 0, got.stderr
    predict = mnist.load_model(tmp_path / "model.npz")
    with np.load(tmp_path / "digits.npz") as f:
        pixels, labels = f["data"], f["target"]
    _, test = mnist.split(len(labels), 0, 0.2)
    accuracy = float((predict(pixels[test]) == labels[test]).mean())
    assert accuracy >= 0.85
    assert f"final test_acc={accuracy:.4f}" in log

    # The one-machine default: apiary up made a local config "home" for the default group.
    home = admin.storage_config("home")
    assert home["mountInfos"] == [{"mountPoint": "/mnt/home", "server": "home", "path": "", "permission": "rw"}]
    local = mnist_job("mnist-home", {"storages": [{"name": "team"}, {"name": "home"}]}, "/mnt/home/run1")
    job = done(c, admin.as_token(alice).submit(local)["id"])
    assert job["state"] == "SUCCEEDED", (job, c.logs(job["id"], "train", 0, stream="stderr"))
    assert [m["config"] for m in c.get(job["id"])["storage"]] == ["team", "home"]
    assert (p.home / "storage" / "home" / "run1" / "model.npz").exists()
    shown = cli(p.home, alice, "job", "get", job["id"])
    assert "/mnt/home" in shown.stdout and "gfs:mnist" in shown.stdout, shown.stdout

    # Another group's user: 403 at submission, naming the config, and 403 for its files.
    r = admin.as_token(bob)
    with pytest.raises(Exception) as refused:
        r.submit(mnist_job("theirs", {"storages": [{"name": "team"}]}, "/mnt/team/x"))
    assert getattr(refused.value, "status_code", None) == 403 and "team" in str(refused.value)
    denied = cli(p.home, bob, "storage", "get", "team:models/run1/model.npz", str(tmp_path / "bob"))
    assert denied.returncode == 1 and "team" in denied.stderr and not (tmp_path / "bob").exists()


def test_a_storage_server_that_is_down_fails_the_attempt_in_seconds_and_it_is_retried(
        platform_factory, volume: GlusterVolume) -> None:
    """Runs last in the module: it stops the volume's glusterd."""
    p, c = platform_factory()
    admin = c.admin
    admin.put_storage_server("gfs", "glusterfs", volume.server_data())
    admin.put_storage_config("team", [{"mountPoint": "/mnt/team", "server": "gfs", "path": "mnist"}])
    admin.set_storage_grant("default", "team")
    admin.create_user("carol")
    carol = admin.as_token(admin.create_token("carol", expires_in_s=3600)["token"])
    for server in volume.servers:
        server.stop()
    doc = yaml.safe_load(mnist_job("down", {"storages": [{"name": "team"}]}, "/mnt/team/out"))
    doc["jobRetryCount"] = 0  # the platform's failures are retried whatever this says
    job_id = carol.submit(yaml.safe_dump(doc, sort_keys=False))["id"]
    started = time.monotonic()

    def retried_twice() -> dict | None:
        j = c.get(job_id)
        return j if j["retryDetails"]["platform"] >= 2 else None

    job = until(retried_twice, 120, "two attempts ended by the mount failure and retried")
    took = time.monotonic() - started
    assert took < 90, took  # each attempt ends within the mount timeout (20 s), not hanging
    assert job["retryDetails"]["user"] == 0  # the platform's failure: jobRetryCount 0 did not stop it
    stderr = c.logs(job_id, "train", 0, stream="stderr", attempt=0)
    assert f"exit code {EXIT_MOUNT_FAILED}" in stderr and "'gfs'" in stderr and "glusterfs" in stderr, stderr
    c.stop(job_id)
