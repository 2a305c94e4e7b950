"""The image catalogue's REST API (/api/v2/images) over an in-process app and a fake registry
(tests/support/fake_registry.py): who sees which images, the filters, user builds (the builder is
a recording fake that pushes into the fake registry: real builds run in
tests/docker/test_image_catalogue.py), the refusals (403 shared, 400 FROM, 413, 503), and a job
naming another user's image refused at submission."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from tests.support.auth import Principals, bearer
from tests.support.builders import LAB6, job_text
from tests.support.fake_registry import FakeRegistry, PushingBuilder, context_tar

from apiary.api import create_app
from apiary.auth import Directory
from apiary.control import ControlPlane
from apiary.images import labels as oci
from apiary.images.service import ImageService
from apiary.settings import Settings
from apiary.spec.cluster import load_cluster_config
from apiary.store import make_engine, migrate, session_factory

IMG = "/api/v2/images"
LIMIT = 64 * 1024
MNIST = {oci.FRAMEWORK: "numpy", oci.FRAMEWORK_VERSION: "2.4.6", oci.CUDA_VERSION: "none", oci.AUTHORS: "apiary",
         oci.DESCRIPTION: "Lab 6's mnist digits"}


class World:
    def __init__(self, tmp: Path, registry: FakeRegistry | None) -> None:
        self.engine = make_engine(f"sqlite:///{tmp}/a.db")
        migrate(self.engine)
        self.plane = ControlPlane(session_factory(self.engine), load_cluster_config(LAB6 / "hived-config-two-vcs.yaml"),
                                  tmp / "logs")
        directory = Directory(self.plane.sessions)
        p = Principals(directory, ["default", "vc1"])
        self.h = {"alice": bearer(p.user("alice")), "bob": bearer(p.user("bob")), "admin": bearer(p.admin()),
                  "agent": bearer(p.agent("hostname-carol"))}
        self.builder = PushingBuilder(registry) if registry else None
        images = ImageService(lambda: registry.address if registry else None, builder=self.builder,
                              max_context_bytes=LIMIT)
        self.c = TestClient(create_app(self.plane, directory=directory, images=images,
                                       settings=Settings(image_build_max_bytes=LIMIT)))
        self.c.__enter__()

    def get(self, path: str, who: str, **params: str) -> list[dict]:
        r = self.c.get(path, headers=self.h[who], params=params)
        assert r.status_code == 200, r.text
        return r.json()

    def build(self, who: str, body: bytes, **params: str):
        return self.c.post(f"{IMG}/builds", params=params, content=body,
                           headers={**self.h[who], "Content-Type": "application/octet-stream"})

    def close(self) -> None:
        self.c.__exit__(None, None, None)
        self.engine.dispose()


@pytest.fixture
def registry() -> Iterator[FakeRegistry]:
    r = FakeRegistry().start()
    r.push("apiary/mnist", "latest", MNIST, layer_sizes=(5000, 40_000))
    r.push("apiary/torchish", "1.0", {oci.FRAMEWORK: "torch", oci.CUDA_VERSION: "12.4", oci.AUTHORS: "apiary",
                                      oci.DESCRIPTION: "a GPU image"}, kind="oci-index")
    r.push("users/bob/tool", "1", {oci.AUTHORS: "bob", oci.DESCRIPTION: "bob's tool"}, kind="oci")
    r.push("unsorted/thing", "x")
    yield r
    r.stop()


@pytest.fixture
def world(tmp_path: Path, registry: FakeRegistry) -> Iterator[World]:
    w = World(tmp_path, registry)
    yield w
    w.close()


def refs(images: list[dict]) -> list[str]:
    return [i["reference"] for i in images]


def test_users_see_the_shared_images_and_their_own_and_admins_all(world: World) -> None:
    assert refs(world.get(IMG, "alice")) == ["apiary/mnist:latest", "apiary/torchish:1.0"]
    assert refs(world.get(IMG, "bob")) == ["apiary/mnist:latest", "apiary/torchish:1.0", "users/bob/tool:1"]
    assert refs(world.get(IMG, "admin")) == ["apiary/mnist:latest", "apiary/torchish:1.0", "unsorted/thing:x",
                                           "users/bob/tool:1"]
    mnist = world.get(IMG, "alice")[0]
    assert (mnist["framework"], mnist["frameworkVersion"], mnist["cuda"], mnist["authors"]) == \
        ("numpy", "2.4.6", "none", "apiary")
    assert mnist["sizeBytes"] > 45_000 and mnist["digest"].startswith("sha256:")


@pytest.mark.parametrize(("params", "who", "want"), [
    ({"framework": "TORCH"}, "bob", ["apiary/torchish:1.0"]),
    ({"cuda": "none"}, "bob", ["apiary/mnist:latest"]),
    ({"q": "tool"}, "bob", ["users/bob/tool:1"]),
    ({"q": "digits mnist"}, "alice", ["apiary/mnist:latest"]),
    ({"mine": "true"}, "bob", ["users/bob/tool:1"]),
    ({"mine": "true"}, "alice", []),
], ids=["framework-any-case", "cuda", "q-own", "q-words", "mine", "mine-none"])
def test_filters(world: World, params: dict, who: str, want: list[str]) -> None:
    assert refs(world.get(IMG, who, **params)) == want


def test_one_repository_is_hidden_from_other_users(world: World) -> None:
    assert refs(world.get(f"{IMG}/users/bob/tool", "bob")) == ["users/bob/tool:1"]
    assert refs(world.get(f"{IMG}/apiary/mnist:latest", "alice")) == ["apiary/mnist:latest"]
    r = world.c.get(f"{IMG}/users/bob/tool", headers=world.h["alice"])
    assert r.status_code == 404, r.text
    assert world.c.get(f"{IMG}/users/bob/none", headers=world.h["bob"]).status_code == 404
    assert world.c.get(IMG, headers=world.h["agent"]).status_code == 403


def test_alice_builds_an_image_of_her_own_that_bob_does_not_see(world: World) -> None:
    body = context_tar("FROM apiary/mnist:latest\nCOPY hello.txt /hello.txt\n", {"hello.txt": b"hi\n"})
    r = world.build("alice", body, name="hello", tag="1")
    assert r.status_code == 201, r.text
    image = r.json()
    assert (image["reference"], image["owner"], image["authors"]) == ("users/alice/hello:1", "alice", "alice")
    # The parent's framework and CUDA carried over; the tag is the version, the context's hash the revision.
    assert (image["framework"], image["cuda"], image["labels"][oci.VERSION]) == ("numpy", "none", "1")
    assert image["labels"][oci.REVISION].startswith("sha256:") and image["labels"][oci.CREATED].endswith("Z")
    assert world.builder.dockerfiles == [
        f"FROM {world.builder.registry.address}/apiary/mnist:latest\nCOPY hello.txt /hello.txt\n"]
    assert world.builder.files == [["Dockerfile", "hello.txt"]]
    assert "users/alice/hello:1" in refs(world.get(IMG, "alice", mine="true"))
    assert "users/alice/hello:1" not in refs(world.get(IMG, "bob"))


def test_build_refusals(world: World) -> None:
    ok = context_tar("FROM apiary/base:bookworm\n")
    r = world.build("bob", ok, name="tool", shared="true")
    assert r.status_code == 403 and "Only admins" in r.json()["message"]
    r = world.build("alice", context_tar("FROM debian:bookworm\n"), name="x")
    assert r.status_code == 400 and r.json()["field"] == "FROM" and "debian:bookworm" in r.json()["message"]
    r = world.build("alice", context_tar("FROM apiary/base\n", {"big": b"x" * (LIMIT + 1)}), name="x")
    assert r.status_code == 413, r.text
    r = world.build("alice", context_tar("FROM apiary/base\n", evil="../escape"), name="x")
    assert r.status_code == 400 and r.json()["field"] == "body"
    r = world.build("alice", b"not a tar at all", name="x")
    assert r.status_code == 400 and r.json()["field"] == "body"
    r = world.build("alice", context_tar("FROM apiary/base\n"), name="Bad/Name")
    assert r.status_code == 400 and r.json()["field"] == "name"
    assert world.builder.dockerfiles == []  # nothing reached dockerd
    r = world.build("admin", ok, name="tool", shared="true")
    assert r.status_code == 201 and r.json()["reference"] == "apiary/tool:latest", r.text
    assert "apiary/tool:latest" in refs(world.get(IMG, "bob"))


def test_without_a_registry_every_route_says_why(tmp_path: Path) -> None:
    w = World(tmp_path, None)
    try:
        for r in (w.c.get(IMG, headers=w.h["alice"]),
                  w.build("alice", context_tar("FROM apiary/base\n"), name="x")):
            assert r.status_code == 503 and "no image registry" in r.json()["message"], r.text
    finally:
        w.close()


def _job(name: str, image: str) -> str:
    doc = yaml.safe_load(job_text(0, name=name))
    for p in doc["prerequisites"]:
        if p["type"] == "dockerimage":
            p["uri"] = image
    return yaml.safe_dump(doc)


def test_a_job_naming_another_users_image_is_refused_at_submission(world: World) -> None:
    submit = lambda who, text: world.c.post("/api/v2/jobs", content=text,  # noqa: E731
                                            headers={**world.h[who], "Content-Type": "text/yaml"})
    r = submit("bob", _job("steal", "users/alice/hello:1"))
    assert r.status_code == 403 and "users/alice/hello:1" in r.json()["message"], r.text
    assert "prerequisites[0].uri" in r.json()["message"]
    assert submit("alice", _job("mine", "users/alice/hello:1")).status_code == 202
    assert submit("bob", _job("shared", "apiary/mnist:latest")).status_code == 202


def test_a_compressed_context_over_the_limit_once_unpacked_is_413(world: World) -> None:
    import gzip

    body = gzip.compress(context_tar("FROM apiary/base\n", {"zeros": b"\0" * (4 * LIMIT)}))
    assert len(body) < LIMIT  # the upload itself is small
    r = world.build("alice", body, name="zeros")
    assert r.status_code == 413 and "unpacked build directory" in r.json()["message"], r.text
    assert world.builder.dockerfiles == []
