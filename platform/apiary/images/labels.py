"""The labels every image built by Apiary carries: OCI's annotation keys plus Apiary's own.

OCI (``org.opencontainers.image.*``): ``title``, ``description``, ``authors`` (who built it: the
Apiary user of a user build, ``apiary`` for the shipped images), ``created`` (RFC 3339, UTC),
``revision`` (the git commit, or the SHA-256 of an uploaded build context), ``source``,
``version`` (the tag). Apiary's (``io.apiary.*``): ``framework`` and ``framework.version`` (the
ML framework the image carries, e.g. ``scikit-learn`` / ``1.9.1``; ``none`` for none), and
``cuda.version`` (``none`` for a CPU-only image: no shipped image carries CUDA).

:func:`dockerfile_labels` reads a Dockerfile's ``LABEL`` lines: the shipped images say their
description and framework there, and :func:`apiary.images.build.build_example` measures the
framework's version from the wheels it puts into the image.
"""

from __future__ import annotations

import shlex
import time

from apiary.images.namespaces import dockerfile_instructions

OCI = "org.opencontainers.image"
TITLE = f"{OCI}.title"
DESCRIPTION = f"{OCI}.description"
AUTHORS = f"{OCI}.authors"
CREATED = f"{OCI}.created"
REVISION = f"{OCI}.revision"
SOURCE = f"{OCI}.source"
VERSION = f"{OCI}.version"
APIARY = "io.apiary"
FRAMEWORK = f"{APIARY}.framework"
FRAMEWORK_VERSION = f"{APIARY}.framework.version"
CUDA_VERSION = f"{APIARY}.cuda.version"
PYTHON_VERSION = f"{APIARY}.python.version"
#: ``authors`` of the images Apiary ships (the examples', the base, Apiary's own).
SHIPPED_AUTHOR = "apiary"
#: The value of ``framework`` / ``cuda.version`` for none.
NONE = "none"


def rfc3339(ts: float) -> str:
    """``2026-11-29T12:00:00Z`` for unix seconds ``ts`` (UTC, whole seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def build_labels(*, title: str, authors: str, version: str, created: float, source: str,
                 revision: str | None = None, description: str | None = None, framework: str | None = None,
                 framework_version: str | None = None, cuda_version: str | None = None) -> dict[str, str]:
    """The labels of one build; ``created`` in unix seconds. Keys whose value is ``None`` are left
    out, so that a value the Dockerfile or the parent image sets (``LABEL``) stays."""
    labels = {TITLE: title, AUTHORS: authors, VERSION: version, CREATED: rfc3339(created), SOURCE: source,
              REVISION: revision, DESCRIPTION: description, FRAMEWORK: framework,
              FRAMEWORK_VERSION: framework_version, CUDA_VERSION: cuda_version}
    return {k: v for k, v in labels.items() if v is not None}


def dockerfile_labels(text: str) -> dict[str, str]:
    """The ``key=value`` pairs of a Dockerfile's ``LABEL`` instructions (continuation lines joined,
    values unquoted as a shell would); later ones win, as in Docker. ``LABEL`` with a variable is
    read as written."""
    out: dict[str, str] = {}
    for line in dockerfile_instructions(text):
        head, _, rest = line.partition(" ")
        if head.upper() != "LABEL":
            continue
        for word in shlex.split(rest):
            key, sep, value = word.partition("=")
            if sep:
                out[key] = value
    return out
