"""Job templates end to end on the embedded platform (process runtime), through the CLI: the shipped
templates are there as the admin's official ones, a user runs mnist with ``-p`` values and ``--wait``
until it SUCCEEDS with those values, publishes a template visible to their group only, which a user
of another group neither lists nor runs; a bad value is refused naming the parameter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from apiary.embedded import REPO_ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def cli(home: Path, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "APIARY_HOME": str(home), "APIARY_TOKEN": token, "COLUMNS": "200"}
    env.pop("APIARY_API_URL", None)
    return subprocess.run([sys.executable, "-m", "apiary", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)


def test_run_the_shipped_mnist_publish_a_group_template_and_another_group_cannot_see_it(
        platform_factory, tmp_path: Path) -> None:
    p, c = platform_factory()
    admin = c.admin
    admin.create_group("team-b", virtual_clusters=["default"])
    admin.create_user("alice")  # group default
    admin.create_user("bob", groups=["team-b"])
    alice = admin.create_token("alice", expires_in_s=3600)["token"]
    bob = admin.create_token("bob", expires_in_s=3600)["token"]

    listed = cli(p.home, alice, "template", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    shipped = {t["name"]: t for t in json.loads(listed.stdout)}
    assert {"mnist", "gang-ssh", "jupyter", "stress"} <= set(shipped)
    assert all(shipped[n]["official"] and shipped[n]["owner"] == "admin" for n in ("mnist", "gang-ssh"))
    shown = cli(p.home, alice, "template", "get", "mnist")
    assert shown.returncode == 0 and "epochs" in shown.stdout and "integer" in shown.stdout, shown.stdout

    run = cli(p.home, alice, "template", "run", "mnist", "-p", "epochs=1", "-p", "lr=0.05", "-p", "register_model=",
              "--name", "mnist-cli", "--wait", "--timeout", "240")
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "alice~mnist-cli SUCCEEDED" in run.stdout
    job = admin.get("alice~mnist-cli")
    assert job["user"] == "alice"
    logs = admin.logs("alice~mnist-cli")
    assert "epoch" in logs.lower(), logs

    bad = cli(p.home, alice, "template", "run", "mnist", "-p", "epochs=lots")
    assert bad.returncode == 1 and "parameters.epochs" in bad.stderr, bad.stderr
    unknown = cli(p.home, alice, "template", "run", "mnist", "-p", "epoch=1")
    assert unknown.returncode == 1 and "parameters.epoch" in unknown.stderr, unknown.stderr

    mine = yaml.safe_load((REPO_ROOT / "examples" / "marketplace" / "templates" / "stress.yaml").read_text())
    mine.update(name="team-stress", summary="for my group", visibility={"groups": ["default"]})
    path = tmp_path / "team-stress.yaml"
    path.write_text(yaml.safe_dump(mine, sort_keys=False))
    published = cli(p.home, alice, "template", "publish", str(path))
    assert published.returncode == 0 and "team-stress published" in published.stdout, published.stderr

    seen_by_bob = json.loads(cli(p.home, bob, "template", "list", "--json").stdout)
    assert "team-stress" not in {t["name"] for t in seen_by_bob} and "mnist" in {t["name"] for t in seen_by_bob}
    refused = cli(p.home, bob, "template", "run", "team-stress")
    assert refused.returncode == 1 and "(404)" in refused.stderr and "team-stress" in refused.stderr, refused.stderr
    assert cli(p.home, bob, "template", "get", "team-stress").returncode == 1
    changed = cli(p.home, bob, "template", "delete", "mnist")
    assert changed.returncode == 1 and "(403)" in changed.stderr, changed.stderr

    started = cli(p.home, alice, "template", "run", "team-stress", "-p", "trials=2", "-p", "matmul_n=32")
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.split()[0]
    assert job_id.startswith("alice~stress-")
    assert admin.wait(job_id, timeout=240)["state"] == "SUCCEEDED"
