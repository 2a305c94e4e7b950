"""The image catalogue on real dockerd and the platform's own registry (the embedded platform with
``--runtime docker``): the shipped mnist image listed with its labels through ``apiary image
list``; alice's build from a directory (FROM the platform's base) pushed under ``users/alice/``,
listed for her and not for bob; bob's shared build refused 403; a Dockerfile FROM anything else
refused 400; alice's job running her image by its catalogue name, bob's job naming it refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.builders import LAB6, job_text
from tests.support.polling import done, nodes_ready, until

from apiary.client import ApiaryClient
from apiary.embedded import REPO_ROOT, Embedded
from apiary.errors import ForbiddenError
from apiary.images.build import build_example, git_revision, lock_pins

pytestmark = [pytest.mark.docker, pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, docker_client: Any) -> Iterator[tuple[Embedded, dict]]:
    """The platform with mnist built into its registry, and tokens of alice and bob (group default)."""
    home = tmp_path_factory.mktemp("catalogue-platform")
    p = Embedded(home=home, cluster=LAB6 / "hived-config-two-vcs.yaml", prefect=False, workdir=str(REPO_ROOT),
                 runtime="docker")
    try:
        p.start()
        p.start_supervisor(period_s=0.2)
        assert p.registry is not None
        build_example(docker_client, "mnist", p.registry.address)
        admin = p.client()
        until(lambda: nodes_ready(admin, 2), 60, "node agents")
        admin.set_grant("default", "default")
        tokens = {}
        for user in ("alice", "bob"):
            admin.create_user(user)
            tokens[user] = admin.create_token(user, expires_in_s=3600)["token"]
        yield p, tokens
    finally:
        p.stop()


def cli(p: Embedded, token: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "APIARY_HOME": str(p.home), "COLUMNS": "250"}
    if token:
        env["APIARY_TOKEN"] = token
    env.pop("APIARY_API_URL", None)
    return subprocess.run([sys.executable, "-m", "apiary", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def rows(out: str) -> dict[str, list[str]]:
    """``apiary image list``'s table: ``{IMAGE: [cells]}`` (cells split on runs of two spaces or more)."""
    table = {}
    for line in out.splitlines():
        cells = [c for c in re.split(r"\s{2,}", line.strip()) if c]
        if cells and "/" in cells[0]:
            table[cells[0]] = cells
    return table


def build_dir(tmp: Path, dockerfile: str, files: dict[str, str]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "Dockerfile").write_text(dockerfile)
    for name, text in files.items():
        (tmp / name).write_text(text)
    return tmp


def test_shipped_images_are_listed_with_their_labels(platform) -> None:
    p, tokens = platform
    out = cli(p, tokens["alice"], "image", "list")
    assert out.returncode == 0, out.stderr
    mnist = rows(out.stdout).get("apiary/mnist")
    assert mnist is not None, out.stdout
    # IMAGE TAG FRAMEWORK CUDA SIZE DIGEST BUILT-BY DESCRIPTION
    assert mnist[1:4] == ["latest", "numpy", "none"], mnist
    assert mnist[5].startswith("sha256:") and mnist[6] == "apiary", mnist
    assert "MiB" in mnist[4], mnist  # numpy + scikit-learn in a venv on the base
    alice = ApiaryClient(p.api_url, token=tokens["alice"])
    image = next(i for i in alice.images() if i["repository"] == "apiary/mnist")
    assert image["frameworkVersion"] == lock_pins()["numpy"].split("==")[1]
    assert image["labels"]["io.apiary.python.version"].startswith("3.")  # measured in the base image
    assert image["labels"]["org.opencontainers.image.revision"] == git_revision()
    assert image["sizeBytes"] > 30 * 1024**2 and "digits" in image["description"]
    assert cli(p, tokens["alice"], "image", "list", "--framework", "torch").stdout.count("apiary/mnist") == 0


