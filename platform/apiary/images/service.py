"""The image catalogue service behind ``/api/v2/images``: listing with the namespace rules, and
user builds from an uploaded directory.

* :meth:`ImageService.list_images` / :meth:`ImageService.get`: the registry's images
  (:mod:`apiary.images.catalogue`) a caller may see (:func:`apiary.images.namespaces.visible`),
  filtered by framework, CUDA version, text and ownership.
* :meth:`ImageService.build`: a build context (a tar archive, gzip allowed) is unpacked (members
  outside the directory, links out of it and device files refused: tarfile's ``data`` filter;
  at most ``max_context_bytes`` unpacked, 413 beyond), its ``Dockerfile`` checked
  (:func:`apiary.images.namespaces.check_dockerfile`: 400 naming ``FROM``), built by the
  platform's dockerd with no network for its ``RUN`` steps, labelled (authors = the caller) and
  pushed as ``users/<caller>/<name>:<tag>`` (``apiary/<name>:<tag>`` for an admin's shared build).
  Builds run one at a time (this machine's dockerd and CPUs are shared with the tasks).

The registry is the platform's (``registry()`` answers its ``host:port``, or ``None`` when the
platform runs no registry: then every call is a 503 saying so). Nothing is written to the store:
the registry is the catalogue's truth.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from apiary.errors import ForbiddenError, NotFoundError, PayloadTooLargeError, UnavailableError, ValidationError
from apiary.images import labels as oci
from apiary.images.catalogue import CatalogueImage, RegistryCatalogue
from apiary.images.namespaces import (
    BASE_REPOSITORY,
    build_repository,
    check_dockerfile,
    check_reference,
    check_tag,
    parse_reference,
    visible,
)

logger = logging.getLogger(__name__)

#: Bytes of an unpacked build context (the sum of its files' sizes) by default.
DEFAULT_MAX_CONTEXT_BYTES = 256 * 1024**2


class ImageBuilder(Protocol):
    """Builds a context directory into an image and pushes it. Blocking (minutes); not idempotent
    (a second call builds again, Docker's cache makes it quick)."""

    def build(self, context: Path, image: str, labels: dict[str, str]) -> None:
        """Build ``context/Dockerfile`` as ``image`` (``host:port/repo:tag``) with ``labels`` and push
        it. Raises :class:`ValidationError` (field ``Dockerfile``) for a build that fails on its
        content, :class:`UnavailableError` when dockerd does not answer."""

    def labels_of(self, image: str) -> dict[str, str]:
        """The labels of a local image (``{}`` when there is none)."""


class DockerBuilder:
    """:class:`ImageBuilder` over this machine's dockerd (``docker.from_env()``)."""

    def build(self, context: Path, image: str, labels: dict[str, str]) -> None:
        from apiary.errors import PlatformError
        from apiary.images.build import build_image, push
        from apiary.images.daemons import docker_client

        client = docker_client()
        try:
            build_image(client, context, image, labels=labels, network_mode="none")
        except PlatformError as exc:  # the user's Dockerfile failed: their error, with the log's tail
            raise ValidationError("Dockerfile", exc.message) from exc
        push(client, image)
        client.images.remove(image)  # the registry holds it; tasks pull it from there

    def labels_of(self, image: str) -> dict[str, str]:
        import docker
        from apiary.images.daemons import docker_client

        try:
            return dict(docker_client().images.get(image).labels or {})
        except docker.errors.ImageNotFound:
            return {}


def too_large(limit_bytes: int, what: str) -> PayloadTooLargeError:
    """A 413 for ``what`` over ``limit_bytes`` (``APIARY_IMAGE_BUILD_MAX_BYTES``)."""
    err = PayloadTooLargeError(limit_bytes)
    err.message = f"{what} larger than {limit_bytes} bytes (the limit, APIARY_IMAGE_BUILD_MAX_BYTES)"
    err.args = (err.message,)
    return err


def _text_matches(image: CatalogueImage, q: str) -> bool:
    hay = " ".join(filter(None, (image.repository, image.tag, image.labels.get(oci.DESCRIPTION),
                                 image.labels.get(oci.TITLE)))).lower()
    return all(word in hay for word in q.lower().split())


class ImageService:
    """The catalogue over the platform registry (see the module doc).

    ``registry``: answers the registry's ``host:port`` or ``None`` (asked on every call: the
    registry may start after the control plane). ``builder``: builds and pushes (default: none, so
    builds answer 503). ``max_context_bytes``: the largest unpacked build context. ``clock``: unix
    seconds, for the ``created`` label."""

    def __init__(self, registry: Callable[[], str | None], *, builder: ImageBuilder | None = None,
                 max_context_bytes: int = DEFAULT_MAX_CONTEXT_BYTES, clock: Callable[[], float] = time.time,
                 catalogue: Callable[[str], RegistryCatalogue] | None = None) -> None:
        self._registry = registry
        self.builder = builder
        self.max_context_bytes = max_context_bytes
        self.clock = clock
        self._make_catalogue = catalogue or (lambda address: RegistryCatalogue(f"http://{address}"))
        self._catalogues: dict[str, RegistryCatalogue] = {}
        self._lock = threading.Lock()
        self._building = threading.Lock()

    def registry(self) -> str:
        """The registry's ``host:port``; :class:`UnavailableError` (503) when the platform has none."""
        address = self._registry()
        if not address:
            raise UnavailableError("This platform runs no image registry: the image catalogue needs the docker "
                                   "runtime (apiary up --runtime docker) or APIARY_REGISTRY=host:port.")
        return address.removeprefix("http://")

    def catalogue(self) -> RegistryCatalogue:
        address = self.registry()
        with self._lock:
            cat = self._catalogues.get(address)
            if cat is None:
                cat = self._catalogues[address] = self._make_catalogue(address)
            return cat

    def list_images(self, user: str, admin: bool, *, framework: str | None = None, cuda: str | None = None,
             q: str | None = None, mine: bool = False) -> list[dict[str, Any]]:
        """The images ``user`` may see (shared ones, their own; admins: all), as
        :meth:`CatalogueImage.to_json`. ``framework`` / ``cuda``: equal to the label (any case);
        ``q``: every word in the repository, tag, title or description; ``mine``: only the caller's
        own (``users/<user>/...``)."""
        cat = self.catalogue()
        repos = [r for r in cat.repositories() if visible(r, user, admin)]
        if mine:
            repos = [r for r in repos if r.startswith(f"users/{user}/")]
        out = []
        for image in cat.images(repos):
            if framework and (image.labels.get(oci.FRAMEWORK) or "").lower() != framework.lower():
                continue
            if cuda and (image.labels.get(oci.CUDA_VERSION) or "").lower() != cuda.lower():
                continue
            if q and not _text_matches(image, q):
                continue
            out.append(image.to_json())
        return out

    def get(self, repository: str, user: str, admin: bool) -> list[dict[str, Any]]:
        """Every tag of ``repository`` (``repo`` or ``repo:tag`` for one tag). 404 for a repository
        the caller may not see, as for one that does not exist (no hint that it does); 400 naming
        ``repository`` for a malformed name."""
        ref = check_reference(repository)
        if ref.host or not visible(ref.repository, user, admin):
            raise NotFoundError(f"Image {repository} not found.")
        cat = self.catalogue()
        try:
            if ref.tag:
                return [cat.image(ref.repository, ref.tag).to_json()]
            found = [cat.image(ref.repository, tag).to_json() for tag in cat.tags(ref.repository)]
        except NotFoundError:
            raise NotFoundError(f"Image {repository} not found.") from None
        if not found:  # every tag deleted: nothing to pull
            raise NotFoundError(f"Image {repository} not found.")
        return found

    def check_build(self, user: str, admin: bool, *, name: str, tag: str, shared: bool) -> str:
        """What :meth:`build` checks before it reads the context (the route calls it before reading
        the body): 403 for a non-admin's ``shared`` build, 400 naming ``name`` or ``tag``, 503
        without a registry or builder. Returns the repository the build is pushed to."""
        if shared and not admin:
            raise ForbiddenError(f"Only admins may publish to the shared catalogue (apiary/...); {user} may build "
                                 f"users/{user}/<name> only.")
        repository = build_repository(user, name, shared)
        check_tag(tag)
        self.registry()
        if self.builder is None:
            raise UnavailableError("This control plane builds no images (no dockerd was wired).")
        return repository

    def build(self, user: str, admin: bool, *, name: str, tag: str, shared: bool, archive: Path,
              description: str | None = None) -> dict[str, Any]:
        """Build the context in ``archive`` (a tar file) and push it; returns the pushed image as
        :meth:`CatalogueImage.to_json`. 403 for a non-admin's ``shared`` build; 400 naming ``name``,
        ``tag``, ``body``, ``Dockerfile`` or ``FROM``; 413 for a context over the limit; 503 when
        there is no registry or no builder."""
        repository = self.check_build(user, admin, name=name, tag=tag, shared=shared)
        address = self.registry()
        digest = hashlib.sha256()
        with archive.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        with tempfile.TemporaryDirectory(prefix="apiary-user-build-") as tmp:
            context = Path(tmp) / "ctx"
            self._unpack(archive, context)
            dockerfile = context / "Dockerfile"
            if not dockerfile.is_file():
                raise ValidationError("Dockerfile", "the build directory has no Dockerfile at its top")
            text = dockerfile.read_text(encoding="utf-8", errors="replace")
            shared_tags = {i.reference for i in self.catalogue().images(
                [r for r in self.catalogue().repositories() if r.startswith("apiary/")])}
            rewritten = check_dockerfile(text, address, shared_tags)
            dockerfile.write_text(rewritten, encoding="utf-8")
            image = f"{address}/{repository}:{tag}"
            labels = self._labels(user, repository, tag, text, rewritten, address, digest.hexdigest(), description)
            builder = self.builder
            if builder is None:  # check_build refused it already; for the type checker
                raise UnavailableError("This control plane builds no images (no dockerd was wired).")
            with self._building:
                logger.info("image build user=%s image=%s", user, image)
                builder.build(context, image, labels)
        return self.catalogue().image(repository, tag).to_json()

    def _labels(self, user: str, repository: str, tag: str, text: str, rewritten: str, address: str,
                context_sha: str, description: str | None) -> dict[str, str]:
        """authors = ``user``; framework and CUDA from the Dockerfile's ``LABEL`` lines, else the
        parent's (the last ``FROM``: the base, whose debootstrap root has no CUDA, or a shared
        catalogue image with its labels), else ``none`` for the base."""
        declared = oci.dockerfile_labels(text)
        parent = [ln.split()[1:] for ln in rewritten.splitlines() if re.match(r"^\s*FROM\s", ln, re.IGNORECASE)][-1]
        parent_image = next(w for w in parent if not w.startswith("--"))
        ref = parse_reference(parent_image)
        if ref.repository == BASE_REPOSITORY and not ref.host:
            inherited = {oci.FRAMEWORK: oci.NONE, oci.FRAMEWORK_VERSION: oci.NONE, oci.CUDA_VERSION: oci.NONE}
            inherited.update({k: v for k, v in (self.builder.labels_of(parent_image) if self.builder else {}).items()
                              if k in inherited})
        elif ref.host == address:
            try:
                inherited = self.catalogue().image(ref.repository, ref.tag or "latest").labels
            except NotFoundError:
                inherited = {}
        else:  # an earlier stage: its own FROM's labels are inherited by Docker itself
            inherited = {}

        def pick(key: str) -> str | None:
            return declared.get(key) or inherited.get(key)

        return oci.build_labels(
            title=repository, authors=user, version=tag, created=self.clock(),
            source="upload: POST /api/v2/images/builds", revision=f"sha256:{context_sha}",
            description=description or declared.get(oci.DESCRIPTION), framework=pick(oci.FRAMEWORK),
            framework_version=pick(oci.FRAMEWORK_VERSION), cuda_version=pick(oci.CUDA_VERSION))

    def _unpack(self, archive: Path, dest: Path) -> None:
        dest.mkdir(parents=True)
        try:
            with tarfile.open(archive, "r:*") as tar:
                members = tar.getmembers()
                total = sum(m.size for m in members if m.isfile())
                if total > self.max_context_bytes:
                    raise too_large(self.max_context_bytes, "unpacked build directory")
                tar.extractall(dest, filter="data")
        except tarfile.TarError as exc:  # includes the data filter's refusals (absolute paths, links out)
            shutil.rmtree(dest, ignore_errors=True)
            raise ValidationError("body", f"the build directory is no readable tar archive: {exc}") from exc
