"""The catalogue reads a registry's HTTP API v2 (a fake registry on loopback, tests/support/fake_registry.py):
every manifest kind gives the pull digest, config + layer sizes and the config's labels; the
catalogue's pages are followed; a missing digest header is computed; config blobs are read once."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import httpx
import pytest
from tests.support.fake_registry import KINDS, FakeRegistry

from apiary.errors import NotFoundError, UnavailableError
from apiary.images import catalogue
from apiary.images.catalogue import RegistryCatalogue
from apiary.images.labels import CUDA_VERSION, DESCRIPTION, FRAMEWORK

LABELS = {FRAMEWORK: "numpy", CUDA_VERSION: "none", DESCRIPTION: "digits"}


@pytest.fixture
def registry() -> Iterator[FakeRegistry]:
    r = FakeRegistry().start()
    yield r
    r.stop()


def _expected_size(reg: FakeRegistry, digest: str) -> int:
    """Config + layers of the amd64 manifest a pull of ``digest`` resolves to, from the stored bodies."""
    media, body = reg.manifests[digest]
    doc = json.loads(body)
    if "manifests" in doc:
        entry = next(m for m in doc["manifests"] if m["platform"]["architecture"] == "amd64")
        doc = json.loads(reg.manifests[entry["digest"]][1])
    return doc["config"]["size"] + sum(layer["size"] for layer in doc["layers"])


@pytest.mark.parametrize("kind", KINDS)
def test_each_manifest_kind_gives_digest_size_and_labels(registry: FakeRegistry, kind: str) -> None:
    digest = registry.push("apiary/mnist", "latest", LABELS, layer_sizes=(1500, 70_000), kind=kind)
    image = RegistryCatalogue(registry.url).image("apiary/mnist", "latest")
    assert image.digest == digest
    assert image.size_bytes == _expected_size(registry, digest)
    assert image.size_bytes > 71_500  # both layers counted, not the arm64 variant's one
    assert image.labels == LABELS
    assert (image.namespace, image.owner) == ("shared", None)
    out = image.to_json()
    assert (out["framework"], out["cuda"], out["description"]) == ("numpy", "none", "digits")


def test_a_missing_digest_header_is_the_sha256_of_the_manifest() -> None:
    reg = FakeRegistry(send_digest_header=False).start()
    try:
        digest = reg.push("users/alice/x", "1", {}, kind="oci")
        image = RegistryCatalogue(reg.url).image("users/alice/x", "1")
        assert image.digest == digest == "sha256:" + hashlib.sha256(reg.manifests[digest][1]).hexdigest()
        assert (image.namespace, image.owner) == ("user", "alice")
    finally:
        reg.stop()


def test_every_page_of_the_catalog_is_read(registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalogue, "PAGE", 2)
    names = [f"apiary/img{i}" for i in range(5)]
    for name in names:
        registry.push(name, "latest")
    assert RegistryCatalogue(registry.url).repositories() == names
    assert sum(p.startswith("/v2/_catalog") for p in registry.requests) == 3


def test_images_lists_every_tag_and_reads_each_config_once(registry: FakeRegistry) -> None:
    registry.push("apiary/mnist", "latest", LABELS)
    registry.push("apiary/mnist", "v2", {**LABELS, FRAMEWORK: "torch"})
    registry.push("users/bob/tool", "1", {})
    cat = RegistryCatalogue(registry.url)
    got = [(i.repository, i.tag, i.labels.get(FRAMEWORK)) for i in cat.images()]
    assert got == [("apiary/mnist", "latest", "numpy"), ("apiary/mnist", "v2", "torch"), ("users/bob/tool", "1", None)]
    blobs = sum("/blobs/" in p for p in registry.requests)
    cat.images()
    assert sum("/blobs/" in p for p in registry.requests) == blobs == 3


def test_unknown_images_are_not_found_and_a_dead_registry_is_unavailable(registry: FakeRegistry) -> None:
    registry.push("apiary/mnist", "latest")
    cat = RegistryCatalogue(registry.url)
    with pytest.raises(NotFoundError):
        cat.image("apiary/mnist", "nope")
    with pytest.raises(NotFoundError):
        cat.tags("apiary/none")
    dead = RegistryCatalogue(registry.url, transport=httpx.MockTransport(
        lambda request: (_ for _ in ()).throw(httpx.ConnectError("refused", request=request))))
    with pytest.raises(UnavailableError, match="does not answer"):
        dead.repositories()
