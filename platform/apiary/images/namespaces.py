"""Who owns which image of the catalogue, and which Dockerfiles a user build may run: pure rules.

Repositories of the platform registry live in two namespaces:

* ``apiary/<name>``: shared. Every user sees them and may run them; only admins publish to them
  (the shipped images, Apiary's own images, ``--shared`` builds).
* ``users/<user>/<name>``: ``<user>``'s own. Only that user and admins see them or run them.

Anything else in the registry (pushed by hand) is seen by admins only.

A reference is ``[host[:port]/]path[:tag][@digest]``; a first component with a ``.`` or ``:`` or
``localhost`` is a registry host (Docker's rule) and is left out when the namespace is judged, so
``127.0.0.1:5000/users/alice/x:1`` is alice's as much as ``users/alice/x:1`` is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from apiary.errors import ForbiddenError, ValidationError

SHARED = "apiary"
USERS = "users"
#: The platform's base image (``apiary image build-base``): a user build may start ``FROM`` it.
BASE_REPOSITORY = "apiary/base"

#: One path component of a repository name (Docker distribution's grammar, lower case only).
COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
DIGEST = re.compile(r"^[a-z0-9]+(?:[+._-][a-z0-9]+)*:[a-zA-Z0-9=_-]{32,}$")

Namespace = Literal["shared", "user", "other"]


@dataclass(frozen=True)
class Reference:
    """A parsed image reference: ``host`` ("" when none), ``repository`` (the path), ``tag``
    ("" when none), ``digest`` ("" when none)."""

    host: str
    repository: str
    tag: str
    digest: str

    @property
    def namespace(self) -> Namespace:
        return namespace_of(self.repository)[0]

    @property
    def owner(self) -> str | None:
        return namespace_of(self.repository)[1]


def parse_reference(ref: str) -> Reference:
    """``[host[:port]/]path[:tag][@digest]`` -> :class:`Reference` (no validation of the parts)."""
    rest, _, digest = ref.partition("@")
    host = ""
    first, sep, remainder = rest.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        host, rest = first, remainder
    tag = ""
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        rest, _, tag = rest.rpartition(":")
    return Reference(host, rest, tag, digest)


def check_reference(ref: str, field: str = "repository") -> Reference:
    """``ref`` parsed, each path component checked against Docker's grammar (lower case), the tag
    against :data:`TAG`, a digest as ``algorithm:hex``. Raises :class:`ValidationError` naming
    ``field``."""
    r = parse_reference(ref)
    components_ok = bool(r.repository) and all(COMPONENT.fullmatch(c) for c in r.repository.split("/"))
    if not components_ok or ref.partition("@")[0].endswith(":") or (r.tag and not TAG.fullmatch(r.tag)) \
            or (r.digest and not DIGEST.fullmatch(r.digest)):
        raise ValidationError(field, f"{ref!r} is no image reference: repo/name[:tag][@sha256:...] in lower-case "
                                     f"letters, digits and . _ -")
    return r


def namespace_of(repository: str) -> tuple[Namespace, str | None]:
    """``("shared", None)`` for ``apiary/...``, ``("user", "<user>")`` for ``users/<user>/...``,
    ``("other", None)`` for anything else."""
    parts = repository.split("/")
    if len(parts) >= 2 and parts[0] == SHARED:
        return "shared", None
    if len(parts) >= 3 and parts[0] == USERS and parts[1]:
        return "user", parts[1]
    return "other", None


def visible(repository: str, user: str, admin: bool) -> bool:
    """Whether ``user`` (an admin with ``admin``) sees ``repository`` in the catalogue."""
    kind, owner = namespace_of(repository)
    return admin or kind == "shared" or (kind == "user" and owner == user)


def check_job_image(image: str, user: str, admin: bool, field: str = "image") -> None:
    """Refuse a job of ``user`` naming another user's catalogue image (``users/<other>/...``).

    Raises :class:`ForbiddenError` (403) naming the image and ``field``. Shared images, images
    outside the catalogue's namespaces (public names the image map resolves) and admins' jobs pass."""
    ref = parse_reference(image)
    kind, owner = namespace_of(ref.repository)
    if admin or kind != "user" or owner == user:
        return
    raise ForbiddenError(f"{field}: image {image} belongs to user {owner}; only {owner} and admins may run it.")


def build_repository(user: str, name: str, shared: bool) -> str:
    """The repository a build of ``user`` named ``name`` is pushed to: ``apiary/<name>`` when
    ``shared``, else ``users/<user>/<name>``. Raises :class:`ValidationError` (field ``name``, or
    ``user`` for a user name that cannot be a repository component, e.g. one with capitals)."""
    if not COMPONENT.fullmatch(name) or len(name) > 64:
        raise ValidationError("name", f"{name!r} is no image name: lower-case letters, digits and . _ - "
                                      f"between them, at most 64 characters")
    if name == "base" and shared:
        raise ValidationError("name", "apiary/base is the platform's base image (apiary image build-base)")
    if shared:
        return f"{SHARED}/{name}"
    if not COMPONENT.fullmatch(user):
        raise ValidationError("user", f"user name {user!r} cannot name a repository (users/<user>/...): "
                                      f"Docker allows lower-case letters, digits and . _ - only")
    return f"{USERS}/{user}/{name}"


def check_tag(tag: str) -> str:
    """``tag`` if it is a Docker tag; :class:`ValidationError` (field ``tag``) otherwise."""
    if not TAG.fullmatch(tag):
        raise ValidationError("tag", f"{tag!r} is no tag: letters, digits, _ . -, at most 128, not starting "
                                     f"with . or -")
    return tag


_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
_COPY_FROM = re.compile(r"--from=(\S+)", re.IGNORECASE)


def dockerfile_instructions(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments and blanks dropped."""
    out: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        out.append(current + stripped)
        current = ""
    if current:
        out.append(current)
    return out


