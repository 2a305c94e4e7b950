"""The catalogue's namespace rules, the FROM check of user builds, the labels read from a
Dockerfile, and how a job's catalogue name resolves to the registry (image map + docker runtime)."""

from __future__ import annotations

import pytest

from apiary.errors import ForbiddenError, ValidationError
from apiary.images import imagemap
from apiary.images.labels import dockerfile_labels
from apiary.images.namespaces import (
    build_repository,
    check_dockerfile,
    check_job_image,
    check_reference,
    check_tag,
    parse_reference,
    visible,
)
from apiary.runtime.docker import resolve_image

REG = "127.0.0.1:5000"


@pytest.mark.parametrize(("ref", "host", "repo", "tag", "digest"), [
    ("apiary/mnist", "", "apiary/mnist", "", ""),
    ("apiary/mnist:latest", "", "apiary/mnist", "latest", ""),
    ("127.0.0.1:5000/users/alice/x:1", "127.0.0.1:5000", "users/alice/x", "1", ""),
    ("localhost/users/a/b@sha256:ab", "localhost", "users/a/b", "", "sha256:ab"),
    ("registry.example/ns/img:v@sha256:cd", "registry.example", "ns/img", "v", "sha256:cd"),
], ids=["bare", "tag", "host-port", "localhost-digest", "host-tag-digest"])
def test_parse_reference(ref: str, host: str, repo: str, tag: str, digest: str) -> None:
    r = parse_reference(ref)
    assert (r.host, r.repository, r.tag, r.digest) == (host, repo, tag, digest)


@pytest.mark.parametrize(("repo", "user", "admin", "seen"), [
    ("apiary/mnist", "bob", False, True),
    ("users/alice/x", "alice", False, True),
    ("users/alice/x", "bob", False, False),
    ("users/alice/x", "root", True, True),
    ("other/thing", "alice", False, False),
    ("other/thing", "root", True, True),
    ("users/alice", "alice", False, False),  # no name under the user: not the user's namespace
], ids=["shared", "own", "others", "admin-others", "outside", "admin-outside", "short"])
def test_who_sees_what(repo: str, user: str, admin: bool, seen: bool) -> None:
    assert visible(repo, user, admin) is seen


@pytest.mark.parametrize("image", ["users/alice/x:1", f"{REG}/users/alice/x", "users/alice/deep/x@sha256:00"])
def test_a_job_naming_another_users_image_is_refused_naming_it(image: str) -> None:
    with pytest.raises(ForbiddenError, match=r"prerequisites\[0\]\.uri: image .* belongs to user alice"):
        check_job_image(image, "bob", False, field="prerequisites[0].uri")
    check_job_image(image, "alice", False)
    check_job_image(image, "root", True)


@pytest.mark.parametrize("image", ["apiary/mnist:latest", "openpai/pai.example.pytorch", "users", "ubuntu:22.04"])
def test_images_outside_users_namespaces_pass(image: str) -> None:
    check_job_image(image, "bob", False)


def test_build_repository_and_tag_rules() -> None:
    assert build_repository("alice", "my-img", shared=False) == "users/alice/my-img"
    assert build_repository("alice", "tool", shared=True) == "apiary/tool"
    for bad in ("My", "-x", "a/b", "x" * 65, ""):
        with pytest.raises(ValidationError, match="^name: "):
            build_repository("alice", bad, shared=False)
    with pytest.raises(ValidationError, match="^user: "):
        build_repository("Alice", "x", shared=False)
    with pytest.raises(ValidationError, match="^name: apiary/base"):
        build_repository("root", "base", shared=True)
    assert check_tag("v1.0_rc-2") == "v1.0_rc-2"
    for bad in (".x", "-x", "a:b", "x" * 129):
        with pytest.raises(ValidationError, match="^tag: "):
            check_tag(bad)


