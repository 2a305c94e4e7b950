"""Build Apiary's images here, where nothing can be pulled from outside.

* :func:`build_base`: ``debootstrap --variant=minbase --include=python3,python3-venv bookworm``
  into a temporary directory, then ``docker import`` (about 60 s; needs root and a Debian mirror).
  The result, ``apiary/base:bookworm``, is the ``FROM`` of every other image.
* :func:`build_image`: ``docker build`` of a Dockerfile (the examples' ``examples/<name>/Dockerfile``,
  Apiary's own ``deploy/docker/Dockerfile.<name>``) with host networking, after putting the
  Python wheels its requirements need into the build context (``pip download`` on this machine,
  constrained by ``requirements.lock``, so the image gets the versions the tests ran with).
* :func:`push`: ``docker push`` to the registry; pushing errors raise instead of being lost in
  the progress stream.

Every image built here carries the labels of :mod:`apiary.images.labels` (authors ``apiary``,
created, the git revision, version = tag; the examples' description and framework from their
Dockerfile's ``LABEL`` lines, the framework's version from the wheels baked in, the Python version
measured in the base image, CUDA ``none``: nothing here carries CUDA).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from apiary.errors import PlatformError, ValidationError
from apiary.images import labels as oci

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
BASE_IMAGE = "apiary/base:bookworm"
#: The examples' images: name -> (Dockerfile directory, Python requirements baked into it).
EXAMPLES: dict[str, tuple[Path, tuple[str, ...]]] = {
    "mnist": (REPO / "examples" / "mnist", ("numpy", "scikit-learn")),
}


def import_changes(labels: dict[str, str]) -> list[str]:
    """The Dockerfile instructions ``docker import`` applies to the base: PATH, LANG, ``/bin/sh``
    and one ``LABEL`` per label (values JSON-quoted)."""
    return ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
            "CMD [\"/bin/sh\"]", *(f"LABEL {k}={json.dumps(v)}" for k, v in labels.items())]


def build_base(client: Any, tag: str = BASE_IMAGE, suite: str = "bookworm",
               include: Iterable[str] = ("python3", "python3-venv"), mirror: str | None = None) -> str:
    """Build the minimal Debian base with debootstrap and ``docker import`` it as ``tag``; returns
    the image id. Raises :class:`PlatformError` when debootstrap is missing or fails."""
    debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    if not os.path.exists(debootstrap):
        raise PlatformError("debootstrap is not installed (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="apiary-base-") as tmp:
        root = Path(tmp) / "root"
        argv = [debootstrap, "--variant=minbase", f"--include={','.join(include)}", suite, str(root)]
        if mirror:
            argv.append(mirror)
        logger.info("debootstrap %s into %s", suite, root)
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise PlatformError(f"debootstrap failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        # apt's caches are not needed in an image; /dev and /proc are the runtime's business.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(root / junk, ignore_errors=True)
        tarball = Path(tmp) / "root.tar"
        subprocess.run(["tar", "-C", str(root), "-cf", str(tarball), "."], check=True)
        repo, _, version = tag.partition(":")
        labels = oci.build_labels(
            title=repo, authors=oci.SHIPPED_AUTHOR, version=version or "latest", created=time.time(),
            source="https://deb.debian.org/debian", revision=git_revision(),
            description=f"Debian {suite} minbase with {', '.join(include)} (debootstrap)",
            framework=oci.NONE, framework_version=oci.NONE, cuda_version=oci.NONE)
        out = client.api.import_image_from_file(str(tarball), repository=repo, tag=version or "latest",
                                                changes=import_changes(labels))
    image = client.images.get(tag)
    logger.info("built %s %s (%s)", tag, image.short_id, str(out)[:200])
    return str(image.id)


def git_revision(repo: Path = REPO) -> str | None:
    """The full commit of ``repo``'s HEAD, or ``None`` outside git (the ``revision`` label is then left out)."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def source_url(repo: Path = REPO, subdir: str = "") -> str:
    """``org.opencontainers.image.source`` of an image built from ``repo/subdir``: the git remote
    ``origin``'s URL with ``#<subdir>`` when there is one, else ``file://<repo>/<subdir>``."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "config", "--get", "remote.origin.url"], capture_output=True,
                             text=True, timeout=10)
        remote = out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        remote = ""
    if remote:
        return f"{remote}#{subdir}" if subdir else remote
    return (repo / subdir).as_uri() if subdir else repo.as_uri()


def python_version(client: Any, image: str) -> str | None:
    """The Python version of ``image`` (``python3`` run in it, no network), or ``None`` when it has
    no Python or does not run."""
    import docker

    try:
        out = client.containers.run(image, ["python3", "-c", "import platform; print(platform.python_version())"],
                                    network_mode="none", remove=True, stdout=True, stderr=False)
    except docker.errors.DockerException as exc:
        logger.warning("no python version measured in %s: %s", image, exc)
        return None
    return out.decode().strip() or None


def lock_pins(lock: Path = REPO / "requirements.lock") -> dict[str, str]:
    """``{normalized name: "name==version"}`` from requirements.lock."""
    pins = {}
    for line in lock.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name = line.split("==", 1)[0].strip()
            pins[name.lower().replace("_", "-")] = line.strip()
    return pins


def download_wheels(requirements: Iterable[str], dest: Path, *, apiary: bool = False, repo: Path = REPO) -> None:
    """``pip download`` the requirements (pinned by ``repo``'s requirements.lock) and their
    dependencies as wheels into ``dest``, for the image's Python (Debian bookworm's 3.11, the same
    as here). ``apiary``: also a wheel of the Apiary source tree at ``repo`` (a CI workspace, or
    this checkout) into ``dest/apiary/`` and its runtime dependencies (``apiary[postgres]``; the
    dev tools are left out) into ``dest/deps/``: two folders, so that the image's dependency layer
    stays in Docker's build cache while only Apiary's own wheel changes from commit to commit.
    Raises :class:`PlatformError` when pip fails."""
    dest.mkdir(parents=True, exist_ok=True)
    lock = repo / "requirements.lock"
    pins = lock_pins(lock)
    reqs = [pins.get(r.lower().replace("_", "-"), r) for r in requirements]
    target = dest
    if apiary:
        own, target = dest / "apiary", dest / "deps"
        own.mkdir(exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(own), str(repo)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise PlatformError(f"pip wheel {repo} failed: {proc.stderr[-2000:]}")
        wheel = next(own.glob("apiary-*.whl"))
        # Debian bookworm's Python is 3.11.2: redis needs async-timeout below 3.11.3, which pip
        # leaves out when it resolves here (3.11.7).
        reqs += [f"{wheel}[postgres]", "async-timeout>=4.0.3"]
    if not reqs:
        return
    target.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(target),
            "-c", str(lock), *reqs]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PlatformError(f"pip download failed: {proc.stderr[-2000:]}")
    for copied in target.glob("apiary-*.whl"):  # pip copies the local wheel too: it belongs in apiary/
        copied.unlink()


def build_image(client: Any, dockerfile_dir: Path, tag: str, *, requirements: Iterable[str] = (),
                base: str = BASE_IMAGE, dockerfile: str = "Dockerfile", extra: dict[str, Path] | None = None,
                apiary_wheel: bool = False, repo: Path = REPO, labels: dict[str, str] | None = None,
                network_mode: str = "host") -> str:
    """``docker build`` ``dockerfile_dir/dockerfile`` as ``tag`` (build arg ``BASE``) with
    ``labels`` (they override the Dockerfile's own and the parent image's for the same keys) and
    the build's ``RUN`` steps on ``network_mode`` (``none`` for user builds); returns the image id.

    The build context is a temporary copy of ``dockerfile_dir`` plus ``wheels/`` (the wheels of
    ``requirements``, and of Apiary itself with ``apiary_wheel``) and each ``extra`` item
    (context name -> file or directory to copy); ``repo``: the source tree Apiary's wheel and the
    lock come from. Raises :class:`PlatformError` with the build
    log's tail when the build fails."""
    import docker

    if not (dockerfile_dir / dockerfile).is_file():
        raise ValidationError("dockerfile", f"{dockerfile_dir / dockerfile} does not exist")
    with tempfile.TemporaryDirectory(prefix="apiary-build-") as tmp:
        ctx = Path(tmp) / "ctx"
        shutil.copytree(dockerfile_dir, ctx, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        download_wheels(requirements, ctx / "wheels", apiary=apiary_wheel, repo=repo)
        for name, src in (extra or {}).items():
            if src.is_dir():
                shutil.copytree(src, ctx / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, ctx / name)
        try:
            image, _logs = client.images.build(path=str(ctx), dockerfile=dockerfile, tag=tag, rm=True,
                                               network_mode=network_mode, buildargs={"BASE": base}, pull=False,
                                               labels=labels or {})
        except docker.errors.BuildError as exc:
            tail = "".join(str(x.get("stream", x.get("error", ""))) for x in exc.build_log)[-3000:]
            raise PlatformError(f"docker build of {tag} failed: {exc}\n{tail}") from exc
    logger.info("built %s %s", tag, image.short_id)
    return str(image.id)


def push(client: Any, tag: str) -> None:
    """``docker push tag``; raises :class:`PlatformError` with the registry's error."""
    repo, _, version = tag.rpartition(":") if ":" in tag.rsplit("/", 1)[-1] else (tag, "", "latest")
    for line in client.images.push(repo, tag=version, stream=True, decode=True):
        if "error" in line:
            raise PlatformError(f"docker push {tag} failed: {line['error']}")
    logger.info("pushed %s", tag)


def build_example(client: Any, name: str, registry: str, tag: str = "latest", base: str = BASE_IMAGE) -> str:
    """Build ``examples/<name>/Dockerfile`` as ``<registry>/apiary/<name>:<tag>`` and push it;
    returns the full name. Raises :class:`ValidationError` for an unknown example."""
    if name not in EXAMPLES:
        raise ValidationError("name", f"unknown example image {name!r}; known: {', '.join(sorted(EXAMPLES))}")
    directory, requirements = EXAMPLES[name]
    full = f"{registry}/apiary/{name}:{tag}"
    build_image(client, directory, full, requirements=requirements, base=base,
                labels=example_labels(client, name, tag, base))
    push(client, full)
    return full


def example_labels(client: Any, name: str, tag: str, base: str = BASE_IMAGE) -> dict[str, str]:
    """The labels of the example image ``name``: its Dockerfile's description and framework
    (``LABEL`` lines), the framework's version as pinned in requirements.lock (the wheel baked in),
    the Python version measured in ``base``, CUDA ``none``, authors ``apiary``, the git revision."""
    directory, _requirements = EXAMPLES[name]
    declared = oci.dockerfile_labels((directory / "Dockerfile").read_text(encoding="utf-8"))
    framework = declared.get(oci.FRAMEWORK, oci.NONE)
    pin = lock_pins().get(framework.lower().replace("_", "-"), "")
    labels = oci.build_labels(
        title=f"apiary/{name}", authors=oci.SHIPPED_AUTHOR, version=tag, created=time.time(),
        source=source_url(REPO, f"examples/{name}"), revision=git_revision(),
        description=declared.get(oci.DESCRIPTION), framework=framework,
        framework_version=pin.partition("==")[2] or (oci.NONE if framework == oci.NONE else None),
        cuda_version=declared.get(oci.CUDA_VERSION, oci.NONE))
    py = python_version(client, base)
    if py:
        labels[oci.PYTHON_VERSION] = py
    return labels


#: Apiary's own images (``deploy/docker/Dockerfile.<name>``), all ``FROM`` the shared Python layer.
PLATFORM_IMAGES = ("control-plane", "agent", "prefect")


def build_platform(client: Any, registry: str, tag: str, base: str = BASE_IMAGE, repo: Path = REPO) -> list[str]:
    """Build and push ``<registry>/apiary/python:<tag>`` (Apiary from the source tree ``repo`` +
    locked dependencies + the examples) and, from it, ``<registry>/apiary/<name>:<tag>`` for each
    of :data:`PLATFORM_IMAGES`; returns the names pushed. ``repo`` defaults to this checkout; the
    CI pipeline passes its workspace (the commit under test). Raises PlatformError."""
    docker_dir = repo / "deploy" / "docker"
    python = f"{registry}/apiary/python:{tag}"

    def labels(name: str, description: str) -> dict[str, str]:
        return oci.build_labels(title=f"apiary/{name}", authors=oci.SHIPPED_AUTHOR, version=tag,
                                created=time.time(), source=source_url(repo, "deploy/docker"),
                                revision=git_revision(repo), description=description, framework=oci.NONE,
                                framework_version=oci.NONE, cuda_version=oci.NONE)

    build_image(client, docker_dir, python, dockerfile="Dockerfile.python", base=base, apiary_wheel=True,
                extra={"examples": repo / "examples"}, repo=repo,
                labels=labels("python", "Apiary and its locked dependencies on the platform's base"))
    push(client, python)
    built = [python]
    for name in PLATFORM_IMAGES:
        full = f"{registry}/apiary/{name}:{tag}"
        build_image(client, docker_dir, full, dockerfile=f"Dockerfile.{name}", base=python, repo=repo,
                    labels=labels(name, f"Apiary's {name}"))
        push(client, full)
        built.append(full)
    return built
