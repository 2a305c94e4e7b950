"""The image catalogue: what the platform registry holds, read through its HTTP API v2.

For each repository (``GET /v2/_catalog``, followed page by page through its ``Link`` header) and
each tag (``GET /v2/<repo>/tags/list``), the manifest (``GET /v2/<repo>/manifests/<tag>`` accepting
Docker's schema 2 and OCI's manifest and index types): its digest is the registry's
``Docker-Content-Digest`` header (the SHA-256 of the body when the header is missing), its size
the config's plus the layers' sizes in bytes, and its labels the config blob's
``config.Labels`` (``GET /v2/<repo>/blobs/<config digest>``). A manifest list / OCI index is
read through its ``linux/amd64`` entry (else its first); the digest stays the list's, the one a
pull by tag resolves to.

Config blobs are immutable (named by digest): :class:`RegistryCatalogue` keeps the labels of each
one it has read, so listing again costs one request per repository and one per tag.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx

from apiary.errors import NotFoundError, PlatformError, UnavailableError
from apiary.images import labels as oci
from apiary.images.namespaces import namespace_of

logger = logging.getLogger(__name__)

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
#: The manifest types asked for, in the ``Accept`` header.
ACCEPT = ", ".join((DOCKER_MANIFEST, OCI_MANIFEST, DOCKER_LIST, OCI_INDEX))
LISTS = (DOCKER_LIST, OCI_INDEX)
#: Repositories asked for per page of ``/v2/_catalog``.
PAGE = 100


@dataclass(frozen=True)
class CatalogueImage:
    """One tag of one repository.

    ``digest``: the manifest's (``sha256:...``); ``size_bytes``: config + layers (compressed, as
    stored); ``labels``: the config's labels; ``namespace``: ``shared`` (``apiary/...``), ``user``
    (``users/<owner>/...``) or ``other``; ``owner``: the user of a ``user`` image."""

    repository: str
    tag: str
    digest: str
    size_bytes: int
    labels: dict[str, str] = field(default_factory=dict)
    namespace: str = "other"
    owner: str | None = None

    @property
    def reference(self) -> str:
        return f"{self.repository}:{self.tag}"

    def to_json(self) -> dict[str, Any]:
        """The REST shape: ``repository``, ``tag``, ``digest``, ``sizeBytes``, ``labels``,
        ``namespace``, ``owner`` and, from the labels, ``title``, ``description``, ``authors``,
        ``created``, ``framework``, ``frameworkVersion``, ``cuda`` (each ``None`` when unlabelled)."""
        lab = self.labels
        return {
            "repository": self.repository, "tag": self.tag, "reference": self.reference, "digest": self.digest,
            "sizeBytes": self.size_bytes, "namespace": self.namespace, "owner": self.owner, "labels": dict(lab),
            "title": lab.get(oci.TITLE), "description": lab.get(oci.DESCRIPTION), "authors": lab.get(oci.AUTHORS),
            "created": lab.get(oci.CREATED), "framework": lab.get(oci.FRAMEWORK),
            "frameworkVersion": lab.get(oci.FRAMEWORK_VERSION), "cuda": lab.get(oci.CUDA_VERSION),
        }


class RegistryCatalogue:
    """Reads the registry at ``url`` (``http://host:port``). ``transport``: an httpx transport
    (tests pass a mock); ``timeout_s``: per request. Thread-safe. Every method raises
    :class:`UnavailableError` when the registry does not answer or answers 5xx,
    :class:`NotFoundError` for an unknown repository or tag, :class:`PlatformError` for a
    manifest it cannot read."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport)
        self._configs: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self._client.close()

    def _get(self, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self._client.get(path, **kw)
        except httpx.HTTPError as exc:
            raise UnavailableError(f"registry {self.url} does not answer: {exc}") from exc
        if r.status_code == 404:
            raise NotFoundError(f"registry {self.url} has no {path.removeprefix('/v2/')}")
        if r.status_code >= 500:
            raise UnavailableError(f"registry {self.url} answered {r.status_code} to {path}")
        if r.status_code != 200:
            raise PlatformError(f"registry {self.url} answered {r.status_code} to {path}: {r.text[:200]}")
        return r

    def repositories(self) -> list[str]:
        """Every repository, sorted (all pages of ``/v2/_catalog``)."""
        out: list[str] = []
        path: str | None = "/v2/_catalog"
        params: dict[str, Any] | None = {"n": PAGE}
        while path is not None:
            r = self._get(path, params=params)
            out += r.json().get("repositories") or []
            nxt = r.links.get("next", {}).get("url")
            path, params = (nxt, None) if nxt else (None, None)
        return sorted(set(out))

    def tags(self, repository: str) -> list[str]:
        """The repository's tags, sorted ([] for a repository whose tags were all deleted)."""
        return sorted(self._get(f"/v2/{repository}/tags/list").json().get("tags") or [])

    def image(self, repository: str, tag: str) -> CatalogueImage:
        """One tag: manifest digest, size, config labels."""
        r = self._get(f"/v2/{repository}/manifests/{tag}", headers={"Accept": ACCEPT})
        digest = r.headers.get("Docker-Content-Digest") or "sha256:" + hashlib.sha256(r.content).hexdigest()
        manifest = self._manifest_json(r, repository, tag)
        kind = manifest.get("mediaType") or r.headers.get("Content-Type", "").split(";")[0]
        if kind in LISTS or "manifests" in manifest:
            entry = _pick(manifest.get("manifests") or [], repository, tag)
            r = self._get(f"/v2/{repository}/manifests/{entry['digest']}", headers={"Accept": ACCEPT})
            manifest = self._manifest_json(r, repository, tag)
        config = manifest.get("config") or {}
        layers = manifest.get("layers") or []
        if "digest" not in config:
            raise PlatformError(f"registry {self.url}: manifest of {repository}:{tag} has no config (schema 1?)")
        size = int(config.get("size") or 0) + sum(int(layer.get("size") or 0) for layer in layers)
        kind_, owner = namespace_of(repository)
        return CatalogueImage(repository, tag, digest, size, self._labels(repository, config["digest"]), kind_, owner)

    def images(self, repositories: list[str] | None = None) -> list[CatalogueImage]:
        """Every tag of ``repositories`` (default: all), sorted by repository then tag. A tag that
        vanishes between the listing and its manifest (deleted meanwhile) is left out."""
        out: list[CatalogueImage] = []
        for repo in self.repositories() if repositories is None else repositories:
            try:
                tags = self.tags(repo)
            except NotFoundError:
                continue
            for tag in tags:
                try:
                    out.append(self.image(repo, tag))
                except NotFoundError:
                    logger.info("registry image vanished while listed repo=%s tag=%s", repo, tag)
        return out

    def _manifest_json(self, r: httpx.Response, repository: str, tag: str) -> dict[str, Any]:
        try:
            data = json.loads(r.content)
        except ValueError as exc:
            raise PlatformError(f"registry {self.url}: manifest of {repository}:{tag} is no JSON") from exc
        if not isinstance(data, dict):
            raise PlatformError(f"registry {self.url}: manifest of {repository}:{tag} is no JSON object")
        return data

    def _labels(self, repository: str, config_digest: str) -> dict[str, str]:
        with self._lock:
            known = self._configs.get(config_digest)
        if known is not None:
            return dict(known)
        blob = self._get(f"/v2/{repository}/blobs/{config_digest}", follow_redirects=True)
        try:
            raw = (json.loads(blob.content).get("config") or {}).get("Labels") or {}
        except (ValueError, AttributeError) as exc:
            raise PlatformError(f"registry {self.url}: config {config_digest} of {repository} is no image config") \
                from exc
        found = {str(k): str(v) for k, v in raw.items()}
        with self._lock:
            self._configs[config_digest] = found
        return dict(found)


def _pick(entries: list[dict[str, Any]], repository: str, tag: str) -> dict[str, Any]:
    """The ``linux/amd64`` entry of a manifest list, else its first."""
    if not entries:
        raise PlatformError(f"manifest list of {repository}:{tag} is empty")
    for e in entries:
        p = e.get("platform") or {}
        if p.get("os") == "linux" and p.get("architecture") == "amd64":
            return e
    return entries[0]