@pytest.mark.parametrize(("dockerfile", "rewritten_from"), [
    ("FROM apiary/base:bookworm\nRUN true\n", ["FROM apiary/base:bookworm"]),
    ("from apiary/base\n", ["from apiary/base"]),
    ("FROM apiary/mnist:latest\n", [f"FROM {REG}/apiary/mnist:latest"]),
    ("FROM apiary/mnist\n", [f"FROM {REG}/apiary/mnist:latest"]),
    (f"FROM {REG}/apiary/mnist:latest AS b\n", [f"FROM {REG}/apiary/mnist:latest AS b"]),
    ("FROM apiary/base:bookworm AS build\nRUN echo\nFROM build\nCOPY --from=build /a /b\n",
     ["FROM apiary/base:bookworm AS build", "FROM build"]),
    ("FROM apiary/base:bookworm\nFROM apiary/mnist:latest\nCOPY --from=0 /x /y\n",
     ["FROM apiary/base:bookworm", f"FROM {REG}/apiary/mnist:latest"]),
], ids=["base", "base-lower", "shared", "shared-untagged", "shared-full", "stages", "stage-index"])
def test_allowed_froms_are_pointed_at_the_registry(dockerfile: str, rewritten_from: list[str]) -> None:
    out = check_dockerfile(dockerfile, REG, {"apiary/mnist:latest"})
    assert [ln for ln in out.splitlines() if ln.upper().startswith("FROM")] == rewritten_from
    assert [ln for ln in out.splitlines() if not ln.upper().startswith("FROM")] == \
        [ln for ln in dockerfile.splitlines() if not ln.upper().startswith("FROM")]


@pytest.mark.parametrize(("dockerfile", "field", "words"), [
    ("FROM debian:bookworm\n", "FROM", "debian:bookworm"),
    ("FROM users/alice/x:1\n", "FROM", "users/alice/x:1"),
    ("FROM other.registry/apiary/mnist\n", "FROM", "other.registry"),
    ("FROM 127.0.0.1:5000/apiary/base:bookworm\n", "FROM", "platform's base"),
    ("ARG B=apiary/base\nFROM ${B}\n", "FROM", "variable"),
    ("FROM apiary/gone:latest\n", "FROM", "not in the shared catalogue"),
    ("RUN true\n", "FROM", "no FROM"),
    ("FROM apiary/base\nCOPY --from=users/alice/x:1 /a /b\n", "COPY --from", "users/alice/x:1"),
    ("FROM apiary/base\nRUN --mount=type=bind,from=users/alice/x,target=/x \\\n  true\n", "RUN --mount", "not"),
], ids=["public", "another-user", "other-registry", "base-via-registry", "variable", "unknown-shared", "none",
        "copy-from-image", "run-mount"])
def test_refused_dockerfiles_name_the_field(dockerfile: str, field: str, words: str) -> None:
    with pytest.raises(ValidationError) as info:
        check_dockerfile(dockerfile, REG, {"apiary/mnist:latest"})
    assert info.value.field == field
    assert words in info.value.message


def test_dockerfile_labels_are_read_as_docker_reads_them() -> None:
    text = ('FROM x\nLABEL a=1 "b"="two words" \\\n      c=\'3\'\n# LABEL d=4\nLABEL a=5\n')
    assert dockerfile_labels(text) == {"a": "5", "b": "two words", "c": "3"}


def test_catalogue_names_resolve_to_the_registry_and_the_shipped_map_still_works() -> None:
    m = imagemap.load(None, REG)
    assert resolve_image("apiary/mnist:latest", m) == f"{REG}/apiary/mnist:latest"
    assert resolve_image("users/alice/myimg:1", m) == f"{REG}/users/alice/myimg:1"
    assert resolve_image("apiary/base:bookworm", m) == "apiary/base:bookworm"  # the local base, never pushed
    assert resolve_image("openpai/pai.example.pytorch", m) == f"{REG}/apiary/mnist:latest"
    assert resolve_image("openpai/standard:python_3.6-pytorch_1.2.0-gpu", m) == f"{REG}/apiary/mnist:latest"
    assert resolve_image("ubuntu:22.04", m) == "ubuntu:22.04"
    # Without a registry nothing is added; a map's own key wins over the catalogue's.
    assert imagemap.parse("a: b\n") == {"a": "b"}
    own = imagemap.parse('"apiary/": "mirror:1/apiary/"\n', REG)
    assert resolve_image("apiary/mnist:latest", own) == "mirror:1/apiary/mnist:latest"


@pytest.mark.parametrize("ref", ["\x1f", "Apiary/x", "a//b", "a/b:", "a/b:-x", "a/b@md5", "", "a/b c"])
def test_malformed_references_are_refused_naming_the_field(ref: str) -> None:
    with pytest.raises(ValidationError, match="^repository: "):
        check_reference(ref)


def test_well_formed_references_pass() -> None:
    assert check_reference("users/alice/x:1").repository == "users/alice/x"
    assert check_reference("apiary/mnist@sha256:" + "a" * 64).digest == "sha256:" + "a" * 64