def check_dockerfile(text: str, registry: str, shared_tags: set[str] | None = None) -> str:
    """The Dockerfile of a user build, checked and with its ``FROM`` lines pointed at the registry.

    Every ``FROM`` must name the platform's base (``apiary/base[:tag]``, the local image) or an
    image of the shared catalogue (``apiary/<name>[:tag]``, optionally written with the
    registry's host ``registry``), or an earlier stage of the same file; the latter become
    ``<registry>/apiary/<name>:<tag>`` so that dockerd finds them. ``shared_tags``: the shared
    catalogue's ``repository:tag`` entries (None: not checked beyond the namespace). ``COPY
    --from=`` may name earlier stages only. A variable in ``FROM`` is refused (its value could
    name anything). Returns the rewritten text (only ``FROM`` lines change). Raises
    :class:`ValidationError` with field ``FROM`` (or ``COPY --from``, ``Dockerfile``)."""
    stages: set[str] = set()
    lines = text.splitlines()
    froms = 0
    out: list[str] = []
    for line in lines:
        m = _FROM.match(line)
        if m is None:
            out.append(line)
            continue
        froms += 1
        prefix, flags, image, rest = m.groups()
        if "--platform" in flags.lower() and "$" in flags:
            raise ValidationError("FROM", f"{line.strip()!r}: a variable in FROM is not allowed")
        if "$" in image:
            raise ValidationError("FROM", f"{image!r}: a variable in FROM is not allowed; name the image "
                                          f"(apiary/base:bookworm or apiary/<name>:<tag>)")
        alias = re.match(r"\s+AS\s+(\S+)", rest, re.IGNORECASE)
        if image.lower() in stages:
            target = image
        else:
            ref = parse_reference(image)
            if ref.host and ref.host != registry:
                raise ValidationError("FROM", f"{image!r} is from registry {ref.host}: a build may start only "
                                              f"from the platform's base or a shared catalogue image")
            repo = ref.repository
            tag = ref.tag or "latest"
            if repo == BASE_REPOSITORY and not ref.host:
                target = image
            elif namespace_of(repo)[0] == "shared" and repo != BASE_REPOSITORY:
                if shared_tags is not None and f"{repo}:{tag}" not in shared_tags:
                    raise ValidationError("FROM", f"{image!r} is not in the shared catalogue "
                                                  f"(GET /api/v2/images)")
                target = f"{registry}/{repo}:{tag}" + (f"@{ref.digest}" if ref.digest else "")
            else:
                raise ValidationError("FROM", f"{image!r}: a build may start only from the platform's base "
                                              f"(apiary/base:bookworm) or a shared catalogue image (apiary/<name>)")
        if alias:
            stages.add(alias.group(1).lower())
        out.append(f"{prefix}{flags}{target}{rest}")
    if froms == 0:
        raise ValidationError("FROM", "the Dockerfile has no FROM line")
    for instruction in dockerfile_instructions(text):
        if re.match(r"^(COPY|ADD)\s", instruction, re.IGNORECASE):
            for source in _COPY_FROM.findall(instruction):
                if source.lower() not in stages and not source.isdigit():
                    raise ValidationError("COPY --from", f"{source!r}: COPY --from may name an earlier stage "
                                                         f"of this Dockerfile only")
        if re.match(r"^RUN\s", instruction, re.IGNORECASE) and "--mount" in instruction:
            raise ValidationError("RUN --mount", "RUN --mount is not allowed in a user build")
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")
