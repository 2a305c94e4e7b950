"""Real Docker for the container tests: dockerd, a registry on loopback and the images.

Nothing is faked here. The session fixtures start Debian's ``dockerd`` (``--bridge=none
--iptables=false --ip-masq=false``) when it does not answer, build ``apiary/base:bookworm`` with
debootstrap when it is missing (about 60 s, once per machine), start a private
``docker-registry`` on a free loopback port and build + push the mnist example's image into it
(about 40 s). They need root, dockerd, docker-registry and debootstrap (``.ci/run`` installs
them); without them the tests fail, naming what is missing, rather than skip.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apiary.images.build import BASE_IMAGE, build_base, build_example
from apiary.images.daemons import Registry, ensure_dockerd
from apiary.tracking.prefect_server import free_port

pytestmark = pytest.mark.docker


@pytest.fixture(scope="session")
def docker_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if os.geteuid() != 0:
        pytest.fail("the Docker tests need root (dockerd, debootstrap)")
    logs = tmp_path_factory.mktemp("dockerd")
    started = ensure_dockerd(logs / "dockerd.log")
    from apiary.images.daemons import docker_client as connect

    client = connect()
    try:
        client.images.get(BASE_IMAGE)
    except Exception:  # docker.errors.ImageNotFound
        build_base(client)
    yield client
    if started is not None:  # leave a dockerd that was running before alone
        started.terminate()
        started.wait(30)


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory, docker_client: Any) -> Iterator[Registry]:
    root = tmp_path_factory.mktemp("registry")
    reg = Registry(root, free_port()).start(root / "registry.log")
    yield reg
    reg.stop()


@pytest.fixture(scope="session")
def mnist_image(docker_client: Any, registry: Registry) -> str:
    """``<registry>/apiary/mnist:latest``, built and pushed, then removed from the local store so
    the first run really pulls it from the registry."""
    name = build_example(docker_client, "mnist", registry.address)
    docker_client.images.remove(name)
    return name


@pytest.fixture
def image_map(registry: Registry, mnist_image: str) -> dict[str, str]:
    from apiary.images import imagemap

    return imagemap.load(None, registry.address)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def node(docker_client: Any) -> Iterator[str]:
    """A node name of this test alone; its containers (label ``apiary.node``) are removed after it."""
    import uuid

    name = f"test-{uuid.uuid4().hex[:8]}"
    yield name
    for c in docker_client.containers.list(all=True, filters={"label": f"apiary.node={name}"}):
        c.remove(force=True)