def test_alice_builds_and_runs_her_image_bob_neither_sees_nor_runs_it(platform, tmp_path: Path) -> None:
    p, tokens = platform
    d = build_dir(tmp_path / "hello", "FROM apiary/base:bookworm\nCOPY hello.txt /opt/hello.txt\n",
                  {"hello.txt": "hello from alice's image\n"})
    out = cli(p, tokens["alice"], "image", "build", "--from-dir", str(d), "--name", "hello", "--tag", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pushed users/alice/hello:1 sha256:"), out.stdout

    mine = cli(p, tokens["alice"], "image", "list", "--mine")
    assert mine.returncode == 0, mine.stderr
    hello = rows(mine.stdout).get("users/alice/hello")
    assert hello is not None and hello[1] == "1" and hello[3] == "none" and hello[6] == "alice", mine.stdout
    bobs = cli(p, tokens["bob"], "image", "list")
    assert bobs.returncode == 0, bobs.stderr
    assert "users/alice/hello" not in bobs.stdout and all(k.startswith("apiary/") for k in rows(bobs.stdout))

    # Alice's job names her image by its catalogue name; the runtime pulls it from the registry.
    job = yaml.safe_load(job_text(0, name="hello-img"))
    job["prerequisites"][0]["uri"] = "users/alice/hello:1"
    job["taskRoles"]["train"]["commands"] = ["cat /opt/hello.txt"]
    job["taskRoles"]["train"]["resourcePerInstance"] = {"cpu": 1, "memoryMB": 512, "gpu": 1}
    job["defaults"] = {"virtualCluster": "default"}
    alice = ApiaryClient(p.api_url, token=tokens["alice"])
    result = done(alice, alice.submit(yaml.safe_dump(job))["id"])
    assert result["state"] == "SUCCEEDED", (result, alice.logs(result["id"], "train", 0, stream="stderr"))
    assert alice.logs(result["id"], "train", 0).strip() == "hello from alice's image"
    run_dir = next(d for d in (p.home / "agents").glob(f"*/{result['id']}.*") if d.is_dir())
    launched = json.loads((run_dir / "launch.json").read_text())
    assert launched["resolved_image"] == f"{p.registry.address}/users/alice/hello:1"

    job["name"] = "steal"
    with pytest.raises(ForbiddenError, match="users/alice/hello:1"):
        ApiaryClient(p.api_url, token=tokens["bob"]).submit(yaml.safe_dump(job))


def test_refused_builds(platform, tmp_path: Path) -> None:
    p, tokens = platform
    ok = build_dir(tmp_path / "ok", "FROM apiary/base:bookworm\n", {})
    shared = cli(p, tokens["bob"], "image", "build", "--from-dir", str(ok), "--name", "tool", "--shared")
    assert shared.returncode == 1 and "(403)" in shared.stderr and "admins" in shared.stderr, shared.stderr
    other = build_dir(tmp_path / "other", "FROM debian:bookworm\nRUN true\n", {})
    refused = cli(p, tokens["alice"], "image", "build", "--from-dir", str(other), "--name", "deb")
    assert refused.returncode == 1 and "(400)" in refused.stderr and "FROM" in refused.stderr, refused.stderr
    broken = build_dir(tmp_path / "broken", "FROM apiary/base:bookworm\nRUN exit 3\n", {})
    failed = cli(p, tokens["alice"], "image", "build", "--from-dir", str(broken), "--name", "broken")
    assert failed.returncode == 1 and "(400)" in failed.stderr and "Dockerfile" in failed.stderr, failed.stderr
    listed = cli(p, tokens["alice"], "image", "list", "--mine").stdout
    assert "deb" not in rows(listed) and "users/alice/broken" not in listed


def test_the_base_image_import_carries_its_labels(docker_client: Any, tmp_path: Path) -> None:
    """build_base's ``docker import`` changes (its 60 s debootstrap is not rerun here: a one-file root)."""
    import tarfile

    from apiary.images.build import import_changes
    from apiary.images.labels import build_labels

    (tmp_path / "hello").write_text("hi\n")
    with tarfile.open(tmp_path / "root.tar", "w") as tar:
        tar.add(tmp_path / "hello", arcname="hello")
    labels = build_labels(title="apiary/base-labels-test", authors="apiary", version="t", created=0.0,
                          source="https://deb.debian.org/debian", description='Debian "minbase" with python3',
                          framework="none", cuda_version="none")
    docker_client.api.import_image_from_file(str(tmp_path / "root.tar"), repository="apiary/base-labels-test",
                                             tag="t", changes=import_changes(labels))
    try:
        image = docker_client.images.get("apiary/base-labels-test:t")
        assert image.labels == labels
        assert image.attrs["Config"]["Cmd"] == ["/bin/sh"]
    finally:
        docker_client.images.remove("apiary/base-labels-test:t", force=True)
